"""disk: a safetensors directory as save_pretrained writes it, which each engine reloads
(`POST /update_weights_from_disk`): anything that can reload from disk, engines on other machines
included when the pusher's `tmp_dir` is on a shared filesystem. Deleted when every engine has
answered."""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from vime.transport.base import Metrics, NamedTensors, Sums, Transport, each_client, write_safetensors


class Disk(Transport):
    """The weights in the engines' dtype when they share one: half the bytes of float32 master
    weights for bfloat16 engines, and the tensors the engines checksum are then the ones the
    trainer did."""

    def push(
        self, clients: list[Any], weights: NamedTensors, version: int, lora_base: bool, sums: Sums | None
    ) -> Metrics:
        tmp_dir = self.settings.tmp_dir
        if tmp_dir is not None:
            tmp_dir.mkdir(parents=True, exist_ok=True)
        out = Path(tempfile.mkdtemp(prefix=f"vime-weights-v{version}-", dir=tmp_dir))
        dtypes = {self.settings.dtype_of(c) for c in clients}
        cast = dtypes.pop() if len(dtypes) == 1 else None
        t0 = time.perf_counter()
        try:
            write_safetensors(
                {k: (t if cast is None else t.to(cast)).cpu() for k, t in weights}, out / "model.safetensors"
            )
            write_time = time.perf_counter() - t0
            base = {"lora_base": True} if lora_base else {}  # said only when so: any client takes the rest
            timeout = self.settings.timeout
            each_client(clients, lambda c: c.update_weights_from_disk(str(out), version, timeout, **base))
        finally:
            shutil.rmtree(out, ignore_errors=True)
        return {"perf/update_weights_write_time": write_time}
