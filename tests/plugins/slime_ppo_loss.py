"""A per-token loss for --custom-loss-function-path built from slime's `slime.utils.ppo_utils`:
PPO's clipped term from `compute_policy_loss` (with the dual clip) plus a small k3 KL to the
rollout's log-probs from `compute_approx_kl`, reporting the clip fraction and the KL. For
tests/unit/compat/test_slime_ppo_utils.py, in slime's API, not copied."""

from slime.utils.ppo_utils import compute_approx_kl, compute_policy_loss


def clipped_with_kl(args, *, log_probs, old_log_probs, advantages, loss_mask, rollout_log_probs, seq_ids):
    pg_loss, clipfrac = compute_policy_loss(old_log_probs - log_probs, advantages, 0.2, 0.28, eps_clip_c=3.0)
    kl = compute_approx_kl(log_probs, rollout_log_probs.detach(), kl_loss_type="low_var_kl")
    return pg_loss + 0.01 * kl, {"slime_clipfrac": clipfrac, "slime_kl": kl.detach()}
