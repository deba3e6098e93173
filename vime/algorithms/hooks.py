"""slime's loss hooks, and the checks of their answers: --custom-loss-function-path's per-token
policy term and --custom-tis-function-path. The adapters here take vime's `LossInputs` and call a
hook with slime's keywords, so plug-ins written for slime run unchanged. A hook's fault is a
`PluginError` naming it."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from vime.plugins import Plugin, as_plugin, first_line

if TYPE_CHECKING:
    from vime.algorithms.loss_inputs import LossInputs

CUSTOM_LOSS_SIGNATURE = (
    "fn(args, *, log_probs, old_log_probs, advantages, loss_mask, rollout_log_probs, seq_ids) -> "
    "per-token loss [T] or (loss, {name: per-token tensor})"
)
CUSTOM_TIS_SIGNATURE = (
    "fn(args, *, pg_loss, train_log_probs, rollout_log_probs, loss_masks, total_lengths, response_lengths, **kw) "
    "-> (pg_loss, loss_masks, metrics)"
)


def custom_loss_term(
    fn: Callable[..., Any], log_probs: Tensor, old: Tensor, t: LossInputs
) -> tuple[Tensor, dict[str, Tensor]]:
    """slime's --custom-loss-function-path on one micro-batch, called with keywords as slime calls
    it (`CUSTOM_LOSS_SIGNATURE`, every tensor [tokens]); returns its per-token loss [tokens],
    checked, and its metrics as masked sums (`token_metrics`)."""
    plugin = as_plugin(fn, "--custom-loss-function-path")
    out = plugin(
        log_probs=log_probs,
        old_log_probs=old,
        advantages=t.advantages,
        loss_mask=t.mask,
        rollout_log_probs=t.rollout_lp,
        seq_ids=t.seq_ids,
    )
    if isinstance(out, tuple) and len(out) != 2:
        raise plugin.error(
            f"returned {answer_kind(out)}: return the per-token loss, or (loss, {{name: per-token tensor}})"
        )
    per_token, metrics = out if isinstance(out, tuple) else (out, {})
    check_loss(plugin, "per-token loss", per_token, log_probs)
    return per_token, token_metrics(plugin, metrics, t.mask)


def apply_custom_tis(
    fn: Callable[..., Any], per_token: Tensor, old_log_probs: Tensor, t: LossInputs
) -> tuple[Tensor, dict[str, Tensor]]:
    """slime's --custom-tis-function-path on one micro-batch's whole sequences: called with
    keywords `pg_loss` (the flat per-token loss [tokens]), `train_log_probs`, `rollout_log_probs`,
    `loss_masks` (lists, one tensor per sequence), `response_lengths` and `total_lengths` (prompt +
    response, from `t.prompt_lens`; None without it); returns (pg_loss, masks, metrics), masks one
    per sequence, metrics flat per-token tensors (reported as masked token means). A returned mask
    zeroes tokens; the denominator stays the step's. Sequences are never split over ranks here (no
    context parallelism), so a function that gathers and slices them with slime's `cp_utils` gets
    each whole."""
    seq_ids, mask = t.seq_ids, t.mask
    lengths = torch.bincount(seq_ids, minlength=int(seq_ids.max()) + 1 if seq_ids.numel() else 0).tolist()
    totals = None
    if t.prompt_lens is not None:
        starts = (
            torch.tensor([0, *lengths[:-1]], dtype=torch.long).cumsum(0)
            if lengths
            else torch.zeros(0, dtype=torch.long)
        )
        prompts = t.prompt_lens[
            starts.to(t.prompt_lens.device)
        ].tolist()  # one read from the device, not one per sequence
        totals = [int(p) + k for p, k in zip(prompts, lengths, strict=True)]

    def split(x: Tensor) -> list[Tensor]:
        return list(torch.split(x, lengths))

    plugin = as_plugin(fn, "--custom-tis-function-path")
    out = plugin(
        pg_loss=per_token,
        total_lengths=totals,
        train_log_probs=split(old_log_probs.detach()),
        rollout_log_probs=split(t.rollout_lp),
        loss_masks=split(mask),
        response_lengths=lengths,
    )
    if not (isinstance(out, tuple) and len(out) == 3):
        raise plugin.error(f"returned {answer_kind(out)}: it must return (pg_loss, loss_masks, metrics)")
    new_loss, masks, metrics = out
    check_loss(plugin, "pg_loss", new_loss, per_token)
    if masks:
        if not isinstance(masks, (list, tuple)) or len(masks) != len(lengths):
            got = len(masks) if isinstance(masks, (list, tuple)) else f"a {type(masks).__name__} of"
            raise plugin.error(f"returned {got} loss_masks for {len(lengths)} sequences: return one mask per sequence")
        try:
            kept = [torch.as_tensor(m, dtype=mask.dtype, device=mask.device) for m in masks]
        except (TypeError, ValueError, RuntimeError) as e:
            raise plugin.error(f"returned loss_masks that are not numbers ({first_line(e)})") from None
        if [m.numel() for m in kept] != lengths:
            raise plugin.error(
                f"returned loss_masks of {[m.numel() for m in kept]} tokens for sequences of {lengths}: "
                "return one mask per sequence, as long as the one it was given"
            )
        keep = torch.cat([m.flatten() for m in kept])
    else:
        keep = mask
    return new_loss * keep, token_metrics(plugin, metrics, mask)


def answer_kind(value: Any) -> str:
    """A plug-in's answer, named for an error line: a tuple by its length, else its type."""
    return f"a tuple of {len(value)}" if isinstance(value, tuple) else type(value).__name__


def check_loss(plugin: Plugin, name: str, loss: Any, like: Tensor) -> None:
    """A hook's per-token loss: a tensor shaped like the one vime computes, with a gradient
    wherever vime's has one (a detached loss would train nothing, silently)."""
    if not isinstance(loss, Tensor) or loss.shape != like.shape:
        shape = f" of shape {tuple(loss.shape)}" if isinstance(loss, Tensor) else ""
        raise plugin.error(
            f"returned a {name} {type(loss).__name__}{shape} for {like.numel()} tokens: "
            f"return one value per token, shape {tuple(like.shape)}"
        )
    if like.requires_grad and not loss.requires_grad:
        raise plugin.error(
            f"returned a {name} with no gradient (detached, or computed under no_grad): build it from the tensors it is given"
        )


def token_metrics(plugin: Plugin, metrics: Any, mask: Tensor) -> dict[str, Tensor]:
    """A hook's metrics as masked sums over its tokens (the caller divides by the step's token
    count): one value per token each, or one number for all of them."""
    if not isinstance(metrics, dict):
        raise plugin.error(f"returned metrics as {answer_kind(metrics)}: give a dict of per-token tensors")
    sums = {}
    for name, value in metrics.items():
        try:
            v = torch.as_tensor(value, dtype=mask.dtype, device=mask.device).detach()
        except (TypeError, ValueError, RuntimeError) as e:
            raise plugin.error(f"returned metric '{name}' that is not numbers ({first_line(e)})") from None
        if v.dim() > 1 or (v.dim() == 1 and v.numel() != mask.numel()):
            raise plugin.error(
                f"returned metric '{name}' of shape {tuple(v.shape)} for {mask.numel()} tokens: give one value per token"
            )
        sums[str(name)] = (v * mask).sum()
    return sums
