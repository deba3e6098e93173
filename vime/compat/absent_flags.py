"""`ABSENT`: slime's flags that vime does not accept, each with what it is in slime and what vime
has instead, for the one error that names every flag of a command line vime does not know
(`parse.py`). Plain data beside `flags.py`'s `FLAGS` (the flags vime reads), in the same rows.
"""

from __future__ import annotations

from vime.compat.flags import Flag


def _absent(says: str, *names: str) -> list[Flag]:
    return [Flag(n, "absent", str, says) for n in names]


# slime's flags that vime does not accept (not parsed, so argparse leaves them over): what each
# is in slime and what vime has instead, for the one error that lists every flag a command line
# has that vime does not know. A name ending in * is a family of flags.
_NOT_YET = "not in vime yet"
_MEGATRON_HOOK = "a hook into slime's Megatron trainer; vime trains the HF model with FSDP2 and has no such hook"
_OTHER_MODELS = (
    "a Megatron flag of a model architecture vime does not train (multi-latent attention: DeepSeek-V3, Kimi K2, "
    "GLM-4.7; gated attention and DeltaNet: Qwen3-Next, Qwen3.5; GLM-4's extra norms); vime trains the Llama and "
    "Qwen families"
)
_MEMORY_PROFILE = f"memory profiling of slime's trainer; {_NOT_YET}"
OPSD = (
    "slime's on-policy self-distillation (--opd-type self, its run-qwen3-8B-opsd.sh): the policy, given "
    "privileged information such as a reference solution, as its own frozen teacher under a full-vocabulary JSD "
    f"loss; {_NOT_YET} (vime's OPD: --opd-type megatron or sglang, a teacher's log-prob of each token)"
)
_ROLLOUT_BUFFER = "slime's external rollout buffer (an agent server); vime: a --rollout-function-path of your own"
_NOT_HERE = [
    *_absent(
        _MEGATRON_HOOK,
        "custom_megatron_before_log_prob_hook_path",
        "custom_megatron_before_train_step_hook_path",
        "custom_megatron_init_path",
        "custom_model_provider_path",
    ),
    *_absent(
        "slime's hook from samples to its trainer's batch; vime trains the Samples themselves "
        "(--custom-reward-post-process-path sees them first)",
        "custom_convert_samples_to_train_data_path",
        "rollout_data_postprocess_path",
    ),
    *_absent(
        "how slime reduces the policy loss over tokens; vime: --calculate-per-token-loss, or --loss-type custom_loss",
        "custom_pg_loss_reducer_function_path",
    ),
    *_absent(
        "a rollout function that brings its own prompts; vime hands every rollout function the --prompt-data source",
        "disable_rollout_global_dataset",
    ),
    *_absent(
        "slime's dump of every step's details; vime: --save-debug-rollout-data, and the run directory's "
        "metrics.jsonl and eval/",
        "dump_details",
        "save_debug_train_data",
    ),
    *_absent(_ROLLOUT_BUFFER, "rollout_buffer_url", "fetch_trajectory_retry_times", "rollout_task_type"),
    *_absent(
        "training only some parameters, by name; vime trains every weight, or LoRA adapters (--lora-rank)",
        "freeze_indexer",
        "freeze_params_name_list",
        "only_train_params_name_list",
    ),
    *_absent(f"a proxy for slime's HTTP calls; {_NOT_YET}", "http_proxy"),
    *_absent(OPSD, "opsd_*"),
    *_absent(
        "a copy of the previous actor for off-policy log-probs; vime: the async modes' --off-policy-correction",
        "keep_old_actor",
    ),
    *_absent(
        "a share of a saved rollout; vime loads it whole (--load-debug-rollout-data)",
        "load_debug_rollout_data_subsample",
    ),
    *_absent(f"rollouts from slime's forge; {_NOT_YET}", "load_forge_rollout_data"),
    *_absent(
        "no loss on a resumed sample's earlier tokens; vime trains them under the off-policy correction "
        "(--update-in-flight resume)",
        "mask_offpolicy_in_partial_rollout",
    ),
    *_absent(
        "a YAML of Megatron's flags; vime: --config (a YAML of its flags) or --custom-config-path",
        "megatron_config_path",
    ),
    *_absent(
        _MEMORY_PROFILE, "memory_recorder", "memory_snapshot_dir", "memory_snapshot_num_steps", "record_memory_history"
    ),
    *_absent(f"slime's profiler targets; {_NOT_YET}", "profile_target"),
    *_absent("training on a partly collected batch; vime's batches are always whole", "min_batch_collection_ratio"),
    *_absent("the step of a Megatron --ref-load; vime's --ref-load is an HF directory", "ref_ckpt_step"),
    *_absent(f"a reference model refreshed every N steps; {_NOT_YET}", "ref_update_interval"),
    *_absent(f"fresh optimizer state at every rollout; {_NOT_YET}", "reset_optimizer_states"),
    *_absent(
        "a hook on every generated sample; vime: a --custom-generate-function-path that wraps the generate",
        "rollout_sample_hook_path",
    ),
    *_absent(f"the entropy of the rollout's log-probs, for loss masks of one's own; {_NOT_YET}", "use_rollout_entropy"),
    *_absent(f"Adam without moments kept across steps; {_NOT_YET} (--optimizer sgd keeps none)", "use_stateless_adam"),
    *_absent(
        "how often slime flushes the engines' cache at a weight sync (other values pause generation in place, "
        "PipelineRL); vime: train_async.py's fully-async and decoupled modes pause in-flight groups at a push "
        "(--update-in-flight keep, the default)",
        "flush_cache_interval",
    ),
    *_absent(
        f"the order slime's buffer resumes partial groups in (oldest weight version first); {_NOT_YET}",
        "buffer_sort_by_staleness",
    ),
    *_absent(
        "slime's REINFORCE objective with score centering; vime's policy loss is PPO's clipped ratio (slime's "
        f"--pg-loss-type ppo: drop the flag), the REINFORCE one is {_NOT_YET}",
        "pg_loss_type",
        "use_score_centering",
        "score_centering_top_k",
    ),
    *_absent(
        "Dr.GRPO's constant divisor of the policy loss; vime: --calculate-per-token-loss (the step's token "
        "mean), or --loss-type custom_loss",
        "pg_loss_divisor",
    ),
    *_absent(
        "slime's bitwise-equal training and rollout kernels (FlashAttention 3, batch-invariant ops); not in vime: "
        "the engine/trainer gap is logged (train/train_rollout_logprob_abs_diff) and --use-tis corrects it",
        "true_on_policy_mode",
    ),
    *_absent(
        "slime's power-of-two scales for block-FP8 rollout weights; vime's built-in engines quantize their own "
        "weights (--engine-quantization fp8)",
        "force_fp8_ue8m0_scale",
    ),
    *_absent("slime's switch for LoRA; vime: --lora-rank N turns LoRA on (drop --use-lora)", "use_lora"),
    *_absent(
        "slime's named sets of LoRA targets; vime: --target-modules (PEFT's names, all-linear by default)",
        "lora_target_preset",
    ),
    *_absent(
        "slime's adapter-only and merged saves; vime's checkpoints hold both, the merged model and the adapter "
        "(<step>/adapter/), at --save-interval",
        "save_lora",
        "lora_save_merged_hf",
    ),
    *_absent(
        "the adapters' own weight decay and learning rate; vime: --weight-decay and --lr (with --lora-rank the "
        "adapters are all that train)",
        "lora_weight_decay",
        "lora_learning_rate",
    ),
    *_absent(f"an adapter to start from; {_NOT_YET} (--load resumes a vime LoRA run)", "lora_load"),
    *_absent(
        "Megatron's fresh start from --load's weights (no optimizer, step 0); vime: --hf-checkpoint DIR starts "
        "from a checkpoint's weights",
        "finetune",
    ),
    *_absent(
        "Transformer Engine's FP8 training; vime trains in bfloat16 (--engine-quantization fp8 quantizes the "
        "built-in engines only)",
        "fp8_format",
        "fp8_recipe",
        "fp8_param_gather",
    ),
    *_absent(
        _OTHER_MODELS,
        "multi_latent_attention",
        "q_lora_rank",
        "kv_lora_rank",
        "qk_head_dim",
        "qk_pos_emb_head_dim",
        "v_head_dim",
        "mscale",
        "mscale_all_dim",
        "no_position_embedding",
        "rotary_interleaved",
        "post_self_attn_layernorm",
        "post_mlp_layernorm",
        "apply_layernorm_1p",
        "use_gated_attention",
        "attention_output_gate",
        "qwen_gdn_backend",
    ),
]
ABSENT: dict[str, Flag] = {
    f.name: f
    for f in [
        *_absent("image/video columns for vision-language models; vime trains text models only", "multimodal_keys"),
        *_absent(
            "the request router in front of slime's engines; vime's client spreads requests itself",
            "router_*",
            "slime_router_*",
        ),
        *_absent(
            "GPUs per node of the cluster; vime: --actor-num-gpus-per-node and --rollout-num-gpus",
            "num_gpus_per_node",
            "rollout_num_gpus_per_node",  # its older name, which slime's run-llama3.1-8B.sh passes
        ),
        *_absent(
            "a hook after slime's disk weight-sync writes; vime's pushes (--weight-transport) call none",
            "custom_update_weight_post_write_path",
        ),
        *_absent(
            "SGLang's prefill/decode disaggregation; every vime engine prefills and decodes", "prefill_num_servers"
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
            "a logging function of one's own for rollouts or eval; vime logs rollout/* and eval/* metrics itself",
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
        *_NOT_HERE,
    ]
}
ABSENT_DOC = "docs/slime-flags.md"


def absent(dest: str) -> Flag | None:
    """The row of a slime flag vime does not accept (`dest`: e.g. opd_type), or None."""
    return ABSENT.get(dest) or next(
        (f for f in ABSENT.values() if f.name.endswith("*") and dest.startswith(f.name[:-1])), None
    )
