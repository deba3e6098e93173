"""The checks of the algorithm a training run uses: the advantages, the policy loss, the
off-policy corrections, on-policy distillation and SFT. Each check is (bad, message)."""

from __future__ import annotations

from vime.algorithms import ADVANTAGES, BASE_LOSS, POLICY_LOSSES, Estimator, estimator_names, estimator_of
from vime.algorithms.sft import SFTLoss
from vime.config.schema import Settings, default_of
from vime.modes import SFT_ROLLOUT_FN
from vime.plugins import OPD_POST_PROCESS, OPD_REWARD, vime_path


def algorithm_checks(c: Settings) -> list[tuple[bool, str]]:
    """Every check of the algorithm's flags, loss first."""
    # SFT's before OPD's: an SFT run is told to drop --use-opd, not to add what a teacher needs
    return [*_loss_checks(c), *_correction_checks(c), *_sft_checks(c), *_opd_checks(c)]


def _loss_checks(c: Settings) -> list[tuple[bool, str]]:
    """The advantages and the policy loss."""
    return [
        (
            c.opsm_delta != default_of("opsm_delta") and not c.use_opsm,
            f"--opsm-delta {c.opsm_delta:g} is OPSM's threshold: add --use-opsm, or drop it",
        ),
        (
            c.loss_type == "custom_loss" and (_estimator(c).loss != BASE_LOSS or c.eps_clip_c is not None),
            "--loss-type custom_loss replaces the policy term, and --advantage-estimator "
            f"{'/'.join(name for name in POLICY_LOSSES if name != BASE_LOSS)} and --eps-clip-c "
            "change that term: drop one (the custom term gets GRPO's advantages, the correction and OPSM)",
        ),
        *_estimator(c).refused(c.algorithm),
        (
            c.gamma != 1.0 and not _estimator(c).advantages.discounted,
            f"--gamma {c.gamma:g} discounts REINFORCE++'s returns: it needs --advantage-estimator "
            + " or ".join(name for name, cls in ADVANTAGES.items() if cls.discounted),
        ),
        (
            not 0 < c.gamma <= 1,
            f"--gamma {c.gamma:g} must be in (0, 1]",
        ),
        (
            c.gamma != 1.0 and c.custom_advantage_function_path is not None,
            "--gamma and --custom-advantage-function-path both set the advantages: drop one",
        ),
        (
            c.loss_type == "custom_loss" and c.custom_loss_function_path is None,
            "--loss-type custom_loss needs --custom-loss-function-path (the per-token policy term)",
        ),
        (
            c.loss_type != "custom_loss" and c.custom_loss_function_path is not None,
            "--custom-loss-function-path is used with --loss-type custom_loss: add it, or drop the path",
        ),
        (
            c.eps_clip_c is not None and not c.eps_clip_c > 1,
            f"--eps-clip-c {c.eps_clip_c} must be above 1 (the dual clip caps -A·ratio at -A·c; c <= 1 would cap the unclipped ratio itself)",
        ),
    ]


def _correction_checks(c: Settings) -> list[tuple[bool, str]]:
    """The off-policy corrections (TIS, rejection, M2PO) and what they weigh against."""
    return [
        (
            c.use_rollout_logprobs and (c.use_tis or c.use_rs),
            "--use-tis/--use-rs weigh π_old against the engine's log-probs, which --use-rollout-logprobs makes π_old: drop one",
        ),
        (
            not 0 <= c.tis_clip_low < c.tis_clip,
            f"--tis-clip-low {c.tis_clip_low} must be >= 0 and below --tis-clip {c.tis_clip}",
        ),
        (
            c.m2_threshold is not None and not c.m2_threshold > 0,
            f"--m2-threshold {c.m2_threshold} must be above 0 (M2PO's paper uses 0.04)",
        ),
        (
            c.rs_veto_threshold is not None and not 0 < c.rs_veto_threshold < 1,
            f"--rs-veto-threshold {c.rs_veto_threshold} must be between 0 and 1 (a ratio far below 1, e.g. 1e-4)",
        ),
        (
            c.use_rollout_logprobs and (c.rs_veto_threshold is not None or c.custom_tis_function_path is not None),
            "--rs-veto-threshold/--custom-tis-function-path weigh π_old against the engine's log-probs, which "
            "--use-rollout-logprobs makes π_old: drop one",
        ),
        (
            not 0 <= c.rs_lower_bound < c.rs_upper_bound,
            f"--rs-lower-bound {c.rs_lower_bound} must be >= 0 and below --rs-upper-bound {c.rs_upper_bound}",
        ),
    ]


