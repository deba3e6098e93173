"""The settings of the components above the config: the trainer, evaluation and a run's outputs,
each declared once here with its type, default and flag help (vime/setting.py); and what belongs
to the run as a whole (its mode, the foreign flags it was given, its live objects), which is no
component's. The other components declare theirs where they live: vime/rollout/settings.py,
vime/algorithms/settings.py, vime/backends/settings.py."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vime.setting import DERIVED, PASSTHROUGH, RUNTIME, Component, setting


@dataclass
class TrainerConfig(Component):
    """What vime/trainer/ reads: LoRA, the optimizer and its schedule, batches and micro-batches,
    compilation and checkpointing of activations; `steps_per_rollout`, set by validation."""

    # --- LoRA ---
    lora_rank: int = setting(
        0,
        "train LoRA adapters of this rank on the target layers, the base frozen (0 = full fine-tuning); pushes and "
        "checkpoints carry the merged weights, checkpoints also the adapter in PEFT's layout (adapter/)",
        group="lora",
    )
    lora_alpha: float = setting(16.0, "LoRA's alpha: the adapter's update is scaled by alpha / rank", group="lora")
    lora_dropout: float = setting(
        0.0,
        "dropout on the adapters' input while training; above 0 the training forward differs from the one that "
        "scored the old log-probs, so the importance ratio is not 1 even on-policy",
        group="lora",
    )
    target_modules: list = setting(
        ["all-linear"],
        "layers that get adapters, by their names' last parts (q_proj k_proj v_proj o_proj gate_proj up_proj "
        "down_proj), or all-linear (every linear layer but the LM head)",
        group="lora",
        nargs="+",
    )
    exclude_modules: list = setting(
        [], "layers left without adapters, by last part or whole dotted name", group="lora", nargs="+"
    )
    # --- optimizer ---
    optimizer: str = setting(
        "adam",
        "adam (AdamW: Megatron's adam, weight decay decoupled) or sgd (with --sgd-momentum)",
        ("adam", "sgd"),
        group="optimizer",
    )
    lr: float = setting(1e-6, "peak learning rate", group="optimizer")
    lr_decay_style: str = setting(
        "constant",
        "learning rate after warm-up: constant, or decayed to --min-lr over --lr-decay-iters, linearly or on a cosine",
        ("constant", "linear", "cosine"),
        group="optimizer",
    )
    lr_warmup_iters: int = setting(
        0, "optimizer steps of linear warm-up from 0 to --lr (step 0 runs at 0, as in Megatron)", group="optimizer"
    )
    lr_warmup_fraction: float | None = setting(
        None,
        "warm-up as a share of the decay's optimizer steps (Megatron's; slime's SFT scripts give 0.1): instead of --lr-warmup-iters",
        group="optimizer",
    )
    lr_decay_iters: int | None = setting(
        None,
        "optimizer steps over which the learning rate decays, warm-up included (default: every optimizer step of the run)",
        group="optimizer",
    )
    min_lr: float = setting(0.0, "learning rate at the end of the decay", group="optimizer")
    weight_decay: float = setting(
        0.0,
        "weight decay of the weight matrices, not of biases and norm weights, as in Megatron (decoupled with adam, an L2 term with sgd)",
        group="optimizer",
    )
    adam_beta1: float = setting(0.9, "AdamW beta1", group="optimizer")
    adam_beta2: float = setting(0.98, "AdamW beta2", group="optimizer")
    adam_eps: float = setting(1e-8, "AdamW epsilon", group="optimizer")
    sgd_momentum: float = setting(0.9, "momentum of --optimizer sgd", group="optimizer")
    clip_grad: float = setting(1.0, "gradient norm clip", group="optimizer")
    global_batch_size: int | None = setting(
        None, "samples per optimizer step (default: one step per rollout)", group="optimizer"
    )
    num_steps_per_rollout: int | None = setting(
        None,
        "optimizer steps per rollout: sets --global-batch-size to the rollout's samples divided by it",
        group="optimizer",
    )
    max_tokens_per_gpu: int = setting(
        4096,
        "micro-batch token budget (real tokens per forward/backward on one GPU): larger micro-batches run the GPU "
        "closer to its peak (bench/RESULTS.md measures the trainer at 8192-16384) at the cost of activation memory; "
        "the gradient is the same for any budget",
        group="optimizer",
    )
    micro_batch_size: int | None = setting(
        None,
        "samples per micro-batch at most, besides the --max-tokens-per-gpu budget (the gradient is the same for any split)",
        group="optimizer",
    )
    gradient_checkpointing: bool = setting(False, "recompute activations in backward", group="optimizer")
    gradient_checkpointing_layers: int | None = setting(
        None,
        "with --gradient-checkpointing: recompute only the first N decoder layers (default: all of them)",
        group="optimizer",
    )
    compile: bool | None = setting(
        None,
        "torch.compile each decoder layer of the trainer's model: on by default when the trainer is on CUDA. One compile serves every layer; micro-batches are padded up to one of 16 sizes, all compiled in a warm-up before step 1, so nothing compiles mid-run (speed: bench/RESULTS.md)",
        group="optimizer",
    )
    attention_kernel: str = setting(
        "auto",
        "the trainer's packed attention on CUDA: fa2 (torch's varlen FlashAttention-2), fa4 (FlashAttention-4 from the "
        "optional flash-attn-4 package, Hopper and sm100 GPUs, checked against float32 attention at load) or sdpa "
        "(one SDPA call per sequence); auto is fa4 where it is installed and passes its check (a 7-14% faster step "
        "on an H200: bench/RESULTS.md), else fa2 where it runs, else sdpa. float32 attention (CPU) is always sdpa",
        ("auto", "fa4", "fa2", "sdpa"),
        group="optimizer",
    )
    logprob_chunk_size: int = setting(
        4096,
        "tokens per chunk when log-probs are computed from hidden states: caps the logits memory at chunk x vocabulary (bf16: 2 bytes each); smaller chunks are slower (bench/RESULTS.md)",
        group="optimizer",
    )
    seed: int = setting(1234, "trainer seed", group="optimizer")
    max_bad_steps: int = setting(
        3,
        "stop the run after this many steps in a row whose rewards, advantages, loss or gradient norm were not finite (each such optimizer step is skipped)",
        group="optimizer",
    )
    # --- mixture of experts ---
    moe_aux_loss_coeff: float = setting(
        0.0,
        "weight of the routers' load-balancing loss (Switch Transformer's, summed over MoE layers: Megatron's flag and "
        "default; slime's MoE scripts pass 0), added to an MoE model's loss; logged as train/moe_aux_loss whatever "
        "its weight (1 per layer when balanced)",
        group="mixture of experts",
    )
    expert_model_parallel_size: int = setting(
        1,
        "split each MoE layer's experts over this many trainer ranks, all of them (Megatron's expert parallelism): "
        "each rank holds experts / N of every layer, tokens reach them by all-gather and come back by "
        "reduce-scatter; everything else is FSDP2 over the ranks. 1: FSDP2 shards the experts like any weight",
        group="mixture of experts",
    )
    # --- derived ---
    steps_per_rollout: int = setting(
        1,
        "optimizer steps per rollout batch (rollout batch size × samples per prompt / --global-batch-size): the policy "
        "version advances by this much per step",
        group=DERIVED,
    )


@dataclass
class EvalConfig(Component):
    """Held-out evaluation: when, on which sets (`eval_sets`, resolved at validation), and the
    sampling and grading settings a set may override."""

    # --- evaluation, checkpoints, logging ---
    eval_interval: int | None = setting(
        None, "evaluate every K steps (and before the first and after the last)", group="eval and output"
    )
    eval_prompt_data: list | None = setting(
        None,
        "held-out prompts (JSONL/Parquet, path@[a:b]): PATH, or slime's NAME PATH pairs, one pair per set (NAME PATH NAME PATH ...)",
        group="eval and output",
        nargs="+",
        sep=None,
    )
    eval_name: str | None = setting(None, "name of a held-out set given as a lone PATH", group="eval and output")
    eval_config: str | None = setting(
        None,
        "slime's eval YAML: several held-out sets, each with its own limit, sampling and rm type (docs/slime-flags.md); instead of --eval-prompt-data",
        group="eval and output",
    )
    eval_input_key: str | None = setting(None, "key of the eval prompt (default: --input-key)", group="eval and output")
    eval_label_key: str | None = setting(None, "key of the eval answer (default: --label-key)", group="eval and output")
    n_samples_per_eval_prompt: int = setting(1, "responses per eval prompt (greedy when 1)", group="eval and output")
    eval_temperature: float | None = setting(
        None,
        "eval sampling temperature (default: 0, greedy, with one sample per prompt; --rollout-temperature with more)",
        group="eval and output",
    )
    eval_top_p: float | None = setting(
        None, "eval nucleus mass (default: 1 when greedy, --rollout-top-p otherwise)", group="eval and output"
    )
    eval_top_k: int | None = setting(
        None, "eval top-k, -1 or 0 off (default: off when greedy, --rollout-top-k otherwise)", group="eval and output"
    )
    eval_rm_type: str | None = setting(
        None,
        "grade eval by this built-in rm type's rule (its acc) (default: math's answer reading, exact's with --rm-type exact)",
        group="eval and output",
    )
    skip_eval_before_train: bool = setting(
        False, "with --eval-interval: no evaluation before the first step", group="eval and output"
    )
    eval_max_response_len: int | None = setting(
        None, "max new tokens in eval (default: --rollout-max-response-len)", group="eval and output"
    )
    eval_limit: int | None = setting(None, "evaluate on the first N eval prompts only", group="eval and output")
    eval_sets: list = setting(
        [],
        "every held-out set and the settings it overrides, from --eval-config or --eval-prompt-data (vime/eval_sets.py)",
        group=DERIVED,
    )

    def rule(self, rm_type: str) -> str:
        """The rule held-out answers are graded by: the set's own rm type; else the run's (`rm_type`,
        --rm-type) where it is a rule of its own kind (`exact`: a list in full, on its last line;
        a multiple-choice type: the option letter); else math's (boxed, Answer:, trailing number),
        the held-out metric's reading for every other rm type."""
        from vime.rollout.rewards.grading import BUILTIN_RM_TYPES

        if self.eval_rm_type:
            return self.eval_rm_type
        own = BUILTIN_RM_TYPES.get(rm_type)
        return rm_type if own is not None and (own.exact or own.choice) else "math"


