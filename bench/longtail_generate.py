"""A seeded long-tailed response-length mix for speed benchmarks on random-weight models.

A random model never emits a meaningful EOS, so each sample's length is drawn instead (fixed by
`--rollout-seed` and the sample's index, identical in every arm) and EOS is ignored:
60% short (32–128 tokens), 30% medium (128–384), 10% long (768 – --rollout-max-response-len).
The long 10% is the tail that a synchronous step waits for.
"""

from __future__ import annotations

import random

from vime.rollout.generate import generate as default_generate


def target_length(index: int, seed: int, max_len: int) -> int:
    rng = random.Random(seed * 1_000_003 + index)
    u = rng.random()
    if u < 0.6:
        return rng.randint(32, 128)
    if u < 0.9:
        return rng.randint(128, 384)
    return rng.randint(min(768, max_len), max_len)


async def generate(args, sample, params):
    n = target_length(sample.index, args.rollout_seed, args.rollout_max_response_len)
    return await default_generate(args, sample, dict(params, max_new_tokens=n, ignore_eos=True))


async def zero_reward(args, sample) -> float:
    """A random-weight model never answers right; scoring its text would only add grading
    cost (and the math-verify import) to the rollout loop being timed."""
    return 0.0
