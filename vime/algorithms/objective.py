"""The loss of a micro-batch's tokens, built once from the config (`Objective.of`): the policy
term of the --advantage-estimator's row of POLICY_LOSSES with the dual clip, OPSM and the
off-policy correction (`Objective.policy_term`), the entropy bonus and the KL to the reference
model; and the per-staleness diagnostics of the same tokens.

Everything here works on flat per-token tensors, [tokens]: one entry per response token of a
micro-batch, packed over its sequences. The forward's log-probs and entropy come as arguments,
everything else the loss reads in one `LossInputs`, so it can be checked by hand and reused by
any actor. Losses are *masked sums divided by a
denominator the caller chooses*: the actor passes the token count (or Dr.GRPO constant) of the
whole optimizer step, so summing the losses of its micro-batches gives exactly the loss of the
step, whatever the micro-batch split.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor

from vime.algorithms import POLICY_LOSSES, estimator_of
from vime.algorithms.corrections import OffPolicyCorrection, behaviour_weights, in_band, reweigh
from vime.algorithms.hooks import CUSTOM_LOSS_SIGNATURE, CUSTOM_TIS_SIGNATURE, custom_loss_term
from vime.algorithms.kl import kl_penalty
from vime.algorithms.loss_inputs import LossInputs
from vime.algorithms.settings import AlgorithmConfig
from vime.algorithms.sft import SFTLoss
from vime.plugins import Plugin, load_function, read_only

Aggregation = Literal["token_mean", "sample_mean", "seq_sum_const"]


def aggregate(
    values: Tensor,
    loss_mask: Tensor,
    agg: Aggregation = "token_mean",
    num_tokens: float | Tensor | None = None,
    const: float | None = None,
    weights: Tensor | None = None,
) -> Tensor:
    """Masked sum of per-token `values` [tokens] divided by the step's denominator: a scalar.

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


# Per-token diagnostics split by staleness: buckets 0, 1, 2, 3 and 4 or more optimizer steps.
STALENESS_BUCKETS = 5
# what each bucket sums over its loss tokens (divided by the bucket's token count for the log)
STALENESS_STATS = (
    "train_rollout_logprob_abs_diff",  # |log π_old − log π_rollout|: drift since sampling + kernel mismatch
    "log_ratio_sq",  # (log π_old/π_rollout)²: M2PO's second moment
    "is_weight",  # the factor the off-policy correction put on the token (1 without one)
    "is_clipfrac",  # share of tokens whose ratio π_old/π_rollout left the TIS band
    "pg_clipfrac",  # share of tokens whose PPO clip was the active term
    "advantage",
    "entropy",
)


def bucket_label(b: int) -> str:
    return f"{b}+" if b == STALENESS_BUCKETS - 1 else str(b)


def staleness_sums(
    t: LossInputs,
    log_probs: Tensor,
    old: Tensor,
    entropy: Tensor,
    correction: OffPolicyCorrection,
    clipped: Callable[[Tensor, Tensor, Tensor], Tensor],
) -> dict[str, Tensor]:
    """Masked sums of STALENESS_STATS per staleness bucket (`_stale<b>_<stat>`, and the tokens
    `_stale<b>_n`), so the trainer can say what stale tokens do that fresh ones don't. One
    index_add over a [tokens, stats] matrix, not a reduction per bucket and stat."""
    assert t.staleness is not None
    with torch.no_grad():
        known = (t.staleness >= 0).to(t.mask.dtype)
        w = t.mask * known  # [tokens]
        log_w = (old - t.rollout_lp) * t.has_rollout  # [tokens]
        factor = torch.ones_like(old)
        if correction.active:
            factor = behaviour_weights(old, t.rollout_lp, t.mask, correction, t.seq_ids)[0]
        if correction.settings.use_tis:
            outside = (~in_band(log_w, correction.settings.tis_clip_low, correction.settings.tis_clip)).to(w.dtype)
        else:
            outside = torch.zeros_like(w)
        cols = torch.stack(
            [
                w,
                log_w.abs() * w,
                log_w.square() * w,
                factor * w,
                outside * w,
                clipped(log_probs.detach(), old, t.advantages).to(w.dtype) * w,
                t.advantages * w,
                entropy.detach() * w,
            ],
            dim=1,
        )  # [tokens, 1 + stats]
        bucket = t.staleness.clamp(0, STALENESS_BUCKETS - 1).long()  # [tokens]
        sums = torch.zeros(
            STALENESS_BUCKETS, cols.shape[1], dtype=cols.dtype, device=cols.device
        )  # [buckets, 1 + stats]
        sums.index_add_(0, bucket, cols)
    names = ("n", *STALENESS_STATS)
    return {f"_stale{b}_{name}": sums[b, j] for b in range(STALENESS_BUCKETS) for j, name in enumerate(names)}


