"""The rows of slime's and Megatron's flags: `FLAGS`, those vime reads and what it does with each
(its kind, as the package's docstring lists them); those it refuses are `absent_flags.py`'s.
Plain data: the command line (`parse.py`), the start-up lines (`startup.py`), the model check
(`model.py`) and docs/slime-flags.md all read these rows.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator
from dataclasses import dataclass

from vime.compat.sglang_flags import PREFIX as SGLANG_PREFIX


@dataclass(frozen=True)
class Flag:
    """One foreign flag. `type` bool is a switch (store_true); `nargs` as argparse's, for a flag
    that takes several values (Megatron's `--spec MODULE FUNCTION`)."""

    name: str  # the dest, e.g. tensor_model_parallel_size
    kind: str  # shape | parallel | recompute | same | inert | zero | value
    type: type
    says: str  # what vime does with it: the start-up line, the --help and docs/slime-flags.md
    nargs: str | None = None

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


def _rows(kind: str, type_: type, says: str, *names: str) -> list[Flag]:
    return [Flag(n, kind, type_, says) for n in names]


_CHECKED = "checked against the checkpoint's config.json and weights"
_KERNELS = "a Megatron kernel or implementation choice: vime's trainer picks its own kernels"
_STRAW = "slime's straw rollout-data queue on a shared disk: the driver hands each trainer rank its samples itself"
_WEIGHT_SYNC = (
    "slime's disk and delta weight sync: vime pushes the whole weights at every push, by --weight-transport, "
    "so the engines hold the same weights"
)
# slime's own flags (and Megatron's that its scripts pass) accepted with what vime does instead;
# a `value` row's line depends on its value (startup.py says which)
_SLIME_ROWS = [
    *_rows(
        "inert",
        bool,
        "vime keeps AdamW's state in float32 on the actor GPUs, sharded by FSDP2; on CUDA a model whose state "
        "cannot fit them is refused at start-up",
        "optimizer_cpu_offload",
        "overlap_cpu_optimizer_d2h_h2d",
        "use_precision_aware_optimizer",
    ),
    Flag(
        "deterministic_mode",
        "inert",
        bool,
        "vime does not switch torch to deterministic kernels, and its GPU attention backward is not bitwise "
        "reproducible; seeds fix the prompt order and every sample's draws (--rollout-seed) and the trainer's (--seed)",
    ),
    Flag("kl_coef", "value", float, "slime's KL penalty in the reward (REINFORCE++ and PPO only)"),
    Flag("update_weight_mode", "value", str, _WEIGHT_SYNC),
    Flag("update_weight_transport", "value", str, "disk: --weight-transport disk; nccl: vime picks per engine"),
    *_rows("inert", str, _WEIGHT_SYNC, "update_weight_disk_dir", "update_weight_local_checkpoint_dir"),
    *_rows("inert", str, _WEIGHT_SYNC, "update_weight_delta_encoding", "update_weight_delta_checksum"),
    Flag("update_weight_disk_keep_files", "inert", bool, _WEIGHT_SYNC),
    Flag("log_probs_chunk_size", "value", int, "tokens per log-prob chunk: --logprob-chunk-size"),
    Flag("log_probs_max_tokens_per_gpu", "inert", int, "vime packs log-prob passes by --max-tokens-per-gpu too"),
    Flag("recompute_loss_function", "inert", bool, "vime's LM head never holds the whole vocabulary's logits"),
    Flag("async_save", "inert", bool, "vime writes each checkpoint between two steps"),
    Flag("no_save_optim", "inert", bool, "vime's checkpoints always hold the optimizer state, so --load resumes it"),
    Flag("balance_by_flops", "inert", bool, "vime packs micro-batches and balances ranks by tokens"),
    Flag("data_pad_size_multiplier", "inert", int, "vime's packing pads sequences to no multiple"),
    Flag("distributed_backend", "inert", str, "vime's trainer ranks talk NCCL on GPUs and gloo on CPU"),
    Flag("distributed_timeout_minutes", "inert", int, "a trainer rank waits 30 minutes for the others"),
    Flag("model_name", "inert", str, "vime reads the architecture from --hf-checkpoint's config.json"),
    Flag("padded_vocab_size", "inert", int, "vime keeps the checkpoint's vocabulary"),
    Flag("rollout_data_transport", "inert", str, "the driver hands each trainer rank its samples itself"),
    # slime's extra logs: flags of many scripts, which change nothing but what slime logs
    Flag("log_passrate", "inert", bool, "vime logs no pass@k: rollout/reward_mean, and each eval set's accuracy"),
    Flag(
        "log_multi_turn", "inert", bool, "vime logs a multi-turn run's turns and tool calls itself (rollout/turns_mean)"
    ),
    Flag("log_correct_samples", "inert", bool, "vime logs no sample texts: --save-debug-rollout-data keeps them"),
    Flag(
        "log_reward_category",
        "inert",
        str,
        "vime logs a dict reward's other values as rollout/reward_<key> means, not as categories",
    ),
    # slime's straw transport (rollout data in a packed queue on a shared disk) and its settings
    *_rows("inert", str, _STRAW, "rollout_data_dir", "rollout_storage_profile", "rollout_storage_declaration"),
    *_rows("inert", str, _STRAW, "rollout_queue_run_id"),
    Flag("rollout_queue_online_gc", "inert", bool, _STRAW),
    Flag("rollout_queue_lease_seconds", "inert", float, _STRAW),
    *_rows("inert", int, _STRAW, "rollout_queue_segment_mib", "rollout_io_concurrency"),
    Flag(
        "rollout_session_id", "inert", str, "vime's engines are the run's own: there is no serving to keep across runs"
    ),
    Flag("rollout_cleanup_timeout", "inert", float, "vime ends a run's processes itself when the run ends"),
    Flag(
        "routing_replay_prefetch_microbatches",
        "inert",
        int,
        "vime keeps the engine's routes in memory (--use-rollout-routing-replay): nothing to prefetch from disk",
    ),
    Flag("async_strategy", "inert", str, "vime writes each checkpoint between two steps"),
    Flag("use_distributed_post", "inert", bool, "vime's client spreads requests over the engines itself"),
    Flag(
        "use_slime_router",
        "inert",
        bool,
        "vime's client spreads requests over the engines itself; plug-ins reach them at args.sglang_router_ip/port",
    ),
    Flag("train_env_vars", "inert", str, "trainer ranks inherit the command's environment: export them before it"),
    Flag("rollout_skip_special_tokens", "same", bool, "responses are decoded without special tokens"),
    Flag(
        "get_mismatch_metrics",
        "same",
        bool,
        "the engine/trainer log-prob mismatch is logged every step (train/train_rollout_logprob_abs_diff)",
    ),
    Flag("allgather_cp", "inert", bool, "no context parallelism: a sequence is never split over GPUs"),
    *[
        Flag(n, "inert", str, _KERNELS, nargs="+")
        for n in (
            "megatron_deepgemm_forward_layers",
            "megatron_deepgemm_forward_modules",
            "megatron_deepgemm_moe_forward_layers",
            "megatron_deepgemm_moe_forward_modules",
        )
    ],
    *_rows("inert", bool, _KERNELS, "no_rope_fusion", "no_masked_softmax_fusion", "no_gradient_accumulation_fusion"),
    *_rows("inert", bool, _KERNELS, "enable_experimental"),
    Flag("transformer_impl", "inert", str, _KERNELS),
    Flag("spec", "inert", str, "a Megatron layer spec: vime builds the model from --hf-checkpoint", nargs="*"),
    Flag("bf16", "same", bool, "on GPU the trainer computes in bfloat16 over float32 master weights"),
    Flag("use_distributed_optimizer", "same", bool, "FSDP2 shards the optimizer state over the actor GPUs"),
    Flag(
        "no_check_for_nan_in_loss_and_grad",
        "inert",
        bool,
        "vime skips a step whose loss or gradient norm is not finite, and stops after --max-bad-steps in a row",
    ),
    *_rows(
        "inert",
        int,
        "no pipeline parallelism: FSDP2 shards every layer over the actor GPUs",
        "decoder_first_pipeline_num_layers",
        "decoder_last_pipeline_num_layers",
    ),
    Flag(
        "use_rope_scaling",
        "inert",
        bool,
        "not compared with the checkpoint: vime reads rope scaling from its config.json",
    ),
    Flag(
        "rotary_scaling_factor",
        "inert",
        float,
        "not compared with the checkpoint: vime reads rope scaling from its config.json",
    ),
    *_rows(
        "inert",
        bool,
        "vime moves nothing to the CPU (with --colocate the engine releases its memory while the trainer steps)",
        "no_offload_train",
        "no_offload_rollout",
    ),
]
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
        *_SLIME_ROWS,
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


class _Accepted(Collection[str]):
    """The dests of every foreign flag vime takes: the rows of `FLAGS`, and the `--sglang-*`
    family (SGLang's server arguments, vime/compat/sglang_flags.py), which has no rows of its own
    here. A config file's key is read as slime's flag where it is one of these."""

    def __contains__(self, name: object) -> bool:
        return name in FLAGS or (isinstance(name, str) and name.startswith(SGLANG_PREFIX))

    def __iter__(self) -> Iterator[str]:
        return iter(FLAGS)

    def __len__(self) -> int:
        return len(FLAGS)


ACCEPTED = _Accepted()
