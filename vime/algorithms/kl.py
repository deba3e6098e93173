"""The KL penalty to the reference model, per token."""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

KLKind = Literal["low_var_kl", "k1", "k2", "k3"]


def kl_penalty(
    log_probs: Tensor, ref_log_probs: Tensor, kind: KLKind = "low_var_kl", old_log_probs: Tensor | None = None
) -> Tensor:
    """Per-token estimate of KL(policy ‖ reference) from the sampled tokens' log-probs: every
    tensor [tokens], in and out.

    With r = π/π_ref: k1 = log r (unbiased, high variance, can be negative); k2 = ½ (log r)²
    (biased, low variance); k3 (Schulman's) = 1/r − 1 + log r, unbiased and never negative;
    low_var_kl is k3 clamped to [-10, 10] (as verl and slime do), so a single token whose
    probability collapsed cannot blow up the step.

    `old_log_probs` (--use-unbiased-kl, DeepSeek-V3.2's estimator, as slime computes it): each
    token's estimate is weighted by ρ = π/π_old, the tokens having been sampled from π_old, and
    the clamp of low_var_kl applies to the weighted value. ρ is not detached (slime's neither):
    its gradient is what makes the one of ρ·k3 that of the KL itself, ρ log r ∇log π, also at
    ρ = 1, where plain k3 gives (1 − 1/r) ∇log π.
    """
    log_ratio = log_probs - ref_log_probs
    if kind == "k1":
        kl = log_ratio
    elif kind == "k2":
        kl = 0.5 * log_ratio.square()
    elif kind in ("k3", "low_var_kl"):
        kl = torch.exp(-log_ratio) - 1.0 + log_ratio
    else:
        raise ValueError(f"unknown KL kind {kind!r}: use low_var_kl, k1, k2 or k3")
    if old_log_probs is not None:
        kl = torch.exp(log_probs - old_log_probs) * kl
    if kind == "low_var_kl":
        kl = kl.clamp(min=-10.0, max=10.0)
    return kl