@dataclass
class OutputConfig(Component):
    """What a run writes: checkpoints, its directory and name, TensorBoard and W&B, the console."""

    save: str | None = setting(None, "checkpoint directory", group="eval and output")
    save_interval: int | None = setting(None, "save every K steps (and at the end)", group="eval and output")
    load: str | None = setting(
        None,
        "resume from this checkpoint directory (the newest intact step inside it), or from one <step>/ directory of it",
        group="eval and output",
    )
    overwrite_save: bool = setting(
        False,
        "let --save name a directory that already holds checkpoints (another run's, or ones newer than the step "
        "--load resumes): each is replaced when this run saves the same step, the others stay, and a later --load "
        "resumes from the newest of all. Without it such a run is refused at start-up",
        group="eval and output",
    )
    run_name: str | None = setting(None, "run name (default: timestamp)", group="eval and output")
    runs_dir: str = setting("runs", "where runs/<name>/ is written", group="eval and output")
    use_tensorboard: bool = setting(
        True, "write TensorBoard events when tensorboard is installed", group="eval and output"
    )
    tb_project_name: str | None = setting(
        None,
        "TensorBoard events where slime writes them instead of the run directory: $TENSORBOARD_DIR when set, else tensorboard_log/<this>/<--tb-experiment-name>",
        group="eval and output",
    )
    tb_experiment_name: str | None = setting(
        None, "with --tb-project-name: the events' directory name (default: the run name)", group="eval and output"
    )
    use_wandb: bool = setting(
        False, "log every metric to Weights & Biases too (pip install 'vime[wandb]')", group="eval and output"
    )
    wandb_project: str | None = setting(None, "W&B project (default: vime)", group="eval and output")
    wandb_team: str | None = setting(None, "W&B entity (team or user)", group="eval and output")
    wandb_group: str | None = setting(None, "W&B run group", group="eval and output")
    wandb_run_id: str | None = setting(
        None, "W&B run id: the same id resumes the same W&B run (default: the run name)", group="eval and output"
    )
    wandb_mode: str | None = setting(
        None,
        "online, offline (written to disk, no network; wandb sync uploads it later) or disabled (default: $WANDB_MODE, else online)",
        ("online", "offline", "disabled"),
        group="eval and output",
    )
    wandb_key: str | None = setting(
        None, "W&B API key (default: $WANDB_API_KEY or wandb login)", group="eval and output"
    )
    wandb_host: str | None = setting(None, "W&B server URL (a self-hosted one)", group="eval and output")
    wandb_dir: str | None = setting(
        None, "where W&B writes its files (default: the run directory)", group="eval and output"
    )
    quiet: bool = setting(
        False,
        "no progress bar or per-step lines on stderr (log.txt and metrics.jsonl still get them)",
        group="eval and output",
    )

    @property
    def run_dir(self) -> Path:
        """Where --runs-dir and --run-name put the run."""
        return Path(self.runs_dir) / (self.run_name or "run")


