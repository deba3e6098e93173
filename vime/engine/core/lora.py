"""LoRA adapters pushed on their own, merged into the engine's weights as they arrive.

A LoRA run's trainer changes only its adapters, so a push needs only them: for the 0.6B model at
rank 32 on every linear layer ~40 MB in place of 1.2 GB. The engine keeps a copy of each adapted
weight as it was before the first adapters came (the base) and sets the weight to
base + B A whenever a new pair arrives, on the weight's own device, in float32, rounded once to
the engine's dtype: the trainer's merge (`vime/trainer/lora.py`), so the engine samples from
what the trainer trains. Merged rather than run as a LoRA forward: a merged model decodes at
the plain model's speed and its CUDA graphs stay as they are; the price is the base copy (the
adapted weights twice) and one [out, r] × [r, in] product per layer per push.

On the wire an adapter is two tensors named after the layer, `<layer>.lora_A` [r, in] and
`<layer>.lora_B` [out, r], with the scaling alpha / r already in B, so every transport (shm,
disk, CUDA IPC, nccl / gloo buckets) carries them like any weight. A push of plain weights
replaces the base: adapters that follow merge into the weights it brought.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor

from vime.transport.checksums import checksums

PARTS = ("lora_A", "lora_B")


def adapter_of(name: str) -> tuple[str, str] | None:
    """`model.layers.0.mlp.up_proj.lora_B` → (`model.layers.0.mlp.up_proj.weight`, `lora_B`); None for a plain weight."""
    layer, _, part = name.rpartition(".")
    return (f"{layer}.weight", part) if part in PARTS and layer else None


def merge(base: Tensor, a: Tensor, b: Tensor) -> Tensor:
    """base + B A, computed in float32 and rounded once to the base's dtype: the trainer's merge
    (`vime/trainer/lora.py`), so engines sample from what the trainer trains."""
    return (base.float() + b.float() @ a.float()).to(base.dtype)


class AdapterMerger:
    """The engine's LoRA state: the base copies, the pairs half received, what was merged."""

    def __init__(self) -> None:
        self.base: dict[str, Tensor] = {}  # HF weight name → the weight before any adapter
        self.pending: dict[str, dict[str, Tensor]] = {}  # HF weight name → the half of a pair received so far
        self.merged: dict[str, list[int]] = {}  # adapter tensor name → checksum, as merged (for the trainer's check)

    def check(self, layout: list[tuple[str, tuple[int, ...]]], views: dict[str, Tensor], complete: bool) -> None:
        """ValueError for an adapter that cannot merge into this model: a layer it lacks, shapes
        that do not make its weight's shape, ranks that disagree; with `complete`, half a pair."""
        seen: dict[str, dict[str, tuple[int, ...]]] = {}
        for name, shape in layout:
            weight, part = adapter_of(name)  # type: ignore[misc]
            w = views.get(weight)
            if w is None:
                raise ValueError(f"adapter '{name}': this model has no weight '{weight}' to merge it into")
            out_f, in_f = w.shape
            if len(shape) != 2 or (part == "lora_A" and shape[1] != in_f) or (part == "lora_B" and shape[0] != out_f):
                want = f"[r, {in_f}]" if part == "lora_A" else f"[{out_f}, r]"
                raise ValueError(f"adapter '{name}' has shape {list(shape)}, '{weight}' takes {want}")
            seen.setdefault(weight, {})[part] = tuple(shape)
        for weight, parts in seen.items():
            if len(parts) == 2 and parts["lora_A"][0] != parts["lora_B"][1]:
                raise ValueError(
                    f"adapter of '{weight}': lora_A has rank {parts['lora_A'][0]}, lora_B rank {parts['lora_B'][1]}"
                )
            if complete and len(parts) == 1:
                raise ValueError(f"adapter of '{weight}' came without its {({*PARTS} - set(parts)).pop()}")

    @torch.no_grad()
    def load(self, items: Iterable[tuple[str, Tensor]], views: dict[str, Tensor]) -> int:
        """Take adapter tensors (any order, any split over buckets); merge each pair once both
        halves are here. Returns the number of tensors taken."""
        n = 0
        for name, t in items:
            weight, part = adapter_of(name)  # type: ignore[misc]
            w = views[weight]
            # a copy in the engine's dtype on its device: a bucket's buffer is reused, and every
            # transport then merges the same numbers
            self.pending.setdefault(weight, {})[part] = t.to(device=w.device, dtype=w.dtype, copy=True)
            n += 1
            pair = self.pending[weight]
            if len(pair) == 2:
                del self.pending[weight]
                self._merge(weight, w, pair["lora_A"], pair["lora_B"])
        return n

    def _merge(self, weight: str, w: Tensor, a: Tensor, b: Tensor) -> None:
        base = self.base.get(weight)
        if base is None:
            base = self.base[weight] = w.clone()
        w.copy_(merge(base, a, b))
        layer = weight.removesuffix(".weight")
        self.merged.update(zip((f"{layer}.lora_A", f"{layer}.lora_B"), checksums([a, b])))

    def unpaired(self) -> list[str]:
        return sorted(self.pending)

    def reset(self) -> None:
        """Plain weights arrived: they are the base from now on."""
        self.base.clear()
        self.pending.clear()
        self.merged.clear()

    def to(self, device: torch.device | str) -> int:
        """With the weights to the host on release and back on resume; returns the bytes that left
        a GPU (the release's count)."""
        left = sum(v.nbytes for v in self.base.values() if v.is_cuda and v.device != torch.device(device))
        self.base = {k: v.to(device) for k, v in self.base.items()}
        return left
