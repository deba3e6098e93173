"""The rollout backends, one row each: what differs between engines a run can generate with.

Every backend speaks vime's engine protocol (`vime/backends/client.py`) through a client class of
its own, and places its engines with a `place(settings, model_dir, run_dir, seed) -> Placement`
(`settings`: the placement component's `PlacementConfig`; ending in `vime/backends/placement.py`'s
`placed`). A new backend is one package beside `builtin/` and `vllm/` holding those two, plus
one row here; a `ray_place` for `--launcher ray` is optional.

Rows name their client and placement function by import path, resolved when a run uses them:
the table is plain data, so `vime.config` reads it for `--rollout-backend`'s choices and checks
without importing any engine code (and a backend's module, which imports the placement
helpers, never has to be imported by them).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

from vime.transport import TRANSPORTS


@dataclass(frozen=True)
class Backend:
    name: str  # --rollout-backend's value
    what: str  # for --help
    client: str  # "module:Class": the client of one engine, Class(url, api_key=...)
    place: str  # "module:function": place(settings, model_dir, run_dir, seed) -> Placement
    transports: tuple[str, ...]  # the --weight-transport values that reach its engines
    tensor_parallel: bool  # an engine may span several GPUs (--rollout-num-gpus-per-engine > 1)
    lora_adapters: bool  # a LoRA run pushes its adapters alone (the engine merges them), not merged weights
    # "module:function" as `place`, with engines as Ray actors (--launcher ray); None: Ray does not
    # place this backend's engines (--launcher ray is refused at validation, auto stays local)
    ray_place: str | None = None
    # its engines may start while the trainer builds (--launcher local): one on the trainer's GPU
    # waits for the run directory's TRAINER_READY file before sizing its KV cache from free memory
    # (vime/launch/assemble.py). vLLM measures the GPU's memory as it starts, so its engines start
    # after the trainer
    starts_beside_trainer: bool = False
    # None: --engine-quantization quantizes its engines; else its own flag that does (the former is refused)
    quantization_flag: str | None = None
    # None: --engine-num-kv-blocks sizes its engines' KV cache; else its own flag that does (as above)
    kv_blocks_flag: str | None = None
    # "module:function" `fn(model_dir) -> why its engines cannot run that model, or None`, asked at
    # start-up before any engine starts; None: the backend's engines say so themselves
    check_model: str | None = None

    def make_client(self, url: str, api_key: str | None = None) -> Any:
        """A client of the engine at `url` (an `EngineClient`)."""
        return _load(self.client)(url, api_key=api_key)

    def load(self, path: str) -> Any:
        """One of the row's "module:function" paths imported: its `place` or `ray_place`, which the
        run's launcher picks (`vime/launch/launcher.py`)."""
        return _load(path)


BACKENDS: dict[str, Backend] = {
    b.name: b
    for b in [
        Backend(
            "vime",
            "the built-in engine",
            client="vime.backends.client:EngineClient",
            place="vime.backends.builtin.place:place",
            transports=TRANSPORTS,
            tensor_parallel=False,
            lora_adapters=True,  # vime/engine/core/lora.py
            ray_place="vime.backends.builtin.place:place_ray",
            starts_beside_trainer=True,
            check_model="vime.engine.core.model_config:unsupported",
        ),
        Backend(
            "vllm",
            "a vLLM server per engine (install the vllm extra)",
            client="vime.backends.vllm.client:VLLMClient",
            place="vime.backends.vllm.place:place_vllm",
            transports=("auto", "nccl", "gloo", "disk"),  # no shared-memory or CUDA IPC load
            tensor_parallel=True,
            lora_adapters=True,  # merged by vime's worker extension into its copy of the base (vime/backends/vllm/worker_ext.py)
            ray_place="vime.backends.vllm.place:place_vllm_ray",
            # vLLM's online FP8 with per-channel weight and per-token activation scales, the
            # scheme of --engine-quantization fp8; pushes re-quantize through vLLM's layer-wise
            # reload, which the worker extension loads every push with
            quantization_flag="--vllm-quantization fp8_per_channel",
            kv_blocks_flag="--vllm-num-gpu-blocks-override N",
        ),
    ]
}


def _load(path: str) -> Any:
    module, name = path.split(":")
    return getattr(importlib.import_module(module), name)
