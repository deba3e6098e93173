"""The checks of a training run (train.py, train_async.py) beyond what every entry point needs:
the data and batch sizes, the schedule and staleness, running one side alone, checkpoints, the
optimizer; the algorithm's are in checks_algorithm.py. Each check is (bad, message)."""

from __future__ import annotations

import json

from vime.config.checks_algorithm import algorithm_checks
from vime.config.schema import Settings, default_of
from vime.modes import SFT_ROLLOUT_FN, custom_rollout


def train_checks(c: Settings, entry: str) -> list[tuple[bool, str]]:
    """Every check of a training run, `entry` being sync (train.py) or async (train_async.py)."""
    return [
        *_debug_checks(c),
        *_batch_checks(c, entry),
        *_output_checks(c),
        *algorithm_checks(c),
        *_optimizer_checks(c),
        *_moe_checks(c),
    ]


def eval_checks(c: Settings) -> list[tuple[bool, str]]:
    """What `vime eval` needs beyond the common checks: the held-out prompts."""
    return [
        (
            not c.eval_prompt_data and c.eval_config is None,
            "--eval-prompt-data or --eval-config is required (the held-out prompts)",
        ),
        (  # it was taken and dropped: the base model was evaluated as if it were the checkpoint
            c.load is not None,
            f"--load {c.load}: vime eval does not resume a run, it evaluates --hf-checkpoint: give a checkpoint's "
            f"step directory there (--hf-checkpoint {c.load}/<step>)",
        ),
    ]


def _batch_checks(c: Settings, entry: str) -> list[tuple[bool, str]]:
    """The data, the batch sizes, the schedule and how stale a sample may be."""
    return [
        (c.prompt_data is None, "--prompt-data is required (a JSONL or Parquet file of prompts)"),
        (c.rollout_batch_size < 1, "--rollout-batch-size must be at least 1"),
        (c.n_samples_per_prompt < 1, "--n-samples-per-prompt must be at least 1"),
        (c.global_batch_size < 1, "--global-batch-size must be at least 1"),
        (
            c.global_batch_size >= 1 and c.samples_per_rollout % c.global_batch_size != 0,
            f"--rollout-batch-size × --n-samples-per-prompt = {c.samples_per_rollout} is not a multiple of "
            f"--global-batch-size {c.global_batch_size}: pick a global batch size that divides it",
        ),
        (
            c.num_steps_per_rollout is not None
            and (c.num_steps_per_rollout < 1 or c.samples_per_rollout % c.num_steps_per_rollout != 0),
            f"--num-steps-per-rollout {c.num_steps_per_rollout} must be at least 1 and divide the rollout's "
            f"{c.samples_per_rollout} samples (--rollout-batch-size × --n-samples-per-prompt)",
        ),
        (
            c.num_rollout is None and c.num_epoch is None,
            "give --num-rollout (steps) or --num-epoch (passes over the data)",
        ),
        (c.num_rollout is not None and c.num_rollout < 1, "--num-rollout must be at least 1"),
        # --num-epoch 0 or -2 made --num-rollout 0 or -40: the engines started, nothing trained, rc 0
        (c.num_epoch is not None and c.num_epoch < 1, f"--num-epoch {c.num_epoch}: give at least 1 pass over the data"),
        (
            c.rollout_max_prompt_len is not None and c.rollout_max_prompt_len < 1,
            "--rollout-max-prompt-len must be at least 1",
        ),
        (
            c.over_sampling_batch_size is not None and c.over_sampling_batch_size < c.rollout_batch_size,
            f"--over-sampling-batch-size {c.over_sampling_batch_size} is below --rollout-batch-size {c.rollout_batch_size}: "
            "a round of prompts must be able to fill a batch; raise it or leave it out",
        ),
        (
            c.over_sampling_batch_size is not None and c.dynamic_sampling_filter_path is None,
            "--over-sampling-batch-size only matters with --dynamic-sampling-filter-path (which groups to drop): give the filter or drop the flag",
        ),
        (c.dynamic_sampling_max_epochs < 1, "--dynamic-sampling-max-epochs must be at least 1"),
        (c.update_weights_interval < 1, "--update-weights-interval must be at least 1"),
        (
            entry == "async" and c.colocate,
            "train_async.py cannot --colocate: async training overlaps generation with training, so trainer and engine need their own "
            "devices (or two processes on one GPU without --colocate); use train.py for colocated runs",
        ),
        (c.max_staleness is not None and c.max_staleness < 0, "--max-staleness must be >= 0"),
        (
            c.max_staleness is not None and c.max_staleness < c.min_staleness,
            f"--max-staleness {c.max_staleness} cannot hold: with --update-weights-interval {c.update_weights_interval} and "
            f"{c.steps_per_rollout} optimizer step(s) per rollout even sync training trains tokens {c.min_staleness} steps old; "
            f"raise --max-staleness to {c.min_staleness} or push and step once per rollout",
        ),
        (
            entry == "sync" and c.max_staleness is not None,
            "--max-staleness is decoupled async training: run it with train_async.py",
        ),
        (
            c.partial_rollout and c.update_in_flight not in ("keep", "resume"),
            f"--partial-rollout is --update-in-flight resume, and --update-in-flight is {c.update_in_flight}: give one",
        ),
        (c.rollout_concurrency is not None and c.rollout_concurrency < 1, "--rollout-concurrency must be at least 1"),
        *(
            (
                not 1 <= getattr(c, name) <= 100,
                f"--{name.replace('_', '-')} {getattr(c, name)}: give a percentage from 1 to 100",
            )
            for name in ("mps_trainer_sm_percent", "mps_engine_sm_percent")
        ),
        (
            c.rollout_process == "on" and custom_rollout(c),
            "--rollout-process on runs the default generate in a process of its own, and a custom generate or rollout "
            "function runs in the trainer's (it may call the engines through the run's router): drop one of them",
        ),
    ]


