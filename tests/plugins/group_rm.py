"""Group rewards for tests/unit/rollout/test_group_rm.py, written vllm-project/vime's way (--group-rm: called
once per prompt group with its samples, one reward per sample back)."""

CALLS: list[list[int]] = []  # the sample indices of each call, in this process


def longest_wins(args, samples):
    """1 for the longest response of the group (the first of equals), 0 for the others: a reward
    that only a whole group can give, so a per-sample call would score every sample 1."""
    CALLS.append([s.index for s in samples])
    longest = max(range(len(samples)), key=lambda i: len(samples[i].response or ""))
    return [1.0 if i == longest else 0.0 for i in range(len(samples))]


async def one_short(args, samples):
    return [0.0] * (len(samples) - 1)


def raises_on_group_1(args, samples):
    if samples[0].group_index == 1:
        raise RuntimeError("judge unreachable")
    return [0.5] * len(samples)


def as_array(args, samples):
    import numpy as np

    return np.arange(len(samples), dtype=np.float64) / len(samples)
