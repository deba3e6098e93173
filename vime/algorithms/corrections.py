"""Off-policy corrections: how the engine's log-probs (the behaviour policy) enter the policy
loss: TIS, rejection, the veto, M2PO's second-moment mask, slime's TIS hook, and OPSM, which
every policy term goes through after its per-token loss (`reweigh`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from vime.algorithms.hooks import apply_custom_tis
from vime.algorithms.losses import per_sequence
from vime.algorithms.settings import AlgorithmConfig

if TYPE_CHECKING:
    from vime.algorithms.loss_inputs import LossInputs


@dataclass(frozen=True)
class OffPolicyCorrection:
    """How the engine's log-probs (the behaviour policy, π_behav) enter the policy loss.

    The PPO ratio is always taken against the old log-probs the caller passes (π_old: the
    trainer's own log-probs of the current weights, the *proximal* policy, unless the actor
    was told to use the engine's). Samples that are stale, or drawn by other kernels, come from
    π_behav ≠ π_old; the ratio w = π_old / π_behav per token is what these corrections read.
    Names are slime's (TIS in its core, the rest in its MIS example's config):

    * `use_tis`: multiply each token's loss by w. `tis_mode="truncate"` clamps w to
      [tis_clip_low, tis_clip] (truncated IS; with a lower bound above 0 no token is silenced
      entirely); `"mask"` keeps w inside that band and sets it to 0 outside (IcePop; with
      tis_clip_low 0 and tis_clip = C it is AReaL's decoupled PPO with behaviour-weight cap C).
      `tis_level` "sequence" or "geometric" weighs every token of a sequence alike, by the
      product of its tokens' w or their geometric mean (slime's MIS example).
    * `use_rs`: rejection, i.e. masked IS without reweighting: drop a token (`rs_level="token"`)
      or a whole sequence whose w leaves [rs_lower_bound, rs_upper_bound]; a sequence's w is the
      product of its tokens' (`"sequence"`) or their geometric mean (`"geometric"`).
    * `rs_veto_threshold`: drop a whole sequence in which any loss token has w below it: one
      token the trainer finds far less likely than the engine did (a numerical catastrophe, not
      staleness) makes the whole sequence suspect, whatever its mean.
    * `m2_threshold` (M2PO, Zheng et al. 2025; AReaL's `m2_threshold`): a trust region on the
      second moment of the log-ratio. The tokens of largest (log w)² are masked, fewest first,
      until the mean (log w)² of the micro-batch's remaining loss tokens is at most the
      threshold; nothing else is touched (no weight, no clip). Stale data whose drift is spread
      over many tokens keeps them all; a few runaway tokens are what goes. Taken per micro-batch
      (up to --max-tokens-per-gpu tokens), not per step: the step's old log-probs are not known
      before its first backward.
    * `custom` (--custom-tis-function-path): slime's hook, called on each micro-batch's
      per-token loss with per-sequence lists; it returns the loss, per-sequence masks and
      per-token metrics (`apply_custom_tis`). It takes the built-in TIS's place (slime's rule:
      the hook is the TIS function); rejection and the veto still apply.

    A dropped token weighs 0 in the step's token mean; the denominator stays the step's
    loss-token count (IcePop's zero weight), because renormalizing over the kept tokens would
    need every micro-batch's mask before the first backward.
    """

    # the run's algorithm settings: the flags above (--use-tis, --tis-mode, ...) are read from them
    settings: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    custom: Callable[..., Any] | None = None  # --custom-tis-function-path's hook, bound to the run's args

    def __post_init__(self) -> None:
        """The flags are checked with their names in `Config.validate`; this guards direct use."""
        levels = ("token", "sequence", "geometric")
        if (
            self.settings.tis_mode not in ("truncate", "mask")
            or self.settings.rs_level not in levels
            or self.settings.tis_level not in levels
        ):
            raise ValueError(
                f"tis_mode {self.settings.tis_mode!r} / tis_level {self.settings.tis_level!r} / rs_level {self.settings.rs_level!r}: "
                "use truncate|mask and token|sequence|geometric"
            )
        if not (
            0 <= self.settings.tis_clip_low < self.settings.tis_clip
            and 0 <= self.settings.rs_lower_bound < self.settings.rs_upper_bound
        ):
            raise ValueError(
                f"empty band: TIS [{self.settings.tis_clip_low}, {self.settings.tis_clip}], rejection [{self.settings.rs_lower_bound}, {self.settings.rs_upper_bound}]"
            )
        if self.settings.m2_threshold is not None and not self.settings.m2_threshold > 0:
            raise ValueError(f"m2_threshold {self.settings.m2_threshold} must be > 0")

    @property
    def active(self) -> bool:
        return (
            self.settings.use_tis
            or self.settings.use_rs
            or self.settings.rs_veto_threshold is not None
            or self.settings.m2_threshold is not None
            or self.custom is not None
        )

    @property
    def per_sequence(self) -> bool:
        """Whether a token's factor depends on the rest of its sequence (then the loss cannot be
        taken chunk by chunk in the LM head, where a chunk may end mid-sequence)."""
        return (
            (self.settings.use_tis and self.settings.tis_level != "token")
            or (self.settings.use_rs and self.settings.rs_level != "token")
            or self.settings.rs_veto_threshold is not None
            or self.settings.m2_threshold is not None  # its mask depends on every token of the micro-batch
            or self.custom is not None
        )


def in_band(log_w: Tensor, low: float, high: float) -> Tensor:
    """low <= exp(log_w) <= high, compared in log space so a sequence's product never overflows."""
    lo = torch.log(torch.tensor(low, dtype=log_w.dtype))  # -inf for a lower bound of 0
    return (log_w >= lo) & (log_w <= torch.log(torch.tensor(high, dtype=log_w.dtype)))


