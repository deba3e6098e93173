"""The rows of slime's and Megatron's flags: `FLAGS`, those vime reads and what it does with each
(its kind, as the package's docstring lists them), and `ABSENT`, those it refuses with what it has
instead. Plain data: the command line (`parse.py`), the start-up lines (`startup.py`), the model
check (`model.py`) and docs/slime-flags.md all read these rows.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Flag:
    """One foreign flag. `type` bool is a switch (store_true)."""

    name: str  # the dest, e.g. tensor_model_parallel_size
    kind: str  # shape | parallel | recompute | same | inert | zero
    type: type
    says: str  # what vime does with it: the start-up line, the --help and docs/slime-flags.md

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


def _rows(kind: str, type_: type, says: str, *names: str) -> list[Flag]:
    return [Flag(n, kind, type_, says) for n in names]


_CHECKED = "checked against the checkpoint's config.json and weights"
FLAGS: dict[str, Flag] = {
    f.name: f
    for f in [
        *_rows(
            "shape",
            int,
            _CHECKED,
            "num_layers",
            "hidden_size",
            "ffn_hidden_size",
            "num_attention_heads",
            "num_query_groups",
            "kv_channels",
            "vocab_size",
            "max_position_embeddings",
        ),
        *_rows(
            "shape",
            int,
            _CHECKED,
            "num_experts",
            "moe_ffn_hidden_size",
            "moe_router_topk",
            "moe_shared_expert_intermediate_size",
        ),
        *_rows("shape", float, _CHECKED, "rotary_base", "norm_epsilon", "rotary_percent"),
        *_rows(
            "shape",
            str,
            _CHECKED,
            "normalization",
            "position_embedding_type",
            "moe_router_score_function",
            "moe_layer_freq",
        ),
        *_rows(
            "shape",
            bool,
            _CHECKED,
            "swiglu",
            "group_query_attention",
            "qk_layernorm",
            "add_qkv_bias",
            "disable_bias_linear",
            "untie_embeddings_and_output_weights",
            "use_rotary_position_embeddings",
        ),
        *_rows(
            "parallel",
            int,
            "vime shards weights, gradients and optimizer state over every actor GPU with FSDP2",
            "tensor_model_parallel_size",
            "pipeline_model_parallel_size",
            "context_parallel_size",
            "expert_tensor_parallel_size",
        ),
        Flag("moe_grouped_gemm", "same", bool, "the experts run as one grouped GEMM (transformers 5's grouped_mm)"),
        *_rows(
            "inert",
            str,
            "vime's experts drop no token and take them by all-gather under --expert-model-parallel-size",
            "moe_token_dispatcher_type",
            "moe_token_drop_policy",
        ),
        *_rows(
            "inert",
            bool,
            "no fused permutation or DeepEP: tokens reach the experts by all-gather",
            "moe_permute_fusion",
            "moe_enable_deepep",
        ),
        Flag("moe_router_dtype", "inert", str, "the routers' softmax runs in float32, as transformers' does"),
        Flag(
            "moe_router_load_balancing_type",
            "inert",
            str,
            "the load-balancing loss is --moe-aux-loss-coeff's (Switch's, summed over MoE layers)",
        ),
        Flag("sequence_parallel", "inert", bool, "no tensor parallelism to pair it with: FSDP2 instead"),
        Flag("recompute_granularity", "recompute", str, "full: --gradient-checkpointing"),
        Flag("recompute_method", "recompute", str, "uniform: every layer; block: --gradient-checkpointing-layers"),
        Flag("recompute_num_layers", "recompute", int, "with block: --gradient-checkpointing-layers"),
        Flag("use_dynamic_batch_size", "same", bool, "micro-batches are always packed up to --max-tokens-per-gpu"),
        Flag(
            "balance_data", "same", bool, "each step's samples are always split over trainer ranks balanced by tokens"
        ),
        Flag("accumulate_allreduce_grads_in_fp32", "same", bool, "FSDP2 reduces gradients in float32"),
        Flag("attention_softmax_in_fp32", "same", bool, "the attention kernels keep the softmax in float32"),
        Flag("attention_backend", "inert", str, "vime's packed attention chooses its kernel: --attention-kernel"),
        Flag("train_backend", "inert", str, "vime trains with FSDP2: the same model and loss"),
        Flag("train_memory_margin_bytes", "inert", int, "vime's trainer reserves no memory margin"),
        Flag("disable_wandb_random_suffix", "same", bool, "the W&B run id is the run name, no random suffix"),
        Flag("wandb_always_use_train_step", "same", bool, "W&B rows are logged at the training step"),
        Flag("seq_length", "inert", int, "sequence lengths come from the data"),
        Flag(
            "use_fault_tolerance",
            "same",
            bool,
            "engines that die or fall silent are always found (--rollout-health-check-*) and those vime launched restarted",
        ),
        Flag(
            "rollout_health_check_first_wait",
            "inert",
            float,
            "an engine is probed only once it has answered at start-up, so a slow first load never counts against it",
        ),
        Flag("make_vocab_size_divisible_by", "inert", int, "vime keeps the checkpoint's vocabulary"),
        Flag(
            "megatron_to_hf_mode",
            "inert",
            str,
            "vime trains the HF model itself: there are no Megatron weights to convert for the engines",
        ),
        *_rows(
            "zero",
            float,
            "vime trains without dropout, which would make the trainer's log-probs differ from the engine's",
            "attention_dropout",
            "hidden_dropout",
        ),
        Flag("moe_z_loss_coeff", "zero", float, "vime's routers have no z-loss"),
    ]
}


def _absent(says: str, *names: str) -> list[Flag]:
    return [Flag(n, "absent", str, says) for n in names]


# slime's flags that vime does not accept (not parsed, so argparse leaves them over): what each
# is in slime and what vime has instead, for the one error that lists every flag a command line
# has that vime does not know. A name ending in * is a family of flags.
_NOT_YET = "not in vime yet"
ABSENT: dict[str, Flag] = {
    f.name: f
    for f in [
        *_absent("image/video columns for vision-language models; vime trains text models only", "multimodal_keys"),
        *_absent("a KL penalty folded into the reward; vime: --kl-loss-coef (the KL as a loss term)", "kl_coef"),
        *_absent("the request router in front of slime's engines; vime's client spreads requests itself", "router_*"),
        *_absent(
            "GPUs per node of the cluster; vime: --actor-num-gpus-per-node and --rollout-num-gpus", "num_gpus_per_node"
        ),
        *_absent(
            "delta weight sync through a shared disk; vime pushes whole weights, by --weight-transport",
            "update_weight_mode",
            "update_weight_transport",
            "update_weight_disk_dir",
            "update_weight_disk_keep_files",
            "update_weight_local_checkpoint_dir",
            "update_weight_delta_encoding",
            "update_weight_delta_checksum",
            "custom_update_weight_post_write_path",
        ),
        *_absent(
            "Megatron's optimizer state on the CPU or in low precision; vime: FSDP2 shards it over the actor GPUs",
            "optimizer_cpu_offload",
            "overlap_cpu_optimizer_d2h_h2d",
            "use_precision_aware_optimizer",
        ),
        *_absent(
            "an argument of the SGLang servers slime starts; vime: --vllm-NAME with --rollout-backend vllm, "
            "or the built-in engine's --engine-* flags",
            "sglang_*",
        ),
        *_absent("engines started elsewhere; vime: --rollout-engine-urls", "rollout_external_engine_addrs"),
        *_absent(
            "memory offload while colocated; vime: --colocate releases the engine's memory while the trainer steps",
            "offload",
            "offload_train",
            "offload_rollout",
            "release_train",
        ),
        *_absent(
            "a rollout function of eval's own; vime evaluates with the run's generate function (vime/eval.py)",
            "eval_function_path",
        ),
        *_absent("eval's tool schemas key; vime: --tool-key (training and eval)", "eval_tool_key"),
        *_absent("eval's reward key; vime grades eval by rm type rules (--eval-rm-type)", "eval_reward_key"),
        *_absent(
            "eval's prompt/context bounds; vime: --rollout-max-context-len bounds eval too, and prompts too long for the model are refused",
            "eval_max_prompt_len",
            "eval_max_context_len",
        ),
        *_absent("a minimum response length; vime's engines have none", "eval_min_new_tokens"),
        *_absent(
            "no reward normalization at all; vime: --disable-grpo-std-normalization drops the std only",
            "disable_rewards_normalization",
        ),
        *_absent(
            "PPO's critic; vime trains critic-free estimators (GRPO family, REINFORCE++)",
            "value_clip",
            "lambd",
            "num_critic_only_steps",
        ),
        *_absent(
            "replay of the trainer's own routing from its old-log-prob forward (R2); vime: "
            "--use-rollout-routing-replay replays the engine's (R3)",
            "use_routing_replay",
        ),
        *_absent(
            "routing of mixtures of experts vime does not train (DeepSeek-V3, GLM-4.5, Kimi K2, Qwen3-Next: expert "
            "bias, grouped or scaled top-k, a shared-expert gate); vime trains Qwen3-MoE and Mixtral",
            "moe_router_pre_softmax",
            "moe_router_enable_expert_bias",
            "moe_router_bias_update_rate",
            "moe_router_topk_scaling_factor",
            "moe_router_num_groups",
            "moe_router_group_topk",
            "moe_shared_expert_gate",
        ),
        *_absent("multi-token-prediction layers; not in vime", "enable_mtp_training", "mtp_*"),
        *_absent("slime's own CI checks; not in vime", "ci_*"),
        *_absent(
            "extra rollout logs (pass rate, multi-turn, samples); vime logs rollout/* and eval/* metrics itself",
            "log_passrate",
            "log_multi_turn",
            "log_correct_samples",
            "log_reward_category",
            "custom_rollout_log_function_path",
            "custom_eval_rollout_log_function_path",
        ),
        *_absent(
            "per-sample filters and hooks of slime's rollout buffer; vime: --dynamic-sampling-filter-path",
            "rollout_sample_filter_path",
            "rollout_all_samples_process_path",
            "buffer_filter_path",
        ),
        *_absent("a data source class of one's own; not in vime", "data_source_path"),
        *_absent("the first rollout's id; vime: --load resumes at its checkpoint's step", "start_rollout_id"),
        *_absent("HF-format saves; vime's checkpoints are HF directories already", "save_hf"),
        *_absent("compares pushed weights with the engine's; vime: --check-weight-push", "check_weight_update_equal"),
    ]
}
ABSENT_DOC = "docs/slime-flags.md"


def absent(dest: str) -> Flag | None:
    """The row of a slime flag vime does not accept (`dest`: e.g. opd_type), or None."""
    return ABSENT.get(dest) or next(
        (f for f in ABSENT.values() if f.name.endswith("*") and dest.startswith(f.name[:-1])), None
    )
