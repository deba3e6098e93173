"""The checks a weight update passes before anything is copied, and the state a failed one leaves.

`LLMEngine.replace_weights` and the bucketed route check an announced layout here first, so a
wrong update (another architecture, a missing shard, a non-float tensor) changes nothing.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from vime.engine.core.lora import AdapterMerger, adapter_of
from vime.engine.core.model import CausalLM
from vime.engine.core.moe import is_expert_weight


class WeightsIncomplete(RuntimeError):
    """An update failed after some tensors were copied: the weights are a mix of two versions,
    so the engine generates nothing (HTTP 503) until a complete update succeeds."""

    http_status = 503


def check_layout(
    layout: Iterable[tuple[str, tuple[int, ...], torch.dtype | str]],
    params: dict[str, torch.Tensor],
    model: CausalLM,
    lora: AdapterMerger,
    complete: bool = False,
) -> None:
    """KeyError / ValueError naming the first announced weight this model does not have, has
    in another shape, or that is not floating point (an integer tensor would be cast without
    a word); with `complete`, also any weight missing or named twice. Checked before anything
    is received or read, so a refused update changes nothing."""
    layout = list(layout)
    for name, _, dtype in layout:
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise ValueError(
                f"weight '{name}' has dtype {str(dtype).removeprefix('torch.')}: weights must be floating point"
            )
    adapters = [(n, tuple(s)) for n, s, _ in layout if adapter_of(n) is not None]
    if adapters:
        if len(adapters) < len(layout):
            raise ValueError("an update mixes LoRA adapters with plain weights: push them separately")
        expert = next((n for n, _ in adapters if is_expert_weight(n)), None)
        if expert is not None:  # merging into stacked experts is not built: a layer has many, of another shape
            raise ValueError(
                f"adapter '{expert}': LoRA on experts or routers is not supported by the vime engine; "
                "leave them out of --target-modules"
            )
        lora.check(adapters, params, complete)
        return
    seen: set[str] = set()
    for name, shape, _ in layout:
        p = params.get(name)
        if p is None:
            raise KeyError(f"weight '{name}' does not exist in this {model.config.model_type} model")
        if tuple(p.shape) != tuple(shape):
            raise ValueError(f"weight '{name}' has shape {tuple(shape)}, the model expects {tuple(p.shape)}")
        if complete and name in seen:
            raise ValueError(f"weight '{name}' appears twice in the update")
        seen.add(name)
    if complete:
        missing = model.missing_weights(seen)
        if missing:
            raise ValueError(
                f"the update lacks {len(missing)} of the model's weights, e.g. {sorted(missing)[:3]} (another architecture, "
                "or a partial checkpoint?): nothing was loaded"
            )
