"""Every input checked before anything starts.

A run used to find a bad `--custom-generate-function-path`, a missing eval file, a read-only
`--save` or a prompt too long for the model only when it reached them: after the engines had
started, after steps had trained, or hours in when the row came up. `check_inputs` reads and
checks all of them first, each failure one line naming the flag, file or row and the fix, and
hands the run what it built on the way (tokenizer, rollout function, data source), so nothing
is read twice. It is also where the values only the inputs tell are found: the directory
--hf-checkpoint resolves to (`model_dir`), --num-epoch's rollouts, a --load with nothing to
resume. They go into a new config (`Config.derived`), the run's from then on; the one passed
in is never written. It writes nothing but a probe file in the output directories.
"""

from __future__ import annotations

import copy
import math
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vime.backends import BACKENDS
from vime.checkpoint_dirs import check_save, resume_point
from vime.config import Config, ConfigError, RolloutConfig, TrainerConfig
from vime.config.checks_train import inert_flags
from vime.config.mode_inert import mode_inert_flags
from vime.debug_rollout import check_template
from vime.dialect import dialect_of
from vime.eval_sets import args_for
from vime.models import ModelError, context_length, load_tokenizer, parameter_count, read_config, resolve_model
from vime.plugin_args import PluginArgs
from vime.plugin_checks import check_plugins
from vime.plugins import load_function
from vime.rollout.data.prompts import load_eval_samples
from vime.rollout.data.source import DataSource
from vime.rollout.filters import load_filter
from vime.rollout.rewards import Rewards
from vime.sinks import check_sinks


@dataclass
class Inputs:
    """What the checks built, for the run to use."""

    cfg: Config  # the settings with the values found here (model_dir, num_rollout, load)
    tokenizer: Any
    rollout_fn: Callable
    data_source: DataSource
    rewards: Rewards  # its pool starts at the first sample; the run closes it
    notes: list[str] = field(default_factory=list)  # warnings to log once the run's log exists
    custom_advantages: Callable | None = None  # --custom-advantage-function-path
    seconds: list[tuple[str, float]] = field(default_factory=list)  # what each check took, for the start-up line


def check_inputs(args: Config) -> Inputs:
    """Check output directories, model, plug-ins and data, in that order (cheapest first). Each
    check reads the component its settings belong to (`args.output`, `args.rollout`, ...); a value
    found on the way makes a new config, whose components are read again."""
    seconds: list[tuple[str, float]] = []
    last = time.monotonic()

    def took(name: str) -> None:  # the checks' own split of the start-up line's `checks`
        nonlocal last
        now = time.monotonic()
        seconds.append((name, now - last))
        last = now

    args, ckpt, notes = _outputs(args)
    took("outputs")
    args, tokenizer = _model(args)
    took("tokenizer")
    model_dir = Path(args.rollout.model_dir)
    if ckpt is not None:
        _resumable(args, ckpt, model_dir)
    if not args.rollout.debug_train_only:  # SFT and saved rollouts start no engine
        _engines_run(args, model_dir)
    _responses_fit(args, model_dir, training=True)
    _check_model_flags(args, model_dir)
    if args.trainer.lora_rank:
        _check_lora(args.trainer, model_dir)
    if args.output.save:
        _room_for_checkpoints(Path(args.output.save), model_dir, args.trainer)

    took("model")
    rewards = Rewards(args)
    _load_plugins(args)
    took("plug-ins loaded")
    max_prompt_len = context_length(model_dir) - 1  # room for at least one response token
    args, data_source = _data(args, tokenizer, max_prompt_len)
    if ckpt is not None:
        done, num_rollout = int(ckpt.name), args.rollout.num_rollout
        if done >= num_rollout:
            raise ConfigError(
                f"--load {args.output.load} resumes after step {done}, and this run ends at step {num_rollout} "
                f"(--num-rollout/--num-epoch): nothing is left to train; raise it above {done}"
            )
    if data_source.skipped_note:
        notes.append(data_source.skipped_note)
    ro = args.rollout
    # trained on: not with --debug-rollout-only (no trainer), nor samples saved by another run
    if data_source.longest_row is not None and not ro.debug_rollout_only and ro.load_debug_rollout_data is None:
        _check_lengths(args, model_dir, data_source.longest_row)
    _check_eval_sets(args, tokenizer, max_prompt_len)
    took("data")
    # every plug-in called as the run calls it, on made-up input (vime/plugin_checks.py), handed
    # what the run hands them: a read-only view of the settings, over a frozen copy of them here
    # (nothing a plug-in does reaches the run's config)
    view = PluginArgs(copy.copy(args).freeze(), None)
    rewards.args = view
    checked = check_plugins(view, tokenizer, data_source, rewards)
    notes += checked.notes
    took("plug-ins called")
    return Inputs(args, tokenizer, checked.rollout_fn, data_source, rewards, notes, checked.custom_advantages, seconds)


