"""The trainer's weights as they leave it, for weight pushes and checkpoints: every tensor
under its HF name (LoRA's adapters merged into their layers), or the adapters alone. A part of
`Actor` (vime/trainer/actor.py) of its own: what it reads of the actor is declared below."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import torch
from torch import Tensor, nn

from vime.trainer.lora import LoraSpec, is_adapter, merged
from vime.trainer.model import full_tensor


class WeightExport:
    """`named_weights`, `adapter_weights` and `adapter_tensors` of the actor's model."""

    model: nn.Module
    rank: int
    lora: LoraSpec | None
    lora_modules: set[str]  # the layers that carry adapters
    _buffers: list[str]  # what a checkpoint holds besides parameters

    def ready(self) -> None:
        """The actor's: returns once its compile warm-up (which runs the model) is done."""
        raise NotImplementedError

    def named_weights(self, merge: bool = True) -> Iterator[tuple[str, Tensor]]:
        """(HF name, full tensor) as in the checkpoint files, for weight pushes and saves. With
        LoRA the adapted weights are merged (W + s·B A), unless `merge=False` (the frozen base).

        Every rank must iterate to the end (each sharded tensor is gathered by all ranks, one
        at a time, so at most one full tensor beyond the shards exists); only rank 0 receives
        anything. A tensor shared by several names (tied embeddings) is yielded once, under its
        first name (`model.embed_tokens.weight`), which is the one save_pretrained keeps.
        """
        self.ready()
        # named_parameters, not state_dict(): FSDP2's state-dict hooks cost ~45 µs a tensor on the
        # H200 host, 14 ms of a 0.6B push (bench/RESULTS.md)
        tensors = itertools.chain(self.model.named_parameters(), ((n, self.model.get_buffer(n)) for n in self._buffers))
        with torch.no_grad():
            for name, tensor in tensors:
                if is_adapter(name):
                    continue  # LoRA: merged into its layer's weight below
                tensor = full_tensor(tensor.detach())
                module = name.removesuffix(".weight")
                if merge and module in self.lora_modules:
                    assert self.lora is not None
                    layer = self.model.get_submodule(module)
                    tensor = merged(
                        tensor,
                        full_tensor(layer.lora_A.detach()),
                        full_tensor(layer.lora_B.detach()),
                        self.lora.scaling,
                    )
                if self.rank == 0:
                    yield name, tensor

    def adapter_weights(self) -> Iterator[tuple[str, Tensor]]:
        """LoRA: the adapters as a push sends them (`vime/engine/core/lora.py`): `<layer>.lora_A`
        and `<layer>.lora_B` in float32 on the trainer's device, the scaling s folded into B. Every
        rank iterates to the end, as with `named_weights`; rank 0 receives them."""
        assert self.lora is not None
        self.ready()
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                if is_adapter(name):
                    full = full_tensor(p.detach()).float()
                    if name.endswith(".lora_B"):
                        full = full * self.lora.scaling
                    if self.rank == 0:
                        yield name, full

    def adapter_tensors(self) -> dict[str, Tensor]:
        """LoRA: every adapter tensor, full, by parameter name (rank 0 gets them; every rank calls)."""
        out = {}
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                if is_adapter(name):
                    full = full_tensor(p.detach()).cpu()
                    if self.rank == 0:
                        out[name] = full
        return out
