"""Weight push transports: trainer → engines, HF-named tensors.

* shm: one safetensors file in /dev/shm, written once whatever the number of engines; each
  engine mmaps it and copies into its parameters; deleted when every engine has answered.
* disk: a safetensors directory as save_pretrained writes it (anything that can reload from
  disk, including engines on other machines when `tmp_dir` is on a shared filesystem).
* cuda_ipc: CUDA IPC handles of the trainer's own tensors, for engines on the same GPU; no
  copy on the trainer side at all.
* nccl: engines on other GPUs (or machines) join an NCCL group with the trainer's rank 0 once
  (`/init_weights_update_group`); each push then broadcasts the weights in flat buckets of
  `update_weight_buffer_size` bytes, one dtype per bucket, announcing each bucket's names,
  dtypes and shapes with `/update_weights_from_distributed` so the engine can post the
  matching receive. The announcement of bucket k + 1 goes out while bucket k is on the wire.
  Not exercised by CI (no GPUs there); the engine side is the contract in docs/architecture.md.

Pausing generation around a push is the train loop's job; this module only moves tensors.
"""
from __future__ import annotations

import base64
import os
import socket
import pickle
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Iterable

import torch
from torch import Tensor

TRANSPORTS = ("auto", "shm", "disk", "cuda_ipc", "nccl")
DEFAULT_BUCKET_BYTES = 512 * 2**20  # large enough to hide per-bucket latency, small enough to stay cheap to stage


