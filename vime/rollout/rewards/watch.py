"""A reward that fails for every sample, step after step, stops the run.

A reward failure scores its sample 0 and is counted (`rollout/reward_errors`, `_timeouts`), so a
reward model or an OPD teacher that is down for a minute costs that minute's rewards. One that
stays down cost the whole run: a served teacher killed mid-run left every later step unscored
(each waiting out --reward-timeout per sample) and the run finished with exit 0 and one warning.
`FailedRewardSteps` counts the steps in a row in which every sample that was scored failed;
at `--max-failed-reward-steps` the run stops in one line saying what failed, since when, and
how to resume. A step with any reward that came through starts the count again.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from vime.rollout.rewards import RewardError
from vime.rollout.settings import RolloutConfig
from vime.rollout.types import Sample, Status


@dataclass
class FailedRewardSteps:
    """The count of steps in a row whose every scored sample's reward failed; raises at `limit`."""

    limit: int
    source: str  # what scores: the flag and value named in the line
    save: str | None  # --save, where a resume reads from
    in_a_row: int = 0
    since: tuple[int, float] | None = None  # the first failing step of the row and its wall time

    @classmethod
    def of(cls, rollout: RolloutConfig, save: str | None) -> FailedRewardSteps:
        if rollout.rm_url:
            source = f"the service at --rm-url {rollout.rm_url}"
        elif rollout.custom_rm_path:
            source = f"--custom-rm-path {rollout.custom_rm_path}"
        else:
            source = f"--rm-type {rollout.rm_type}"
        return cls(rollout.max_failed_reward_steps, source, save)

    def observe(self, step: int, groups: list[list[Sample]], last_failure: str | None) -> None:
        """Count `step` (1-based) by its samples; RewardError once `limit` steps in a row failed.
        Samples the engine failed, or none scored at all, leave the count as it is."""
        scored = [s for g in groups for s in g if s.status != Status.FAILED]
        if not scored:
            return
        if any(s.reward_error is None for s in scored):
            self.in_a_row, self.since = 0, None
            return
        self.in_a_row += 1
        if self.since is None:
            self.since = (step, time.time())
        if self.in_a_row >= self.limit:
            first, at = self.since
            when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(at))
            resume = (
                f"then resume with --load {self.save}"
                if self.save
                else "then start the run again (it saves no checkpoints: --save)"
            )
            raise RewardError(
                f"step {step}: every sample's reward failed in {self.in_a_row} steps in a row, since step {first} "
                f"({when}): {last_failure or 'no reward came back'}; check {self.source}, {resume} "
                "(--max-failed-reward-steps sets how many such steps stop the run)"
            )
