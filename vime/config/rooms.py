"""Each room's own settings: frozen dataclasses built from the validated flat `Config` and
reached as `cfg.rollout`, `cfg.algorithm`, `cfg.trainer`, `cfg.placement`, `cfg.eval` and
`cfg.output`, so a room's code names the settings it reads and nothing else.

They are built on access (`Config`'s properties; a few dozen attribute reads), never stored: a
field the run still sets after validation (`load`, `num_rollout`, `model_dir`, `launcher`,
`update_weights_master_address`) is read as it is now, not as it was. A room that keeps one
keeps a snapshot: take it after start-up's writes (the trainer is built after preflight).
Each field has its flag's name and type; tests/test_config.py checks that against `Settings`.
Plug-ins written for slime keep receiving the flat `args`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, TypeVar

Room = TypeVar("Room")


def take(room: type[Room], cfg: Any) -> Room:
    """The room's fields read from the flat config (a property such as `steps_per_rollout` too)."""
    return room(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(room)})


@dataclass(frozen=True)
class RolloutConfig:
    """What the rollout room reads: the prompts and their keys, sampling, the rollout function and
    its plug-ins, debugging one side, multi-turn tools, async training and the rewards."""

    hf_checkpoint: str | None
    prompt_data: str | None
    input_key: str
    label_key: str
    label_format: str
    metadata_key: str
    tool_key: str | None
    apply_chat_template: bool
    apply_chat_template_kwargs: dict
    rollout_batch_size: int
    n_samples_per_prompt: int
    num_rollout: int | None
    num_epoch: int | None
    rollout_function_path: str
    custom_generate_function_path: str | None
    custom_config_path: str | None
    rollout_max_response_len: int
    rollout_temperature: float
    rollout_top_p: float
    rollout_top_k: int
    rollout_stop_token_ids: list
    rollout_stop: list
    rollout_max_prompt_len: int | None
    rollout_max_context_len: int | None
    dynamic_sampling_filter_path: str | None
    over_sampling_batch_size: int | None
    rollout_shuffle: bool
    rollout_seed: int
    skip_overlong_prompts: bool
    save_debug_rollout_data: str | None
    load_debug_rollout_data: str | None
    debug_train_only: bool
    debug_rollout_only: bool
    tools: list
    max_turns: int
    tool_timeout: float
    tool_max_output_chars: int
    rollout_concurrency: int | None
    max_staleness: int | None
    partial_rollout: bool
    update_in_flight: str
    rm_type: str
    rm_url: str | None
    custom_rm_path: str | None
    custom_reward_post_process_path: str | None
    reward_timeout: float
    reward_key: str | None


@dataclass(frozen=True)
class AlgorithmConfig:
    """What vime/algorithms/ reads: the advantage estimator, the policy loss and its clipping, KL
    and entropy terms, on-policy distillation and the off-policy corrections."""

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


@dataclass(frozen=True)
class TrainerConfig:
    """What vime/trainer/ reads: LoRA, the optimizer and its schedule, batches and micro-batches,
    compilation and checkpointing of activations. Besides those: `hf_checkpoint` (the base an
    adapter names), `rollout_temperature` (log-probs are recomputed at the temperature the
    engines sampled at), `rollout_max_response_len` (Dr.GRPO's loss divides by it), `num_rollout`
    and `steps_per_rollout` (the schedule's default horizon)."""

    lora_rank: int
    lora_alpha: float
    lora_dropout: float
    target_modules: list
    exclude_modules: list
    optimizer: str
    lr: float
    lr_decay_style: str
    lr_warmup_iters: int
    lr_warmup_fraction: float | None
    lr_decay_iters: int | None
    min_lr: float
    weight_decay: float
    adam_beta1: float
    adam_beta2: float
    adam_eps: float
    sgd_momentum: float
    clip_grad: float
    global_batch_size: int | None
    num_steps_per_rollout: int | None
    max_tokens_per_gpu: int
    micro_batch_size: int | None
    gradient_checkpointing: bool
    gradient_checkpointing_layers: int | None
    compile: bool | None
    logprob_chunk_size: int
    seed: int
    max_bad_steps: int
    hf_checkpoint: str | None
    rollout_temperature: float
    rollout_max_response_len: int
    num_rollout: int | None
    steps_per_rollout: int


@dataclass(frozen=True)
class PlacementConfig:
    """Where trainer and engines run, how many engines, how they are reached and probed, and how
    weights are pushed to them."""

    colocate: bool
    actor_num_nodes: int
    actor_num_gpus_per_node: int
    rollout_num_gpus: int | None
    rollout_num_gpus_per_engine: int
    rollout_num_engines: int | None
    rollout_backend: str
    rollout_engine_urls: list
    device: str
    launcher: str
    engine_max_num_seqs: int
    engine_num_kv_blocks: int | None
    update_weights_interval: int
    weight_transport: str
    update_weight_buffer_size: int
    update_weights_timeout: float
    rollout_health_check_interval: float
    rollout_health_check_timeout: float
    check_weight_push: bool
    update_weights_master_address: str | None
    actor_num_procs: int
    api_key: str | None


@dataclass(frozen=True)
class EvalConfig:
    """Held-out evaluation: when, on which sets (`eval_sets`, resolved at validation), and the
    sampling and grading settings a set may override."""

    eval_interval: int | None
    eval_prompt_data: list | None
    eval_name: str | None
    eval_config: str | None
    eval_input_key: str | None
    eval_label_key: str | None
    n_samples_per_eval_prompt: int
    eval_temperature: float | None
    eval_top_p: float | None
    eval_top_k: int | None
    eval_rm_type: str | None
    skip_eval_before_train: bool
    eval_max_response_len: int | None
    eval_limit: int | None
    eval_sets: list


@dataclass(frozen=True)
class OutputConfig:
    """What a run writes: checkpoints, its directory and name, TensorBoard and W&B, the console."""

    save: str | None
    save_interval: int | None
    load: str | None
    overwrite_save: bool
    run_name: str | None
    runs_dir: str
    use_tensorboard: bool
    tb_project_name: str | None
    tb_experiment_name: str | None
    use_wandb: bool
    wandb_project: str | None
    wandb_team: str | None
    wandb_group: str | None
    wandb_run_id: str | None
    wandb_mode: str | None
    wandb_key: str | None
    wandb_host: str | None
    wandb_dir: str | None
    quiet: bool