@dataclass
class RunFields:
    """What belongs to the run as a whole, read flat (`cfg.mode`): no component's."""

    slime_flags: dict = setting(
        {},
        "flags of the run's dialect (slime's and Megatron's: vime/compat/) vime keeps no setting of its own for, as given",
        group=PASSTHROUGH,
    )
    mode: str | None = setting(
        None,
        "sync, one-step-off, fully-async or decoupled: from the entry point, --max-staleness and --rollout-function-path",
        group=DERIVED,
    )
    custom_config: dict = setting(
        {}, "the keys of --custom-config-path that are no vime setting: attributes of args for plug-ins", group=DERIVED
    )
    # the run's live objects (engine clients, tokenizer, fully-async worker): not settings, never
    # written or pickled; slime's rollout signatures pass only args, so this is how the run hands
    # them to rollout and generate functions
    runtime: Any = field(
        default=None, repr=False, compare=False, metadata={"help": "", "choices": None, "group": RUNTIME}
    )
    # the framework whose flags and plug-in names the run also takes (vime/dialect.py; slime's is
    # vime.compat.SLIME, handed in by the entry points): not a setting, kept through pickles
    dialect: Any = field(
        default=None, repr=False, compare=False, metadata={"help": "", "choices": None, "group": RUNTIME}
    )
