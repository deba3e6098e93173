"""`from vime.rollout.rm_hub import async_rm, batched_async_rm`: vllm-project/vime's reward calls, on the
run's own rewards (`args.runtime.rewards`: --rm-type or --custom-rm-path, with vime's timeout
and error counting). Each sets the samples' rewards, as vime's rollout does, and returns them.
slime's rule helpers its plug-ins import from here too, at the package and at their modules'
paths: `grade_answer_verl` (math_utils.py), `get_deepscaler_rule_based_reward` (deepscaler.py),
`compute_gpqa_reward` (gpqa.py), `f1_score` (f1.py, QA's word-overlap F1), `compute_score` (math_dapo_utils.py), and `remote_rm`, slime's
call of a reward model behind HTTP."""

from __future__ import annotations

from typing import Any

from vime.compat.rm_hub.deepscaler import get_deepscaler_rule_based_reward
from vime.compat.rm_hub.f1 import f1_score
from vime.compat.rm_hub.gpqa import compute_gpqa_reward
from vime.compat.rm_hub.math_utils import extract_answer, grade_answer_verl
from vime.rollout.rewards import score_samples
from vime.rollout.rewards.remote import RemoteReward
from vime.rollout.types import Sample


async def async_rm(args: Any, sample: Sample, **_: Any) -> float:
    """The reward of one sample."""
    await score_samples(args, [sample])
    return sample.reward


async def batched_async_rm(args: Any, samples: list[Sample], **_: Any) -> list[float]:
    """The rewards of several samples, scored concurrently."""
    await score_samples(args, samples)
    return [s.reward for s in samples]


async def remote_rm(args: Any, sample: Sample, max_retries: int = 10) -> Any:
    """slime's reward model behind HTTP: `{prompt, response, label}` posted to `args.rm_url`, its
    JSON answer returned. Tried again while busy or restarting, as `--rm-type remote_rm` is, for
    up to the run's `--reward-timeout` (slime counts `max_retries` instead)."""
    return await RemoteReward(args.rm_url, args.reward_timeout)(sample)


__all__ = [
    "async_rm",
    "batched_async_rm",
    "compute_gpqa_reward",
    "extract_answer",
    "f1_score",
    "get_deepscaler_rule_based_reward",
    "grade_answer_verl",
    "remote_rm",
]
