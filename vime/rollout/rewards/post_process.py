"""`--custom-reward-post-process-path`: slime's hook between a rollout's rewards and its advantages.

`fn(args, samples)` gets the rollout's samples, flat and in batch order, once every reward is in:
each sample's reward function answer as it came (`sample.get_reward_value(args)`: a number, or
whatever the function returned, e.g. the OPD teacher's `/generate` answer) and may set what the
trainer reads (`sample.teacher_log_probs`). It returns slime's pair `(raw_rewards, rewards)`, or
the rewards alone, one per sample: `rewards` become each `sample.reward`, from which
`--advantage-estimator` computes the advantages as it does for every reward. (slime's own default
post-process is where it normalizes GRPO's groups; vime's estimator does that, so a function that
returns rewards already normalized per group has them normalized once more, which changes nothing.)

`Run.rollout` calls it on every rollout, whatever made it, so it runs in every mode, before a
rollout is saved with `--save-debug-rollout-data`: a saved rollout holds what the trainer reads.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

from vime.plugins import Plugin, load_plugin
from vime.rollout.settings import RolloutConfig
from vime.rollout.types import Sample

FLAG = "--custom-reward-post-process-path"
SIGNATURE = "fn(args, samples) -> (raw_rewards, rewards)"


def load_post_process(rollout: RolloutConfig) -> Plugin | None:
    """The run's post-process, or None without the flag."""
    path = rollout.custom_reward_post_process_path
    return load_plugin(path, FLAG, signature=SIGNATURE) if path else None


def post_process(plugin: Plugin, args: Any, groups: list[list[Sample]]) -> None:
    """Call the post-process on the rollout's samples and set each one's reward to what it returned;
    the reward functions' answers it read are dropped (they can be large: a teacher's per-token answer)."""
    samples = [s for g in groups for s in g]
    out = plugin.call(f"on the rollout's {len(samples)} samples", args, samples)
    rewards = _rewards_of(out, len(samples))
    if rewards is None:
        raise plugin.error(
            f"returned {_shown(out)}: return (raw_rewards, rewards), two lists of one finite number per sample "
            f"({len(samples)}), or the rewards alone"
        )
    for s, r in zip(samples, rewards, strict=True):
        s.reward, s.reward_result = r, None


def _rewards_of(out: Any, n: int) -> list[float] | None:
    """The trained rewards of an answer: slime's (raw, rewards) pair or one list (a tensor too)."""
    if isinstance(out, (tuple, list)) and len(out) == 2 and all(_is_list(x) for x in out):
        out = out[1]
    values = out.tolist() if hasattr(out, "tolist") else out
    if not isinstance(values, (list, tuple)) or len(values) != n:
        return None
    if not all(isinstance(v, numbers.Real) and math.isfinite(v) for v in values):
        return None
    return [float(v) for v in values]


def _is_list(x: Any) -> bool:
    return isinstance(x, (list, tuple)) or getattr(x, "ndim", None) == 1


def _shown(out: Any) -> str:
    if isinstance(out, (list, tuple)):
        return f"a {type(out).__name__} of {len(out)}"
    return type(out).__name__
