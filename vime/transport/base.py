"""What every weight transport does (`Transport`), and what several share: the engines called
together, the dtype they hold weights in, a safetensors file written where engines read it.

A transport moves the tensors and nothing else. The pusher (`push.py`) decides which engines each
push goes to, hands every call their clients, and checks afterwards what arrived; pausing
generation around a push is the train loop's job.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import Tensor

from vime.errors import EngineError, VimeError
from vime.transport.buckets import DTYPES

NamedTensors = Iterable[tuple[str, Tensor]]  # HF-named weights, as the trainer yields them
Metrics = dict[str, float]  # perf/update_weights_*
# what the trainer sent, as the engines should hold it: [bit sum, element count] by tensor name,
# by the dtype the sums were taken in (`vime.transport.checksums`)
Sums = dict[torch.dtype, dict[str, list[int]]]


@dataclass(frozen=True)
class PushSettings:
    """The run's settings that transports read (`WeightPusher`'s arguments)."""

    tmp_dir: Path | None  # where shm and disk write (None: /dev/shm, or the system's temp dir)
    bucket_bytes: int  # the broadcast's flat buckets
    timeout: float  # a push, or forming the weight group, may take this long
    master_address: str  # the weight group's rendezvous
    dtype_of: Callable[[Any], torch.dtype]  # the dtype an engine holds weights in (asked once per engine)


class Transport:
    """One way weights reach engines: a subclass per row of `TRANSPORT_CLASSES`, one instance per
    row a pusher uses, called with the clients of the engines it reaches."""

    # pushes the weights as they come (a sharded trainer gathers one bucket at a time) and takes the
    # checksums of what it sent itself, as it casts it; else the pusher first holds the weights
    # together (detached, contiguous) and sums them once per engine dtype after every transport sent
    streams: ClassVar[bool] = False

    def __init__(self, name: str, settings: PushSettings) -> None:
        self.name = name  # its --weight-transport value
        self.settings = settings

    def connect(self, clients: list[Any], device: str | torch.device) -> None:
        """Form what lasts from push to push (a process group) with these engines, at the run's start
        so that its set-up is not charged to the first step's push. Nothing by default."""

    def push(
        self, clients: list[Any], weights: NamedTensors, version: int, lora_base: bool, sums: Sums | None
    ) -> Metrics:
        """Send the weights to these engines, stamped with `version`; returns perf/update_weights_*
        metrics. `lora_base`: the weights are a LoRA run's frozen base, which the engine keeps to
        merge later pushes' adapters into. `sums`: where a transport that `streams` records the
        checksums of what it sent (None: this push is not checked)."""
        raise NotImplementedError

    def close(self, clients: list[Any]) -> None:
        """Undo `connect` on both sides (the engines forget it, so another trainer can join them
        later). Nothing by default."""


def each_client(clients: list[Any], call: Callable[[Any], Any]) -> None:
    """Run `call` on every client concurrently: engines load in parallel, not in turn."""
    if len(clients) <= 1:
        for c in clients:
            call(c)
        return
    with ThreadPoolExecutor(len(clients)) as pool:
        for future in [pool.submit(call, c) for c in clients]:
            future.result()


def common_dtype(infos: list[dict], urls: list[str]) -> torch.dtype:
    """The dtype the engines hold their weights in (pushed in it, so no engine casts)."""
    names = {str(i.get("dtype", "bfloat16")) for i in infos}
    if len(names) != 1 or next(iter(names)) not in DTYPES:
        raise EngineError(
            f"engines at {', '.join(urls)} report weight dtypes {sorted(names)}: start them with one --dtype (float32, bfloat16 or float16)"
        )
    return DTYPES[names.pop()]


class WeightWriteError(VimeError, OSError):
    """The weights could not be written where the engines read them (shm or disk push)."""


def write_safetensors(weights: dict[str, Tensor], path: Path) -> None:
    """One safetensors file at `path`; a full disk is a `WeightWriteError` that names the place and
    the fix, and leaves no partial file behind."""
    from safetensors.torch import save_file

    try:
        save_file(weights, str(path), metadata={"format": "pt"})
    except Exception as e:  # an OSError, or safetensors' own error type holding one
        path.unlink(missing_ok=True)
        if not isinstance(e, OSError) and "I/O error" not in str(e):
            raise
        detail = " ".join((getattr(e, "strerror", None) or str(e)).split())[:200]
        raise WeightWriteError(
            f"cannot write the weights for the engines to {path.parent} ({detail}): make room there "
            "(a push needs the model's size free), or choose another --weight-transport"
        ) from None