def second_moment_mask(log_w: Tensor, mask: Tensor, threshold: float) -> Tensor:
    """M2PO's keep-mask (1 kept, 0 masked) over the loss tokens: the largest set of tokens of
    smallest (log w)² whose mean (log w)² is at most `threshold`. Masking the largest first
    lowers the mean fastest, so the kept set is a prefix of the tokens sorted by (log w)², and
    the prefix means only grow along it: the kept count is how many of them are in bounds.
    Tensors only (no host sync): other tokens sort last as +inf and are never kept."""
    m2 = torch.where(mask > 0, log_w.square(), torch.full_like(log_w, float("inf")))
    sorted_m2, order = torch.sort(m2)
    counts = torch.arange(1, m2.numel() + 1, device=m2.device, dtype=m2.dtype)
    kept = (torch.cumsum(sorted_m2, 0) / counts <= threshold).sum()
    rank = torch.empty_like(order)
    rank[order] = torch.arange(m2.numel(), device=m2.device)
    return ((rank < kept) & (mask > 0)).to(mask.dtype)


def behaviour_weights(
    old_log_probs: Tensor,
    rollout_log_probs: Tensor,
    loss_mask: Tensor,
    correction: OffPolicyCorrection,
    seq_ids: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-token factor (detached) that `correction` puts on the policy loss, and its metrics.

    Every tensor is [tokens] (`LossInputs`' fields: π_old's, the engine's log-probs, the loss
    mask); `seq_ids` numbers the sequence each token belongs to (0..S-1): the sequence and
    geometric levels and the veto need it. Metrics are masked sums (the caller divides by its
    token count): tis (weight after truncation/masking), tis_clipfrac (share of tokens outside
    the TIS band), rs_dropfrac (share of tokens rejected), rs_veto_frac (share of tokens in
    vetoed sequences), m2_maskfrac (share of tokens M2PO masked) and m2 (mean (log w)² before
    masking). A sequence's log-ratio is clamped to ±20 before exp, so a product over a
    long sequence never overflows a weight.
    """
    mask = loss_mask.to(old_log_probs.dtype)
    log_w = (old_log_probs - rollout_log_probs).detach()
    factor = torch.ones_like(log_w)
    sums: dict[str, Tensor] = {}
    if correction.settings.use_tis and correction.custom is None:  # a custom TIS hook takes its place (slime's rule)
        level_log_w = per_sequence(log_w, mask, seq_ids, correction.settings.tis_level).clamp(-20.0, 20.0)
        inside = in_band(level_log_w, correction.settings.tis_clip_low, correction.settings.tis_clip)
        w = torch.exp(level_log_w)
        w = (
            w.clamp(correction.settings.tis_clip_low, correction.settings.tis_clip)
            if correction.settings.tis_mode == "truncate"
            else torch.where(inside, w, torch.zeros_like(w))
        )
        factor = factor * w
        sums["tis"] = (w * mask).sum()
        sums["tis_clipfrac"] = ((~inside).to(mask.dtype) * mask).sum()
    if correction.settings.use_rs:
        level_log_w = per_sequence(log_w, mask, seq_ids, correction.settings.rs_level)
        keep = in_band(level_log_w, correction.settings.rs_lower_bound, correction.settings.rs_upper_bound).to(
            mask.dtype
        )
        factor = factor * keep
        sums["rs_dropfrac"] = ((1 - keep) * mask).sum()
    if correction.settings.rs_veto_threshold is not None:
        if seq_ids is None:
            raise ValueError("rs_veto_threshold needs seq_ids (the sequence of each token)")
        low = torch.log(torch.tensor(correction.settings.rs_veto_threshold, dtype=log_w.dtype))
        bad = ((log_w < low) & (mask > 0)).to(mask.dtype)
        n_seq = int(seq_ids.max()) + 1 if seq_ids.numel() else 0
        vetoed = (torch.zeros(n_seq, dtype=mask.dtype, device=mask.device).index_add_(0, seq_ids, bad) > 0)[seq_ids]
        factor = factor * (~vetoed).to(mask.dtype)
        sums["rs_veto_frac"] = (vetoed.to(mask.dtype) * mask).sum()
    if correction.settings.m2_threshold is not None:
        keep = second_moment_mask(log_w, mask, correction.settings.m2_threshold)
        factor = factor * keep
        sums["m2_maskfrac"] = ((1 - keep) * mask).sum()
        sums["m2"] = (log_w.square() * mask).sum()  # before masking: the drift the mask answers
    return factor, sums


def reweigh(
    per_token: Tensor,
    log_probs: Tensor,
    old_log_probs: Tensor,
    t: LossInputs,
    *,
    correction: OffPolicyCorrection,
    opsm_delta: float | None,
    n: Tensor,
) -> tuple[Tensor, dict[str, Tensor]]:
    """What every policy term goes through after its per-token loss [tokens], PPO's or a custom
    one: OPSM's mask, then the off-policy correction (`behaviour_weights`, and the custom TIS hook,
    which takes the place of the built-in TIS as in slime). Metrics are token means over `n`, the
    step's loss tokens."""
    metrics: dict[str, Tensor] = {}
    if opsm_delta is not None:
        drift = per_sequence((old_log_probs - log_probs).detach(), t.mask, t.seq_ids, "geometric")  # [tokens]
        left_out = (t.advantages < 0) & (drift > opsm_delta)
        per_token = per_token * (~left_out).to(per_token.dtype)
        metrics["opsm_clipfrac"] = (left_out.to(t.mask.dtype) * t.mask).sum() / n
    if correction.active:
        factor, sums = behaviour_weights(old_log_probs, t.rollout_lp, t.mask, correction, t.seq_ids)
        per_token = per_token * factor
        if correction.custom is not None:
            per_token, hook_sums = apply_custom_tis(correction.custom, per_token, old_log_probs, t)
            sums.update(hook_sums)
        metrics.update({k: v / n for k, v in sums.items()})
    return per_token, metrics
