"""Weight push transports: trainer → engines, HF-named tensors.

* shm: one safetensors file in /dev/shm, written once whatever the number of engines; each
  engine mmaps it and copies into its parameters; deleted when every engine has answered.
* disk: a safetensors directory as save_pretrained writes it (anything that can reload from
  disk, including engines on other machines when `tmp_dir` is on a shared filesystem).
* cuda_ipc: CUDA IPC handles of the trainer's own tensors, for engines on the same GPU; no
  copy on the trainer side at all.

Pausing generation around a push is the train loop's job; this module only moves tensors.
"""
from __future__ import annotations

import base64
import os
import pickle
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Iterable

from torch import Tensor

TRANSPORTS = ("auto", "shm", "disk", "cuda_ipc")


class WeightPusher:
    """Pushes named weights to every engine client and stamps them with a weight version."""

    def __init__(self, clients: list[Any], transport: str = "auto", tmp_dir: str | Path | None = None) -> None:
        if transport not in TRANSPORTS:
            raise ValueError(f"unknown weight transport {transport!r}: one of {TRANSPORTS}")
        self.clients = clients
        self.transport = transport
        self.tmp_dir = Path(tmp_dir) if tmp_dir is not None else None

    def push(self, named_weights: Iterable[tuple[str, Tensor]], version: int) -> dict[str, float]:
        """Send the weights to all engines; returns perf/update_weights_* metrics."""
        weights = {name: t.detach().contiguous() for name, t in named_weights}
        transport = self._resolve(weights)
        t0 = time.perf_counter()
        if transport == "shm":
            metrics = self._push_shm(weights, version)
        elif transport == "disk":
            metrics = self._push_disk(weights, version)
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