def _debug_checks(c: Settings) -> list[tuple[bool, str]]:
    """Running one side alone (debug rollouts saved or loaded)."""
    return [
        (
            c.debug_rollout_only and (c.debug_train_only or c.load_debug_rollout_data is not None),
            "--debug-rollout-only starts no trainer and --debug-train-only / --load-debug-rollout-data no engine: give one of them",
        ),
        (
            c.debug_rollout_only and c.max_staleness is not None,
            "--debug-rollout-only pushes no weights, so --max-staleness would hold the worker back forever: drop one",
        ),
        (
            c.save_debug_rollout_data is not None and c.load_debug_rollout_data is not None,
            "--save-debug-rollout-data with --load-debug-rollout-data would write back what was read: give one",
        ),
        (
            c.debug_train_only and c.load_debug_rollout_data is None and not c.sft_rollout,
            "--debug-train-only starts no engine: give --load-debug-rollout-data (the rollouts to train on), "
            f"or SFT's --rollout-function-path {SFT_ROLLOUT_FN}",
        ),
        (
            c.debug_rollout_only and (c.save is not None or c.load is not None),
            "--debug-rollout-only trains nothing, so it saves and loads no checkpoint: drop --save/--load",
        ),
        *[
            (
                path is not None and not _one_file_per_rollout(path),
                f"--{flag} {path}: put {{rollout_id}} in the path (one file per rollout), e.g. {(path or '').rstrip('/')}/{{rollout_id}}.pt",
            )
            for flag, path in (
                ("save-debug-rollout-data", c.save_debug_rollout_data),
                ("load-debug-rollout-data", c.load_debug_rollout_data),
            )
        ],
    ]


def _output_checks(c: Settings) -> list[tuple[bool, str]]:
    """Checkpoints and evaluation during training."""
    return [
        (
            c.save_interval is not None and c.save is None,
            "--save-interval needs --save DIR (where to write checkpoints)",
        ),
        # a negative interval saved or evaluated at every step (step % -1 == 0), 0 only at the end
        (
            c.save_interval is not None and c.save_interval < 1,
            f"--save-interval {c.save_interval}: give at least 1 (leave it out to save only at the end)",
        ),
        (
            c.eval_interval is not None and c.eval_interval < 1,
            f"--eval-interval {c.eval_interval}: give at least 1 (leave it out for no evaluation)",
        ),
        (c.overwrite_save and c.save is None, "--overwrite-save needs --save DIR (the checkpoints it may replace)"),
        (
            c.eval_interval is not None and not c.eval_prompt_data and c.eval_config is None,
            "--eval-interval needs --eval-prompt-data or --eval-config (held-out prompts)",
        ),
    ]


