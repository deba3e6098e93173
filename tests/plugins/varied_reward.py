"""A reward that varies within a group even for a random model (the share of digits in the
response), so GRPO advantages are non-zero and every training step moves the weights."""

from __future__ import annotations


def digit_share(args, sample) -> float:
    text = sample.response or ""
    return sum(ch.isdigit() for ch in text) / max(len(text), 1)


def last_token_parity(args, sample) -> float:
    """1 for an odd last token id: varies within a group whatever the model's vocabulary."""
    return float(sample.tokens[-1] % 2)


def half_constant(args, sample) -> float:
    """digit_share for prompts with an even answer, 0.5 for the others: the groups of odd answers
    have equal rewards, which dynamic sampling must drop, and the others vary."""
    return 0.5 if int(sample.label) % 2 else digit_share(args, sample)


def constant(args, sample) -> float:
    return 1.0


def float_filter(args, samples) -> float:
    """A dynamic sampling filter that answers a number instead of keep/drop (refused)."""
    return 0.0


def tensor_filter(args, samples):
    """slime's way: keep computed as a tensor comparison."""
    import torch

    from vime.rollout.filters import DynamicFilterOutput

    return DynamicFilterOutput(keep=torch.tensor([s.reward for s in samples]).std() > 0)


def numpy_filter(args, samples):
    import numpy as np

    return np.std([s.reward for s in samples]) > 0


def two_bools_filter(args, samples):
    import torch

    return torch.tensor([True, False])


def filter_reading_a_missing_key(args, samples):
    """A filter that reads metadata the rows do not have: it raises on every group."""
    return samples[0].metadata["difficulty"] > 1


def filter_with_a_numeric_reason(args, samples):
    from vime.rollout.filters import DynamicFilterOutput

    return DynamicFilterOutput(keep=False, reason=3)


def filter_of_one_argument(samples):
    return True


def reward_as_text(args, sample):
    return "right"


def reward_forgotten(args, sample):
    """A reward whose author forgot the `return`."""
    sample.response.count("1")


def reward_of_the_sample_alone(sample):
    return 1.0


def reward_that_raises(args, sample):
    return 1 / 0