def _outputs(args: Config) -> tuple[Config, Path | None, list[str]]:
    """What --load resumes (without a checkpoint, the config without --load), the output
    directories and debug-rollout paths writable, --save's checkpoints safe from this run; the
    notes for the log (the foreign flags' and the sinks' too)."""
    ckpt, notes = resume_point(args)
    if ckpt is None:
        args = args.derived(load=None)  # nothing to resume: the run starts from --hf-checkpoint (said in a note)
    out = args.output
    _writable(Path(out.runs_dir), "--runs-dir")
    if out.save:
        _writable(Path(out.save), "--save")
        notes += check_save(Path(out.save), ckpt, out.overwrite_save)
    _debug_rollout_paths(args.rollout)
    notes += startup_notes(args) + check_sinks(out)
    return args, ckpt, notes


def startup_notes(args: Config) -> list[str]:
    """What start-up says of the flags: the dialect's lines on its own flags (vime/compat/:
    slime's), one line of every flag given with no effect (vime's own, those this run's mode
    leaves unread, and the dialect's), and what --custom-config-path set."""
    lines, foreign_inert = dialect_of(args).notes(args)
    inert = [*inert_flags(args), *mode_inert_flags(args), *foreign_inert]
    if inert:
        lines.append("flags with no effect in vime: " + "; ".join(inert))
    if args.rollout.custom_config_path:
        extras = ", ".join(args.custom_config) or "none"
        lines.append(
            f"--custom-config-path {args.rollout.custom_config_path}: its settings override the flags (config.yaml has the "
            f"result); its other keys, attributes of args for plug-ins: {extras}"
        )
    return lines


def _load_plugins(args: Config) -> None:
    """Every plug-in path the settings name, loaded: a bad path fails here, before any model.
    Each is tried on made-up input once the data is read (`check_plugins`); the loss's hooks are
    loaded again where the actor builds its objective."""
    ro, al = args.rollout, args.algorithm
    load_function(ro.rollout_function_path, "--rollout-function-path")
    if ro.custom_generate_function_path:
        load_function(ro.custom_generate_function_path, "--custom-generate-function-path")
    load_filter(args)  # a dynamic sampling filter that cannot load fails here, before any model
    for path, flag in (
        (al.custom_advantage_function_path, "--custom-advantage-function-path"),
        (al.custom_loss_function_path, "--custom-loss-function-path"),
        (al.custom_tis_function_path, "--custom-tis-function-path"),
    ):
        if path:
            load_function(path, flag)


def _data(args: Config, tokenizer: Any, max_prompt_len: int) -> tuple[Config, DataSource]:
    """The data source (SFT's reads conversations, not prompts: vime/rollout/sft_rollout.py),
    and the config with --num-epoch's rollouts once the data's size is known (the LR schedule
    needs them)."""
    ro = args.rollout
    if ro.sft_rollout:
        from vime.rollout.sft_rollout import ConversationSource

        data_source: DataSource = ConversationSource(ro, tokenizer, max_prompt_len=max_prompt_len)
    else:
        data_source = DataSource(ro, tokenizer, max_prompt_len=max_prompt_len)
    if ro.num_rollout is None:
        args = args.derived(num_rollout=math.ceil(ro.num_epoch * len(data_source) / ro.rollout_batch_size))
    return args, data_source


def _resumable(args: Config, ckpt: Path, model_dir: Path) -> None:
    """The checkpoint --load resumes, every key and shape against the model (a crafted or damaged
    one failed in the trainer, after the engines started), and of this kind of run."""
    from vime.trainer.checkpoint_check import check_checkpoint

    check_checkpoint(ckpt, model_dir, lora=bool(args.trainer.lora_rank))
    _same_kind_of_run(args.output.load, ckpt, args.algorithm.loss_type)


def _same_kind_of_run(load: str, ckpt: Path, loss_type: str) -> None:
    """An SFT run resumes only an SFT run's checkpoint, an RL run only an RL run's: the other's
    data position and optimizer state would be read into this run. Its weights start a run of the
    other kind through --hf-checkpoint (the checkpoint is an HF directory)."""
    from vime.trainer.checkpoint import loss_type as loss_type_of

    was_sft, is_sft = loss_type_of(ckpt) == "sft_loss", loss_type == "sft_loss"
    if was_sft != is_sft:
        kind = {True: "an SFT", False: "an RL"}
        raise ConfigError(
            f"--load {load}: {ckpt} is a checkpoint of {kind[was_sft]} run, and this is {kind[is_sft]} run: "
            f"start from its weights with --hf-checkpoint {ckpt} instead"
        )