def _optimizer_checks(c: Settings) -> list[tuple[bool, str]]:
    """The optimizer, its schedule, LoRA, the micro-batches and the weight push."""
    lora_shape = _lora_shaping(c)
    return [
        (c.lr < 0, "--lr must be >= 0"),
        (not 0 <= c.min_lr <= c.lr, f"--min-lr {c.min_lr} must be between 0 and --lr {c.lr}"),
        (c.lr_warmup_iters < 0, "--lr-warmup-iters must be >= 0"),
        (
            c.lr_warmup_fraction is not None and not 0 <= c.lr_warmup_fraction < 1,
            f"--lr-warmup-fraction {c.lr_warmup_fraction} must be in [0, 1)",
        ),
        (
            c.lr_warmup_fraction is not None and c.lr_warmup_iters != 0,
            "--lr-warmup-fraction and --lr-warmup-iters both set the warm-up: give one",
        ),
        (c.lr_decay_iters is not None and c.lr_decay_iters < 1, "--lr-decay-iters must be at least 1"),
        (
            c.lr_decay_style != "constant" and c.lr_decay_iters is not None and c.lr_decay_iters <= c.lr_warmup_iters,
            f"--lr-decay-iters {c.lr_decay_iters} must be above --lr-warmup-iters {c.lr_warmup_iters}: the decay counts the warm-up's steps",
        ),
        (c.weight_decay < 0, "--weight-decay must be >= 0"),
        (c.optimizer == "sgd" and not 0 <= c.sgd_momentum < 1, "--sgd-momentum must be in [0, 1)"),
        (c.adam_eps <= 0, "--adam-eps must be > 0"),
        (c.lora_rank < 0, f"--lora-rank {c.lora_rank} must be >= 1 (or 0: full fine-tuning)"),
        (c.lora_rank > 0 and c.lora_alpha <= 0, f"--lora-alpha {c.lora_alpha} must be > 0"),
        (
            c.lora_rank == 0 and bool(lora_shape),
            f"{' '.join(lora_shape)} shape LoRA adapters, but --lora-rank is 0 (full fine-tuning): give --lora-rank N, "
            "or leave them out",
        ),
        (not 0 <= c.lora_dropout < 1, f"--lora-dropout {c.lora_dropout} must be in [0, 1)"),
        (c.max_tokens_per_gpu < 1, "--max-tokens-per-gpu must be at least 1"),
        # 0 became chunks of one token (the log-probs' slowest way) with no line
        (c.logprob_chunk_size < 1, f"--logprob-chunk-size {c.logprob_chunk_size}: give at least 1 token"),
        (  # torch.manual_seed's range: past it, a ValueError's traceback once the run had started
            not -(2**63) <= c.seed < 2**64,
            f"--seed {c.seed}: a seed is 64 bits; give one from 0 to {2**64 - 1}",
        ),
        (c.micro_batch_size is not None and c.micro_batch_size < 1, "--micro-batch-size must be at least 1"),
        (
            c.gradient_checkpointing_layers is not None and c.gradient_checkpointing_layers < 1,
            "--gradient-checkpointing-layers must be at least 1",
        ),
        (
            c.gradient_checkpointing_layers is not None and not c.gradient_checkpointing,
            "--gradient-checkpointing-layers needs --gradient-checkpointing",
        ),
        (c.update_weights_timeout <= 0, "--update-weights-timeout must be > 0 seconds"),
        (c.update_weight_buffer_size < 1, "--update-weight-buffer-size must be at least 1 byte"),
        (c.max_bad_steps < 1, "--max-bad-steps must be at least 1"),
    ]


def _moe_checks(c: Settings) -> list[tuple[bool, str]]:
    """A mixture of experts' settings, from the settings alone (what needs the model is checked at
    start-up: `vime.trainer.moe.moe_refusal`)."""
    flag = "--use-rollout-routing-replay" if c.use_rollout_routing_replay else "--record-routed-experts"
    ranks = {"cpu": c.actor_num_procs, "cuda": c.actor_num_nodes * c.actor_num_gpus_per_node}.get(c.device)
    return [
        (c.moe_aux_loss_coeff < 0, f"--moe-aux-loss-coeff {c.moe_aux_loss_coeff} must be >= 0"),
        (c.expert_model_parallel_size < 1, "--expert-model-parallel-size must be at least 1"),
        (
            c.expert_model_parallel_size > 1 and ranks is not None and ranks != c.expert_model_parallel_size,
            f"--expert-model-parallel-size {c.expert_model_parallel_size}: vime splits the experts over all of the "
            f"trainer's {ranks} rank(s) (--actor-num-procs on CPU, --actor-num-nodes × --actor-num-gpus-per-node on "
            "GPUs): give that many, or 1",
        ),
        (
            (c.use_rollout_routing_replay or c.record_routed_experts) and c.rollout_backend == "vllm",
            f"{flag}: vime's vLLM adapter does not read routed experts (vLLM captures them with "
            "--enable-return-routed-experts, and newer servers return them on /inference/v1/generate as .npy, which "
            "this adapter was not built against): use --rollout-backend vime",
        ),
        (
            c.use_rollout_routing_replay and c.record_routed_experts,
            "--record-routed-experts is what --use-rollout-routing-replay records already: give one",
        ),
    ]


