"""`from vime.rollout.rm_hub import async_rm, batched_async_rm`: vllm-project/vime's reward calls, on the
run's own rewards (`args.runtime.rewards`: --rm-type or --custom-rm-path, with vime's timeout
and error counting). Each sets the samples' rewards, as vime's rollout does, and returns them."""

from __future__ import annotations

from typing import Any

from vime.rollout.rewards import score_samples
from vime.rollout.types import Sample


async def async_rm(args: Any, sample: Sample, **_: Any) -> float:
    """The reward of one sample."""
    await score_samples(args, [sample])
    return sample.reward


async def batched_async_rm(args: Any, samples: list[Sample], **_: Any) -> list[float]:
    """The rewards of several samples, scored concurrently."""
    await score_samples(args, samples)
    return [s.reward for s in samples]


__all__ = ["async_rm", "batched_async_rm"]
