"""A custom generate function that makes the engine slow on purpose, for staleness tests.

It asks for two tokens at a time and sleeps between requests, so one response spans several
weight pushes and its tokens carry different policy versions.
"""

import asyncio
import random

from vime.rollout.generate import generate as default_generate
from vime.rollout.types import Status


async def generate(args, sample, params):
    budget = params["max_new_tokens"]
    while True:
        await asyncio.sleep(random.uniform(0.05, 0.3))
        step = dict(params, max_new_tokens=min(budget, sample.response_length + 2))
        sample = await default_generate(args, sample, step)
        if sample.status != Status.TRUNCATED or sample.response_length >= budget:
            return sample
