"""Advantages, the PPO-clip policy loss, KL penalties and entropy: pure functions on tensors.

Everything here works on flat per-token tensors (one entry per response token of a micro-batch)
so it can be checked by hand and reused by any actor. Losses are *masked sums divided by a
denominator the caller chooses*: the actor passes the token count (or Dr.GRPO constant) of the
whole optimizer step, so summing the losses of its micro-batches gives exactly the loss of the
step, whatever the micro-batch split.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor

Estimator = Literal["grpo", "dr_grpo"]
Aggregation = Literal["token_mean", "sample_mean", "seq_sum_const"]
KLKind = Literal["low_var_kl", "k1", "k2", "k3"]
TISMode = Literal["truncate", "mask"]
RSLevel = Literal["token", "sequence", "geometric"]


def compute_advantages(
    rewards: Tensor, estimator: Estimator = "grpo", std_normalize: bool = True, eps: float = 1e-6
) -> Tensor:
    """Group-relative advantages for rewards shaped [num_groups, n_samples_per_prompt].

    The baseline is the group mean. GRPO also divides by the group's *population* std
    (correction=0): a group's advantages then have unit variance exactly, and a group of one
    sample gives 0 rather than the NaN of the unbiased std. Dr.GRPO never divides by the std
    (it biases updates towards groups that are almost all right or all wrong), whatever
    `std_normalize` says. A group with equal rewards gets zero advantages either way.
    """
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [num_groups, n], got shape {tuple(rewards.shape)}")
    if estimator not in ("grpo", "dr_grpo"):
        raise ValueError(f"unknown advantage estimator {estimator!r}: use grpo or dr_grpo")
    rewards = rewards.float()
    centered = rewards - rewards.mean(dim=1, keepdim=True)
    if estimator == "dr_grpo" or not std_normalize:
        return centered
    return centered / (rewards.std(dim=1, correction=0, keepdim=True) + eps)


def group_advantages(
    groups: list[list[Any]], estimator: Estimator = "grpo", std_normalize: bool = True
) -> tuple[Tensor, Tensor]:
    """A rollout's rewards and advantages as [num_groups, n] tensors, from its groups of samples
    (a missing reward counts 0): what the actor trains on, kept as tensors end to end."""
    rewards = torch.tensor([[s.reward or 0.0 for s in g] for g in groups], dtype=torch.float32)
    return rewards, compute_advantages(rewards, estimator, std_normalize=std_normalize)


def aggregate(
    values: Tensor,
    loss_mask: Tensor,
    agg: Aggregation = "token_mean",
    num_tokens: float | Tensor | None = None,
    const: float | None = None,
    weights: Tensor | None = None,
) -> Tensor:
    """Masked sum of per-token `values` divided by the step's denominator.

    token_mean: by `num_tokens` (the loss tokens of the whole optimizer step; default: this
    call's mask sum, i.e. a plain token mean). sample_mean (slime without
    --calculate-per-token-loss): each token weighted by `weights` (1 / its sample's loss
    tokens), the sum divided by `const` (the step's samples): the mean over samples of each
    sample's token mean, still a plain weighted sum, so micro-batches and chunks add up.
    seq_sum_const (Dr.GRPO): by `const` (max response length × number of sequences), so a token
    weighs the same in a short and in a long response and no length bias creeps in through the
    normalizer.
    """
    if agg == "sample_mean":
        if weights is None or const is None or const <= 0:
            raise ValueError(
                "sample_mean aggregation needs per-token weights and a positive const (the step's samples)"
            )
        return (values * loss_mask * weights).sum() / const
    total = (values * loss_mask).sum()
    if agg == "token_mean":
        denom = loss_mask.sum() if num_tokens is None else torch.as_tensor(num_tokens, dtype=total.dtype)
        return total / denom.clamp(min=1)
    if agg == "seq_sum_const":
        if const is None or const <= 0:
            raise ValueError(
                "seq_sum_const aggregation needs a positive const (max response length × number of sequences)"
            )
        return total / const
    raise ValueError(f"unknown loss aggregation {agg!r}: use token_mean, sample_mean or seq_sum_const")


@dataclass(frozen=True, kw_only=True)
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
    * `use_rs`: rejection, i.e. masked IS without reweighting: drop a token (`rs_level="token"`)
      or a whole sequence whose w leaves [rs_lower_bound, rs_upper_bound]; a sequence's w is the
      product of its tokens' (`"sequence"`) or their geometric mean (`"geometric"`).

    A dropped token weighs 0 in the step's token mean; the denominator stays the step's
    loss-token count (IcePop's zero weight), because renormalizing over the kept tokens would
    need every micro-batch's mask before the first backward.
    """

    use_tis: bool = False
    tis_mode: TISMode = "truncate"
    tis_clip: float = 2.0
    tis_clip_low: float = 0.0
    use_rs: bool = False
    rs_level: RSLevel = "token"
    rs_lower_bound: float = 0.5
    rs_upper_bound: float = 2.0

    def __post_init__(self) -> None:
        """The flags are checked with their names in `Config.validate`; this guards direct use."""
        if self.tis_mode not in ("truncate", "mask") or self.rs_level not in ("token", "sequence", "geometric"):
            raise ValueError(
                f"tis_mode {self.tis_mode!r} / rs_level {self.rs_level!r}: use truncate|mask and token|sequence|geometric"
            )
        if not (0 <= self.tis_clip_low < self.tis_clip and 0 <= self.rs_lower_bound < self.rs_upper_bound):
            raise ValueError(
                f"empty band: TIS [{self.tis_clip_low}, {self.tis_clip}], rejection [{self.rs_lower_bound}, {self.rs_upper_bound}]"
            )

    @property
    def active(self) -> bool:
        return self.use_tis or self.use_rs


def _in_band(log_w: Tensor, low: float, high: float) -> Tensor:
    """low <= exp(log_w) <= high, compared in log space so a sequence's product never overflows."""
    lo = torch.log(torch.tensor(low, dtype=log_w.dtype))  # -inf for a lower bound of 0
    return (log_w >= lo) & (log_w <= torch.log(torch.tensor(high, dtype=log_w.dtype)))


def behaviour_weights(
    old_log_probs: Tensor,
    rollout_log_probs: Tensor,
    loss_mask: Tensor,
    correction: OffPolicyCorrection,
    seq_ids: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-token factor (detached) that `correction` puts on the policy loss, and its metrics.

    `seq_ids` [T] numbers the sequence each token belongs to (0..S-1); sequence and geometric
    rejection need it. Metrics are masked sums (the caller divides by its token count):
    tis (weight after truncation/masking), tis_clipfrac (share of tokens outside the TIS band),
    rs_dropfrac (share of tokens rejected).
    """
    mask = loss_mask.to(old_log_probs.dtype)
    log_w = (old_log_probs - rollout_log_probs).detach()
    factor = torch.ones_like(log_w)
    sums: dict[str, Tensor] = {}
    if correction.use_tis:
        inside = _in_band(log_w, correction.tis_clip_low, correction.tis_clip)
        w = torch.exp(log_w)
        w = (
            w.clamp(correction.tis_clip_low, correction.tis_clip)
            if correction.tis_mode == "truncate"
            else torch.where(inside, w, torch.zeros_like(w))
        )
        factor = factor * w
        sums["tis"] = (w * mask).sum()
        sums["tis_clipfrac"] = ((~inside).to(mask.dtype) * mask).sum()
    if correction.use_rs:
        level_log_w = log_w
        if correction.rs_level != "token":
            if seq_ids is None:
                raise ValueError(f"rs_level {correction.rs_level!r} needs seq_ids (the sequence of each token)")
            n_seq = int(seq_ids.max()) + 1 if seq_ids.numel() else 0
            seq_sum = torch.zeros(n_seq, dtype=log_w.dtype, device=log_w.device).index_add_(0, seq_ids, log_w * mask)
            if correction.rs_level == "geometric":
                seq_sum = seq_sum / torch.zeros_like(seq_sum).index_add_(0, seq_ids, mask).clamp(min=1)
            level_log_w = seq_sum[seq_ids]
        keep = _in_band(level_log_w, correction.rs_lower_bound, correction.rs_upper_bound).to(mask.dtype)
        factor = factor * keep
        sums["rs_dropfrac"] = ((1 - keep) * mask).sum()
    return factor, sums


def policy_loss(
    log_probs: Tensor,
    old_log_probs: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    eps_clip: float,
    eps_clip_high: float | None = None,
    eps_clip_c: float | None = None,
    rollout_log_probs: Tensor | None = None,
    correction: OffPolicyCorrection = OffPolicyCorrection(),
    seq_ids: Tensor | None = None,
    agg: Aggregation = "token_mean",
    const: float | None = None,
    num_tokens: float | Tensor | None = None,
    weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO-clip loss over flat per-token tensors; returns (loss, metrics). `agg`, `const`,
    `num_tokens` and `weights` are `aggregate`'s.

    The ratio π/π_old is clipped to [1 - eps_clip, 1 + eps_clip_high] (DAPO's clip-higher when
    the two differ) and the pessimistic (larger) of the clipped and unclipped losses is kept.
    With π_old the proximal policy and a `correction` that reweights by π_old/π_behav, this is
    the decoupled PPO objective: the clip bounds the step from the current weights, the weight
    corrects for who sampled (see `OffPolicyCorrection`).

    `eps_clip_c` (dual-clip PPO, Ye et al. 2020; slime's --eps-clip-c, > 1): a token with a
    negative advantage loses at most -A·c. PPO's clip leaves such a token's loss -A·ratio
    unbounded above when the ratio is large (a token the current policy likes far more than
    the one that sampled it, as stale samples do), and one such token could set the step;
    capped, it contributes no gradient. `pg_clipfrac_lower` is the share of tokens capped.

    Metrics are token means over `num_tokens` (default: this call's mask sum), so they too add
    up over the micro-batches of one step: pg_loss, pg_clipfrac (share of tokens whose clipped
    term was the active one), ppo_kl (mean old − new log-prob), and those of the correction.
    """
    if eps_clip_high is None:
        eps_clip_high = eps_clip
    mask = loss_mask.to(log_probs.dtype)
    n = mask.sum() if num_tokens is None else torch.as_tensor(num_tokens, dtype=log_probs.dtype)
    n = n.clamp(min=1)
    log_ratio = log_probs - old_log_probs
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - eps_clip, 1.0 + eps_clip_high)
    per_token = torch.maximum(unclipped, clipped)
    metrics: dict[str, Tensor] = {}
    if eps_clip_c is not None:
        cap = -advantages * eps_clip_c
        capped = (advantages < 0) & (per_token > cap)
        per_token = torch.where(capped, cap, per_token)
        with torch.no_grad():
            metrics["pg_clipfrac_lower"] = (capped.to(mask.dtype) * mask).sum() / n
    if correction.active:
        if rollout_log_probs is None:
            raise ValueError("TIS and rejection need rollout_log_probs (the engine's log-probs of the sampled tokens)")
        factor, sums = behaviour_weights(old_log_probs, rollout_log_probs, mask, correction, seq_ids)
        per_token = per_token * factor
        metrics.update({k: v / n for k, v in sums.items()})
    loss = aggregate(per_token, mask, agg, num_tokens=n, const=const, weights=weights)
    with torch.no_grad():
        metrics["pg_loss"] = loss.detach()
        metrics["pg_clipfrac"] = ((clipped > unclipped).to(mask.dtype) * mask).sum() / n
        metrics["ppo_kl"] = (-log_ratio * mask).sum() / n
    return loss, metrics


def kl_penalty(
    log_probs: Tensor, ref_log_probs: Tensor, kind: KLKind = "low_var_kl", old_log_probs: Tensor | None = None
) -> Tensor:
    """Per-token estimate of KL(policy ‖ reference) from the sampled tokens' log-probs.

    With r = π/π_ref: k1 = log r (unbiased, high variance, can be negative); k2 = ½ (log r)²
    (biased, low variance); k3 (Schulman's) = 1/r − 1 + log r, unbiased and never negative;
    low_var_kl is k3 clamped to [-10, 10] (as verl and slime do), so a single token whose
    probability collapsed cannot blow up the step.

    `old_log_probs` (--use-unbiased-kl, DeepSeek-V3.2's estimator, as slime computes it): each
    token's estimate is weighted by ρ = π/π_old, the tokens having been sampled from π_old, and
    the clamp of low_var_kl applies to the weighted value. ρ is not detached (slime's neither):
    its gradient is what makes the one of ρ·k3 that of the KL itself, ρ log r ∇log π, also at
    ρ = 1, where plain k3 gives (1 − 1/r) ∇log π.
    """
    log_ratio = log_probs - ref_log_probs
    if kind == "k1":
        kl = log_ratio
    elif kind == "k2":
        kl = 0.5 * log_ratio.square()
    elif kind in ("k3", "low_var_kl"):
        kl = torch.exp(-log_ratio) - 1.0 + log_ratio
    else:
        raise ValueError(f"unknown KL kind {kind!r}: use low_var_kl, k1, k2 or k3")
    if old_log_probs is not None:
        kl = torch.exp(log_probs - old_log_probs) * kl
    if kind == "low_var_kl":
        kl = kl.clamp(min=-10.0, max=10.0)
    return kl


@dataclass
class LossInputs:
    """One micro-batch's per-token loss inputs, [R] each, in the order of its scored rows."""

    mask: Tensor
    advantages: Tensor
    rollout_lp: Tensor
    has_rollout: Tensor  # the mask where the engine sent log-probs, else zeros
    seq_ids: Tensor  # the sequence of each token, 0..S-1
    old: Tensor | None  # None: the forward's own log-probs, detached
    ref: Tensor | None
    weights: Tensor | None = None  # sample_mean: 1 / the loss tokens of each token's sample

    def rows(self, sl: slice) -> LossInputs:
        return LossInputs(**{k: None if v is None else v[sl] for k, v in vars(self).items()})


@dataclass(frozen=True)
class Objective:
    """The loss of some of a step's tokens, built once from the config: PPO-clip with the
    off-policy correction, the entropy bonus and the KL to the reference model.

    Denominators are the step's (`num_tokens`, or Dr.GRPO's constant `const`), never the
    tokens' own, so the loss of a micro-batch, or of one chunk of it, is its share of the
    step's: the trainer sums shares as it goes (actor.py, `_accumulate`)."""

    eps_clip: float
    eps_clip_high: float
    eps_clip_c: float | None  # dual clip: None off
    correction: OffPolicyCorrection
    agg: str  # token_mean; sample_mean (--no-calculate-per-token-loss); seq_sum_const for Dr.GRPO
    entropy_coef: float
    kl_coef: float
    kl_type: str
    unbiased_kl: bool  # each token's KL weighted by the current-to-old ratio
    coupled: bool  # --use-rollout-logprobs: the engine's log-probs are π_old

    @classmethod
    def of(cls, args: Any) -> Objective:
        return cls(
            eps_clip=args.eps_clip,
            eps_clip_high=args.eps_clip_high,
            eps_clip_c=args.eps_clip_c,
            correction=OffPolicyCorrection(
                use_tis=args.use_tis,
                tis_mode=args.tis_mode,
                tis_clip=args.tis_clip,
                tis_clip_low=args.tis_clip_low,
                use_rs=args.use_rs,
                rs_level=args.rs_level,
                rs_lower_bound=args.rs_lower_bound,
                rs_upper_bound=args.rs_upper_bound,
            ),
            agg="seq_sum_const"
            if args.advantage_estimator == "dr_grpo"
            else "token_mean"
            if args.calculate_per_token_loss
            else "sample_mean",
            entropy_coef=args.entropy_coef,
            kl_coef=args.kl_loss_coef,
            kl_type=args.kl_loss_type,
            unbiased_kl=args.use_unbiased_kl,
            coupled=args.use_rollout_logprobs,
        )

    def __call__(
        self, log_probs: Tensor, entropy: Tensor, t: LossInputs, num_tokens: float, const: float
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """(loss, metrics) of these tokens; the metrics are sums the trainer adds up over a step."""
        old = log_probs.detach() if t.old is None else t.old
        pg, m = policy_loss(
            log_probs,
            old,
            t.advantages,
            t.mask,
            eps_clip=self.eps_clip,
            eps_clip_high=self.eps_clip_high,
            eps_clip_c=self.eps_clip_c,
            rollout_log_probs=t.rollout_lp,
            correction=self.correction,
            seq_ids=t.seq_ids,
            agg=self.agg,
            const=const,
            num_tokens=num_tokens,
            weights=t.weights,
        )
        loss = pg
        # entropy is reported as a token mean whatever the loss aggregation
        m["entropy"] = aggregate(entropy.detach(), t.mask, "token_mean", num_tokens=num_tokens)
        if self.entropy_coef != 0:
            loss = loss - self.entropy_coef * aggregate(
                entropy, t.mask, self.agg, num_tokens=num_tokens, const=const, weights=t.weights
            )
        if t.ref is not None:
            per_token = kl_penalty(log_probs, t.ref, self.kl_type, old if self.unbiased_kl else None)
            kl = aggregate(per_token, t.mask, self.agg, num_tokens=num_tokens, const=const, weights=t.weights)
            loss = loss + self.kl_coef * kl
            m["kl_loss"] = kl.detach()
        m["loss"] = loss.detach()
        trainer_lp = log_probs.detach() if self.coupled else old  # coupled: old is the engine's own
        m["_lp_diff_sum"] = ((trainer_lp - t.rollout_lp).abs() * t.has_rollout).sum()
        m["_lp_diff_count"] = t.has_rollout.sum()
        return loss, m
