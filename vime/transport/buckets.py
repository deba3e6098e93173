"""The weight push's payload: named tensors cut into flat buckets (the trainer's side) and an
announced bucket checked and received (the engine's side).

`load_format: "flattened_bucket"` (vime's trainer always sends it) means one broadcast of one flat
buffer holding the named tensors back to back, all of one dtype; without it each tensor is its own
broadcast, as SGLang does. The group that carries them: `group.py`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator

import torch
from torch import Tensor

from vime.transport.group import WeightGroup

FLATTENED = "flattened_bucket"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# ---- the engine's side ---------------------------------------------------------------------


def parse_layout(names: list, dtypes: list, shapes: list) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """Validate an announced bucket; ValueError (→ HTTP 400) on anything malformed."""
    if not (len(names) == len(dtypes) == len(shapes)) or not names:
        raise ValueError(
            f"names, dtypes and shapes must be non-empty lists of one length (got {len(names)}, {len(dtypes)}, {len(shapes)})"
        )
    out = []
    for n, d, s in zip(names, dtypes, shapes):
        if not isinstance(n, str):
            raise ValueError(f"weight name {n!r} is not a string")
        if d not in DTYPES:
            raise ValueError(f"weight '{n}': dtype {d!r} is not one of {', '.join(DTYPES)}")
        if not isinstance(s, list) or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in s):
            raise ValueError(f"weight '{n}': shape {s!r} is not a list of sizes")
        out.append((n, DTYPES[d], tuple(s)))
    return out


def receive(
    group: WeightGroup, layout: list[tuple[str, torch.dtype, tuple[int, ...]]], flattened: bool
) -> Iterator[tuple[str, Tensor]]:
    """Post the receives for one announced bucket; yields (name, tensor) on the group's device
    (gloo: CPU) as they arrive, for the engine to copy into its parameters."""
    device = group.device if group.backend == "nccl" else torch.device("cpu")
    if flattened:
        dtypes = {d for _, d, _ in layout}
        if len(dtypes) != 1:
            raise ValueError("a flattened bucket holds one dtype")
        sizes = [math.prod(s) for _, _, s in layout]
        flat = torch.empty(sum(sizes), dtype=dtypes.pop(), device=device)
        group.wait(group.broadcast(flat), "weight bucket")
        for (name, _, shape), piece in zip(layout, flat.split(sizes)):
            yield name, piece.view(shape)
        return
    for name, dtype, shape in layout:
        t = torch.empty(shape, dtype=dtype, device=device)
        group.wait(group.broadcast(t), f"weight '{name}'")
        yield name, t


# ---- the trainer's side --------------------------------------------------------------------


def pack(
    tensors: Iterable[tuple[str, Tensor]], bucket_bytes: int, dtype: torch.dtype, device: torch.device
) -> Iterator[tuple[list[tuple[str, Tensor]], Tensor]]:
    """Cut a stream of named tensors into flat buckets of at most `bucket_bytes` (a larger tensor
    goes alone), cast to the engines' `dtype` on the way: half the bytes of a float32 master
    copy on the wire for a bfloat16 engine. Yields (the bucket's (name, tensor) list, flat buffer).

    The stream is consumed lazily, one bucket ahead at most, so a sharded trainer never holds
    more than a bucket of gathered tensors."""
    item = dtype.itemsize
    capacity = max(1, bucket_bytes // item)
    names: list[tuple[str, Tensor]] = []
    size = 0
    for name, t in tensors:
        n = t.numel()
        if names and size + n > capacity:
            yield names, _flatten(names, size, dtype, device)
            names, size = [], 0
        names.append((name, t))
        size += n
    if names:
        yield names, _flatten(names, size, dtype, device)


def _flatten(items: list[tuple[str, Tensor]], size: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """One flat buffer in a few launches (a batched cat, then one cast when the trainer's dtype
    differs), not one copy per tensor: at 0.6B the launches cost more than the bytes."""
    parts = [t.detach().to(device).reshape(-1) for _, t in items]  # .to: a no-op on the same device
    if all(p.dtype == dtype for p in parts):
        return torch.cat(parts, out=torch.empty(size, dtype=dtype, device=device))
    return torch.cat(parts).to(dtype)
