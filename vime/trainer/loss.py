"""Advantages, the PPO-clip policy loss, KL penalties and entropy: pure functions on tensors.

Everything here works on flat per-token tensors (one entry per response token of a micro-batch)
so it can be checked by hand and reused by any actor. Losses are *masked sums divided by a
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

from vime.plugins import Plugin, as_plugin, first_line, load_function

Estimator = Literal["grpo", "dr_grpo", "gspo", "cispo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"]
ESTIMATORS: tuple[str, ...] = Estimator.__args__
# estimators whose advantages are whitened over the batch's loss tokens by definition
WHITENED = ("reinforce_plus_plus", "reinforce_plus_plus_baseline")
# the group std divides only these (when not disabled): GRPO's normalization, kept by GSPO and CISPO
STD_NORMALIZED = ("grpo", "gspo", "cispo")
Aggregation = Literal["token_mean", "sample_mean", "seq_sum_const"]
KLKind = Literal["low_var_kl", "k1", "k2", "k3"]
TISMode = Literal["truncate", "mask"]
RSLevel = Literal["token", "sequence", "geometric"]
PolicyKind = Literal["ppo", "gspo", "cispo"]


def compute_advantages(
    rewards: Tensor, estimator: Estimator = "grpo", std_normalize: bool = True, eps: float = 1e-6
) -> Tensor:
    """Per-sample advantages for rewards shaped [num_groups, n_samples_per_prompt].

    The baseline is the group mean. GRPO (and GSPO and CISPO, which change the loss, not the
    advantage) also divides by the group's *population* std (correction=0): a group's
    advantages then have unit variance exactly, and a group of one sample gives 0 rather than
    the NaN of the unbiased std. Dr.GRPO never divides by the std (it biases updates towards
    groups that are almost all right or all wrong), whatever `std_normalize` says. A group with
    equal rewards gets zero advantages either way.

    REINFORCE++ takes the reward itself (no group baseline; with γ = 1 and no KL in the reward,
    every token's return is the sample's reward), REINFORCE++ with baseline the reward minus its
    group's mean; both are then whitened over the batch's tokens (`whiten`), which the caller
    does, as it needs the token counts.
    """
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [num_groups, n], got shape {tuple(rewards.shape)}")
    if estimator not in ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {estimator!r}: use one of {', '.join(ESTIMATORS)}")
    rewards = rewards.float()
    if estimator == "reinforce_plus_plus":
        return rewards.clone()
    centered = rewards - rewards.mean(dim=1, keepdim=True)
    if estimator not in STD_NORMALIZED or not std_normalize:
        return centered
    return centered / (rewards.std(dim=1, correction=0, keepdim=True) + eps)


def whiten(advantages: Tensor, token_counts: Tensor, eps: float = 1e-8) -> Tensor:
    """Per-sample advantages whitened over the batch's loss tokens (REINFORCE++, or any estimator
    with --normalize-advantages): each sample's advantage stands on each of its `token_counts`
    loss tokens, so the mean and the (unbiased) variance are taken over tokens, not samples, and a
    long response weighs as many tokens as it has. Samples without loss tokens change nothing."""
    n = token_counts.float()
    total = n.sum()
    if total < 2:
        return advantages - advantages.mean() if advantages.numel() else advantages
    mean = (n * advantages).sum() / total
    var = (n * (advantages - mean).square()).sum() / (total - 1)
    return (advantages - mean) * torch.rsqrt(var + eps)


def discounted_returns(groups: list[list[Any]], gamma: float) -> list[Tensor]:
    """REINFORCE++'s per-token returns with discount `gamma` (and no KL in the reward): the
    reward is paid at the response's last loss token, so G_t = γ^(last − t) · R for t up to it
    (masked tokens in between, a tool's answer, count in the distance as in slime) and 0 after.
    One float tensor per sample, in the groups' order, whitened over the loss tokens."""
    out, masks = [], []
    for g in groups:
        for s in g:
            mask = torch.tensor(s.effective_loss_mask(), dtype=torch.float32)
            g_t = torch.zeros(s.response_length)
            if mask.any():
                last = int(mask.nonzero().max())
                g_t[: last + 1] = (s.reward or 0.0) * gamma ** torch.arange(last, -1, -1, dtype=torch.float32)
            out.append(g_t)
            masks.append(mask)
    values, mask = torch.cat(out), torch.cat(masks).bool()
    if int(mask.sum()) < 2:
        return out
    mean, std = values[mask].mean(), values[mask].var(correction=1).add(1e-8).sqrt()
    return [(t - mean) / std for t in out]


def group_advantages(
    groups: list[list[Any]],
    estimator: Estimator = "grpo",
    std_normalize: bool = True,
    whitened: bool = False,
    custom: Callable[..., Any] | None = None,
    args: Any = None,
) -> tuple[Tensor, Tensor]:
    """A rollout's rewards and advantages as [num_groups, n] tensors, from its groups of samples
    (a missing reward counts 0): what the actor trains on, kept as tensors end to end.

    `custom` (--custom-advantage-function-path) replaces the estimator: `custom(args, groups,
    rewards)` returns the [num_groups, n] advantages. Whitening (`whitened`, or a REINFORCE++
    estimator) applies after either."""
    rewards = torch.tensor([[s.reward or 0.0 for s in g] for g in groups], dtype=torch.float32)
    if custom is None:
        adv = compute_advantages(rewards, estimator, std_normalize=std_normalize)
    else:
        plugin = as_plugin(custom, "--custom-advantage-function-path")
        out = plugin(args, groups, rewards)
        try:
            adv = torch.as_tensor(out, dtype=torch.float32)
        except (TypeError, ValueError, RuntimeError) as e:
            raise plugin.error(
                f"returned {type(out).__name__}: return a [groups × n] tensor of numbers, one per sample ({first_line(e)})"
            ) from None
        if adv.shape != rewards.shape:
            raise plugin.error(
                f"returned advantages of shape {tuple(adv.shape)}, "
                f"the rollout's rewards are {tuple(rewards.shape)} (groups × samples): return one per sample"
            )
    if whitened or estimator in WHITENED:
        counts = torch.tensor([[sum(s.effective_loss_mask()) for s in g] for g in groups], dtype=torch.float32)
        adv = whiten(adv.flatten(), counts.flatten()).view_as(adv)
    return rewards, adv


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

    use_tis: bool = False
    tis_mode: TISMode = "truncate"
    tis_clip: float = 2.0
    tis_clip_low: float = 0.0
    tis_level: RSLevel = "token"
    use_rs: bool = False
    rs_level: RSLevel = "token"
    rs_lower_bound: float = 0.5
    rs_upper_bound: float = 2.0
    rs_veto_threshold: float | None = None
    m2_threshold: float | None = None
    custom: Callable[..., Any] | None = None

    def __post_init__(self) -> None:
        """The flags are checked with their names in `Config.validate`; this guards direct use."""
        levels = ("token", "sequence", "geometric")
        if self.tis_mode not in ("truncate", "mask") or self.rs_level not in levels or self.tis_level not in levels:
            raise ValueError(
                f"tis_mode {self.tis_mode!r} / tis_level {self.tis_level!r} / rs_level {self.rs_level!r}: "
                "use truncate|mask and token|sequence|geometric"
            )
        if not (0 <= self.tis_clip_low < self.tis_clip and 0 <= self.rs_lower_bound < self.rs_upper_bound):
            raise ValueError(
                f"empty band: TIS [{self.tis_clip_low}, {self.tis_clip}], rejection [{self.rs_lower_bound}, {self.rs_upper_bound}]"
            )
        if self.m2_threshold is not None and not self.m2_threshold > 0:
            raise ValueError(f"m2_threshold {self.m2_threshold} must be > 0")

    @property
    def active(self) -> bool:
        return (
            self.use_tis
            or self.use_rs
            or self.rs_veto_threshold is not None
            or self.m2_threshold is not None
            or self.custom is not None
        )

    @property
    def per_sequence(self) -> bool:
        """Whether a token's factor depends on the rest of its sequence (then the loss cannot be
        taken chunk by chunk in the LM head, where a chunk may end mid-sequence)."""
        return (
            (self.use_tis and self.tis_level != "token")
            or (self.use_rs and self.rs_level != "token")
            or self.rs_veto_threshold is not None
            or self.m2_threshold is not None  # its mask depends on every token of the micro-batch
            or self.custom is not None
        )


def _in_band(log_w: Tensor, low: float, high: float) -> Tensor:
    """low <= exp(log_w) <= high, compared in log space so a sequence's product never overflows."""
    lo = torch.log(torch.tensor(low, dtype=log_w.dtype))  # -inf for a lower bound of 0
    return (log_w >= lo) & (log_w <= torch.log(torch.tensor(high, dtype=log_w.dtype)))


def _per_sequence(log_w: Tensor, mask: Tensor, seq_ids: Tensor | None, level: str) -> Tensor:
    """Each token's log-ratio at `level`: its own (token), or its sequence's sum over loss tokens
    (sequence, the log of the product) or mean (geometric), on every token of the sequence."""
    if level == "token":
        return log_w
    if seq_ids is None:
        raise ValueError(f"level {level!r} needs seq_ids (the sequence of each token)")
    n_seq = int(seq_ids.max()) + 1 if seq_ids.numel() else 0
    seq_sum = torch.zeros(n_seq, dtype=log_w.dtype, device=log_w.device).index_add_(0, seq_ids, log_w * mask)
    if level == "geometric":
        seq_sum = seq_sum / torch.zeros_like(seq_sum).index_add_(0, seq_ids, mask).clamp(min=1)
    return seq_sum[seq_ids]


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

    `seq_ids` [T] numbers the sequence each token belongs to (0..S-1); the sequence and
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
    if correction.use_tis and correction.custom is None:  # a custom TIS hook takes its place (slime's rule)
        level_log_w = _per_sequence(log_w, mask, seq_ids, correction.tis_level).clamp(-20.0, 20.0)
        inside = _in_band(level_log_w, correction.tis_clip_low, correction.tis_clip)
        w = torch.exp(level_log_w)
        w = (
            w.clamp(correction.tis_clip_low, correction.tis_clip)
            if correction.tis_mode == "truncate"
            else torch.where(inside, w, torch.zeros_like(w))
        )
        factor = factor * w
        sums["tis"] = (w * mask).sum()
        sums["tis_clipfrac"] = ((~inside).to(mask.dtype) * mask).sum()
    if correction.use_rs:
        level_log_w = _per_sequence(log_w, mask, seq_ids, correction.rs_level)
        keep = _in_band(level_log_w, correction.rs_lower_bound, correction.rs_upper_bound).to(mask.dtype)
        factor = factor * keep
        sums["rs_dropfrac"] = ((1 - keep) * mask).sum()
    if correction.rs_veto_threshold is not None:
        if seq_ids is None:
            raise ValueError("rs_veto_threshold needs seq_ids (the sequence of each token)")
        low = torch.log(torch.tensor(correction.rs_veto_threshold, dtype=log_w.dtype))
        bad = ((log_w < low) & (mask > 0)).to(mask.dtype)
        n_seq = int(seq_ids.max()) + 1 if seq_ids.numel() else 0
        vetoed = (torch.zeros(n_seq, dtype=mask.dtype, device=mask.device).index_add_(0, seq_ids, bad) > 0)[seq_ids]
        factor = factor * (~vetoed).to(mask.dtype)
        sums["rs_veto_frac"] = (vetoed.to(mask.dtype) * mask).sum()
    if correction.m2_threshold is not None:
        keep = second_moment_mask(log_w, mask, correction.m2_threshold)
        factor = factor * keep
        sums["m2_maskfrac"] = ((1 - keep) * mask).sum()
        sums["m2"] = (log_w.square() * mask).sum()  # before masking: the drift the mask answers
    return factor, sums


def apply_custom_tis(
    fn: Callable[..., Any],
    per_token: Tensor,
    old_log_probs: Tensor,
    rollout_log_probs: Tensor,
    mask: Tensor,
    seq_ids: Tensor,
) -> tuple[Tensor, dict[str, Tensor]]:
    """slime's --custom-tis-function-path on one micro-batch's whole sequences: called with
    keywords `pg_loss` (flat per-token), `train_log_probs`, `rollout_log_probs`, `loss_masks`
    (lists, one tensor per sequence), `response_lengths`; returns (pg_loss, masks, metrics),
    masks one per sequence, metrics flat per-token tensors (reported as masked token means).
    A returned mask zeroes tokens; the denominator stays the step's."""
    lengths = torch.bincount(seq_ids, minlength=int(seq_ids.max()) + 1 if seq_ids.numel() else 0).tolist()

    def split(x: Tensor) -> list[Tensor]:
        return list(torch.split(x, lengths))

    plugin = as_plugin(fn, "--custom-tis-function-path")
    out = plugin(
        pg_loss=per_token,
        total_lengths=None,  # slime's context-parallel slicing; vime scores whole sequences
        train_log_probs=split(old_log_probs.detach()),
        rollout_log_probs=split(rollout_log_probs),
        loss_masks=split(mask),
        response_lengths=lengths,
    )
    if not (isinstance(out, tuple) and len(out) == 3):
        raise plugin.error(f"returned {_kind(out)}: it must return (pg_loss, loss_masks, metrics)")
    new_loss, masks, metrics = out
    _check_loss(plugin, "pg_loss", new_loss, per_token)
    if masks:
        if not isinstance(masks, (list, tuple)) or len(masks) != len(lengths):
            got = len(masks) if isinstance(masks, (list, tuple)) else f"a {type(masks).__name__} of"
            raise plugin.error(f"returned {got} loss_masks for {len(lengths)} sequences: return one mask per sequence")
        try:
            kept = [torch.as_tensor(m, dtype=mask.dtype, device=mask.device) for m in masks]
        except (TypeError, ValueError, RuntimeError) as e:
            raise plugin.error(f"returned loss_masks that are not numbers ({first_line(e)})") from None
        if [m.numel() for m in kept] != lengths:
            raise plugin.error(
                f"returned loss_masks of {[m.numel() for m in kept]} tokens for sequences of {lengths}: "
                "return one mask per sequence, as long as the one it was given"
            )
        keep = torch.cat([m.flatten() for m in kept])
    else:
        keep = mask
    return new_loss * keep, _token_metrics(plugin, metrics, mask)


def _kind(value: Any) -> str:
    """A plug-in's answer, named for an error line: a tuple by its length, else its type."""
    return f"a tuple of {len(value)}" if isinstance(value, tuple) else type(value).__name__


def _check_loss(plugin: Plugin, name: str, loss: Any, like: Tensor) -> None:
    """A hook's per-token loss: a tensor shaped like the one vime computes, with a gradient
    wherever vime's has one (a detached loss would train nothing, silently)."""
    if not isinstance(loss, Tensor) or loss.shape != like.shape:
        shape = f" of shape {tuple(loss.shape)}" if isinstance(loss, Tensor) else ""
        raise plugin.error(
            f"returned a {name} {type(loss).__name__}{shape} for {like.numel()} tokens: "
            f"return one value per token, shape {tuple(like.shape)}"
        )
    if like.requires_grad and not loss.requires_grad:
        raise plugin.error(
            f"returned a {name} with no gradient (detached, or computed under no_grad): build it from the tensors it is given"
        )


def _token_metrics(plugin: Plugin, metrics: Any, mask: Tensor) -> dict[str, Tensor]:
    """A hook's metrics as masked sums over its tokens (the caller divides by the step's token
    count): one value per token each, or one number for all of them."""
    if not isinstance(metrics, dict):
        raise plugin.error(f"returned metrics as {_kind(metrics)}: give a dict of per-token tensors")
    sums = {}
    for name, value in metrics.items():
        try:
            v = torch.as_tensor(value, dtype=mask.dtype, device=mask.device).detach()
        except (TypeError, ValueError, RuntimeError) as e:
            raise plugin.error(f"returned metric '{name}' that is not numbers ({first_line(e)})") from None
        if v.dim() > 1 or (v.dim() == 1 and v.numel() != mask.numel()):
            raise plugin.error(
                f"returned metric '{name}' of shape {tuple(v.shape)} for {mask.numel()} tokens: give one value per token"
            )
        sums[str(name)] = (v * mask).sum()
    return sums


def reweigh(
    per_token: Tensor,
    log_probs: Tensor,
    old_log_probs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    rollout_log_probs: Tensor | None,
    correction: OffPolicyCorrection,
    seq_ids: Tensor | None,
    opsm_delta: float | None,
    n: Tensor,
) -> tuple[Tensor, dict[str, Tensor]]:
    """What every policy term goes through after its per-token loss, PPO's or a custom one:
    OPSM's mask, then the off-policy correction (`behaviour_weights`, and the custom TIS hook,
    which takes the place of the built-in TIS as in slime). Metrics are token means over `n`."""
    metrics: dict[str, Tensor] = {}
    if opsm_delta is not None:
        drift = _per_sequence((old_log_probs - log_probs).detach(), mask, seq_ids, "geometric")
        left_out = (advantages < 0) & (drift > opsm_delta)
        per_token = per_token * (~left_out).to(per_token.dtype)
        metrics["opsm_clipfrac"] = (left_out.to(mask.dtype) * mask).sum() / n
    if correction.active:
        if rollout_log_probs is None:
            raise ValueError("TIS and rejection need rollout_log_probs (the engine's log-probs of the sampled tokens)")
        factor, sums = behaviour_weights(old_log_probs, rollout_log_probs, mask, correction, seq_ids)
        per_token = per_token * factor
        if correction.custom is not None:
            assert seq_ids is not None, "--custom-tis-function-path needs seq_ids"
            per_token, hook_sums = apply_custom_tis(
                correction.custom, per_token, old_log_probs, rollout_log_probs, mask, seq_ids
            )
            sums.update(hook_sums)
        metrics.update({k: v / n for k, v in sums.items()})
    return per_token, metrics


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
    kind: PolicyKind = "ppo",
    opsm_delta: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO-clip loss over flat per-token tensors; returns (loss, metrics). `agg`, `const`,
    `num_tokens` and `weights` are `aggregate`'s.

    `kind` "gspo" (Zheng et al. 2025) takes the ratio per sequence: exp of the mean over its
    loss tokens of log π − log π_old, on every token of the sequence (so the gradient of each
    token's log-prob flows through its sequence's mean), then the same clip. Sequences are
    whole in one call (`seq_ids`); GSPO's clip ranges are far tighter than PPO's (slime's
    scripts: 3e-4 to 4e-4). `kind` "cispo" (MiniMax-M1) clips the importance weight instead of
    the update and never drops a token's gradient: −sg(clip(ratio, 1 − eps_clip, 1 +
    eps_clip_high)) · A · log π, the canonical setting --eps-clip 1 (no lower bound).

    `opsm_delta` (off-policy sequence masking, slime's --use-opsm): a token with a negative
    advantage is left out when its sequence's mean of log π_old − log π exceeds delta: a
    sequence the policy has already moved away from is not pushed further down on stale
    evidence. `opsm_clipfrac` is the share of tokens left out.

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
    token_log_ratio = log_probs - old_log_probs
    log_ratio = _per_sequence(token_log_ratio, mask, seq_ids, "geometric") if kind == "gspo" else token_log_ratio
    ratio = torch.exp(log_ratio)
    metrics: dict[str, Tensor] = {}
    if kind == "cispo":
        w = ratio.detach().clamp(1.0 - eps_clip, 1.0 + eps_clip_high)
        per_token = -w * advantages * log_probs
        clipped_active = w != ratio.detach()
    else:
        unclipped = -advantages * ratio
        clipped = -advantages * ratio.clamp(1.0 - eps_clip, 1.0 + eps_clip_high)
        per_token = torch.maximum(unclipped, clipped)
        clipped_active = clipped > unclipped
    if eps_clip_c is not None:
        cap = -advantages * eps_clip_c
        capped = (advantages < 0) & (per_token > cap)
        per_token = torch.where(capped, cap, per_token)
        with torch.no_grad():
            metrics["pg_clipfrac_lower"] = (capped.to(mask.dtype) * mask).sum() / n
    per_token, more = reweigh(
        per_token, log_probs, old_log_probs, advantages, mask, rollout_log_probs, correction, seq_ids, opsm_delta, n
    )
    metrics.update(more)
    loss = aggregate(per_token, mask, agg, num_tokens=n, const=const, weights=weights)
    with torch.no_grad():
        metrics["pg_loss"] = loss.detach()
        metrics["pg_clipfrac"] = (clipped_active.to(mask.dtype) * mask).sum() / n
        metrics["ppo_kl"] = (-token_log_ratio * mask).sum() / n
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


CUSTOM_LOSS_SIGNATURE = (
    "fn(args, *, log_probs, old_log_probs, advantages, loss_mask, rollout_log_probs, seq_ids) -> "
    "per-token loss [T] or (loss, {name: per-token tensor})"
)
CUSTOM_TIS_SIGNATURE = (
    "fn(args, *, pg_loss, train_log_probs, rollout_log_probs, loss_masks, total_lengths, response_lengths, **kw) "
    "-> (pg_loss, loss_masks, metrics)"
)


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
    # optimizer steps between the weights that sampled each token and those it trains (-1: unknown)
    staleness: Tensor | None = None

    def rows(self, sl: slice) -> LossInputs:
        return LossInputs(**{k: None if v is None else v[sl] for k, v in vars(self).items()})


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
        w = t.mask * known
        log_w = (old - t.rollout_lp) * t.has_rollout
        factor = torch.ones_like(old)
        if correction.active:
            factor = behaviour_weights(old, t.rollout_lp, t.mask, correction, t.seq_ids)[0]
        if correction.use_tis:
            outside = (~_in_band(log_w, correction.tis_clip_low, correction.tis_clip)).to(w.dtype)
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
        )
        bucket = t.staleness.clamp(0, STALENESS_BUCKETS - 1).long()
        sums = torch.zeros(STALENESS_BUCKETS, cols.shape[1], dtype=cols.dtype, device=cols.device)
        sums.index_add_(0, bucket, cols)
    names = ("n", *STALENESS_STATS)
    return {f"_stale{b}_{name}": sums[b, j] for b in range(STALENESS_BUCKETS) for j, name in enumerate(names)}


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
    kind: str = "ppo"  # ppo, or the sequence-ratio (gspo) or clipped-weight (cispo) loss
    opsm_delta: float | None = None  # --use-opsm: None off
    custom_loss: Callable[..., Any] | None = None  # --loss-type custom_loss: the per-token policy term

    @property
    def per_sequence(self) -> bool:
        """Whether a token's loss depends on the rest of its sequence: then the actor computes it
        on whole sequences, never chunk by chunk in the LM head (a chunk may end mid-sequence).
        A custom loss may read anything, so it too gets whole sequences."""
        return (
            self.kind == "gspo"
            or self.opsm_delta is not None
            or self.custom_loss is not None
            or self.correction.per_sequence
        )

    @classmethod
    def of(cls, args: Any) -> Objective:
        from functools import partial

        def hook(path: str | None, flag: str, signature: str, by_keyword: bool = False) -> Plugin | None:
            if path is None:
                return None
            fn = load_function(path, flag, signature=signature)
            # slime passes the TIS hook's args by keyword
            return Plugin(partial(fn, args=args) if by_keyword else partial(fn, args), flag, path)

        return cls(
            kind=args.advantage_estimator if args.advantage_estimator in ("gspo", "cispo") else "ppo",
            opsm_delta=args.opsm_delta if args.use_opsm else None,
            custom_loss=hook(
                args.custom_loss_function_path if args.loss_type == "custom_loss" else None,
                "--custom-loss-function-path",
                CUSTOM_LOSS_SIGNATURE,
            ),
            eps_clip=args.eps_clip,
            eps_clip_high=args.eps_clip_high,
            eps_clip_c=args.eps_clip_c,
            correction=OffPolicyCorrection(
                use_tis=args.use_tis,
                tis_mode=args.tis_mode,
                tis_clip=args.tis_clip,
                tis_clip_low=args.tis_clip_low,
                tis_level=args.tis_level,
                use_rs=args.use_rs,
                rs_level=args.rs_level,
                rs_lower_bound=args.rs_lower_bound,
                rs_upper_bound=args.rs_upper_bound,
                rs_veto_threshold=args.rs_veto_threshold,
                m2_threshold=args.m2_threshold,
                custom=hook(
                    args.custom_tis_function_path, "--custom-tis-function-path", CUSTOM_TIS_SIGNATURE, by_keyword=True
                ),
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
        if self.custom_loss is not None:
            pg, m = self._custom_policy_term(log_probs, old, t, num_tokens, const)
        else:
            pg, m = self._policy_term(log_probs, old, t, num_tokens, const)
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
        if t.staleness is not None:
            m.update(staleness_sums(t, log_probs, trainer_lp, entropy, self.correction, self.clipped))
        return loss, m

    def clipped(self, log_probs: Tensor, old: Tensor, advantages: Tensor) -> Tensor:
        """Where the clipped term of the policy loss is the active one (PPO and GSPO's token view;
        CISPO: where its weight was clipped)."""
        ratio = torch.exp(log_probs - old)
        high = self.eps_clip if self.eps_clip_high is None else self.eps_clip_high
        bounded = ratio.clamp(1.0 - self.eps_clip, 1.0 + high)
        if self.kind == "cispo":
            return bounded != ratio
        return -advantages * bounded > -advantages * ratio

    def _policy_term(
        self, log_probs: Tensor, old: Tensor, t: LossInputs, num_tokens: float, const: float
    ) -> tuple[Tensor, dict[str, Tensor]]:
        return policy_loss(
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
            kind=self.kind,
            opsm_delta=self.opsm_delta,
        )

    def _custom_policy_term(
        self, log_probs: Tensor, old: Tensor, t: LossInputs, num_tokens: float, const: float
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """--custom-loss-function-path: the user's per-token policy term, aggregated as vime
        aggregates its own (so micro-batches still add up to the step's loss); its metrics are
        per-token tensors, reported as token means."""
        assert self.custom_loss is not None
        plugin = as_plugin(self.custom_loss, "--custom-loss-function-path")
        out = plugin(
            log_probs=log_probs,
            old_log_probs=old,
            advantages=t.advantages,
            loss_mask=t.mask,
            rollout_log_probs=t.rollout_lp,
            seq_ids=t.seq_ids,
        )
        if isinstance(out, tuple) and len(out) != 2:
            raise plugin.error(
                f"returned {_kind(out)}: return the per-token loss, or (loss, {{name: per-token tensor}})"
            )
        per_token, metrics = out if isinstance(out, tuple) else (out, {})
        _check_loss(plugin, "per-token loss", per_token, log_probs)
        n = torch.as_tensor(num_tokens, dtype=log_probs.dtype).clamp(min=1)
        m = {k: v / n for k, v in _token_metrics(plugin, metrics, t.mask).items()}
        # the run's correction and OPSM apply to the user's term as to PPO's
        per_token, more = reweigh(
            per_token,
            log_probs,
            old,
            t.advantages,
            t.mask,
            t.rollout_lp,
            self.correction,
            t.seq_ids,
            self.opsm_delta,
            n,
        )
        m.update(more)
        loss = aggregate(per_token, t.mask, self.agg, num_tokens=num_tokens, const=const, weights=t.weights)
        m["pg_loss"] = loss.detach()
        return loss, m
