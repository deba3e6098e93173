"""`...filter_hub.base_types`: what a slime filter returns (`DynamicFilterOutput`, vime's), and the
helpers slime's rollout loop judges groups with, for rollout functions written on that loop:
`call_dynamic_filter` (a filter's answer as a DynamicFilterOutput), `should_drop_dynamic_filter_output`
(slime's rule for a fallback group) and `MetricGatherer` (the per-reason drop counts, under the
metric names vime's own dynamic sampling logs)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vime.rollout.filters import DynamicFilterOutput, dropped_metrics


def call_dynamic_filter(fn: Callable[..., Any] | None, *args: Any, **kwargs: Any) -> DynamicFilterOutput:
    """`fn`'s answer on a group as a DynamicFilterOutput (a bare bool is `keep`); no filter keeps."""
    if fn is None:
        return DynamicFilterOutput(keep=True)
    out = fn(*args, **kwargs)
    if isinstance(out, DynamicFilterOutput):
        return out
    if hasattr(out, "keep"):  # slime's own DynamicFilterOutput, from an installed slime
        return DynamicFilterOutput(bool(out.keep), out.reason, bool(getattr(out, "keep_when_insufficient", False)))
    return DynamicFilterOutput(keep=bool(out))


def should_drop_dynamic_filter_output(
    output: DynamicFilterOutput, *, remaining_batch_size: int, target_data_size: int
) -> bool:
    """Whether slime's loop drops a group the filter judged: a kept one never; a fallback one
    only while the groups started (`remaining_batch_size`) could still fill the batch without it."""
    if output.keep:
        return False
    return not (output.keep_when_insufficient and remaining_batch_size <= target_data_size)


class MetricGatherer:
    """The reasons groups were dropped for, counted into `rollout/dynamic_filter/drop_<reason>`."""

    def __init__(self) -> None:
        self.reasons: list[str | None] = []

    def on_dynamic_filter_drop(self, reason: str | None) -> None:
        if reason:
            self.reasons.append(reason)

    def collect(self) -> dict[str, float]:
        out = dropped_metrics(self.reasons)
        del out["rollout/dynamic_filter/dropped"]  # slime counts by reason only
        return out


__all__ = ["DynamicFilterOutput", "MetricGatherer", "call_dynamic_filter", "should_drop_dynamic_filter_output"]
