"""`from slime.rollout.rm_hub.deepscaler import get_deepscaler_rule_based_reward`: slime's
deepscaler rule, which reward plug-ins call on their own responses (vime's `--rm-type deepscaler`)."""

from __future__ import annotations

from vime.rollout.rewards.grading import builtin_score


def get_deepscaler_rule_based_reward(response: str, label: object) -> int:
    """1 when the last box after the reasoning (`</think>`) is the label's answer, else 0."""
    return int(builtin_score("deepscaler", response, str(label)))
