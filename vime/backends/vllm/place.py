"""The vLLM backend's placements (its row in `vime/backends/__init__.py`): servers launched here
(`place_vllm`) or as Ray actors (`place_vllm_ray`), or given by URL, each checked to serve the
trainer's model before the run starts."""

from __future__ import annotations

import logging
import secrets
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vime.backends.client import EngineError
from vime.backends.placement import Placement, engine_devices, fresh_path, launch_all, placed, trainer_device
from vime.backends.vllm.client import VLLMClient, check_version
from vime.backends.vllm.launch import VLLMProcess, launch_vllm
from vime.backends.vllm.worker_ext import API_KEY_ENV
from vime.errors import ConfigError
from vime.transport.group import apply_gpu_safe_env

if TYPE_CHECKING:
    from vime.backends.settings import PlacementConfig

log = logging.getLogger("vime")

# The built-in engine's transports vLLM lacks, and what it uses instead: it has no shared-memory
# load (gloo), and NCCL cannot join two ranks on one GPU, where the built-in engine uses CUDA IPC (disk).
VLLM_TRANSPORTS = {"shm": "gloo", "cuda_ipc": "disk"}


def model_facts(model_dir: Path) -> dict[str, Any]:
    """The trainer's model as `WeightReceiver.vime_hello` describes a served one."""
    import json

    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    text = cfg.get("text_config") or cfg
    return {
        "architectures": list(cfg.get("architectures") or []),
        "vocab_size": int(text.get("vocab_size") or 0),
        "hidden_size": int(text.get("hidden_size") or 0),
        "num_hidden_layers": int(text.get("num_hidden_layers") or 0),
        "tie_word_embeddings": bool(text.get("tie_word_embeddings", cfg.get("tie_word_embeddings", False))),
    }


def check_same_model(trainer: dict[str, Any], served: dict[str, Any], url: str) -> None:
    """One line naming every way the served model differs from the trainer's, before any push
    (a push into another model fails deep inside vLLM's loaders, or silently loads a part)."""
    diffs = [f"{k} {served.get(k)} (trainer: {v})" for k, v in trainer.items() if served.get(k) != v]
    if diffs:
        raise EngineError(
            f"vLLM server at {url} serves another model than --hf-checkpoint: {', '.join(diffs)}; start it with the same model"
        )


def place_vllm(settings: PlacementConfig, model_dir: Path, run_dir: Path, seed: int) -> Placement:
    """The placement of --rollout-backend vllm (`vime/backends/__init__.py`): launch one server per engine (or check the ones at
    --rollout-engine-urls) and pick how weights reach them.

    Every server must run vime's worker extension (launched ones do), serve the trainer's model
    (architecture, vocabulary, sizes: compared now) and answer to the run's API key. Transports
    follow the built-in engine's table (vime.backends.placement), with vLLM's counterparts: gloo where
    the built-in engine would use shm (vLLM has no shared-memory load), disk where it would use
    cuda_ipc (an engine on the trainer's own GPU: NCCL cannot join two ranks on one device).
    """
    apply_gpu_safe_env()  # NVLink multicast off here and in every server started from here (vime eval too)
    trainer = trainer_device(settings)
    want = model_facts(model_dir)
    engines: list[VLLMProcess] = []
    if settings.rollout_engine_urls:
        urls, devices, api_key, launch_one = list(settings.rollout_engine_urls), [], settings.api_key, None
        for u in urls:  # an unreachable or wrong-version server fails now, with its URL
            client = VLLMClient(u, timeout=30, api_key=api_key)
            client.health()
            check_version(client.version(), u)
            if VLLMClient(u, timeout=30, max_retries=1)._get_open("/version"):
                log.warning(
                    "vLLM server at %s answers without an API key: anyone who can reach it can push weights "
                    "(start it with --middleware vime.backends.vllm.worker_ext.require_api_key and $%s)",
                    u,
                    API_KEY_ENV,
                )
    else:
        devices = engine_devices(settings, trainer)
        if settings.colocate and trainer == "cpu":
            raise ConfigError(
                "--colocate with --rollout-backend vllm needs GPUs (vLLM's sleep mode frees GPU memory only): leave --colocate off on CPU"
            )
        api_key = settings.api_key or secrets.token_urlsafe(24)  # engines we start answer only to this run

        def launch_one(i: int) -> VLLMProcess:
            return _launch_for_run(settings, model_dir, run_dir, i, devices[i], trainer, api_key, seed)

        engines = launch_all(launch_one, len(devices))
        urls = [e.url for e in engines]

    def facts(url: str) -> dict:
        found = VLLMClient(url, timeout=60, api_key=api_key).hello()
        check_same_model(want, found, url)
        return found

    return placed(settings, trainer, devices, urls, engines, api_key, launch_one, facts, "vLLM engine", VLLM_TRANSPORTS)


def place_vllm_ray(settings: PlacementConfig, model_dir: Path, run_dir: Path, seed: int) -> Placement:
    """--rollout-backend vllm with --launcher ray: each server started by `launch_vllm` in a Ray
    actor on its node (`vime.backends.ray_actors.place_actors`), checked and fed as `place_vllm`'s are.
    The model directory must be at the same path on every node, as for the built-in engine."""
    from vime.backends.ray_actors import place_actors

    want = model_facts(model_dir)
    dtype = "float32" if trainer_device(settings) == "cpu" else "bfloat16"

    def engine_kwargs(i: int, device: str) -> dict:
        return dict(
            model_path=str(model_dir),
            device=device,
            dtype=dtype,
            max_num_seqs=settings.engine_max_num_seqs,
            seed=seed + i,
            vllm_args=settings.vllm_args,
        )

    def facts(url: str, api_key: str) -> dict:
        found = VLLMClient(url, timeout=60, api_key=api_key).hello()
        check_same_model(want, found, url)
        return found

    return place_actors(
        settings, run_dir, "vime.backends.vllm.launch:launch_vllm", engine_kwargs, facts, "vLLM engine", VLLM_TRANSPORTS
    )


def _launch_for_run(
    settings: PlacementConfig, model_dir: Path, run_dir: Path, i: int, dev: str, trainer: str, api_key: str, seed: int
) -> VLLMProcess:
    """Engine i of a run on `dev` (also how a dead one is started again)."""
    extra = ["--enable-sleep-mode"] if settings.colocate else []
    shared = trainer != "cpu" and trainer.split(":")[1] in dev.split(":")[1].split(",")
    if shared:  # vLLM takes 90% of a GPU by default; the trainer shares this one
        extra += ["--gpu-memory-utilization", "0.45"]
    log_path = fresh_path(run_dir / f"engine{i}.log")  # a resumed run keeps the earlier run's log
    log.info("starting vLLM engine %d on %s (log: %s)", i, dev, log_path)
    return launch_vllm(
        str(model_dir),
        device=dev,
        dtype="float32" if dev == "cpu" else "bfloat16",
        max_num_seqs=settings.engine_max_num_seqs,
        seed=seed + i,
        extra_args=extra,
        vllm_args=settings.vllm_args,
        api_key=api_key,
        log_path=log_path,
    )
