"""The algorithms room's settings, `cfg.algorithm` (one of the per-room sub-configs of
vime/config/rooms.py): declared here, below the config, because vime/config/ reads the
objectives' tables (`ADVANTAGES`, `POLICY_LOSSES`) and the objectives take this type."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AlgorithmConfig:
    """What vime/algorithms/ reads: the advantage estimator, the policy loss and its clipping, KL
    and entropy terms, on-policy distillation and the off-policy corrections. Besides those:
    `normalize_advantages_std` (whether the estimator divides by the group's std, which the
    config derives from the estimator's row and --disable-grpo-std-normalization)."""

    advantage_estimator: str
    custom_advantage_function_path: str | None
    normalize_advantages: bool
    gamma: float
    loss_type: str
    loss_mask_type: str
    disable_compute_advantages_and_returns: bool
    custom_loss_function_path: str | None
    use_opsm: bool
    opsm_delta: float
    disable_grpo_std_normalization: bool
    eps_clip: float
    eps_clip_high: float | None
    calculate_per_token_loss: bool
    eps_clip_c: float | None
    kl_loss_coef: float
    use_kl_loss: bool
    kl_loss_type: str
    use_unbiased_kl: bool
    ref_load: str | None
    use_opd: bool
    opd_type: str | None
    opd_kl_coef: float
    opd_teacher_load: str | None
    opd_teacher_ckpt_step: int | None
    entropy_coef: float
    use_rollout_logprobs: bool
    off_policy_correction: str
    use_tis: bool
    tis_mode: str
    tis_level: str
    custom_tis_function_path: str | None
    tis_clip: float
    tis_clip_low: float
    use_rs: bool
    rs_level: str
    rs_lower_bound: float
    rs_upper_bound: float
    rs_veto_threshold: float | None
    m2_threshold: float | None
    normalize_advantages_std: bool

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
