"""`...filter_hub.dynamic_sampling_filters`: slime's built-in filters, vime's of the same rules."""

from vime.rollout.filters import check_reward_nonzero_std, check_reward_nonzero_std_with_fallback

__all__ = ["check_reward_nonzero_std", "check_reward_nonzero_std_with_fallback"]