def _debug_rollout_paths(ro: RolloutConfig) -> None:
    """--save-/--load-debug-rollout-data templates that format, and a writable directory for
    the saved ones: the first save or load would otherwise fail after the engines started."""
    for template, flag in (
        (ro.save_debug_rollout_data, "--save-debug-rollout-data"),
        (ro.load_debug_rollout_data, "--load-debug-rollout-data"),
    ):
        if template:
            where = check_template(template, flag)
            if template == ro.save_debug_rollout_data:
                _writable(where, flag)


def check_eval_inputs(args: Config) -> tuple[Config, Any]:
    """What `vime eval` reads, checked before an engine starts; returns the config with its
    `model_dir` and the tokenizer."""
    args, tokenizer = _model(args)
    model_dir = Path(args.rollout.model_dir)
    _engines_run(args, model_dir)
    _responses_fit(args, model_dir, training=False)
    _check_model_flags(args, model_dir)
    _check_eval_sets(args, tokenizer, context_length(model_dir) - 1)
    return args, tokenizer


def _check_eval_sets(args: Any, tokenizer: Any, max_prompt_len: int) -> None:
    """Each held-out set's prompts read as its evaluation will read them (its keys, its limit)."""
    for eval_set in args.eval.eval_sets:
        a = args_for(args, eval_set)
        _stop_ids_in_vocabulary(
            a.rollout.rollout_stop_token_ids, f"eval set {eval_set['name']}: stop_token_ids", tokenizer
        )
        load_eval_samples(a, tokenizer, eval_set["path"], limit=a.eval.eval_limit, max_prompt_len=max_prompt_len)


def _model(args: Config) -> tuple[Config, Any]:
    """The config with the directory --hf-checkpoint resolves to as its `model_dir`, and that
    model's tokenizer."""
    model_dir = str(resolve_model(args.rollout.hf_checkpoint))
    try:
        tokenizer = load_tokenizer(model_dir)
    except (OSError, ValueError) as e:
        raise ModelError(
            f"cannot load the tokenizer of {model_dir} ({type(e).__name__}: {' '.join(str(e).split())[:200]})"
        ) from None
    _stop_ids_in_vocabulary(args.rollout.rollout_stop_token_ids, "--rollout-stop-token-ids", tokenizer)
    return args.derived(model_dir=model_dir), tokenizer


def _stop_ids_in_vocabulary(ids: list[int], where: str, tokenizer: Any) -> None:
    """An id past the vocabulary is no token the model can sample: answers never stopped on it, unsaid."""
    outside = [t for t in ids if t >= len(tokenizer)]
    if outside:
        raise ConfigError(
            f"{where} {outside[0]}: the model's vocabulary has {len(tokenizer)} tokens (ids 0 to "
            f"{len(tokenizer) - 1}); give ids of its tokens"
        )


def _engines_run(args: Config, model_dir: Path) -> None:
    """The engines the run starts can run the model (the built-in engine's architectures): one
    they could not passed every check and died at start, its traceback shown."""
    pl = args.placement
    backend = BACKENDS[pl.rollout_backend]
    if pl.rollout_engine_urls or backend.check_model is None:  # engines given by URL already run theirs
        return
    why = backend.load(backend.check_model)(model_dir)
    if why is not None:
        raise ModelError(
            f"--hf-checkpoint {args.rollout.hf_checkpoint}: {why}; --rollout-backend {pl.rollout_backend} cannot "
            "generate with it (another --rollout-backend may)"
        )


def _responses_fit(args: Config, model_dir: Path, training: bool) -> None:
    """The longest response asked for (training's, and each held-out set's) below the context: one
    that is not can never be reached, and 10,000,000 on a 512-token model was taken unsaid (the
    token-sum normalizer of the loss reads it too)."""
    context = context_length(model_dir)  # --rollout-max-context-len below it may cut responses: its purpose
    asked = [("--rollout-max-response-len", args.rollout.rollout_max_response_len)] if training else []
    held_out = args.eval.eval_sets if args.eval.eval_interval or not training else []  # sets named, none run: as slime
    for eval_set in held_out:
        name = f" (eval set {eval_set['name']})" if eval_set["name"] else ""
        asked.append((f"--eval-max-response-len{name}", args_for(args, eval_set).eval.eval_max_response_len))
    for flag, n in asked:
        if n is not None and n >= context:
            raise ConfigError(
                f"{flag} {n} is not below the model's context (config.json) of {context} tokens: a response has at most "
                f"{context - 1} (after a prompt of one token); lower it"
            )


