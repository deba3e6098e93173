"""The algorithm's settings, `cfg.algorithm`: each declared once here, where the objectives live,
with its type, default and flag help (vime/setting.py); the config reads them from here. The
advantage estimator, the policy loss and its clipping, KL and entropy terms, on-policy
distillation and the off-policy corrections."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vime.setting import Component, setting


def _estimator_help() -> str:
    from vime.algorithms import estimator_help

    return estimator_help()


def _estimator_names() -> tuple[str, ...]:
    from vime.algorithms import estimator_names

    return estimator_names()


# What each --off-policy-correction sets (the flags are slime's); "none" turns both off.
# tis: slime's --use-tis defaults; icepop: IcePop's band [0.5, 5]; decoupled-ppo: AReaL's
# behaviour-weight cap of 5, nothing below it touched; m2po: M2PO's second-moment trust region
# at the paper's threshold (0.04).
_NO_CORRECTION = {"use_tis": False, "use_rs": False, "m2_threshold": None}
CORRECTIONS: dict[str, dict[str, Any]] = {
    "none": _NO_CORRECTION,
    "tis": {**_NO_CORRECTION, "use_tis": True, "tis_mode": "truncate", "tis_clip": 2.0, "tis_clip_low": 0.0},
    "icepop": {**_NO_CORRECTION, "use_tis": True, "tis_mode": "mask", "tis_clip": 5.0, "tis_clip_low": 0.5},
    "decoupled-ppo": {**_NO_CORRECTION, "use_tis": True, "tis_mode": "mask", "tis_clip": 5.0, "tis_clip_low": 0.0},
    "m2po": {**_NO_CORRECTION, "m2_threshold": 0.04},
}
# the correction auto picks in every mode that can train stale samples
ASYNC_CORRECTION = "tis"


@dataclass
class AlgorithmConfig(Component):
    # --- algorithm ---
    advantage_estimator: str = setting(
        "grpo",
        _estimator_help(),
        _estimator_names(),
        group="algorithm",
    )
    custom_advantage_function_path: str | None = setting(
        None,
        "dotted path of fn(args, groups, rewards [groups × n]) -> advantages [groups × n], one per sample, in place "
        "of the estimator's (whitening still applies after it)",
        group="algorithm",
    )
    normalize_advantages: bool = setting(
        False,
        "whiten the advantages over the batch's loss tokens (zero mean, unit variance); REINFORCE++ always does",
        group="algorithm",
    )
    gamma: float = setting(
        1.0,
        "REINFORCE++'s discount: a token's return is the reward times gamma^(its distance to the last loss token), "
        "so the advantage is per token below 1",
        group="algorithm",
    )
    loss_type: str = setting(
        "policy_loss",
        "policy_loss (the estimator's); custom_loss: the per-token policy term of --custom-loss-function-path; "
        "sft_loss: the negative log-likelihood of the loss tokens (SFT, with --rollout-function-path "
        "vime.rollout.sft_rollout.generate_rollout)",
        ("policy_loss", "custom_loss", "sft_loss"),
        group="algorithm",
    )
    loss_mask_type: str = setting(
        "qwen",
        "SFT: which of a conversation's tokens are trained. vime renders the whole conversation with the model's "
        "chat template and trains every assistant turn (its text and the tokens that close it) for qwen, qwen3 and "
        "qwen3_5 alike; distill_qwen (the last message as raw text) is not offered",
        ("qwen", "qwen3", "qwen3_5", "distill_qwen"),
        group="algorithm",
    )
    disable_compute_advantages_and_returns: bool = setting(
        False,
        "slime's switch for losses that need no advantages: accepted with --loss-type sft_loss, which computes none",
        group="algorithm",
    )
    custom_loss_function_path: str | None = setting(
        None,
        "with --loss-type custom_loss: dotted path of fn(args, *, log_probs, old_log_probs, advantages, loss_mask, "
        "rollout_log_probs, seq_ids) -> per-token loss (or (loss, {name: per-token tensor})), flat over a micro-batch's "
        "tokens; vime aggregates it as its own (so micro-batches add up) and adds entropy and KL terms",
        group="algorithm",
    )
    use_opsm: bool = setting(
        False,
        "off-policy sequence masking: leave out the tokens of negative-advantage sequences whose mean log π_old − log π "
        "exceeds --opsm-delta (the policy already moved away from them)",
        group="algorithm",
    )
    opsm_delta: float = setting(1e-4, "the drift --use-opsm tolerates", group="algorithm")
    disable_grpo_std_normalization: bool = setting(
        False, "do not divide advantages by the group std (Dr.GRPO)", group="algorithm"
    )
    eps_clip: float = setting(0.2, "PPO clip range below 1", group="algorithm")
    eps_clip_high: float | None = setting(None, "PPO clip range above 1 (default: --eps-clip)", group="algorithm")
    calculate_per_token_loss: bool = setting(
        True,
        "the policy loss is a mean over all of the step's loss tokens (default, as DAPO argues: every token weighs the same whatever its response's length, so a long wrong answer is not penalized less per token than a short one; every vime figure was measured so); --no-calculate-per-token-loss is slime's default: the mean over samples of each sample's token mean",
        group="algorithm",
    )
    eps_clip_c: float | None = setting(
        None,
        "dual-clip PPO: a token with a negative advantage A loses at most -A·c (c > 1), so one token whose ratio exploded cannot set the step (default: off)",
        group="algorithm",
    )
    kl_loss_coef: float = setting(
        0.0, "weight of the KL loss to a frozen reference (0 = no reference model)", group="algorithm"
    )
    use_kl_loss: bool = setting(
        False,
        "slime's switch for the KL loss; vime applies any nonzero --kl-loss-coef with or without it, and with a coefficient of 0 loads no reference model",
        group="algorithm",
    )
    kl_loss_type: str = setting(
        "low_var_kl",
        "KL estimator: k1 (log-ratio), k2 (half its square), k3 (exp(-r) - 1 + r), low_var_kl (k3 clamped to [-10, 10])",
        ("low_var_kl", "k1", "k2", "k3"),
        group="algorithm",
    )
    use_unbiased_kl: bool = setting(
        False,
        "weight each token's KL by the ratio of the current to the old policy (the unbiased estimate of the KL under the current policy)",
        group="algorithm",
    )
    ref_load: str | None = setting(
        None,
        "the reference model of the KL loss: an HF model directory (default: --hf-checkpoint); read only when --kl-loss-coef > 0",
        group="algorithm",
    )
    use_opd: bool = setting(
        False,
        "on-policy distillation: a teacher scores every token of the student's responses, and "
        "--opd-kl-coef x (log p_teacher - log p_student) is added to each token's advantage",
        group="algorithm",
    )
    opd_type: str | None = setting(
        None,
        "where the teacher runs: megatron (slime's name; in vime the trainer loads it from --opd-teacher-load); "
        "sglang (an engine at --rm-url serving SGLang's /generate, e.g. `vime serve`, scores the tokens through "
        "--custom-rm-path and --custom-reward-post-process-path vime.rollout.on_policy_distillation's functions); "
        "vllm (the same, the teacher a vLLM server: --rm-url its /v1/completions, or /inference/v1/generate)",
        ("megatron", "sglang", "vllm"),
        group="algorithm",
    )
    opd_kl_coef: float = setting(1.0, "weight of the per-token reverse-KL advantage of --use-opd", group="algorithm")
    opd_teacher_load: str | None = setting(
        None,
        "the OPD teacher: an HF model directory, a vime --save directory (its newest checkpoint) or one <step>/ "
        "checkpoint of it; the student's tokenizer (its table may be padded to another size)",
        group="algorithm",
    )
    opd_teacher_ckpt_step: int | None = setting(
        None, "the step of the --opd-teacher-load --save directory to load (default: its newest)", group="algorithm"
    )
    entropy_coef: float = setting(0.0, "entropy bonus weight (the entropy is always logged)", group="algorithm")
    use_rollout_logprobs: bool = setting(
        False,
        "take the PPO ratio against the engine's log-probs (the behaviour policy) instead of the trainer's current weights: coupled PPO, no recompute",
        group="algorithm",
    )
    off_policy_correction: str = setting(
        "auto",
        "how samples from older weights (or other kernels) are corrected: auto = none in sync and at --max-staleness 0, "
        f"else {ASYNC_CORRECTION} (chosen by a sweep over seeds: bench/RESULTS.md); none; "
        "tis = --use-tis, weight π_old/π_rollout clamped to [0, 2]; icepop = weight kept in [0.5, 5], tokens outside it "
        "masked; decoupled-ppo = AReaL's, weight kept up to 5, tokens above it masked; m2po = --m2-threshold 0.04, the "
        "tokens of largest (log π_old/π_rollout)² masked until the rest's mean is at most 0.04; custom = exactly what "
        "--use-tis/--use-rs/--m2-threshold and their bounds say (auto becomes custom when one is given)",
        ("auto", "none", "tis", "icepop", "decoupled-ppo", "m2po", "custom"),
        group="algorithm",
    )
    use_tis: bool = setting(
        False,
        "weight each token's loss by π_old/π_rollout (truncated importance sampling; with stale samples this is decoupled PPO)",
        group="algorithm",
    )
    tis_mode: str = setting(
        "truncate",
        "truncate: clamp the TIS weight to [--tis-clip-low, --tis-clip]; mask: weight 0 outside that band (IcePop)",
        ("truncate", "mask"),
        group="algorithm",
    )
    tis_level: str = setting(
        "token",
        "what one TIS weight covers: each token (token), or every token of a sequence alike, by the product of its "
        "tokens' ratios (sequence) or their geometric mean (geometric)",
        ("token", "sequence", "geometric"),
        group="algorithm",
    )
    custom_tis_function_path: str | None = setting(
        None,
        "dotted path of slime's TIS hook fn(args, *, pg_loss, train_log_probs, rollout_log_probs, loss_masks, "
        "total_lengths, response_lengths, **kw) -> (pg_loss, loss_masks, metrics), applied to each micro-batch after "
        "the built-in corrections (total_lengths: prompt + response of each sequence, every one whole: vime has no "
        "context parallelism)",
        group="algorithm",
    )
    tis_clip: float = setting(2.0, "upper bound of the TIS weight", group="algorithm")
    tis_clip_low: float = setting(0.0, "lower bound of the TIS weight", group="algorithm")
    use_rs: bool = setting(
        False,
        "rejection (masked importance sampling): drop tokens or sequences whose π_old/π_rollout leaves [--rs-lower-bound, --rs-upper-bound]",
        group="algorithm",
    )
    rs_level: str = setting(
        "token",
        "what --use-rs drops: token, or sequence (product of its token ratios) or geometric (their geometric mean) for whole sequences",
        ("token", "sequence", "geometric"),
        group="algorithm",
    )
    rs_lower_bound: float = setting(0.5, "lower bound of the ratio --use-rs keeps", group="algorithm")
    rs_upper_bound: float = setting(2.0, "upper bound of the ratio --use-rs keeps", group="algorithm")
    rs_veto_threshold: float | None = setting(
        None,
        "drop a whole sequence in which any loss token's π_old/π_rollout is below this (e.g. 1e-4): a token the "
        "trainer finds far less likely than the engine did marks a numerical failure, not staleness",
        group="algorithm",
    )
    m2_threshold: float | None = setting(
        None,
        "M2PO: mask the tokens of largest (log π_old/π_rollout)² until the rest's mean is at most this (the paper's 0.04); "
        "a trust region on how far the weights moved since sampling that keeps all but the outliers",
        group="algorithm",
    )
    # --- mixture of experts ---
    use_rollout_routing_replay: bool = setting(
        False,
        "rollout routing replay (R3, slime's flag), for a mixture of experts: the engines return the experts each "
        "token was routed to, and the trainer's MoE layers route as the engine did, with the trainer's gate weights "
        "(so the router still learns); logs train/routing_mismatch (the share of response tokens × MoE layers whose "
        "top-k the trainer would have chosen otherwise) and the log-prob gap to the engine with and without replay "
        "(one more scoring forward a step). The built-in engine and SGLang return routing; vLLM's adapter does not",
        group="mixture of experts",
    )
    record_routed_experts: bool = setting(
        False,
        "ask the engines for the routed experts as --use-rollout-routing-replay does, without replaying them: the "
        "same routing metrics, for the R3-off arm of a comparison",
        group="mixture of experts",
    )

    @property
    def wants_routed_experts(self) -> bool:
        """Whether the rollout asks the engines for each token's routed experts."""
        return self.use_rollout_routing_replay or self.record_routed_experts

    @property
    def normalize_advantages_std(self) -> bool:
        """Whether advantages are divided by the group's std: the estimator's row says it does,
        and --disable-grpo-std-normalization does not turn it off."""
        from vime.algorithms import estimator_of

        return (
            not self.disable_grpo_std_normalization and estimator_of(self.advantage_estimator).advantages.std_normalized
        )

    @property
    def teacher_served(self) -> bool:
        """On-policy distillation whose teacher an engine serves (`--opd-type sglang`, or `vllm`):
        its log-probs come with the rollout, on the samples."""
        return self.use_opd and self.opd_type in ("sglang", "vllm")

    @property
    def teacher_in_trainer(self) -> bool:
        """On-policy distillation whose teacher the trainer loads (`--opd-type megatron`)."""
        return self.use_opd and self.opd_type == "megatron"

    @property
    def needs_rollout_log_probs(self) -> bool:
        """Whether the loss reads the engine's log-prob of every response token: a correction
        (TIS, rejection, the veto, M2, a custom TIS function) or --use-rollout-logprobs. The
        same rule as the trainer's (`OffPolicyCorrection.active` or `coupled`), read on the
        rollout side so that a plug-in's sample without them is named where it is made."""
        return (
            self.use_tis
            or self.use_rs
            or self.rs_veto_threshold is not None
            or self.m2_threshold is not None
            or self.custom_tis_function_path is not None
            or self.use_rollout_logprobs
        )