def _estimator(c: Settings) -> Estimator:
    # an unknown name is refused by the choices check; until then, check as the default would
    return estimator_of(c.advantage_estimator if c.advantage_estimator in estimator_names() else "grpo")


def _sft_checks(c: Settings) -> list[tuple[bool, str]]:
    """SFT's flags: the rollout function and the loss go together, and what needs an engine or
    advantages cannot come with them."""
    fn = f"--rollout-function-path {SFT_ROLLOUT_FN}"
    return [
        (
            c.sft_rollout and c.loss_type != "sft_loss",
            f"{fn} hands out the data's own conversations, with no reward: train them with --loss-type sft_loss",
        ),
        (
            c.sft_rollout and c.n_samples_per_prompt != 1,
            f"--n-samples-per-prompt {c.n_samples_per_prompt}: SFT trains each conversation once; drop the flag",
        ),
        (
            c.sft_rollout and c.debug_rollout_only,
            f"--debug-rollout-only trains nothing, and {fn} generates nothing: drop --debug-rollout-only",
        ),
        (
            c.sft_rollout and c.eval_interval is not None,
            f"{fn} starts no engine, so the run evaluates nothing: drop --eval-interval and evaluate a checkpoint "
            "with `vime eval --hf-checkpoint SAVE/STEP`",
        ),
        (
            c.sft_rollout and c.max_staleness is not None,
            f"--max-staleness bounds how old generated tokens are, and {fn} generates nothing: drop it",
        ),
        *(
            (
                c.sft_rollout and bool(value),
                f"{flag} acts on generated samples, and {fn} generates and scores nothing: drop it",
            )
            for flag, value in (
                ("--custom-generate-function-path", c.custom_generate_function_path),
                ("--custom-rm-path", c.custom_rm_path),
                ("--custom-reward-post-process-path", c.custom_reward_post_process_path),
                ("--dynamic-sampling-filter-path", c.dynamic_sampling_filter_path),
                ("--tools", c.tools),
            )
        ),
        (
            c.disable_compute_advantages_and_returns and c.loss_type != "sft_loss",
            f"--disable-compute-advantages-and-returns: --loss-type {c.loss_type} trains on advantages; "
            "only --loss-type sft_loss needs none",
        ),
        *(SFTLoss.refused(c.algorithm) if c.loss_type == "sft_loss" else []),
    ]


