"""Plug-ins for the custom-function flags, loaded by dotted path in whole-run tests."""

from __future__ import annotations

import torch


def reinforce_loss(args, *, log_probs, old_log_probs, advantages, loss_mask, rollout_log_probs, seq_ids):
    """Plain REINFORCE: −A · log π per token, and the mean ratio as a metric."""
    return -advantages * log_probs, {"custom_ratio": torch.exp(log_probs - old_log_probs).detach()}


def doubled_grpo(args, groups, rewards):
    """GRPO's group-centred rewards, doubled."""
    return 2 * (rewards - rewards.mean(dim=1, keepdim=True))


def halve_tis(args, *, pg_loss, train_log_probs, rollout_log_probs, loss_masks, total_lengths, response_lengths, **kw):
    """Halve every token's loss; report the mismatch per token as a metric."""
    mismatch = torch.cat([(t - r).abs() for t, r in zip(train_log_probs, rollout_log_probs)])
    return pg_loss * 0.5, loss_masks, {"custom_mismatch": mismatch}