class WeightPusher:
    """Pushes named weights to every engine client and stamps them with a weight version."""

    def __init__(
        self, clients: list[Any], transport: str = "auto", tmp_dir: str | Path | None = None, bucket_bytes: int = DEFAULT_BUCKET_BYTES
    ) -> None:
        if transport not in TRANSPORTS:
            raise ValueError(f"unknown weight transport {transport!r}: one of {TRANSPORTS}")
        self.clients = clients
        self.transport = transport
        self.tmp_dir = Path(tmp_dir) if tmp_dir is not None else None
        self.bucket_bytes = bucket_bytes
        self._nccl_group: Any = None

    def push(self, named_weights: Iterable[tuple[str, Tensor]], version: int) -> dict[str, float]:
        """Send the weights to all engines; returns perf/update_weights_* metrics."""
        weights = {name: t.detach().contiguous() for name, t in named_weights}
        transport = self._resolve(weights)
        t0 = time.perf_counter()
        if transport == "shm":
            metrics = self._push_shm(weights, version)
        elif transport == "disk":
            metrics = self._push_disk(weights, version)
        elif transport == "nccl":
            metrics = self._push_nccl(weights, version)
        else:
            metrics = self._push_cuda_ipc(weights, version)
        metrics["perf/update_weights_bytes"] = float(sum(t.numel() * t.element_size() for t in weights.values()))
        metrics["perf/update_weights_push_time"] = time.perf_counter() - t0
        return metrics

    def _resolve(self, weights: dict[str, Tensor]) -> str:
        """auto: shm for CPU weights, disk for GPU ones (correct whichever GPU the engines use;
        the placement picks cuda_ipc explicitly when it knows they share the trainer's GPU)."""
        if self.transport != "auto":
            return self.transport
        on_cpu = all(t.device.type == "cpu" for t in weights.values())
        return "shm" if on_cpu else "disk"

    def _each_client(self, call: Callable[[Any], Any]) -> None:
        """Run `call` on every client concurrently: engines load in parallel, not in turn."""
        if len(self.clients) <= 1:
            for c in self.clients:
                call(c)
            return
        with ThreadPoolExecutor(len(self.clients)) as pool:
            for future in [pool.submit(call, c) for c in self.clients]:
                future.result()

    def _push_shm(self, weights: dict[str, Tensor], version: int) -> dict[str, float]:
        from safetensors.torch import save_file

        base = self.tmp_dir or (Path("/dev/shm") if os.access("/dev/shm", os.W_OK) else Path(tempfile.gettempdir()))
        path = base / f"vime-weights-{os.getpid()}-v{version}.safetensors"
        t0 = time.perf_counter()
        try:
            save_file(weights, str(path), metadata={"format": "pt"})
            write_time = time.perf_counter() - t0
            payload = {"transport": "shm", "path": str(path), "weight_version": version}
            self._each_client(lambda c: c.update_weights_from_tensor(payload))
        finally:
            path.unlink(missing_ok=True)
        return {"perf/update_weights_write_time": write_time}

    def _push_disk(self, weights: dict[str, Tensor], version: int) -> dict[str, float]:
        from safetensors.torch import save_file

        if self.tmp_dir is not None:
            self.tmp_dir.mkdir(parents=True, exist_ok=True)
        out = Path(tempfile.mkdtemp(prefix=f"vime-weights-v{version}-", dir=self.tmp_dir))
        t0 = time.perf_counter()
        try:
            save_file({k: t.cpu() for k, t in weights.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
            write_time = time.perf_counter() - t0
            self._each_client(lambda c: c.update_weights_from_disk(str(out), version))
        finally:
            shutil.rmtree(out, ignore_errors=True)
        return {"perf/update_weights_write_time": write_time}

    def _push_cuda_ipc(self, weights: dict[str, Tensor], version: int) -> dict[str, float]:
        from torch.multiprocessing.reductions import reduce_tensor

        # `weights` keeps the tensors alive until every engine has copied from them.
        handles = [(name, reduce_tensor(t)) for name, t in weights.items()]
        payload = {"transport": "cuda_ipc", "handles": base64.b64encode(pickle.dumps(handles)).decode(), "weight_version": version}
        self._each_client(lambda c: c.update_weights_from_tensor(payload))
        return {}

    # ---- nccl ------------------------------------------------------------------------

    def _join_nccl_group(self, device: torch.device) -> Any:
        """Form the trainer (rank 0) + engines NCCL group, once per run.

        A group of its own (TCPStore + ProcessGroupNCCL), apart from the trainer's FSDP group:
        engines are not trainer ranks. Engine i holds ranks 1 + i·tp .. (i+1)·tp of it; each
        engine's `/init_weights_update_group` returns once it has joined, so the calls run in
        threads while this side joins.
        """
        if self._nccl_group is not None:
            return self._nccl_group
        from torch.distributed import ProcessGroupNCCL, TCPStore  # CUDA builds only

        host = socket.gethostbyname(socket.gethostname())
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        infos = [c.model_info() for c in self.clients]
        tp = [int(i.get("tp_size", 1)) for i in infos]
        world = 1 + sum(tp)
        store = TCPStore(host, port, world, is_master=True)
        offsets = [1 + sum(tp[:i]) for i in range(len(tp))]
        with ThreadPoolExecutor(len(self.clients)) as pool:
            joins = [
                pool.submit(c.init_weights_update_group, {
                    "master_address": host, "master_port": port, "rank_offset": off, "world_size": world,
                    "group_name": "vime-weights", "backend": "nccl",
                })
                for c, off in zip(self.clients, offsets)
            ]
            torch.cuda.set_device(device)
            self._nccl_group = ProcessGroupNCCL(store, 0, world)
            for j in joins:
                j.result()
        return self._nccl_group

    def _push_nccl(self, weights: dict[str, Tensor], version: int) -> dict[str, float]:
        device = next(iter(weights.values())).device
        if device.type != "cuda":
            raise ValueError("the nccl weight transport needs the weights on a CUDA device")
        group = self._join_nccl_group(device)
        buckets = bucket_by_bytes(weights, self.bucket_bytes)
        with ThreadPoolExecutor(max(1, len(self.clients))) as pool:
            def announce(k: int) -> list[Any]:
                names = buckets[k]
                body = {
                    "names": names,
                    "dtypes": [str(weights[n].dtype).removeprefix("torch.") for n in names],
                    "shapes": [list(weights[n].shape) for n in names],
                    "weight_version": version,
                    "flush_cache": k == len(buckets) - 1,  # the new version is complete with the last bucket
                }
                return [pool.submit(c.update_weights_from_distributed, body) for c in self.clients]

            pending = announce(0)
            for k, names in enumerate(buckets):
                flat = torch.cat([weights[n].reshape(-1) for n in names])
                work = group.broadcast([flat], torch.distributed.BroadcastOptions())
                following = announce(k + 1) if k + 1 < len(buckets) else []
                work.wait()
                for f in pending:
                    f.result()  # the engine has copied bucket k into its parameters
                pending = following
        return {"perf/update_weights_buckets": float(len(buckets))}


def bucket_by_bytes(weights: dict[str, Tensor], bucket_bytes: int) -> list[list[str]]:
    """Names in order, cut into runs of one dtype and at most `bucket_bytes` (a larger tensor
    goes alone): each bucket is one flat buffer, one broadcast."""
    buckets: list[list[str]] = []
    size = 0
    for name, t in weights.items():
        nbytes = t.numel() * t.element_size()
        if buckets and size + nbytes <= bucket_bytes and weights[buckets[-1][0]].dtype == t.dtype:
            buckets[-1].append(name)
            size += nbytes
        else:
            buckets.append([name])
            size = nbytes
    return buckets
