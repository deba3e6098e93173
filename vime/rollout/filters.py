"""Dynamic sampling (DAPO): which generated groups reach the trainer.

A group whose rewards are all equal has zero advantage for every sample under GRPO (and every
estimator that subtracts a group baseline): it costs a step's compute and teaches nothing, and
as training goes on (most groups all right, or all wrong) it crowds out the groups that do.
With `--dynamic-sampling-filter-path`, each group is judged as soon as it is scored: a group
the filter keeps goes into the batch, one it drops is done with (counted, never trained, never
generated again), and more prompts are started until the batch is full. A filter is slime's
`fn(args, samples, **kwargs)` returning a bool or an object with `keep` (and `reason`,
`keep_when_insufficient`); slime's built-in filters are accepted by their slime paths.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from vime.errors import VimeError
from vime.plugins import load_plugin
from vime.rollout.types import Sample

FLAG = "--dynamic-sampling-filter-path"
SIGNATURE = "fn(args, samples) -> bool or DynamicFilterOutput(keep, reason)"


class FilterError(VimeError, RuntimeError):
    """A filter that drops so much that no batch can fill (one that raises or answers nonsense
    is a PluginError naming the group)."""


@dataclass(frozen=True)
class DynamicFilterOutput:
    """What a filter says of one group. `reason` names why a dropped one was dropped (a per-step
    count, `rollout/dynamic_filter/drop_<reason>`). `keep_when_insufficient`: keep it after all
    when dropping it would need another round of prompts to fill a sync batch (the async worker
    always has more coming, and drops it)."""

    keep: bool
    reason: str | None = None
    keep_when_insufficient: bool = False


def check_reward_nonzero_std(args: Any, samples: list[Sample], **kwargs: Any) -> DynamicFilterOutput:
    """Keep a group whose rewards are not all equal (a nonzero std): DAPO's dynamic sampling.
    A dropped group's reason carries its reward (`zero_std_0.0`: all wrong; `zero_std_1.0`: all
    right), so the counts say which way the task is saturating."""
    rewards = [s.reward or 0.0 for s in samples]
    keep = max(rewards) - min(rewards) > 1e-6
    return DynamicFilterOutput(keep, None if keep else f"zero_std_{rewards[0]:.1f}")


def check_reward_nonzero_std_with_fallback(args: Any, samples: list[Sample], **kwargs: Any) -> DynamicFilterOutput:
    """`check_reward_nonzero_std`, but a group it drops is kept when a sync batch could not fill
    without another round of generation: fewer useful groups, never a longer step."""
    out = check_reward_nonzero_std(args, samples)
    return DynamicFilterOutput(out.keep, out.reason, keep_when_insufficient=True)


# vllm-project/vime's and slime's scripts name slime's filters; vime's follow the same rules
_SLIME = "slime.rollout.filter_hub.dynamic_sampling_filters."
_ALIASES = {
    _SLIME + name: f"{__name__}.{name}"
    for name in ("check_reward_nonzero_std", "check_reward_nonzero_std_with_fallback")
}

# the built-in filters that judge a group by its rewards' spread, by every path that loads them
REWARD_SPREAD_FILTERS = frozenset([*_ALIASES, *_ALIASES.values()])

GroupFilter = Callable[[list[Sample]], DynamicFilterOutput]


def load_filter(args: Any) -> GroupFilter | None:
    """The run's group filter, or None without --dynamic-sampling-filter-path. A filter that
    raises, or returns something else than a bool or an object with a bool `keep`, stops the
    run in one line naming the group (a silent keep-everything would train on what the user
    meant to drop)."""
    path = getattr(args, "dynamic_sampling_filter_path", None)
    if not path:
        return None
    plugin = load_plugin(_ALIASES.get(path, path), FLAG, signature=SIGNATURE, shown=path)
    plugin.check_call(SIGNATURE, args, [])

    def truth(value: Any) -> bool | None:
        """A bool, or one that answers like one: a one-element tensor or numpy bool (slime's own
        filter computes `keep` as `tensor.std() > 0`). None for anything else."""
        if isinstance(value, bool):
            return value
        if str(getattr(value, "dtype", "")) in ("torch.bool", "bool"):
            size = value.numel() if callable(getattr(value, "numel", None)) else getattr(value, "size", 0)
            return bool(value) if size == 1 else None
        return None

    def judge(group: list[Sample]) -> DynamicFilterOutput:
        where = f"on group {group[0].group_index}" if group else ""
        out = plugin.call(where, args, group)
        keep = truth(out)
        if keep is not None:
            return DynamicFilterOutput(keep)
        keep = truth(getattr(out, "keep", None))
        if keep is None:
            what = type(out).__name__ if not isinstance(out, (int, float, str)) else repr(out)[:40]
            raise plugin.error(f"returned {what}: it must return a bool or an object with a bool .keep", where)
        reason = getattr(out, "reason", None)
        if reason is not None and not isinstance(reason, str):
            raise plugin.error(f"returned a .reason of type {type(reason).__name__}: give a str or None", where)
        return DynamicFilterOutput(keep, reason, bool(getattr(out, "keep_when_insufficient", False)))

    return judge


class GroupSieve:
    """Dynamic sampling's one implementation, shared by the sync batch (`generate.py`) and the
    fully-async worker: each scored group is kept or dropped by the filter, a dropped one is done
    with (marked trained in the data source: never trained, never generated again), and the
    dropped groups are counted, by reason and with their rewards, until `metrics` reports them.
    The caller holds whatever lock guards it (the worker's condition) around `settle`, `check`
    and `metrics`; `judge` is the plug-in's call and runs outside it."""

    def __init__(self, judge: GroupFilter, data_source: Any, batch: int) -> None:
        self.judge = judge
        self.data_source = data_source
        self.batch = batch
        self.reasons: list[str | None] = []  # of the groups dropped since the last `metrics`
        self.dropped_rewards: list[float] = []
        self.in_a_row = 0  # groups dropped since the last one kept: a filter that keeps nothing must not spin forever

    def settle(self, group: list[Sample], verdict: DynamicFilterOutput, short: bool = False) -> bool:
        """Whether `group` goes on to the trainer. `short`: the batch cannot fill without it and
        another round of prompts, so a fallback group (`keep_when_insufficient`) is kept."""
        if verdict.keep or (verdict.keep_when_insufficient and short):
            self.in_a_row = 0
            return True
        self.data_source.mark_trained([group])
        self.reasons.append(verdict.reason)
        self.dropped_rewards += [s.reward or 0.0 for s in group]
        self.in_a_row += 1
        return False

    def check(self, kept: int) -> None:
        """Stop a filter that dropped as many groups in a row as the data has prompts (at least a
        batch); `kept`: the groups kept and waiting for a batch."""
        if self.in_a_row >= max(len(self.data_source), self.batch):
            raise everything_dropped(self.in_a_row, kept, self.batch)

    def metrics(self, kept: list[list[Sample]]) -> dict[str, float]:
        """The drops since the last call, and the raw reward of what was generated: the groups
        `kept` for this batch and those dropped. Starts the next count."""
        out = dropped_metrics(self.reasons)
        rewards = [s.reward or 0.0 for g in kept for s in g] + self.dropped_rewards
        out["rollout/raw_reward_mean"] = sum(rewards) / len(rewards)
        self.reasons, self.dropped_rewards = [], []
        return out


def everything_dropped(dropped: int, kept: int, target: int) -> FilterError:
    """The error of a filter that dropped as many groups in a row as the data has prompts (at
    least a batch): it would go on generating forever (a filter that keeps some, however few,
    fills its batch). `kept`: the groups kept and waiting for a batch."""
    return FilterError(
        f"{FLAG} dropped {dropped} groups in a row (as many as the data has prompts) with {kept} kept groups "
        f"waiting for a batch of {target}: it drops everything this policy generates (e.g. a task too hard for it, "
        "or one it has learned); check the filter and the rewards"
    )


def dropped_metrics(reasons: list[str | None]) -> dict[str, float]:
    """Per-step counts of the groups dropped: in all, and by reason under slime's names."""
    out = {"rollout/dynamic_filter/dropped": float(len(reasons))}
    for r in reasons:
        if r:
            key = "rollout/dynamic_filter/drop_" + re.sub(r"[^\w.]+", "_", r).strip("_")
            out[key] = out.get(key, 0.0) + 1
    return out