def _check_model_flags(args: Config, model_dir: Path) -> None:
    """slime's model-shape and parallel flags (read by vime/compat/ from the flat config, where
    they are) against the checkpoint, the reference model and the OPD teacher."""
    gpu_bytes = None
    if args.placement.device != "cpu":
        import torch

        if torch.cuda.is_available():
            gpu_bytes = torch.cuda.get_device_properties(0).total_memory
    from vime.trainer.moe import moe_refusal

    refusals = [
        *dialect_of(args).check_model(args, model_dir, read_config, gpu_bytes),
        moe_refusal(read_config(model_dir), str(model_dir), args.trainer, args.algorithm),
    ]
    if refusals[0]:
        raise ConfigError(refusals[0])
    al = args.algorithm
    if al.ref_load and al.kl_loss_coef > 0:
        ref = Path(al.ref_load)
        if not (ref / "config.json").exists():
            from vime.models import torch_dist_refusal

            what = "not an HF model (no config.json)" if ref.is_dir() else "not a directory"
            instead = "--ref-load (or leave --ref-load out when it is --hf-checkpoint's model)"
            raise ConfigError(
                torch_dist_refusal("--ref-load", ref, args.rollout.hf_checkpoint, instead)
                or f"--ref-load {ref} is {what}: vime reads the reference model from an HF directory; pass the HF "
                "model it was converted from, or leave --ref-load out to use --hf-checkpoint"
            )
        resolve_model(str(ref))
    if al.use_opd and al.opd_teacher_load:
        from vime.trainer.teacher import check_teacher

        resolve_model(str(check_teacher(al, model_dir)))


def _check_lengths(args: Config, model_dir: Path, longest_row: int) -> None:
    """The longest sequence this run can train on, its longest prompt with a full response (an
    SFT conversation as it is) within the context, against each model that scores it: a windowed
    or dynamic-RoPE model refuses a sequence it would score under other attention or RoPE
    (`length_limits`), and that refusal comes now, not when the first such sample arrives hours
    in. (A custom rollout function's longer samples still meet it at the trainer.)"""
    from transformers import AutoConfig

    from vime.trainer.model import length_limits
    from vime.trainer.teacher import teacher_dir

    ro, al = args.rollout, args.algorithm
    if ro.sft_rollout:
        longest, how = longest_row, f"the longest conversation of --prompt-data is {longest_row} tokens"
    else:
        context = ro.rollout_max_context_len or context_length(model_dir)
        longest = min(context, longest_row + ro.rollout_max_response_len)
        how = (
            f"the longest prompt of --prompt-data ({longest_row} tokens) with --rollout-max-response-len "
            f"{ro.rollout_max_response_len} makes up to {longest} tokens"
        )
    models: list[tuple[str, Path]] = [("--hf-checkpoint", model_dir)]
    if al.ref_load and al.kl_loss_coef > 0:
        models.append(("--ref-load", resolve_model(al.ref_load)))
    if al.use_opd and al.opd_teacher_load:
        models.append(("--opd-teacher-load", teacher_dir(al)))
    for flag, path in models:
        try:
            config = AutoConfig.from_pretrained(path)
        except (OSError, ValueError) as e:  # the trainer loads every model it scores with transformers
            raise ModelError(
                f"{flag} {path}: transformers cannot read its config ({type(e).__name__}: "
                f"{' '.join(str(e).split())[:200]}), and the trainer loads it with transformers"
            ) from None
        try:
            length_limits(config, longest)
        except ModelError as e:
            raise ConfigError(f"{flag} {path}: {how}, and {e}") from None


def _check_lora(trainer: TrainerConfig, model_dir: Path) -> None:
    """The LoRA flags against the model's layers (`lora.lora_targets`), on the model built on the
    meta device: no weights read, and a rank wider than a layer fails before the run starts."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from vime.trainer.lora import LoraSpec, lora_targets

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    try:
        lora_targets(model, LoraSpec.of(trainer))
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _writable(path: Path, flag: str) -> None:
    """Make the directory if need be and write a probe file in it."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".vime-probe-"):
            pass
    except OSError as e:
        raise ConfigError(
            f"{flag} {path} is not writable ({e.strerror or e}): pick a directory you can write to"
        ) from None


def _room_for_checkpoints(save: Path, model_dir: Path, trainer: TrainerConfig) -> None:
    """A checkpoint holds the float32 master weights (4 bytes a parameter, whatever the model's
    files hold: a bf16 model's checkpoint is twice its files before any optimizer state) and the
    optimizer's state of what trains: AdamW's two moments (8 more), SGD's momentum (4); a LoRA
    run's adapters are small beside the model. A disk without room for one fails now, not at the
    first save after hours of steps."""
    state = 0 if trainer.lora_rank else 8 if trainer.optimizer == "adam" else 4 * (trainer.sgd_momentum > 0)
    need = parameter_count(model_dir) * (4 + state)
    free = shutil.disk_usage(save).free
    if free < need:
        raise ConfigError(
            f"--save {save} has {free / 2**30:.2f} GiB free, a checkpoint of this model takes about {need / 2**30:.2f} GiB: free some space or pick another directory"
        )
