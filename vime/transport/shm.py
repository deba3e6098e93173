"""shm: one safetensors file in /dev/shm, written once whatever the number of engines; each engine
maps it and copies into its parameters (`POST /update_weights_from_tensor {transport: shm}`); deleted
when every engine has answered. For engines on the trainer's host."""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path
from typing import Any

from vime.transport.base import Metrics, NamedTensors, Sums, Transport, each_client, write_safetensors


class SharedMemory(Transport):
    """The weights as the trainer holds them (the engine casts them as it loads)."""

    def push(
        self, clients: list[Any], weights: NamedTensors, version: int, lora_base: bool, sums: Sums | None
    ) -> Metrics:
        tmp_dir = self.settings.tmp_dir
        base = tmp_dir or (Path("/dev/shm") if os.access("/dev/shm", os.W_OK) else Path(tempfile.gettempdir()))
        path = base / f"vime-weights-{os.getpid()}-v{version}.safetensors"
        t0 = time.perf_counter()
        try:
            write_safetensors(dict(weights), path)
            write_time = time.perf_counter() - t0
            payload = {"transport": "shm", "path": str(path), "weight_version": version}
            each_client(clients, lambda c: c.update_weights_from_tensor(payload, self.settings.timeout))
        finally:
            path.unlink(missing_ok=True)
        return {"perf/update_weights_write_time": write_time}
