"""A rollout's credit: the rewards of its groups of samples made into the advantages the
trainer takes, by the estimator --advantage-estimator names (a row of
`vime.algorithms.ADVANTAGES`), or by --custom-advantage-function-path; whitening over the
batch's loss tokens, and REINFORCE++'s per-token discounted returns. `rollout_credit` is the one
entry the train loop calls: it picks among these by the settings and the estimator's row.

A generate may return several samples for one (an agent's turns, say): a group is then every
sample that came from one prompt, of any size (`fanned_out`), each normalized within itself, and
the rollout trains the first multiple of its optimizer steps (`trim_to_steps`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from vime.algorithms import estimator_of
from vime.plugins import as_plugin, first_line

if TYPE_CHECKING:
    from vime.algorithms.settings import AlgorithmConfig

log = logging.getLogger("vime")

SFT_LOSS = "sft_loss"  # the loss type that reads no reward and no advantage (vime/algorithms/sft.py)


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


def fanned_out_advantages(
    groups: list[list[Any]],
    estimator: str,
    std_normalize: bool,
    whitened: bool,
    custom: Callable[..., Any] | None = None,
    args: Any = None,
) -> tuple[Tensor, Tensor]:
    """(rewards, advantages), flat, of groups of different sizes: group_advantages' estimator
    (or --custom-advantage-function-path's, asked for one [1 × k] group at a time) on each group
    alone, so each normalizes within itself; whitening, where it applies, over the whole batch."""
    rewards, advs = [], []
    for g in groups:
        r = torch.tensor([[s.reward or 0.0 for s in g]], dtype=torch.float32)
        if custom is None:
            a = compute_advantages(r, estimator, std_normalize=std_normalize)
        else:  # "grpo" only so that nothing is whitened per group; the custom function decides
            _, a = group_advantages([g], "grpo", custom=custom, args=args)
        rewards.append(r.flatten())
        advs.append(a.flatten())
    adv = torch.cat(advs)
    if whitened or estimator_of(estimator).advantages.whitened:
        counts = torch.tensor([float(sum(s.effective_loss_mask())) for g in groups for s in g])
        adv = whiten(adv, counts)
    return torch.cat(rewards), adv


def fanned_out(groups: list[list[Any]], n: int) -> bool:
    """Whether some group is not `n` samples (a generate returned several for one)."""
    return any(len(g) != n for g in groups)


def trim_to_steps(samples: list[Any], steps: int) -> list[Any]:
    """The samples of a fanned-out rollout that its `steps` optimizer steps train: the first
    multiple of `steps`, so every rollout still takes --global-batch-size's steps and the policy
    version stays one count."""
    keep = len(samples) - len(samples) % steps
    if keep == 0:
        raise ValueError(f"{len(samples)} samples cannot fill the rollout's {steps} optimizer steps")
    if keep < len(samples):
        log.info("a rollout of %d samples trains %d (%d optimizer steps)", len(samples), keep, steps)
    return samples[:keep]


@dataclass
class Credit:
    """What a rollout's optimizer steps train on."""

    samples: list[Any]  # the groups' samples in order (a fanned-out rollout's trimmed to its steps)
    rewards: Tensor  # [samples]
    advantages: Tensor | list[Tensor]  # [samples], or under --gamma < 1 one [response tokens] per sample


def rollout_credit(
    groups: list[list[Any]],
    al: AlgorithmConfig,
    n_per_prompt: int,
    steps: int,
    custom: Callable[..., Any] | None = None,
    args: Any = None,
) -> Credit:
    """The rollout's samples, rewards and advantages, as the settings say: none for the SFT loss
    (it reads neither), the estimator's per group (each fanned-out group within itself), and
    per-token discounted returns where the estimator takes --gamma below 1."""
    samples = [s for g in groups for s in g]
    if al.loss_type == SFT_LOSS:
        zeros = torch.zeros(len(samples))
        return Credit(samples, zeros, torch.zeros_like(zeros))
    fanned = fanned_out(groups, n_per_prompt)
    rewards, adv = (fanned_out_advantages if fanned else group_advantages)(
        groups,
        al.advantage_estimator,
        std_normalize=al.normalize_advantages_std,
        whitened=al.normalize_advantages,
        custom=custom,
        args=args,
    )
    advantages: Tensor | list[Tensor] = adv.flatten()
    if al.gamma != 1.0:  # the config allows it only for an estimator whose row is `discounted`
        advantages = discounted_returns(groups, al.gamma)
    rewards = rewards.flatten()
    if fanned:  # every rollout takes the same optimizer steps, whatever its sample count
        samples = trim_to_steps(samples, steps)
        rewards, advantages = rewards[: len(samples)], advantages[: len(samples)]
    return Credit(samples, rewards, advantages)
