"""What vime loads into a vLLM server: a worker extension that receives weight pushes, and a
middleware that closes every route to callers without the run's API key.

vLLM imports this module, vime's trainer never does. The server is started with

    --worker-extension-cls vime.backends.vllm.worker_ext.WeightReceiver
    --middleware vime.backends.vllm.worker_ext.require_api_key      (the key in $VIME_VLLM_API_KEY)

and vLLM mixes `WeightReceiver`'s methods into each of its workers (one per tensor-parallel
rank), where `POST /collective_rpc {"method": "vime_..."}` calls them on every rank at once.

Why our own receiver rather than vLLM's weight-transfer routes: those need vLLM's own NCCL
rendezvous (so they refuse CPU servers, and CI could never run them), and they load through
vLLM's layer-wise reload, which leaves a tied output layer on its old weights (on CPU the
output layer keeps a packed copy of the embedding made at start-up). Here the worker joins
the trainer's weight group (`vime.transport`, the same code the built-in engine
runs: NCCL between GPUs, gloo on CPU), and each bucket goes through the same layer-wise
reload vLLM uses (so fused, sharded and repacked layers are filled by the model's own weight
loaders), plus what it lacks:

* a layer that shares its weights with a reloaded one (a tied output layer) is processed
  again, so it computes with the new values;
* any other layer that no tensor of the push reached is an error, not a warning: a push is
  all of the weights or it fails;
* a checksum of every tensor received is kept, for the trainer to compare with its own
  (`vime_checksums`): the push is proven end to end, not assumed from a 200.

LoRA: a push of adapters alone (`<layer>.lora_A`, `<layer>.lora_B` with alpha / r folded in,
`vime/engine/core/lora.py`) is merged here, in the trainer's float32 merge, into a copy of the
base the worker kept from the push announced `lora_base`; then every weight goes through the
same layer-wise reload from that copy, merged where an adapter came. Only the adapters travel;
the price is the copy, kept in host memory (pinned on GPUs; `_vime_load` says why not on the
GPU). Each adapter push streams it back to the device, a layer at a time. Merged rather
than through vLLM's own LoRA serving (`--enable-lora`): that needs adapters as files, a LoRA
forward on every token and the adapter's name in every request, where a merged model decodes at
the plain model's speed, as the built-in engine does.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import os
import socket
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from vime.engine.core.lora import AdapterMerger, adapter_of, merge
from vime.transport.buckets import parse_layout, receive
from vime.transport.checksums import checksums, non_finite
from vime.transport.cuda_ipc import device_uuid
from vime.transport.group import WeightGroup, join

logger = logging.getLogger("vime.vllm_ext")

API_KEY_ENV = "VIME_VLLM_API_KEY"
# Bumped when a method's arguments change, so a server running another vime is refused by name.
PROTOCOL = 2

# vime's worker extension (weight pushes) and the middleware that closes every route but /health
# to callers without the key in $VIME_VLLM_API_KEY: needed by any server vime pushes weights to.
EXTENSION_FLAGS = (
    "--worker-extension-cls",
    "vime.backends.vllm.worker_ext.WeightReceiver",
    "--middleware",
    "vime.backends.vllm.worker_ext.require_api_key",
)


async def require_api_key(request, call_next):
    """Starlette HTTP middleware: every route but /health needs `Authorization: Bearer <key>`.

    vLLM's own --api-key guards only its /v1, /inference, ... routes, not the dev-mode routes
    vime needs (/collective_rpc, /pause, /sleep), so anyone who could reach the port could push
    weights. Fails closed: with the middleware loaded and no key set, nothing but /health
    answers."""
    key = os.environ.get(API_KEY_ENV, "")
    if request.url.path != "/health":
        given = request.headers.get("Authorization", "").encode()
        if not key or not hmac.compare_digest(given, f"Bearer {key}".encode()):
            from starlette.responses import JSONResponse

            why = "the server has no key" if not key else "missing or wrong API key"
            return JSONResponse(
                {
                    "error": f"{why}: send 'Authorization: Bearer <key>' (vime's --api-key; the server reads ${API_KEY_ENV})"
                },
                status_code=401,
            )
    return await call_next(request)


class WeightReceiver:
    """Methods mixed into each vLLM worker (`self` is vLLM's Worker: `vllm_config`, `device`,
    `model_runner`). State lives in attributes prefixed `_vime_`, made on first use."""

    # ---- facts ------------------------------------------------------------------------------

    def vime_hello(self) -> dict[str, Any]:
        """What the trainer compares with its own model before anything is pushed."""
        from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

        mc = self.vllm_config.model_config
        hf = mc.hf_config
        text = getattr(hf, "get_text_config", lambda: hf)()
        return {
            "protocol": PROTOCOL,
            "architectures": list(getattr(hf, "architectures", None) or []),
            "vocab_size": int(getattr(text, "vocab_size", 0) or 0),
            "hidden_size": int(getattr(text, "hidden_size", 0) or 0),
            "num_hidden_layers": int(getattr(text, "num_hidden_layers", 0) or 0),
            "tie_word_embeddings": bool(getattr(text, "tie_word_embeddings", False)),
            "dtype": str(mc.dtype).removeprefix("torch."),
            "device": str(self.device),
            "device_uuid": device_uuid(self.device),
            "hostname": socket.gethostname(),
            "tp_rank": get_tensor_model_parallel_rank(),
            "tp_size": get_tensor_model_parallel_world_size(),
        }

    # ---- the weight group -------------------------------------------------------------------

    def vime_join(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str,
        timeout: float,
    ) -> dict[str, Any]:
        """Join the trainer's weight group as rank `rank_offset + tp_rank` (each TP rank holds
        its own copy of every pushed tensor and loads its shard of it)."""
        from vllm.distributed import get_tensor_model_parallel_rank

        groups = self._vime_groups()
        old = groups.pop(group_name, None)
        if old is not None:  # a trainer that reconnects (an engine came back): the old group is gone
            old.close()
        rank = int(rank_offset) + get_tensor_model_parallel_rank()
        device = self.device if backend == "nccl" else torch.device("cpu")
        groups[group_name] = join(
            backend, master_address, int(master_port), rank, int(world_size), group_name, device, float(timeout)
        )
        return {"rank": rank}

    def vime_leave(self, group_name: str) -> None:
        group = self._vime_groups().pop(group_name, None)
        if group is not None:
            group.close()

    def _vime_groups(self) -> dict[str, WeightGroup]:
        if not hasattr(self, "_vime_group_map"):
            self._vime_group_map: dict[str, WeightGroup] = {}
        return self._vime_group_map

    # ---- receiving and loading --------------------------------------------------------------

    def vime_receive(
        self,
        group_name: str,
        names: list,
        dtypes: list,
        shapes: list,
        first: bool,
        last: bool,
        lora_base: bool = False,
    ) -> dict[str, Any]:
        """One announced flat bucket: received by broadcast, checksummed, loaded. `first` opens
        a push (vLLM's layer-wise reload is set up), `last` closes and checks it; a push opened
        with `lora_base` is kept as the base that LoRA adapters merge into."""
        group = self._vime_groups().get(group_name)
        if group is None:
            raise RuntimeError(f"no weight group '{group_name}': the trainer must call vime_join first")
        layout = parse_layout(names, dtypes, shapes)
        if first:
            self._vime_begin(lora_base)
        elif getattr(self, "_vime_open", None) is None:
            raise RuntimeError("a bucket arrived outside a push (its first bucket never came): push all weights again")
        with self._vime_undone_on_error():
            self._vime_load(receive(group, layout, flattened=True))
            return self._vime_end() if last else {"tensors": len(layout)}

    def vime_load_files(self, path: str, lora_base: bool = False) -> dict[str, Any]:
        """The same push from a safetensors directory (the disk transport)."""
        from pathlib import Path

        from safetensors import safe_open

        index = Path(path) / "model.safetensors.index.json"
        if index.exists():
            import json

            files = sorted({Path(path) / f for f in json.loads(index.read_text())["weight_map"].values()})
        else:
            files = sorted(Path(path).glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no safetensors files in {path}")

        self._vime_begin(lora_base)
        with self._vime_undone_on_error():
            for f in files:  # a file at a time, as a bucket
                with safe_open(str(f), framework="pt") as st:
                    self._vime_load((name, st.get_tensor(name)) for name in st.keys())  # noqa: SIM118
            return self._vime_end()

    def vime_checksums(self) -> dict[str, list[int]]:
        """checksums (bit sum, count) of every tensor of the last complete push, as received."""
        return dict(getattr(self, "_vime_sums", {}))

    def _vime_model(self) -> torch.nn.Module:
        return self.model_runner.get_model()

    @contextlib.contextmanager
    def _vime_undone_on_error(self) -> Iterator[None]:
        """A push refused part-way closes vLLM's layer-wise reload at once: the layers it had not
        finished get their old tensors back (left open, they hold placeholders, and the next
        request would crash the engine), and the adapters it brought are dropped."""
        try:
            yield
        except BaseException:
            from vllm.config import set_current_vllm_config
            from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

            if getattr(self, "_vime_open", None) is not None:
                try:
                    with set_current_vllm_config(self.vllm_config):
                        finalize_layerwise_reload(self._vime_model(), self.vllm_config.model_config)
                except Exception:  # noqa: BLE001 (the push's own error is the one to report)
                    logger.exception("closing vLLM's layer-wise reload after a refused push")
            self._vime_open, self._vime_keep, self._vime_pairs = None, None, {}
            raise

    def _vime_begin(self, lora_base: bool = False) -> None:
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

        model = self._vime_model()
        with set_current_vllm_config(self.vllm_config):
            if getattr(self, "_vime_open", None) is not None:
                # the previous push failed part-way: put back what it left half-loaded (vLLM
                # keeps the old tensors of every layer it did not finish), then start over
                finalize_layerwise_reload(model, self.vllm_config.model_config)
            initialize_layerwise_reload(model)
        self._vime_open: dict[str, list[int]] | None = {}
        # LoRA: the copy this push's plain weights go to (a base push), and the adapters it brought
        self._vime_keep: dict[str, torch.Tensor] | None = {} if lora_base else None
        self._vime_pairs: dict[str, dict[str, torch.Tensor]] = {}
        if lora_base:  # a new base replaces the old one: not both in memory at once
            self._vime_base = None

    def _vime_load(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        from vllm.config import set_current_vllm_config

        sums = self._vime_open
        assert sums is not None

        items = list(tensors)  # one bucket (or file): its checksums in one pass
        bad = non_finite(items)  # refused before any of it is loaded, like a wrong shape
        if bad is not None:
            raise ValueError(f"weight '{bad}' holds non-finite values (NaN or inf): push finite weights")
        adapters = [(n, t) for n, t in items if adapter_of(n) is not None]
        plain_before = any(adapter_of(n) is None for n in sums)
        if (adapters and (len(adapters) < len(items) or plain_before)) or (not adapters and self._vime_pairs):
            raise ValueError("a push mixes LoRA adapters with plain weights: push them separately")
        sums.update(zip([n for n, _ in items], checksums(t for _, t in items)))
        if adapters:
            self._vime_take_adapters(adapters)
            return
        # the LoRA base: copies, since a bucket's buffer is reused; in host memory, since vLLM has
        # already taken most of the GPU's memory for its KV cache, its sleep mode would not free a
        # copy of ours, and each rank of a tensor-parallel engine holds every tensor, so a copy on
        # the GPU would be the whole model once more per GPU
        if self._vime_keep is not None:
            pin = torch.cuda.is_available()  # pinned: each adapter push copies it back to the GPU
            self._vime_keep.update((n, torch.empty(t.shape, dtype=t.dtype, pin_memory=pin).copy_(t)) for n, t in items)
        with set_current_vllm_config(self.vllm_config):
            self._vime_model().load_weights(iter(items))

    def _vime_take_adapters(self, adapters: list[tuple[str, torch.Tensor]]) -> None:
        """Adapter tensors of this push, kept (in the base's dtype) until the push ends."""
        base = getattr(self, "_vime_base", None)
        if not base:
            raise ValueError(
                "LoRA adapters arrived, but this server holds no base to merge them into: the trainer pushes the "
                "frozen base (announced lora_base) first"
            )
        AdapterMerger().check([(n, tuple(t.shape)) for n, t in adapters], base, complete=False)
        for name, t in adapters:
            weight, part = adapter_of(name)  # type: ignore[misc]
            self._vime_pairs.setdefault(weight, {})[part] = t.to(
                device=self.device, dtype=base[weight].dtype, copy=True
            )

    def _vime_merged(self) -> Iterable[tuple[str, torch.Tensor]]:
        """Every weight of the base, with this push's adapters merged in (one layer at a time)."""
        half = [w for w, pair in self._vime_pairs.items() if len(pair) < 2]
        if half:
            raise ValueError(f"the push ended with half an adapter: {', '.join(sorted(half)[:3])}")
        for name, w in self._vime_base.items():
            pair = self._vime_pairs.get(name)
            w = w.to(self.device, non_blocking=True)
            yield name, w if pair is None else merge(w, pair["lora_A"], pair["lora_B"])

    def _vime_end(self) -> dict[str, Any]:
        """Finish vLLM's layer-wise reload, re-process tied layers, refuse a partial push."""
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.layers.attention import is_deferred_attention_layer
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload
        from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

        model = self._vime_model()
        if self._vime_pairs:  # adapters alone: every weight again, from the base, merged
            try:
                with set_current_vllm_config(self.vllm_config):
                    model.load_weights(iter(self._vime_merged()))
            finally:
                self._vime_pairs = {}
        sums = self._vime_open
        # layers still waiting for weights now got none from this push (a loaded one was
        # processed the moment its last tensor arrived, and waits no more)
        # (attention layers load nothing from a checkpoint of plain weights, rotary embeddings
        # hold buffers only: vLLM finishes both itself)
        untouched = [
            (name, m)
            for name, m in model.named_modules()
            if (info := get_layerwise_info(m)).can_load()
            and info.load_numel <= 0
            and info.load_numel_total > 0
            and not is_deferred_attention_layer(m)
            and any(True for _ in m.parameters(recurse=False))
        ]
        with set_current_vllm_config(self.vllm_config):
            finalize_layerwise_reload(model, self.vllm_config.model_config)
        self._vime_open = None  # closed: a failure from here on has nothing left to undo
        # a tied layer holds the very Parameter of another (vLLM's tie_weights); by identity, as
        # CPU layers that repacked their weights all hold empty tensors at address 0
        untouched_ids = {id(m) for _, m in untouched}
        reloaded = {id(p) for m in model.modules() if id(m) not in untouched_ids for p in m.parameters(recurse=False)}
        stale = []
        for name, m in untouched:
            params = list(m.parameters(recurse=False))
            if params and all(id(p) in reloaded for p in params):
                # tied to a reloaded layer (lm_head ↔ embed_tokens): same storage, new values;
                # what it derived from them at start-up (a packed CPU copy) is made again
                method = getattr(m, "quant_method", None)
                if method is not None:
                    method.process_weights_after_loading(m)
            else:
                stale.append(name)
        if stale:
            raise RuntimeError(
                f"the push reached no weight of {len(stale)} layer(s) of this model, e.g. {stale[:3]}: they keep their old "
                "weights (a trainer with another architecture, or a partial push?)"
            )
        self._vime_sums = sums
        if not any(adapter_of(n) for n in sums):  # plain weights: the new base, or none to merge into
            self._vime_base = self._vime_keep
        self._vime_keep = None
        return {"tensors": len(sums)}
