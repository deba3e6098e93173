"""`from vime.rollout.base_types import RolloutFnTrainOutput, RolloutFnEvalOutput`: what slime's and
vllm-project/vime's rollout functions return (`slime.rollout.base_types` is this module too).

A training rollout's output is vime's `RolloutOutput` (samples, metrics) under slime's name;
slime lets `metrics` be None, vime reads it as no metrics. Evaluation in vime does not go through
the rollout function (vime/eval.py grades every run alike), but a plug-in that builds an eval
output in a branch vime never takes must still import."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vime.rollout.types import RolloutOutput


@dataclass
class RolloutFnTrainOutput(RolloutOutput):
    def __post_init__(self) -> None:
        if self.metrics is None:  # slime's default
            self.metrics = {}


@dataclass
class RolloutFnEvalOutput:
    data: dict[str, dict[str, Any]]
    metrics: dict[str, Any] | None = None


__all__ = ["RolloutFnEvalOutput", "RolloutFnTrainOutput"]
