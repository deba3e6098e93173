"""The trainer's weight pusher: the weights to every engine by its own transport (a colocated run
mixes cuda_ipc for the engine on the trainer's GPU with nccl for the others), stamped with a
weight version, then checked: every engine's checksums of what it holds equal the trainer's of
what it sent.

The transports, one file each, are rows of `vime.transport.TRANSPORT_CLASSES`: shm (a file in
/dev/shm), disk (a safetensors directory), cuda_ipc (handles of the trainer's own tensors) and
nccl / gloo (a process group's broadcast of flat buckets, `broadcast.py`). Pausing generation
around a push is the train loop's job; this module only moves tensors.
"""

from __future__ import annotations

import importlib
import time
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from vime.errors import EngineError
from vime.transport import TRANSPORT_CLASSES, TRANSPORTS
from vime.transport.base import Metrics, NamedTensors, PushSettings, Sums, Transport, common_dtype, each_client
from vime.transport.checksums import checksum_mismatches, checksums

DEFAULT_BUCKET_BYTES = 512 * 2**20  # large enough to hide per-bucket latency, small enough to stay cheap to stage


class WeightPusher:
    """Pushes named weights to every engine client and stamps them with a weight version."""

    def __init__(
        self,
        clients: list[Any],
        transport: str | list[str] = "auto",
        tmp_dir: str | Path | None = None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        timeout: float = 120.0,
        master_address: str = "127.0.0.1",
        check: bool = True,
    ) -> None:
        transports = [transport] * len(clients) if isinstance(transport, str) else list(transport)
        if len(transports) != len(clients):
            raise ValueError(f"{len(transports)} weight transports for {len(clients)} engines")
        for t in transports:
            if t not in TRANSPORTS:
                raise ValueError(f"unknown weight transport {t!r}: one of {TRANSPORTS}")
        self.clients = list(clients)
        self.transports = transports
        self.tmp_dir = Path(tmp_dir) if tmp_dir is not None else None
        self.bucket_bytes = bucket_bytes
        self.timeout = timeout
        self.master_address = master_address
        self.check = check  # compare checksums after every push (`verify`)
        self._open: dict[str, Transport] = {}  # --weight-transport value → its transport, made at first use
        self._dtypes: dict[str, torch.dtype] = {}  # engine URL → the dtype it holds weights in
        # the last push's checksums as the engines should hold them: by dtype (what a broadcast
        # sent is in the group's dtype; other transports send the trainer's, cast by the engine)
        self._sent: Sums = {}

    def connect(self, device: str | torch.device) -> None:
        """Form what a transport keeps from push to push (the weight group of nccl or gloo) with
        its engines, once per run: at start-up, so its set-up is not charged to the first step's
        push. No-op for the others."""
        by_transport = self._engines_by_transport()
        self._refuse_two_streams(by_transport)
        for name, clients in by_transport.items():
            self._transport(name).connect(clients, device)

    def push(self, named_weights: NamedTensors, version: int, lora_base: bool = False) -> Metrics:
        """Send the weights to all engines; returns perf/update_weights_* metrics.

        When every engine receives by broadcast the weights are streamed bucket by bucket (a
        sharded trainer gathers one bucket at a time); otherwise they are held together once.
        `lora_base`: these are a LoRA run's frozen base, which the engine keeps to merge the
        adapters of later pushes into (vLLM's receiver copies it only when told so)."""
        t0 = time.perf_counter()
        self._sent = {}
        sums = self._sent if self.check else None
        by_transport = self._engines_by_transport()
        self._refuse_two_streams(by_transport)
        if self.transports and all(t != "auto" and self._transport(t).streams for t in self.transports):
            [(name, clients)] = by_transport.items()  # one: two that stream are refused
            metrics = self._transport(name).push(clients, named_weights, version, lora_base, sums)
        else:
            weights = {name: t.detach().contiguous() for name, t in named_weights}
            metrics = {}
            for name, clients in self._engines_by_transport(weights).items():
                metrics.update(self._transport(name).push(clients, weights.items(), version, lora_base, sums))
            metrics["perf/update_weights_bytes"] = float(sum(t.numel() * t.element_size() for t in weights.values()))
            if self.check:
                self._sent_from(weights)
        metrics["perf/update_weights_push_time"] = time.perf_counter() - t0
        if self.check:
            t1 = time.perf_counter()
            self.verify(version)
            metrics["perf/update_weights_check_time"] = time.perf_counter() - t1
        return metrics

    def verify(self, version: int) -> None:
        """Every engine holds what the trainer sent: the checksum of each pushed tensor, computed
        by the engine on what it holds (the built-in engine reads its parameters back; vLLM's
        worker extension sums what it received and refuses a push that left a layer out),
        equals the trainer's. A mismatch stops the run with the engine and the tensors."""

        def check(c: Any) -> None:
            want = self._sent[self._dtype_of(c)]
            bad = checksum_mismatches(want, c.weight_checksums())
            if bad:
                raise EngineError(
                    f"weight push v{version}: engine at {c.url} does not hold what the trainer sent, {len(bad)} of {len(want)} "
                    f"tensors differ: {', '.join(bad[:3])}"
                )

        each_client(self.clients, check)

    def set_engines(self, clients: list[Any], transports: list[str]) -> None:
        """The engines the next push goes to (some died, or came back from a restart). A weight
        group formed with other members is left, and formed again at the next push."""
        if [c.url for c in clients] == [c.url for c in self.clients] and list(transports) == self.transports:
            self.clients = list(clients)
            return
        self.close()
        self._open = {}
        self.clients, self.transports = list(clients), list(transports)
        self._dtypes = {u: d for u, d in self._dtypes.items() if u in {c.url for c in clients}}

    def close(self) -> None:
        """Undo what `connect` formed (engines forget the weight group, so another trainer can join
        them later)."""
        for name, clients in self._engines_by_transport().items():
            if name in self._open:
                self._open[name].close(clients)

    def _transport(self, name: str) -> Transport:
        """The transport of a --weight-transport value, made from its row at its first use."""
        if name not in self._open:
            module, cls = TRANSPORT_CLASSES[name].split(":")
            settings = PushSettings(self.tmp_dir, self.bucket_bytes, self.timeout, self.master_address, self._dtype_of)
            self._open[name] = getattr(importlib.import_module(module), cls)(name, settings)
        return self._open[name]

    def _engines_by_transport(self, weights: dict[str, Tensor] | None = None) -> dict[str, list[Any]]:
        """Each transport's engines, in the engines' order. `auto` becomes shm for CPU weights, disk
        for GPU ones (correct whichever GPU the engines use; the placement picks cuda_ipc or nccl
        explicitly when it knows where the engines are); its engines are left out without weights."""
        by_transport: dict[str, list[Any]] = {}
        for client, name in zip(self.clients, self.transports):
            if name == "auto":
                if weights is None:
                    continue
                name = "shm" if all(t.device.type == "cpu" for t in weights.values()) else "disk"
            by_transport.setdefault(name, []).append(client)
        return by_transport

    def _refuse_two_streams(self, by_transport: dict[str, list[Any]]) -> None:
        streaming = [name for name in by_transport if self._transport(name).streams]
        if len(streaming) > 1:
            raise ValueError(f"one weight group per run: the engines' transports mix {' and '.join(streaming)}")

    def _sent_from(self, weights: dict[str, Tensor]) -> None:
        """Checksums of a push that did not go by broadcast, cast as each engine holds them."""
        for dtype in {self._dtype_of(c) for c in self.clients} - set(self._sent):
            self._sent[dtype] = dict(zip(weights, checksums(t.to(dtype) for t in weights.values())))

    def _dtype_of(self, client: Any) -> torch.dtype:
        if client.url not in self._dtypes:
            self._dtypes[client.url] = common_dtype([client.model_info()], [client.url])
        return self._dtypes[client.url]
