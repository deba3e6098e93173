"""Policy losses: one class each, one row of `vime.algorithms.POLICY_LOSSES` each.

A policy loss is the per-token term of the objective, from the current log-probs and the ratio
to the old ones; `vime.algorithms.objective.Objective.policy_term` puts the dual clip, OPSM, the
off-policy correction and the step's denominator around it, the same for every row. Every tensor
is [tokens], packed over a micro-batch's sequences (`LossInputs`).

Tensor methods only, no `import torch` (see advantages.py: the config reads the table).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    from torch import Tensor

    from vime.algorithms.loss_inputs import LossInputs
    from vime.algorithms.settings import AlgorithmConfig


def per_sequence(log_w: Tensor, mask: Tensor, seq_ids: Tensor | None, level: str) -> Tensor:
    """Each token's log-ratio at `level`: its own (token), or its sequence's sum over loss tokens
    (sequence, the log of the product) or mean (geometric), on every token of the sequence. All
    [tokens]; `seq_ids` numbers each token's sequence."""
    if level == "token":
        return log_w
    if seq_ids is None:
        raise ValueError(f"level {level!r} needs seq_ids (the sequence of each token)")
    n_seq = int(seq_ids.max()) + 1 if seq_ids.numel() else 0
    seq_sum = log_w.new_zeros(n_seq).index_add_(0, seq_ids, log_w * mask)
    if level == "geometric":
        seq_sum = seq_sum / seq_sum.new_zeros(n_seq).index_add_(0, seq_ids, mask).clamp(min=1)
    return seq_sum[seq_ids]


class PolicyLoss:
    """What every policy loss says; a new one sets `help` and overrides `per_token` (and
    `clip_acts` when its clip is not PPO's)."""

    help: ClassVar[str] = ""  # what --advantage-estimator's help says of it
    # a token's loss depends on the rest of its sequence: the trainer then scores whole sequences,
    # never chunk by chunk in the LM head (a chunk may end mid-sequence)
    whole_sequences: ClassVar[bool] = False

    @classmethod
    def per_token(
        cls, log_probs: Tensor, log_ratio: Tensor, t: LossInputs, eps_clip: float, eps_clip_high: float
    ) -> tuple[Tensor, Tensor]:
        """Each token's loss and where its clip was the active term, both [tokens], from `log_ratio`
        = log π − log π_old per token, the ratio bounded to [1 - eps_clip, 1 + eps_clip_high]."""
        raise NotImplementedError

    @staticmethod
    def clip_acts(ratio: Tensor, bounded: Tensor, advantages: Tensor) -> Tensor:
        """Where the clip is the active term, in the token view, from the token's ratio and its
        bounded value (the staleness diagnostics' pg_clipfrac): PPO's pessimistic side."""
        return -advantages * bounded > -advantages * ratio

    @staticmethod
    def refused(algo: AlgorithmConfig) -> list[tuple[bool, str]]:
        """Flags it cannot train with, as (condition, one-line error) checks for `Config.validate`."""
        return []


class PPOClip(PolicyLoss):
    """PPO-clip: the ratio π/π_old clipped to [1 - eps_clip, 1 + eps_clip_high] (DAPO's
    clip-higher when the two differ), the pessimistic (larger) of the clipped and unclipped
    losses kept. With π_old the proximal policy and a correction that reweights by π_old/π_behav,
    this is the decoupled PPO objective: the clip bounds the step from the current weights, the
    weight corrects for who sampled."""

    @staticmethod
    def ratio(log_ratio: Tensor, t: LossInputs) -> Tensor:
        return log_ratio.exp()

    @classmethod
    def per_token(
        cls, log_probs: Tensor, log_ratio: Tensor, t: LossInputs, eps_clip: float, eps_clip_high: float
    ) -> tuple[Tensor, Tensor]:
        ratio = cls.ratio(log_ratio, t)
        unclipped = -t.advantages * ratio
        clipped = -t.advantages * ratio.clamp(1.0 - eps_clip, 1.0 + eps_clip_high)
        return unclipped.maximum(clipped), clipped > unclipped


class GSPO(PPOClip):
    """GSPO (Zheng et al. 2025): PPO's clip on the ratio per sequence, exp of the mean over its
    loss tokens of log π − log π_old, on every token of the sequence (so the gradient of each
    token's log-prob flows through its sequence's mean). Its clip ranges are far tighter than
    PPO's (slime's scripts: 3e-4 to 4e-4)."""

    help = "the PPO ratio and clip per sequence: give a tight --eps-clip such as 4e-4"
    whole_sequences = True

    @staticmethod
    def ratio(log_ratio: Tensor, t: LossInputs) -> Tensor:
        return per_sequence(log_ratio, t.mask, t.seq_ids, "geometric").exp()


class CISPO(PolicyLoss):
    """CISPO (MiniMax-M1): clips the importance weight instead of the update and never drops a
    token's gradient: −sg(clip(ratio, 1 − eps_clip, 1 + eps_clip_high)) · A · log π; canonically
    --eps-clip 1 (no lower bound)."""

    help = (
        "the importance weight clipped and detached instead of the update: canonically --eps-clip 1 --eps-clip-high 4"
    )

    @classmethod
    def per_token(
        cls, log_probs: Tensor, log_ratio: Tensor, t: LossInputs, eps_clip: float, eps_clip_high: float
    ) -> tuple[Tensor, Tensor]:
        ratio = log_ratio.exp()
        w = ratio.detach().clamp(1.0 - eps_clip, 1.0 + eps_clip_high)
        return -w * t.advantages * log_probs, w != ratio.detach()

    @staticmethod
    def clip_acts(ratio: Tensor, bounded: Tensor, advantages: Tensor) -> Tensor:
        return bounded != ratio

    @staticmethod
    def refused(algo: AlgorithmConfig) -> list[tuple[bool, str]]:
        return [
            (
                algo.eps_clip_c is not None,
                "--eps-clip-c caps PPO's clipped loss, and CISPO clips the importance weight instead: drop --eps-clip-c",
            )
        ]
