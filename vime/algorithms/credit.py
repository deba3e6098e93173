"""A rollout's credit: the rewards of its groups of samples made into the advantages the
trainer takes, by the estimator --advantage-estimator names (a row of
`vime.algorithms.ADVANTAGES`), or by --custom-advantage-function-path; whitening over the
batch's loss tokens, and REINFORCE++'s per-token discounted returns.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from vime.algorithms import estimator_of
from vime.plugins import as_plugin, first_line


def compute_advantages(
    rewards: Tensor, estimator: str = "grpo", std_normalize: bool = True, eps: float = 1e-6
) -> Tensor:
    """Per-sample advantages for rewards shaped [num_groups, n_samples_per_prompt], by the
    estimator's row of ADVANTAGES (gspo and cispo change the loss, not the advantage: GRPO's).
    `std_normalize` False skips the group std of an estimator that divides by it
    (--disable-grpo-std-normalization). The whitening of REINFORCE++'s estimators is the
    caller's (`whiten`), as it needs the token counts."""
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [num_groups, n], got shape {tuple(rewards.shape)}")
    advantage = estimator_of(estimator).advantages
    return advantage.compute(rewards.float(), std_normalize, eps)


def whiten(advantages: Tensor, token_counts: Tensor, eps: float = 1e-8) -> Tensor:
    """Per-sample advantages whitened over the batch's loss tokens (REINFORCE++, or any estimator
    with --normalize-advantages): each sample's advantage stands on each of its `token_counts`
    loss tokens, so the mean and the (unbiased) variance are taken over tokens, not samples, and a
    long response weighs as many tokens as it has. Samples without loss tokens change nothing."""
    n = token_counts.float()
    total = n.sum()
    if total < 2:
        return advantages - advantages.mean() if advantages.numel() else advantages
    mean = (n * advantages).sum() / total
    var = (n * (advantages - mean).square()).sum() / (total - 1)
    return (advantages - mean) * torch.rsqrt(var + eps)


def discounted_returns(groups: list[list[Any]], gamma: float) -> list[Tensor]:
    """REINFORCE++'s per-token returns with discount `gamma` (and no KL in the reward): the
    reward is paid at the response's last loss token, so G_t = γ^(last − t) · R for t up to it
    (masked tokens in between, a tool's answer, count in the distance as in slime) and 0 after.
    One float tensor per sample, in the groups' order, whitened over the loss tokens."""
    out, masks = [], []
    for g in groups:
        for s in g:
            mask = torch.tensor(s.effective_loss_mask(), dtype=torch.float32)
            g_t = torch.zeros(s.response_length)
            if mask.any():
                last = int(mask.nonzero().max())
                g_t[: last + 1] = (s.reward or 0.0) * gamma ** torch.arange(last, -1, -1, dtype=torch.float32)
            out.append(g_t)
            masks.append(mask)
    values, mask = torch.cat(out), torch.cat(masks).bool()
    if int(mask.sum()) < 2:
        return out
    mean, std = values[mask].mean(), values[mask].var(correction=1).add(1e-8).sqrt()
    return [(t - mean) / std for t in out]


def group_advantages(
    groups: list[list[Any]],
    estimator: str = "grpo",
    std_normalize: bool = True,
    whitened: bool = False,
    custom: Callable[..., Any] | None = None,
    args: Any = None,
) -> tuple[Tensor, Tensor]:
    """A rollout's rewards and advantages as [num_groups, n] tensors, from its groups of samples
    (a missing reward counts 0): what the actor trains on, kept as tensors end to end.

    `custom` (--custom-advantage-function-path) replaces the estimator: `custom(args, groups,
    rewards)` returns the [num_groups, n] advantages. Whitening (`whitened`, or a REINFORCE++
    estimator) applies after either."""
    rewards = torch.tensor([[s.reward or 0.0 for s in g] for g in groups], dtype=torch.float32)
    if custom is None:
        adv = compute_advantages(rewards, estimator, std_normalize=std_normalize)
    else:
        plugin = as_plugin(custom, "--custom-advantage-function-path")
        out = plugin(args, groups, rewards)
        try:
            adv = torch.as_tensor(out, dtype=torch.float32)
        except (TypeError, ValueError, RuntimeError) as e:
            raise plugin.error(
                f"returned {type(out).__name__}: return a [groups × n] tensor of numbers, one per sample ({first_line(e)})"
            ) from None
        if adv.shape != rewards.shape:
            raise plugin.error(
                f"returned advantages of shape {tuple(adv.shape)}, "
                f"the rollout's rewards are {tuple(rewards.shape)} (groups × samples): return one per sample"
            )
    if whitened or estimator_of(estimator).advantages.whitened:
        counts = torch.tensor([[sum(s.effective_loss_mask()) for s in g] for g in groups], dtype=torch.float32)
        adv = whiten(adv.flatten(), counts.flatten()).view_as(adv)
    return rewards, adv
