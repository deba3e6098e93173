"""The objectives: advantage estimators and policy losses, one class and one table row each.

`--advantage-estimator` names both halves of an objective, as slime's flag does: a row of
ADVANTAGES trains with PPO's clipped loss (grpo, dr_grpo, reinforce_plus_plus, ...), a row of
POLICY_LOSSES other than ppo trains on GRPO's advantages (gspo, cispo). A new objective is a
class in advantages.py or losses.py and its row here: the config's choices, help and checks,
the rollout's advantages (`credit.py`) and the trainer's loss (`objective.py`) all read these
tables when they run.

Imports no torch (nor do the two modules the rows come from): the config imports this package.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from vime.algorithms.advantages import GRPO, Advantage, DrGRPO, ReinforcePlusPlus, ReinforcePlusPlusBaseline
from vime.algorithms.losses import CISPO, GSPO, PolicyLoss, PPOClip

if TYPE_CHECKING:
    from vime.algorithms.settings import AlgorithmConfig

ADVANTAGES: dict[str, type[Advantage]] = {
    "grpo": GRPO,
    "dr_grpo": DrGRPO,
    "reinforce_plus_plus": ReinforcePlusPlus,
    "reinforce_plus_plus_baseline": ReinforcePlusPlusBaseline,
}
POLICY_LOSSES: dict[str, type[PolicyLoss]] = {"ppo": PPOClip, "gspo": GSPO, "cispo": CISPO}
# the other half of an --advantage-estimator value, which names one row
BASE_ADVANTAGE, BASE_LOSS = "grpo", "ppo"


@dataclass(frozen=True)
class Estimator:
    """What one --advantage-estimator value trains with: a row of each table."""

    advantage: str
    loss: str

    @property
    def advantages(self) -> type[Advantage]:
        return ADVANTAGES[self.advantage]

    @property
    def policy_loss(self) -> type[PolicyLoss]:
        return POLICY_LOSSES[self.loss]

    def refused(self, algo: AlgorithmConfig) -> list[tuple[bool, str]]:
        """Both halves' checks of the flags (`Config.validate`)."""
        return [*self.advantages.refused(algo), *self.policy_loss.refused(algo)]


def estimator_names() -> tuple[str, ...]:
    """--advantage-estimator's values: every advantage, then every policy loss but the base one."""
    return (*ADVANTAGES, *(name for name in POLICY_LOSSES if name != BASE_LOSS))


def estimator_of(name: str) -> Estimator:
    if name in ADVANTAGES:
        return Estimator(name, BASE_LOSS)
    if name in POLICY_LOSSES and name != BASE_LOSS:
        return Estimator(BASE_ADVANTAGE, name)
    raise ValueError(f"unknown advantage estimator {name!r}: use one of {', '.join(estimator_names())}")


def estimator_help() -> str:
    """--advantage-estimator's help, from the rows' own words."""
    rows = [f"{name} ({cls.help})" for name, cls in ADVANTAGES.items()]
    rows += [
        f"{name} ({BASE_ADVANTAGE}'s advantages, {cls.help})"
        for name, cls in POLICY_LOSSES.items()
        if name != BASE_LOSS
    ]
    return "; ".join(rows)
