"""Non-finite numbers never reach the weights.

One `inf` reward made every advantage NaN, every loss NaN and every weight NaN from the first
step, and the run went on to write NaN checkpoints and exit 0. The defence is in layers:
rewards score 0 when not finite (`rollout/rewards/`); the train loop checks rewards and advantages
before a step (`bad_inputs`); the actor checks the loss and the gradient norm before the
optimizer moves (`OptimizerStep.clip_and_step`) and the weights before a checkpoint is written. A
step with a bad number is skipped and counted (`train/skipped_steps`); `--max-bad-steps` such
steps in a row stop the run (`BadSteps`), since by then the cause is not a stray sample.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import Tensor

from vime.errors import VimeError

log = logging.getLogger("vime")


class NonFiniteError(VimeError, RuntimeError):
    """The run stops: non-finite numbers keep coming. One line naming the step and what to do."""


def bad_inputs(rewards: Tensor, advantages: Tensor | list[Tensor]) -> str | None:
    """What is not finite among a batch's rewards and advantages (per sample, or per token as a
    list of tensors), or None."""
    if isinstance(advantages, list):
        advantages = torch.cat(advantages) if advantages else torch.zeros(0)
    for name, t in (("reward", rewards), ("advantage", advantages)):
        bad = ~torch.isfinite(t)
        if bad.any():
            return f"{int(bad.sum())} {name}s are not finite (e.g. {t[bad].flatten()[0].item()})"
    return None


@dataclass
class BadSteps:
    """Counts steps that skipped an optimizer step for non-finite numbers; raises at the limit."""

    limit: int
    in_a_row: int = 0

    def record(self, step: int, skipped: float, why: str) -> None:
        if not skipped:
            self.in_a_row = 0
            return
        self.in_a_row += 1
        log.warning(
            "step %d: %s; the optimizer step was skipped (%d in a row, --max-bad-steps %d)",
            step,
            why,
            self.in_a_row,
            self.limit,
        )
        if self.in_a_row >= self.limit:
            raise NonFiniteError(
                f"step {step}: {self.in_a_row} steps in a row had non-finite numbers ({why}); the weights and checkpoints are "
                "still finite: check the reward function and lower --lr (or raise --max-bad-steps)"
            )
