"""Every setting in one dataclass, `Settings`: the sections of vime/config/*_fields.py in flag
order, the values derived from them (properties, so no caller recomputes them: each room's
sub-config of vime/config/rooms.py among them), and the tables
the parser and the checks read (`FIELDS`, `FLAGS`, `HINTS`)."""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from pathlib import Path

from vime.algorithms import estimator_of
from vime.config.algorithm_fields import AlgorithmFields
from vime.config.fields import DERIVED, PASSTHROUGH, RUNTIME
from vime.config.output_fields import OutputFields
from vime.config.placement_fields import PlacementFields
from vime.config.rollout_fields import RolloutFields
from vime.config.rooms import (
    AlgorithmConfig,
    EvalConfig,
    OutputConfig,
    PlacementConfig,
    RolloutConfig,
    Room,
    TrainerConfig,
    take,
)
from vime.config.trainer_fields import TrainerFields
from vime.modes import SFT_ROLLOUT_FN


# a dataclass takes its bases' fields last base first: this order is the flags' and config.yaml's
@dataclass
class Settings(OutputFields, PlacementFields, TrainerFields, AlgorithmFields, RolloutFields):
    """The settings and what follows from them; `Config` adds validation and the run's copies."""

    @property
    def normalize_advantages_std(self) -> bool:
        return (
            not self.disable_grpo_std_normalization and estimator_of(self.advantage_estimator).advantages.std_normalized
        )

    @property
    def samples_per_rollout(self) -> int:
        return self.rollout_batch_size * self.n_samples_per_prompt

    @property
    def steps_per_rollout(self) -> int:
        """Optimizer steps per rollout batch; the policy version advances by this much per step."""
        # max(1, ...): validate() reports a zero batch size in one line; this must not divide by it first
        return self.samples_per_rollout // max(1, self.global_batch_size or self.samples_per_rollout)

    @property
    def min_staleness(self) -> int:
        """The largest staleness even sync training has, in optimizer steps: the last optimizer
        step of a rollout is steps_per_rollout - 1 past the weights that generated it, and
        engines lag up to --update-weights-interval - 1 rollouts more."""
        return self.update_weights_interval * self.steps_per_rollout - 1

    @property
    def sft_rollout(self) -> bool:
        """The run's samples are the data's conversations (the SFT rollout function)."""
        return self.rollout_function_path == SFT_ROLLOUT_FN

    @property
    def run_dir(self) -> Path:
        return Path(self.runs_dir) / (self.run_name or "run")

    # ---- each room's settings (vime/config/rooms.py), built on access so none is older than the fields ----
    def _room(self, room: type[Room]) -> Room:
        """`room` read from the fields; once the config is frozen, read once and kept (`_rooms`),
        since per-sample code asks for `args.rollout` thousands of times a step. A copy never
        takes the kept ones along (config/core.py's NOT_COPIED): it may be changed."""
        if "_frozen" not in self.__dict__:
            return take(room, self)
        kept = self.__dict__.setdefault("_rooms", {})
        if room not in kept:
            kept[room] = take(room, self)
        return kept[room]

    @property
    def rollout(self) -> RolloutConfig:
        return self._room(RolloutConfig)

    @property
    def algorithm(self) -> AlgorithmConfig:
        return self._room(AlgorithmConfig)

    @property
    def trainer(self) -> TrainerConfig:
        return self._room(TrainerConfig)

    @property
    def placement(self) -> PlacementConfig:
        return self._room(PlacementConfig)

    @property
    def eval(self) -> EvalConfig:
        return self._room(EvalConfig)

    @property
    def output(self) -> OutputConfig:
        return self._room(OutputConfig)


FIELDS = {f.name: f for f in dataclasses.fields(Settings)}
FLAGS = [name for name, f in FIELDS.items() if f.metadata["group"] not in (DERIVED, RUNTIME, PASSTHROUGH)]
HINTS = typing.get_type_hints(Settings)


def default_of(name: str) -> typing.Any:
    """A setting's default (a list or dict default made fresh)."""
    f = FIELDS[name]
    return f.default if f.default is not dataclasses.MISSING else f.default_factory()
