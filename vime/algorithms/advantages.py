"""Advantage estimators: one class each, one row of `vime.algorithms.ADVANTAGES` each.

An estimator turns a rollout's rewards, [num_groups, n_samples_per_prompt], into one advantage
per sample (`compute`), and says what else it implies: a std division that
--disable-grpo-std-normalization turns off, whitening over the batch's loss tokens, per-token
returns under --gamma, the loss's denominator, and the flags it cannot train with (`refused`).
`vime.algorithms.credit` applies them to a rollout.

Tensor methods only, no `import torch`: the config reads the table for --advantage-estimator's
choices and checks, and a bad flag is reported before torch loads (`vime.cli`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    from torch import Tensor

    from vime.algorithms.settings import AlgorithmConfig


class Advantage:
    """What every estimator says; a new one sets `help`, overrides `compute` and whichever of the
    rest differ."""

    help: ClassVar[str] = ""  # what --advantage-estimator's help says of it
    std_normalized: ClassVar[bool] = False  # `compute` divides by the group's std unless told not to
    whitened: ClassVar[bool] = False  # whitened over the batch's loss tokens whatever --normalize-advantages says
    discounted: ClassVar[bool] = False  # takes --gamma: below 1, per-token discounted returns
    aggregation: ClassVar[str | None] = None  # the loss aggregation it implies (None: --calculate-per-token-loss's)

    @staticmethod
    def compute(rewards: Tensor, std_normalize: bool, eps: float) -> Tensor:
        """Float advantages [num_groups, n] of float rewards [num_groups, n]."""
        raise NotImplementedError

    @staticmethod
    def refused(algo: AlgorithmConfig) -> list[tuple[bool, str]]:
        """Flags it cannot train with, as (condition, one-line error) checks for `Config.validate`."""
        return []


def _centered(rewards: Tensor) -> Tensor:
    return rewards - rewards.mean(dim=1, keepdim=True)


class GRPO(Advantage):
    """The group mean as baseline, divided by the group's *population* std (correction=0): a
    group's advantages then have unit variance exactly, and a group of one sample gives 0 rather
    than the NaN of the unbiased std. A group with equal rewards gets zero advantages."""

    help = "the group mean as baseline, divided by the group's std"
    std_normalized = True

    @staticmethod
    def compute(rewards: Tensor, std_normalize: bool, eps: float) -> Tensor:
        centered = _centered(rewards)
        if not std_normalize:
            return centered
        return centered / (rewards.std(dim=1, correction=0, keepdim=True) + eps)


class DrGRPO(Advantage):
    """GRPO without the std division, which biases updates towards groups that are almost all
    right or all wrong, and with a constant loss denominator (max response length × sequences),
    so a token weighs the same in a short and in a long response."""

    help = "no std normalization, constant-length loss normalizer"
    aggregation = "seq_sum_const"

    @staticmethod
    def compute(rewards: Tensor, std_normalize: bool, eps: float) -> Tensor:
        return _centered(rewards)

    @staticmethod
    def refused(algo: AlgorithmConfig) -> list[tuple[bool, str]]:
        return [
            (
                not algo.calculate_per_token_loss,
                "--no-calculate-per-token-loss with --advantage-estimator dr_grpo: Dr. GRPO divides by a constant, not by tokens or samples; drop one",
            )
        ]


class ReinforcePlusPlus(Advantage):
    """REINFORCE++: the reward itself (no group baseline; with γ = 1 and no KL in the reward,
    every token's return is the sample's reward), whitened over the batch's loss tokens."""

    help = "the reward itself, whitened over the batch's tokens"
    whitened = True
    discounted = True

    @staticmethod
    def compute(rewards: Tensor, std_normalize: bool, eps: float) -> Tensor:
        return rewards.clone()


class ReinforcePlusPlusBaseline(Advantage):
    """REINFORCE++ with baseline: the reward minus its group's mean, whitened over the batch's
    loss tokens."""

    help = "the reward minus its group's mean, whitened over the batch's tokens"
    whitened = True

    @staticmethod
    def compute(rewards: Tensor, std_normalize: bool, eps: float) -> Tensor:
        return _centered(rewards)
