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


# ---- hooks that do not fit: refused at start-up (tests/unit/test_preflight.py) or in the call (test_loss.py)


def loss_one_short(args, *, log_probs, old_log_probs, advantages, loss_mask, rollout_log_probs, seq_ids):
    return (-advantages * log_probs)[:-1]


def detached_loss(args, *, log_probs, old_log_probs, advantages, loss_mask, rollout_log_probs, seq_ids):
    return (-advantages * log_probs).detach()


def loss_with_a_scalar_metric_per_sequence(
    args, *, log_probs, old_log_probs, advantages, loss_mask, rollout_log_probs, seq_ids
):
    return -advantages * log_probs, {"per_sequence": torch.zeros(int(seq_ids.max()) + 1)}


def loss_without_seq_ids(args, *, log_probs, old_log_probs, advantages, loss_mask, rollout_log_probs):
    return -advantages * log_probs


def advantages_per_group(args, groups, rewards):
    return rewards.mean(dim=1)


def advantages_that_divide_by_zero(args, groups, rewards):
    return rewards * (1 / 0)


def advantages_as_none(args, groups, rewards):
    return None


def tis_one_mask_short(args, *, pg_loss, train_log_probs, rollout_log_probs, loss_masks, **kw):
    return pg_loss, loss_masks[:-1], {}


def tis_summed(args, *, pg_loss, train_log_probs, rollout_log_probs, loss_masks, **kw):
    return pg_loss.sum(), loss_masks, {}


def tis_pair(args, *, pg_loss, train_log_probs, rollout_log_probs, loss_masks, **kw):
    return pg_loss, loss_masks


def tis_that_raises(args, *, pg_loss, train_log_probs, rollout_log_probs, loss_masks, **kw):
    raise RuntimeError("expected rollout log-probs in float64")


def deleting_loss(args, *, log_probs, old_log_probs, advantages, loss_mask, rollout_log_probs, seq_ids):
    del args.lr  # the trainer's lr fell back to the class default
    return -advantages * log_probs
