"""What the loss reads of a micro-batch besides its forward's log-probs and entropy, as one object:
the trainer builds it (vime/trainer/step_loss.py: `StepLoss.inputs`) and the objective passes it
down whole to its policy term, the off-policy corrections and the custom hooks' adapters, each of
which reads the fields it needs."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor


@dataclass
class LossInputs:
    """One micro-batch's per-token loss inputs. Every tensor is [tokens]: one entry per response
    token, packed over the micro-batch's sequences in the order of its scored rows (the forward's
    log-probs and entropy line up with them); `rows` cuts the same tokens as a chunk of the LM head."""

    mask: Tensor  # [tokens] float: 1 on loss tokens, 0 elsewhere (a tool's answer, a padding row)
    advantages: Tensor  # [tokens] its sample's advantage on each token, or one per token (REINFORCE++ with gamma < 1)
    rollout_lp: Tensor  # [tokens] the engine's log-prob of each token (π_rollout), 0 where it sent none
    has_rollout: Tensor  # [tokens] the mask where the engine sent log-probs, else zeros
    seq_ids: Tensor  # [tokens] int64: the sequence of each token, 0..S-1 for the micro-batch's S sequences
    old: Tensor | None  # [tokens] π_old's log-probs; None: the forward's own, detached
    ref: Tensor | None  # [tokens] the reference model's log-probs; None: no KL term
    weights: Tensor | None = None  # [tokens] sample_mean: 1 / the loss tokens of each token's sample
    # [tokens] optimizer steps between the weights that sampled each token and those it trains (-1: unknown)
    staleness: Tensor | None = None
    # [tokens] each token's sequence's prompt length: a custom TIS function's total_lengths (slime's)
    prompt_lens: Tensor | None = None

    def rows(self, sl: slice) -> LossInputs:
        """The same fields for a chunk of the tokens: one of the LM head's chunks, which may end
        mid-sequence, so they are taken only when no token's loss reads the rest of its sequence
        (`Objective.per_sequence`)."""
        return LossInputs(**{k: None if v is None else v[sl] for k, v in vars(self).items()})
