"""`from slime.utils.ppo_utils import compute_approx_kl, compute_policy_loss`: slime's per-token
PPO pieces, which losses of one's own import (a --custom-loss-function-path that clips its own
ratio or adds a KL term), on vime's own KL estimators (vime/algorithms/kl.py).

`compute_approx_kl(log_probs, log_probs_base, kl_loss_type, importance_ratio=None)`: k1, k2, k3
or low_var_kl (k3 clamped to [-10, 10] after any importance weighting), in float32.
`compute_policy_loss(ppo_kl, advantages, eps_clip, eps_clip_high, eps_clip_c=None)`: PPO's
clipped loss per token from `ppo_kl` = old − new log-prob, with the dual clip where
`eps_clip_c` (> 1) is given, and the clip fraction; both [tokens]. slime's other helpers here
work on Megatron's logits and batches (log-probs over a vocab-parallel split, GAE over its
rollout batch), which vime's plug-ins are never handed; they are not provided.
"""

from __future__ import annotations

import torch
from torch import Tensor

from vime.algorithms.kl import kl_penalty


def compute_approx_kl(
    log_probs: Tensor, log_probs_base: Tensor, kl_loss_type: str, importance_ratio: Tensor | None = None
) -> Tensor:
    """The per-token KL estimate of the policy from the base, weighted by `importance_ratio`."""
    kind = "k3" if kl_loss_type == "low_var_kl" else kl_loss_type
    kl = kl_penalty(log_probs.float(), log_probs_base.float(), kind)
    if importance_ratio is not None:
        kl = importance_ratio * kl
    return kl.clamp(min=-10.0, max=10.0) if kl_loss_type == "low_var_kl" else kl


def compute_policy_loss(
    ppo_kl: Tensor, advantages: Tensor, eps_clip: float, eps_clip_high: float, eps_clip_c: float | None = None
) -> tuple[Tensor, Tensor]:
    """PPO's clipped per-token loss and which tokens the clip held (1.0) or not (0.0)."""
    ratio = torch.exp(-ppo_kl)
    unclipped = -ratio * advantages
    clipped = -ratio.clamp(1.0 - eps_clip, 1.0 + eps_clip_high) * advantages
    loss = torch.maximum(unclipped, clipped)
    clipfrac = (clipped > unclipped).float()
    if eps_clip_c is not None:
        if eps_clip_c <= 1.0:
            raise ValueError(f"compute_policy_loss: dual-clip PPO's eps_clip_c must be over 1.0, got {eps_clip_c}")
        loss = torch.where(advantages < 0, torch.minimum(loss, -eps_clip_c * advantages), loss)
    return loss, clipfrac
