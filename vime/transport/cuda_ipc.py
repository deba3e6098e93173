"""cuda_ipc: the engine on the trainer's GPU opens the trainer's own tensors through CUDA IPC
handles, with no copy on the trainer's side (`CudaIpc`); the handles as plain data, what
`/update_weights_from_tensor {transport: cuda_ipc}` carries, both sides of it.

`torch.multiprocessing.reductions.reduce_tensor` describes a CUDA tensor as a function and its
arguments, meant to be pickled; unpickling a request body runs whatever code the sender chose.
So the wire format is JSON holding only the data those arguments are made of (sizes and offsets
as ints, the dtype by name, the IPC handles as base64 bytes), and the engine rebuilds each
tensor itself with `rebuild_cuda_tensor`, passing the classes that `reduce_tensor` would have
named (`torch.Tensor`, `TypedStorage`), never classes taken from the request.

One handle per tensor:
`{name, shape, stride, offset, dtype, device, handle, storage_size_bytes, storage_offset_bytes,
ref_counter_handle, ref_counter_offset, event_handle, event_sync_required}`.
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import Tensor

from vime.transport.base import Metrics, NamedTensors, Sums, Transport, each_client

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
MAX_HANDLE_BYTES = 4096  # a CUDA IPC handle is 64 bytes (torch adds a small header): anything far larger is not one


@dataclass(frozen=True)
class IpcHandle:
    """One shared CUDA tensor, as data. `parse` checks every field's type and range."""

    name: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int  # the tensor's offset in its storage, in elements
    dtype: str
    device: int  # CUDA device index in the sender's numbering (IPC maps it by UUID on open)
    handle: bytes
    storage_size_bytes: int
    storage_offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes | None
    event_sync_required: bool

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        for key in ("handle", "ref_counter_handle", "event_handle"):
            d[key] = None if d[key] is None else base64.b64encode(d[key]).decode()
        d["shape"], d["stride"] = list(self.shape), list(self.stride)
        return d

    def rebuild(self) -> Tensor:
        """Open the sender's memory as a tensor (no copy). Needs a CUDA device in this process."""
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        return rebuild_cuda_tensor(
            torch.Tensor,
            torch.Size(self.shape),
            self.stride,
            self.offset,
            torch.storage.TypedStorage,
            DTYPES[self.dtype],
            self.device,
            self.handle,
            self.storage_size_bytes,
            self.storage_offset_bytes,
            False,
            self.ref_counter_handle,
            self.ref_counter_offset,
            self.event_handle,
            self.event_sync_required,
        )


def from_reduce_args(name: str, args: tuple) -> IpcHandle:
    """The handle of one tensor from the arguments `reduce_tensor` gives `rebuild_cuda_tensor`."""
    (
        _,
        size,
        stride,
        offset,
        _,
        dtype,
        device,
        handle,
        size_bytes,
        offset_bytes,
        _,
        ref_handle,
        ref_offset,
        event,
        event_sync,
    ) = args
    dtype_name = str(dtype).removeprefix("torch.")
    if dtype_name not in DTYPES:
        raise ValueError(f"weight '{name}': dtype {dtype_name} cannot be pushed by cuda_ipc (use {', '.join(DTYPES)})")
    return IpcHandle(
        name=name,
        shape=tuple(int(x) for x in size),
        stride=tuple(int(x) for x in stride),
        offset=int(offset),
        dtype=dtype_name,
        device=int(device),
        handle=bytes(handle),
        storage_size_bytes=int(size_bytes),
        storage_offset_bytes=int(offset_bytes),
        ref_counter_handle=bytes(ref_handle),
        ref_counter_offset=int(ref_offset),
        event_handle=None if event is None else bytes(event),
        event_sync_required=bool(event_sync),
    )


def share(named: list[tuple[str, Tensor]]) -> list[dict[str, Any]]:
    """The trainer's side: JSON handles of its CUDA tensors (they must stay alive until every
    engine has copied from them)."""
    from torch.multiprocessing.reductions import reduce_tensor

    out = []
    for name, t in named:
        if t.device.type != "cuda":
            raise ValueError(f"weight '{name}' is on {t.device}: cuda_ipc shares CUDA tensors only")
        _, args = reduce_tensor(t)
        out.append(from_reduce_args(name, args).to_json())
    return out