def inert_flags(c: Settings) -> list[str]:
    """vime's own flags given where the other settings leave them nothing to do, for start-up's
    "no effect" line (`preflight.startup_notes`): named, not refused, as slime's scripts carry such flags
    (a --min-lr beside a constant schedule) and run as they are."""

    def given(names: tuple[str, ...], why: str) -> list[str]:
        shown = {n: json.dumps(v) if isinstance(v := getattr(c, n), dict) else v for n in names}
        return [f"--{n.replace('_', '-')} {shown[n]} ({why})" for n in names if getattr(c, n) != default_of(n)]

    out = []
    if c.lr_decay_style == "constant":  # --lr-warmup-fraction is a share of --lr-decay-iters whatever the style
        decay = ("min_lr",) if c.lr_warmup_fraction is not None else ("min_lr", "lr_decay_iters")
        out += given(decay, "--lr-decay-style constant never decays")
    if c.optimizer == "sgd":
        out += given(("adam_beta1", "adam_beta2", "adam_eps"), "--optimizer sgd")
    else:
        out += given(("sgd_momentum",), f"--optimizer {c.optimizer}")
    # SFT renders every conversation with them, and an eval set may turn the template on for itself
    if not c.apply_chat_template and not c.sft_rollout and not any("apply_chat_template" in s for s in c.eval_sets):
        out += given(("apply_chat_template_kwargs",), "prompts are plain text without --apply-chat-template")
    if c.tool_key and not c.apply_chat_template:
        out.append(f"--tool-key {c.tool_key} for the prompt (no --apply-chat-template; rewards still see the tools)")
    if c.use_kl_loss and c.kl_loss_coef == 0:
        out.append("--use-kl-loss with --kl-loss-coef 0 (no KL term: no reference model is loaded)")
    if c.ref_load and c.kl_loss_coef == 0:
        out.append(f"--ref-load {c.ref_load} (not read: --kl-loss-coef 0 needs no reference model)")
    return out + _inert_vllm_args(c)


# What the built-in engine has in place of a vLLM engine argument, for the start-up line.
VLLM_COUNTERPARTS = {
    "gpu-memory-utilization": "--engine-num-kv-blocks",
    "max-num-seqs": "--engine-max-num-seqs",
    "quantization": "--engine-quantization",
    "tensor-parallel-size": "--rollout-num-gpus-per-engine",
}


def _inert_vllm_args(c: Settings) -> list[str]:
    """`--vllm-NAME` flags of a run that starts no vLLM server (the built-in engine's, or engines
    given by URL)."""
    out = []
    for name, value in c.vllm_args.items():
        if c.rollout_backend != "vllm":
            instead = VLLM_COUNTERPARTS.get(name)
            why = "no vLLM engine: --rollout-backend is vime" + (f"; its counterpart: {instead}" if instead else "")
        elif c.rollout_engine_urls:
            why = "vime starts no vLLM server with --rollout-engine-urls: start yours with it"
        else:
            continue
        out.append(f"--vllm-{name} {value} ({why})")
    return out


def _lora_shaping(c: Settings) -> list[str]:
    """The LoRA flags set away from their defaults: without a rank they would be dropped, and the
    run would fine-tune every weight at what is likely a LoRA-sized learning rate."""
    names = ("lora_alpha", "lora_dropout", "target_modules", "exclude_modules")
    return [f"--{n.replace('_', '-')}" for n in names if getattr(c, n) != default_of(n)]


def _one_file_per_rollout(template: str) -> bool:
    """Whether a debug-rollout path names a file of its own for each rollout (`{rollout_id}`,
    with a format spec or not). One that does not format passes here: preflight's
    `debug_rollout.check_template` names what is wrong with it."""
    try:
        return template.format(rollout_id=0) != template.format(rollout_id=1)
    except (KeyError, IndexError, ValueError, AttributeError):
        return True
