"""Proof of arrival: both sides of a push checksum the tensors, so a tensor that did not arrive,
arrived to the wrong place or was not loaded shows as a mismatch; and a NaN or inf is found before
it is sent."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor


def non_finite(named: list[tuple[str, Tensor]]) -> str | None:
    """The name of the first tensor holding a NaN or inf, else None: one fused float32 norm
    over them all and one sync (a NaN or inf anywhere makes its tensor's norm non-finite)."""
    floats = [(n, t) for n, t in named if t.is_floating_point()]
    if not floats:
        return None
    norms = torch.stack(torch._foreach_norm([t for _, t in floats], dtype=torch.float32))
    bad = (~torch.isfinite(norms)).nonzero()
    return floats[int(bad[0])][0] if bad.numel() else None


def checksums(tensors: Iterable[Tensor]) -> list[list[int]]:
    """[bit sum, element count] of each tensor (`bit_sum`).

    Both sides of a push compute them, the trainer on what it sends (in the engines' dtype) and
    the engine on what it holds or received, so a tensor that did not arrive, arrived to the
    wrong place or was not loaded shows as a mismatch, exactly: no tolerance, no float rounding.
    Read back in one transfer (on a GPU, one sync per bucket rather than one per tensor).
    """
    sums, sizes = [], []
    for t in tensors:
        sums.append(bit_sum(t).to(torch.int64))
        sizes.append(t.numel())
    return [[s, n] for s, n in zip(torch.stack(sums).tolist(), sizes)] if sums else []


def piece_checksums(tensors: Iterable[tuple[Tensor, int]]) -> list[tuple[list[int], list[list[int]]]]:
    """For each (tensor, n): its `checksums` entry and those of its n equal consecutive pieces
    (a stacked tensor's slices along its first dimension), reading each byte once and sending
    everything back in one transfer: a Qwen3-30B-A3B's experts are ~18k such slices, whose
    checksums one by one cost a launch and a Python round each."""
    sums, sizes = [], []
    for t, n in tensors:
        rows = t.detach().contiguous().reshape(n, -1)
        pieces = _row_bit_sums(rows)
        straddle = rows.element_size() == 2 and rows.shape[1] % 2  # the whole pairs words across pieces
        whole = bit_sum(rows) if straddle else pieces.sum(dtype=pieces.dtype)  # wrapping, as bit_sum's
        sums.append(torch.cat([whole.reshape(1), pieces]).to(torch.int64))
        sizes.append((n, rows.shape[1]))
    flat = torch.cat(sums).tolist() if sums else []
    out, i = [], 0
    for n, size in sizes:
        out.append(([flat[i], n * size], [[s, size] for s in flat[i + 1 : i + 1 + n]]))
        i += n + 1
    return out


def _row_bit_sums(rows: Tensor) -> Tensor:
    """`bit_sum` of each row of a contiguous 2-D tensor, in one reduction where the rows' words do
    not straddle rows (an odd row of a 2-byte dtype pairs with the next: summed one by one)."""
    width = rows.element_size()
    if width == 2 and rows.shape[1] % 2:
        return torch.stack([bit_sum(r) for r in rows])
    if width == 8:
        return rows.view(torch.int64).sum(dim=1)
    if width == 1:
        return rows.view(torch.uint8).sum(dim=1, dtype=torch.int32)
    words = rows.view(torch.int16).view(torch.int32) if width == 2 else rows.view(torch.int32)
    return words.sum(dim=1, dtype=torch.int32)


def bit_sum(t: Tensor) -> Tensor:
    """The tensor's bytes read as little-endian 32-bit words (64-bit for 8-byte dtypes) and
    summed, wrapping: the same in any order and on any device, and as fast as a plain sum (a
    widening integer sum is 20x slower on CPU). A 2-byte tensor's words pair its elements; one
    not aligned to 4 bytes (a piece of a flat bucket) is paired explicitly, to the same value."""
    flat = t.detach().contiguous().reshape(-1)
    width = flat.element_size()
    if width == 4:
        return flat.view(torch.int32).sum(dtype=torch.int32)
    if width == 8:
        return flat.view(torch.int64).sum()
    if width == 1:
        return flat.view(torch.uint8).sum(dtype=torch.int32)
    v = flat.view(torch.int16)
    n = v.numel() - v.numel() % 2
    if v[:n].storage_offset() % 2 == 0:
        total = v[:n].view(torch.int32).sum(dtype=torch.int32)
    else:
        lo, hi = v[0:n:2].to(torch.int32) & 0xFFFF, v[1:n:2].to(torch.int32) << 16
        total = (lo + hi).sum(dtype=torch.int32)
    if n < v.numel():  # the odd element out, as a word whose upper half is zero
        total = total + (v[n:].to(torch.int32) & 0xFFFF).sum(dtype=torch.int32)
    return total


def checksum_mismatches(expected: dict[str, list[int]], got: dict[str, list[int]]) -> list[str]:
    """Names whose checksums differ (or that `got` lacks), for an error."""
    bad = []
    for name, want in expected.items():
        have = got.get(name)
        if have is None:
            bad.append(f"{name} (not held by the engine)")
        elif list(have) != list(want):
            bad.append(f"{name} (bit sums: trainer {want[0]}, engine {have[0]})")
    return bad
