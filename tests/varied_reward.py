"""A reward that varies within a group even for a random model (the share of digits in the
response), so GRPO advantages are non-zero and every training step moves the weights."""

from __future__ import annotations


def digit_share(args, sample) -> float:
    text = sample.response or ""
    return sum(ch.isdigit() for ch in text) / max(len(text), 1)