def _opd_checks(c: Settings) -> list[tuple[bool, str]]:
    """On-policy distillation: slime's rules (a type; for a teacher in the trainer its checkpoint,
    for a served one, SGLang's or vLLM's, its address and the functions that ask it)."""
    opd_flags = [
        f"--{name.replace('_', '-')}"
        for name in ("opd_type", "opd_teacher_load", "opd_teacher_ckpt_step", "opd_kl_coef")
        if getattr(c, name) != default_of(name)
    ]
    served = c.algorithm.teacher_served
    asks_teacher = c.custom_rm_path is not None and vime_path(c.custom_rm_path) == OPD_REWARD
    return [
        (
            asks_teacher and c.group_rm,
            f"--group-rm calls --custom-rm-path once per prompt group, and {OPD_REWARD} asks the teacher for one "
            "sample at a time: drop --group-rm",
        ),
        (
            not c.use_opd and bool(opd_flags),
            f"{', '.join(opd_flags)} set up on-policy distillation, which is off: add --use-opd, or drop them",
        ),
        (
            c.use_opd and c.opd_type is None,
            "--use-opd needs --opd-type: megatron loads the teacher in the trainer from --opd-teacher-load DIR, "
            "sglang asks a teacher engine at --rm-url (`vime serve`, SGLang), vllm a vLLM server at --rm-url",
        ),
        *_served_checks(c),
        (
            asks_teacher and not served,
            f"--custom-rm-path {c.custom_rm_path} asks a teacher for on-policy distillation: add --use-opd "
            "--opd-type sglang (or vllm), or give another reward",
        ),
        (
            asks_teacher and c.custom_reward_post_process_path is None,
            f"--custom-rm-path {c.custom_rm_path} answers the teacher's log-probs, which the post-process stores and "
            f"makes rewards of: add --custom-reward-post-process-path {OPD_POST_PROCESS}",
        ),
        (
            c.algorithm.teacher_in_trainer and c.opd_teacher_load is None,
            "--opd-type megatron loads the teacher in the trainer: give --opd-teacher-load (an HF model directory "
            "or a vime --save directory)",
        ),
        (
            c.use_opd and c.opd_kl_coef <= 0,
            f"--opd-kl-coef {c.opd_kl_coef:g} gives the teacher no weight: use a positive coefficient, or drop --use-opd",
        ),
        (
            c.opd_teacher_ckpt_step is not None and c.opd_teacher_ckpt_step < 0,
            f"--opd-teacher-ckpt-step {c.opd_teacher_ckpt_step} is not a step: give a step of the --opd-teacher-load directory",
        ),
    ]


def _served_checks(c: Settings) -> list[tuple[bool, str]]:
    """A teacher served by an engine (`--opd-type sglang` or `vllm`): its address, the functions
    that ask it, and what cannot work beside it."""
    served = c.algorithm.teacher_served
    kind = f"--opd-type {c.opd_type}"
    functions = f"--custom-rm-path {OPD_REWARD} --custom-reward-post-process-path {OPD_POST_PROCESS}"
    address = (
        "http://HOST:PORT/v1/completions (a vLLM server's)"
        if c.opd_type == "vllm"
        else "http://HOST:PORT/generate (e.g. of `vime serve --model-path TEACHER`)"
    )
    return [
        (
            served and c.rm_url is None,
            f"{kind} asks a teacher engine for its log-probs: give its address, --rm-url {address}",
        ),
        (
            served and c.opd_type == "vllm" and c.rm_url is not None and _vllm_route(c.rm_url),
            f"--opd-type vllm: --rm-url {c.rm_url} names neither of the vLLM routes that score tokens: give "
            "http://HOST:PORT/v1/completions (any vLLM server) or http://HOST:PORT/inference/v1/generate (one started "
            "with --enable-scale-out)",
        ),
        (
            served and (c.custom_rm_path is None or c.custom_reward_post_process_path is None),
            f"{kind} asks the teacher through the reward function and stores its log-probs in the "
            f"post-process: add {functions}",
        ),
        (
            served and c.opd_teacher_load is not None,
            f"--opd-teacher-load loads a teacher into the trainer (--opd-type megatron); with {kind} the "
            "teacher is the engine at --rm-url: drop --opd-teacher-load",
        ),
        (
            served and _filters_on_reward(c.dynamic_sampling_filter_path),
            f"--dynamic-sampling-filter-path {c.dynamic_sampling_filter_path} judges each group by its rewards as "
            f"scored, and with {kind} every reward is the teacher's answer (0 once post-processed), so it would drop "
            "every group: drop the filter (distillation's term is per token and needs no spread of rewards)",
        ),
    ]


def _vllm_route(url: str) -> bool:
    """Whether `url` names no route a vLLM teacher scores on (opd_vllm.ROUTES; a bare host:port is one)."""
    from vime.rollout.opd_vllm import route_of

    return route_of(url) is None


def _filters_on_reward(path: str | None) -> bool:
    """Whether `path` is one of the built-in filters that keep a group by its rewards' spread
    (vime's, or slime's name for it): they judge a group before the post-process, on the reward
    functions' answers."""
    if path is None:
        return False
    from vime.rollout.filters import REWARD_SPREAD_FILTERS

    return path in REWARD_SPREAD_FILTERS
