"""The settings of evaluation, checkpoints and logging; the flags passed through to slime and vLLM;
the values validate() and the run derive; the run's live objects."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vime.config.fields import DERIVED, RUNTIME, setting


@dataclass
class OutputFields:
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
    # --- pass-through: collected by parse_args from flags vime has no field for ---
    vllm_args: dict = setting(
        {},
        "every --vllm-NAME VALUE flag as {NAME: VALUE} (True for a bare switch): the arguments of the vLLM servers vime starts",
        group="passthrough",
    )
    slime_flags: dict = setting(
        {},
        "slime/Megatron flags vime reads but keeps no setting of its own for (model shape, parallel sizes, ...), as given: see vime/compat/",
        group="passthrough",
    )
    # --- derived: set by validate() or by the run, once; not flags (config.yaml records them) ---
    mode: str | None = setting(
        None,
        "sync, one-step-off, fully-async or decoupled: from the entry point, --max-staleness and --rollout-function-path",
        group=DERIVED,
    )
    model_dir: str | None = setting(None, "the local directory --hf-checkpoint resolved to", group=DERIVED)
    eval_sets: list = setting(
        [],
        "every held-out set and the settings it overrides, from --eval-config or --eval-prompt-data (vime/eval_sets.py)",
        group=DERIVED,
    )
    custom_config: dict = setting(
        {}, "the keys of --custom-config-path that are no vime setting: attributes of args for plug-ins", group=DERIVED
    )
    # --- the run's live objects (engine clients, tokenizer, fully-async worker): not settings,
    # never written or pickled; slime's rollout signatures pass only args, so this is how the
    # run hands them to rollout and generate functions ---
    runtime: Any = field(
        default=None, repr=False, compare=False, metadata={"help": "", "choices": None, "group": RUNTIME}
    )
    # the framework whose flags and plug-in names the run also takes (vime/dialect.py; slime's is
    # vime.compat.SLIME, handed in by the entry points): not a setting, kept through pickles
    dialect: Any = field(
        default=None, repr=False, compare=False, metadata={"help": "", "choices": None, "group": RUNTIME}
    )
