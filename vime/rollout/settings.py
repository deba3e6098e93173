"""The rollout room's settings, `cfg.rollout` (one of the per-room sub-configs of
vime/config/rooms.py): declared here, below the config, because vime/config/ reads the rollout's
tables (the rm types of `rewards/grading.py`) and the rollout takes this type."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RolloutConfig:
    """What the rollout room reads: the prompts and their keys, sampling, the rollout function and
    its plug-ins, debugging one side, multi-turn tools, async training and the rewards. Besides
    those: `model_dir` (a conversation's context length), `steps_per_rollout` (the fully-async
    worker's staleness is in optimizer steps), `sft_rollout` (the data's conversations stand in
    for generation), the engines' health checks (the runtime probes them)."""

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
    tool_call_parser: str
    tool_max_output_chars: int
    unsafe_python_tool: bool
    rollout_concurrency: int | None
    max_staleness: int | None
    partial_rollout: bool
    update_in_flight: str
    rollout_process: str
    rm_type: str
    rm_url: str | None
    custom_rm_path: str | None
    custom_reward_post_process_path: str | None
    group_rm: bool
    reward_timeout: float
    reward_key: str | None
    max_failed_reward_steps: int
    model_dir: str | None
    steps_per_rollout: int
    sft_rollout: bool
    rollout_health_check_interval: float
    rollout_health_check_timeout: float