@dataclass(frozen=True)
class Objective:
    """The loss of some of a step's tokens, built once from the config: the policy term of
    the estimator's row of POLICY_LOSSES (`kind`) with the off-policy correction, the entropy
    bonus and the KL to the reference model.

    Denominators are the step's (`num_tokens`, or Dr.GRPO's constant `const`), never the
    tokens' own, so the loss of a micro-batch, or of one chunk of it, is its share of the
    step's: the trainer sums shares as it goes (actor.py, `_accumulate`)."""

    # the run's algorithm settings: the clips (--eps-clip, --eps-clip-high, --eps-clip-c), the
    # entropy and KL terms, --use-rollout-logprobs, --use-opsm and the loss type are read from them
    settings: AlgorithmConfig
    correction: OffPolicyCorrection
    kind: str = "ppo"  # the row of POLICY_LOSSES: ppo, or the sequence-ratio (gspo) or clipped-weight (cispo) loss
    agg: str = "token_mean"  # token_mean; sample_mean (--no-calculate-per-token-loss); seq_sum_const for Dr.GRPO
    custom_loss: Callable[..., Any] | None = None  # --loss-type custom_loss: the per-token policy term

    @property
    def sft(self) -> bool:
        """--loss-type sft_loss: the negative log-likelihood of the loss tokens, nothing else."""
        return self.settings.loss_type == "sft_loss"

    @property
    def coupled(self) -> bool:
        """--use-rollout-logprobs: the engine's log-probs are π_old."""
        return self.settings.use_rollout_logprobs

    @property
    def opsm_delta(self) -> float | None:
        """--use-opsm's δ, None without it."""
        return self.settings.opsm_delta if self.settings.use_opsm else None

    @property
    def per_sequence(self) -> bool:
        """Whether a token's loss depends on the rest of its sequence: then the actor computes it
        on whole sequences, never chunk by chunk in the LM head (a chunk may end mid-sequence).
        A custom loss may read anything, so it too gets whole sequences."""
        return (
            POLICY_LOSSES[self.kind].whole_sequences
            or self.opsm_delta is not None
            or self.custom_loss is not None
            or self.correction.per_sequence
        )

    @classmethod
    def of(cls, args: Any) -> Objective:
        """From the run's algorithm settings (`args.algorithm`); the custom loss and TIS hooks,
        written for slime, are bound to the whole flat `args`, as slime calls them, read-only (a
        hook's write would change the run's settings under the trainer)."""
        from functools import partial

        view = read_only(args)

        def hook(path: str | None, flag: str, signature: str, by_keyword: bool = False) -> Plugin | None:
            if path is None:
                return None
            fn = load_function(path, flag, signature=signature)
            # slime passes the TIS hook's args by keyword
            return Plugin(partial(fn, args=view) if by_keyword else partial(fn, view), flag, path)

        a = args.algorithm
        estimator = estimator_of(a.advantage_estimator)
        custom_tis = hook(
            a.custom_tis_function_path, "--custom-tis-function-path", CUSTOM_TIS_SIGNATURE, by_keyword=True
        )
        return cls(
            settings=a,
            correction=OffPolicyCorrection(a, custom=custom_tis),
            kind=estimator.loss,
            agg=estimator.advantages.aggregation or ("token_mean" if a.calculate_per_token_loss else "sample_mean"),
            custom_loss=hook(
                a.custom_loss_function_path if a.loss_type == "custom_loss" else None,
                "--custom-loss-function-path",
                CUSTOM_LOSS_SIGNATURE,
            ),
        )

    def __call__(
        self, log_probs: Tensor, entropy: Tensor, t: LossInputs, num_tokens: float, const: float
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """(loss, metrics) of these tokens: `log_probs` and `entropy` [tokens] from the forward,
        aligned with `t`; the loss a scalar, the metrics scalar sums the trainer adds up over a step."""
        if self.sft:
            return self._sft(log_probs, entropy, t, num_tokens, const)
        old = log_probs.detach() if t.old is None else t.old
        if self.custom_loss is not None:
            pg, m = self._custom_policy_term(log_probs, old, t, num_tokens, const)
        else:
            pg, m = self.policy_term(log_probs, old, t, num_tokens, const)
        loss = pg
        # entropy is reported as a token mean whatever the loss aggregation
        m["entropy"] = aggregate(entropy.detach(), t.mask, "token_mean", num_tokens=num_tokens)
        if self.settings.entropy_coef != 0:
            loss = loss - self.settings.entropy_coef * aggregate(
                entropy, t.mask, self.agg, num_tokens=num_tokens, const=const, weights=t.weights
            )
        if t.ref is not None:
            per_token = kl_penalty(
                log_probs, t.ref, self.settings.kl_loss_type, old if self.settings.use_unbiased_kl else None
            )
            kl = aggregate(per_token, t.mask, self.agg, num_tokens=num_tokens, const=const, weights=t.weights)
            loss = loss + self.settings.kl_loss_coef * kl
            m["kl_loss"] = kl.detach()
        m["loss"] = loss.detach()
        trainer_lp = log_probs.detach() if self.coupled else old  # coupled: old is the engine's own
        m["_lp_diff_sum"] = ((trainer_lp - t.rollout_lp).abs() * t.has_rollout).sum()
        m["_lp_diff_count"] = t.has_rollout.sum()
        if t.staleness is not None:
            m.update(staleness_sums(t, log_probs, trainer_lp, entropy, self.correction, self.clipped))
        return loss, m

    def _sft(
        self, log_probs: Tensor, entropy: Tensor, t: LossInputs, num_tokens: float, const: float
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """The SFT loss of these tokens (`vime.algorithms.sft`), aggregated as the policy term
        is; `sft_loss` is the loss itself, and the entropy a token mean, as in RL."""
        loss = aggregate(
            SFTLoss.per_token(log_probs), t.mask, self.agg, num_tokens=num_tokens, const=const, weights=t.weights
        )
        return loss, {
            "loss": loss.detach(),
            "sft_loss": loss.detach(),
            "entropy": aggregate(entropy.detach(), t.mask, "token_mean", num_tokens=num_tokens),
        }

    def clipped(self, log_probs: Tensor, old: Tensor, advantages: Tensor) -> Tensor:
        """Where the clipped term of the policy loss is the active one, in the token view (GSPO's
        too; CISPO: where its weight was clipped)."""
        ratio = torch.exp(log_probs - old)
        high = self.settings.eps_clip if self.settings.eps_clip_high is None else self.settings.eps_clip_high
        bounded = ratio.clamp(1.0 - self.settings.eps_clip, 1.0 + high)
        return POLICY_LOSSES[self.kind].clip_acts(ratio, bounded, advantages)

    def policy_term(
        self,
        log_probs: Tensor,
        old: Tensor,
        t: LossInputs,
        num_tokens: float | Tensor | None = None,
        const: float | None = None,
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """The policy term of the estimator's row of POLICY_LOSSES (`kind`: ppo, gspo, cispo) on
        these tokens, with what applies to every row; returns (loss, metrics). `log_probs` and
        `old` are [tokens], aligned with `t`; `num_tokens` and `const` are `aggregate`'s
        denominators. The ratio is taken against `old`, clipped to [1 - eps_clip, 1 +
        eps_clip_high]; sequences are whole in one call (`t.seq_ids`) where the row needs them (GSPO).

        `eps_clip_c` (dual-clip PPO, Ye et al. 2020; slime's --eps-clip-c, > 1): a token with a
        negative advantage loses at most -A·c. PPO's clip leaves such a token's loss -A·ratio
        unbounded above when the ratio is large (a token the current policy likes far more than
        the one that sampled it, as stale samples do), and one such token could set the step;
        capped, it contributes no gradient. `pg_clipfrac_lower` is the share of tokens capped.

        `opsm_delta` (off-policy sequence masking, slime's --use-opsm): a token with a negative
        advantage is left out when its sequence's mean of log π_old − log π exceeds delta: a
        sequence the policy has already moved away from is not pushed further down on stale
        evidence. `opsm_clipfrac` is the share of tokens left out. Then the `correction`, which
        reweights by π_old/π_behav (see `OffPolicyCorrection`).

        Metrics are token means over `num_tokens` (default: this call's mask sum), so they too add
        up over the micro-batches of one step: pg_loss, pg_clipfrac (share of tokens whose clipped
        term was the active one), ppo_kl (mean old − new log-prob), and those of the correction.
        """
        eps_clip_high = self.settings.eps_clip if self.settings.eps_clip_high is None else self.settings.eps_clip_high
        mask = t.mask.to(log_probs.dtype)
        n = mask.sum() if num_tokens is None else torch.as_tensor(num_tokens, dtype=log_probs.dtype)
        n = n.clamp(min=1)
        token_log_ratio = log_probs - old  # [tokens]
        per_token, clipped_active = POLICY_LOSSES[self.kind].per_token(
            log_probs, token_log_ratio, t, self.settings.eps_clip, eps_clip_high
        )
        metrics: dict[str, Tensor] = {}
        if self.settings.eps_clip_c is not None:
            cap = -t.advantages * self.settings.eps_clip_c
            capped = (t.advantages < 0) & (per_token > cap)
            per_token = torch.where(capped, cap, per_token)
            with torch.no_grad():
                metrics["pg_clipfrac_lower"] = (capped.to(mask.dtype) * mask).sum() / n
        per_token, more = reweigh(
            per_token, log_probs, old, t, correction=self.correction, opsm_delta=self.opsm_delta, n=n
        )
        metrics.update(more)
        loss = aggregate(per_token, mask, self.agg, num_tokens=n, const=const, weights=t.weights)
        with torch.no_grad():
            metrics["pg_loss"] = loss.detach()
            metrics["pg_clipfrac"] = (clipped_active.to(mask.dtype) * mask).sum() / n
            metrics["ppo_kl"] = (-token_log_ratio * mask).sum() / n
        return loss, metrics

    def _custom_policy_term(
        self, log_probs: Tensor, old: Tensor, t: LossInputs, num_tokens: float, const: float
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """--custom-loss-function-path: the user's per-token policy term, aggregated as vime
        aggregates its own (so micro-batches still add up to the step's loss); its metrics are
        per-token tensors, reported as token means."""
        assert self.custom_loss is not None
        per_token, sums = custom_loss_term(self.custom_loss, log_probs, old, t)
        n = torch.as_tensor(num_tokens, dtype=log_probs.dtype).clamp(min=1)
        m = {k: v / n for k, v in sums.items()}
        # the run's correction and OPSM apply to the user's term as to PPO's
        per_token, more = reweigh(
            per_token, log_probs, old, t, correction=self.correction, opsm_delta=self.opsm_delta, n=n
        )
        m.update(more)
        loss = aggregate(per_token, t.mask, self.agg, num_tokens=num_tokens, const=const, weights=t.weights)
        m["pg_loss"] = loss.detach()
        return loss, m
