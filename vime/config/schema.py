"""Every setting in one dataclass, `Settings`: the components' settings (each declared once, where
its component lives: vime/setting.py) in the order of `COMPONENTS`, which is the flags' and
config.yaml's, then what belongs to the run as a whole; each component's view (`cfg.rollout`,
...), and the tables the parser and the checks read (`FIELDS`, `FLAGS`, `HINTS`)."""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass

from vime.algorithms.settings import AlgorithmConfig
from vime.backends.settings import PlacementConfig
from vime.config.components import EvalConfig, OutputConfig, RunFields, TrainerConfig
from vime.rollout.settings import RolloutConfig
from vime.setting import DERIVED, PASSTHROUGH, RUNTIME, Component

# the components, in the order of their flags in --help and of their keys in config.yaml
COMPONENTS = (RolloutConfig, AlgorithmConfig, TrainerConfig, PlacementConfig, EvalConfig, OutputConfig)


# a dataclass takes its bases' fields last base first: the reverse of COMPONENTS, the run's own last
@dataclass
class Settings(RunFields, OutputConfig, EvalConfig, PlacementConfig, TrainerConfig, AlgorithmConfig, RolloutConfig):
    """The settings, flat (slime's flags and plug-ins read them so), and each component's view of
    them; `Config` adds validation and the run's copies. What the checks compute from several
    components is here too."""

    @property
    def samples_per_rollout(self) -> int:
        return self.rollout_batch_size * self.n_samples_per_prompt

    @property
    def min_staleness(self) -> int:
        """The largest staleness even sync training has, in optimizer steps: the last optimizer
        step of a rollout is steps_per_rollout - 1 past the weights that generated it, and
        engines lag up to --update-weights-interval - 1 rollouts more."""
        return self.update_weights_interval * self.steps_per_rollout - 1

    # ---- each component's view, built on access so none is older than the fields ----
    def _view(self, component: type[Component]) -> typing.Any:
        """`component`'s fields read from the flat ones; once the config is frozen, read once and
        kept (`_views`), since per-sample code asks for `args.rollout` thousands of times a step.
        A copy never takes the kept ones along (config/core.py's NOT_COPIED): it may be changed."""
        if "_frozen" not in self.__dict__:
            return component.view_of(self)
        kept = self.__dict__.setdefault("_views", {})
        if component not in kept:
            kept[component] = component.view_of(self)
        return kept[component]

    @property
    def rollout(self) -> RolloutConfig:
        return self._view(RolloutConfig)

    @property
    def algorithm(self) -> AlgorithmConfig:
        return self._view(AlgorithmConfig)

    @property
    def trainer(self) -> TrainerConfig:
        return self._view(TrainerConfig)

    @property
    def placement(self) -> PlacementConfig:
        return self._view(PlacementConfig)

    @property
    def eval(self) -> EvalConfig:
        return self._view(EvalConfig)

    @property
    def output(self) -> OutputConfig:
        return self._view(OutputConfig)


FIELDS = {f.name: f for f in dataclasses.fields(Settings)}
FLAGS = [name for name, f in FIELDS.items() if f.metadata["group"] not in (DERIVED, RUNTIME, PASSTHROUGH)]
HINTS = typing.get_type_hints(Settings)


def default_of(name: str) -> typing.Any:
    """A setting's default (a list or dict default made fresh)."""
    f = FIELDS[name]
    return f.default if f.default is not dataclasses.MISSING else f.default_factory()