class CudaIpc(Transport):
    """The trainer's tensors shared as they are (the engine casts them as it copies)."""

    def push(
        self, clients: list[Any], weights: NamedTensors, version: int, lora_base: bool, sums: Sums | None
    ) -> Metrics:
        # the pusher holds the tensors until every engine has copied from them; the handles travel
        # as plain JSON data, never as a pickle
        payload = {"transport": "cuda_ipc", "handles": share(list(weights)), "weight_version": version}
        each_client(clients, lambda c: c.update_weights_from_tensor(payload, self.settings.timeout))
        return {}


_INT_FIELDS = ("offset", "device", "storage_size_bytes", "storage_offset_bytes", "ref_counter_offset")
_BYTES_FIELDS = ("handle", "ref_counter_handle", "event_handle")


def parse(payload: Any) -> list[IpcHandle]:
    """The engine's side: validate a request's `handles`; ValueError (→ HTTP 400) naming the
    first thing wrong. Nothing in the payload is ever executed or used as a type."""
    if not isinstance(payload, list) or not payload:
        raise ValueError(
            "handles must be a non-empty JSON list of handle objects (the pickled format of earlier versions is refused)"
        )
    fields = set(IpcHandle.__dataclass_fields__)
    out = []
    for i, h in enumerate(payload):
        if not isinstance(h, dict):
            raise ValueError(f"handles[{i}] is not an object")
        if set(h) != fields:
            missing, extra = sorted(fields - set(h)), sorted(set(h) - fields)
            raise ValueError(f"handles[{i}]: missing fields {missing}, unknown fields {extra}")
        name = h["name"]
        if not isinstance(name, str):
            raise ValueError(f"handles[{i}]: name must be a string")
        for key in _INT_FIELDS:
            if not _is_int(h[key]) or h[key] < 0:
                raise ValueError(f"handles[{i}] ('{name}'): {key} must be an integer >= 0")
        for key in ("shape", "stride"):
            if not isinstance(h[key], list) or not all(_is_int(x) and x >= 0 for x in h[key]):
                raise ValueError(f"handles[{i}] ('{name}'): {key} must be a list of integers >= 0")
        if len(h["shape"]) != len(h["stride"]):
            raise ValueError(f"handles[{i}] ('{name}'): shape and stride differ in length")
        if h["dtype"] not in DTYPES:
            raise ValueError(f"handles[{i}] ('{name}'): dtype {h['dtype']!r} is not one of {', '.join(DTYPES)}")
        if not isinstance(h["event_sync_required"], bool):
            raise ValueError(f"handles[{i}] ('{name}'): event_sync_required must be true or false")
        if all(h["shape"]):  # the view must lie inside the shared storage, or it would read memory past it
            extent = h["offset"] + sum((n - 1) * st for n, st in zip(h["shape"], h["stride"])) + 1
            if extent * DTYPES[h["dtype"]].itemsize > h["storage_size_bytes"]:
                raise ValueError(
                    f"handles[{i}] ('{name}'): shape, stride and offset reach past the {h['storage_size_bytes']}-byte storage"
                )
        raw = {}
        for key in _BYTES_FIELDS:
            if h[key] is None and key == "event_handle":
                raw[key] = None
                continue
            raw[key] = _b64(h[key], f"handles[{i}] ('{name}'): {key}")
        out.append(IpcHandle(**{**h, **raw, "shape": tuple(h["shape"]), "stride": tuple(h["stride"])}))
    return out


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _b64(value: Any, what: str) -> bytes:
    if not isinstance(value, str) or len(value) > MAX_HANDLE_BYTES * 2:
        raise ValueError(f"{what} must be base64 text of at most {MAX_HANDLE_BYTES} bytes")
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError(f"{what} is not valid base64") from None


def device_uuid(device: torch.device | str) -> str | None:
    """The GPU's UUID (None off CUDA): how a trainer and an engine tell whether they share a GPU
    (and so whether CUDA IPC can reach it), whatever CUDA_VISIBLE_DEVICES each was started with."""
    device = torch.device(device)
    return str(torch.cuda.get_device_properties(device).uuid) if device.type == "cuda" else None
