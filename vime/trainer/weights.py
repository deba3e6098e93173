"""The policy's weights as they leave the trainer, for weight pushes and checkpoints: every
tensor under its HF name (LoRA's adapters merged into their layers), or the adapters alone. The
actor waits for its compile warm-up (which runs the model) before it reads them."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from vime.trainer.lora import is_adapter, merged
from vime.trainer.model import full_tensor
from vime.trainer.moe import hub_tensors

if TYPE_CHECKING:
    from vime.trainer.policy import Policy


def named_weights(policy: Policy, merge: bool = True) -> Iterator[tuple[str, Tensor]]:
    """(HF name, full tensor) as in the checkpoint files, for weight pushes and saves. With
    LoRA the adapted weights are merged (W + s·B A), unless `merge=False` (the frozen base).

    Every rank must iterate to the end (each sharded tensor is gathered by all ranks, one
    at a time, so at most one full tensor beyond the shards exists); only rank 0 receives
    anything. A tensor shared by several names (tied embeddings) is yielded once, under its
    first name (`model.embed_tokens.weight`), which is the one save_pretrained keeps. A mixture
    of experts' fused expert tensors leave as the hub's one tensor per expert (`moe.hub_tensors`).
    """
    model, lora = policy.model, policy.lora
    # named_parameters, not state_dict(): FSDP2's state-dict hooks cost ~45 µs a tensor on the
    # H200 host, 14 ms of a 0.6B push (bench/RESULTS.md)
    tensors = itertools.chain(model.named_parameters(), ((n, model.get_buffer(n)) for n in policy.buffers))
    with torch.no_grad():
        for name, tensor in tensors:
            if is_adapter(name):
                continue  # LoRA: merged into its layer's weight below
            tensor = full_tensor(tensor.detach())
            module = name.removesuffix(".weight")
            if merge and module in policy.lora_modules:
                assert lora is not None
                layer = model.get_submodule(module)
                tensor = merged(
                    tensor, full_tensor(layer.lora_A.detach()), full_tensor(layer.lora_B.detach()), lora.scaling
                )
            if policy.ranks.rank == 0:
                yield from hub_tensors(policy.moe, name, tensor)


def adapter_weights(policy: Policy) -> Iterator[tuple[str, Tensor]]:
    """LoRA: the adapters as a push sends them (`vime/engine/core/lora.py`): `<layer>.lora_A`
    and `<layer>.lora_B` in float32 on the trainer's device, the scaling s folded into B. Every
    rank iterates to the end, as with `named_weights`; rank 0 receives them."""
    assert policy.lora is not None
    with torch.no_grad():
        for name, p in policy.model.named_parameters():
            if is_adapter(name):
                full = full_tensor(p.detach()).float()
                if name.endswith(".lora_B"):
                    full = full * policy.lora.scaling
                if policy.ranks.rank == 0:
                    yield name, full


def adapter_tensors(policy: Policy) -> dict[str, Tensor]:
    """LoRA: every adapter tensor, full, by parameter name (rank 0 gets them; every rank calls)."""
    out = {}
    with torch.no_grad():
        for name, p in policy.model.named_parameters():
            if is_adapter(name):
                full = full_tensor(p.detach()).cpu()
                if policy.ranks.rank == 0:
                    out[name] = full
    return out
