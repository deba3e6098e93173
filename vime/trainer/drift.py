"""A warning when a run trains on tokens the policy has moved far away from.

The staleness study (bench/RESULTS.md, issue 45) found that what costs accuracy is not how many
steps old a trained token is but how far the weights moved since it was drawn: the token mean of
(log π_old − log π_rollout)² over a step's trained tokens (`train/log_ratio_sq`). Every cell that
kept sync's accuracy trained at ≤ 0.016, every one that lost ≥ 10 points at ≥ 0.031, whatever its
correction. Neither TIS nor the masking corrections bring it down, so the run says it once and
names the two things that do: a smaller --lr, or a staleness bound.
"""

from __future__ import annotations

from dataclasses import dataclass

DRIFT_LIMIT = 0.025  # between the study's worst harmless cell (0.016) and its best harmful one (0.031)
DRIFT_STEPS = 3  # in a row: one noisy step is not a trend


@dataclass
class DriftWatch:
    limit: float = DRIFT_LIMIT
    steps: int = DRIFT_STEPS
    over: int = 0  # steps in a row above the limit
    warned: bool = False

    def observe(self, step: int, metrics: dict[str, float]) -> str | None:
        """The warning to log after `step`, once per run; None otherwise."""
        drift = metrics.get("train/log_ratio_sq")
        if drift is None or self.warned:
            return None
        self.over = self.over + 1 if drift > self.limit else 0
        if self.over < self.steps:
            return None
        self.warned = True
        return (
            f"step {step}: the trained tokens drifted far from the weights that drew them "
            f"(train/log_ratio_sq {drift:.3f} > {self.limit} for {self.steps} steps in a row); in the staleness "
            "study every run this far off-policy lost accuracy to sync, whatever its correction: lower --lr or "
            "bound staleness (--max-staleness 1; see stale/<k>/log_ratio_sq for which tokens drift)"
        )
