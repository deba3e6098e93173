"""Advantages, the PPO-clip policy loss, KL penalties and entropy: pure functions on tensors.

Everything here works on flat per-token tensors (one entry per response token of a micro-batch)
so it can be checked by hand and reused by any actor. Losses are *masked sums divided by a
denominator the caller chooses*: the actor passes the token count (or Dr.GRPO constant) of the
whole optimizer step, so summing the losses of its micro-batches gives exactly the loss of the
step, whatever the micro-batch split.
"""
from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

Estimator = Literal["grpo", "dr_grpo"]
Aggregation = Literal["token_mean", "seq_sum_const"]
KLKind = Literal["low_var_kl", "k1", "k2"]


def compute_advantages(rewards: Tensor, estimator: Estimator = "grpo", std_normalize: bool = True, eps: float = 1e-6) -> Tensor:
    """Group-relative advantages for rewards shaped [num_groups, n_samples_per_prompt].

    The baseline is the group mean. GRPO also divides by the group's *population* std
    (correction=0): a group's advantages then have unit variance exactly, and a group of one
    sample gives 0 rather than the NaN of the unbiased std. Dr.GRPO never divides by the std
    (it biases updates towards groups that are almost all right or all wrong), whatever
    `std_normalize` says. A group with equal rewards gets zero advantages either way.
    """
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [num_groups, n], got shape {tuple(rewards.shape)}")
    if estimator not in ("grpo", "dr_grpo"):
        raise ValueError(f"unknown advantage estimator {estimator!r}: use grpo or dr_grpo")
    rewards = rewards.float()
    centered = rewards - rewards.mean(dim=1, keepdim=True)
    if estimator == "dr_grpo" or not std_normalize:
        return centered
    return centered / (rewards.std(dim=1, correction=0, keepdim=True) + eps)


def aggregate(
    values: Tensor, loss_mask: Tensor, agg: Aggregation = "token_mean", num_tokens: float | Tensor | None = None, const: float | None = None
) -> Tensor:
    """Masked sum of per-token `values` divided by the step's denominator.

    token_mean: by `num_tokens` (the loss tokens of the whole optimizer step; default: this
    call's mask sum, i.e. a plain token mean). seq_sum_const (Dr.GRPO): by `const`
    (max response length × number of sequences), so a token weighs the same in a short and in a
    long response and no length bias creeps in through the normalizer.
    """
    total = (values * loss_mask).sum()
    if agg == "token_mean":
        denom = loss_mask.sum() if num_tokens is None else torch.as_tensor(num_tokens, dtype=total.dtype)
        return total / denom.clamp(min=1)
    if agg == "seq_sum_const":
        if const is None or const <= 0:
            raise ValueError("seq_sum_const aggregation needs a positive const (max response length × number of sequences)")
        return total / const
    raise ValueError(f"unknown loss aggregation {agg!r}: use token_mean or seq_sum_const")


def policy_loss(
    log_probs: Tensor,
    old_log_probs: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    eps_clip: float,
    eps_clip_high: float | None = None,
    rollout_log_probs: Tensor | None = None,
    use_tis: bool = False,
    tis_clip: float = 2.0,
    agg: Aggregation = "token_mean",
    const: float | None = None,
    num_tokens: float | Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO-clip loss over flat per-token tensors; returns (loss, metrics).

    The ratio is clipped to [1 - eps_clip, 1 + eps_clip_high] (DAPO's clip-higher when the two
    differ) and the pessimistic (larger) of the clipped and unclipped losses is kept.

    With `use_tis`, each token's loss is multiplied by the truncated importance weight
    min(exp(old_log_probs - rollout_log_probs), tis_clip), detached: it corrects for the engine
    sampling from a slightly different distribution than the trainer computes (other kernels,
    other precision, or older weights), while the truncation bounds the variance.

    Metrics are token means over `num_tokens` (default: this call's mask sum), so they too add
    up over the micro-batches of one step: pg_loss, pg_clipfrac (share of tokens whose clipped
    term was the active one), ppo_kl (mean old − new log-prob), and with TIS tis (mean weight)
    and tis_clipfrac (share of weights truncated).
    """
    if eps_clip_high is None:
        eps_clip_high = eps_clip
    mask = loss_mask.to(log_probs.dtype)
    n = mask.sum() if num_tokens is None else torch.as_tensor(num_tokens, dtype=log_probs.dtype)
    n = n.clamp(min=1)
    log_ratio = log_probs - old_log_probs
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - eps_clip, 1.0 + eps_clip_high)
    per_token = torch.maximum(unclipped, clipped)
    metrics: dict[str, Tensor] = {}
    if use_tis:
        if rollout_log_probs is None:
            raise ValueError("use_tis needs rollout_log_probs (the engine's log-probs of the sampled tokens)")
        raw = torch.exp(old_log_probs - rollout_log_probs).detach()
        weight = raw.clamp(max=tis_clip)
        per_token = per_token * weight
        metrics["tis"] = (weight * mask).sum() / n
        metrics["tis_clipfrac"] = ((raw > tis_clip).to(mask.dtype) * mask).sum() / n
    loss = aggregate(per_token, mask, agg, num_tokens=n, const=const)
    with torch.no_grad():
        metrics["pg_loss"] = loss.detach()
        metrics["pg_clipfrac"] = ((clipped > unclipped).to(mask.dtype) * mask).sum() / n
        metrics["ppo_kl"] = (-log_ratio * mask).sum() / n
    return loss, metrics


def kl_penalty(log_probs: Tensor, ref_log_probs: Tensor, kind: KLKind = "low_var_kl") -> Tensor:
    """Per-token estimate of KL(policy ‖ reference) from the sampled tokens' log-probs.

    k1: log r with r = π/π_ref (unbiased, high variance, can be negative). k2: ½ (log r)²
    (biased, low variance). low_var_kl (Schulman's k3): 1/r − 1 + log r, unbiased and never
    negative; clamped to [-10, 10] (as verl and slime do) so a single token whose probability
    collapsed cannot blow up the step.
    """
    log_ratio = log_probs - ref_log_probs
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return 0.5 * log_ratio.square()
    if kind == "low_var_kl":
        return (torch.exp(-log_ratio) - 1.0 + log_ratio).clamp(min=-10.0, max=10.0)
    raise ValueError(f"unknown KL kind {kind!r}: use low_var_kl, k1 or k2")


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of the categorical distribution of each row of logits, in float32.

    Works on log-probs too (log_softmax is shift invariant), which is how the actor calls it.
    """
    log_p = torch.log_softmax(logits.float(), dim=-1)
    return -(log_p.exp() * log_p).sum(dim=-1)
