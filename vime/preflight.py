"""Every input checked before anything starts.

A run used to find a bad `--custom-generate-function-path`, a missing eval file, a read-only
`--save` or a prompt too long for the model only when it reached them: after the engines had
started, after steps had trained, or hours in when the row came up. `check_inputs` reads and
checks all of them first, each failure one line naming the flag, file or row and the fix, and
hands the run what it built on the way (tokenizer, rollout function, data source), so nothing
is read twice. It is also the one place `args.model_dir` (the directory --hf-checkpoint
resolves to) is set. It writes nothing but a probe file in the output directories.
"""

from __future__ import annotations

import math
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vime import compat
from vime.config import ConfigError
from vime.debug_rollout import check_template
from vime.metrics import check_sinks
from vime.models import ModelError, context_length, load_tokenizer, read_config, resolve_model
from vime.plugin_checks import check_plugins
from vime.plugins import load_function
from vime.rollout.data_source import DataSource, load_eval_samples
from vime.rollout.filters import load_filter
from vime.rollout.rewards import Rewards


@dataclass
class Inputs:
    """What the checks built, for the run to use."""

    tokenizer: Any
    rollout_fn: Callable
    data_source: DataSource
    rewards: Rewards  # its pool starts at the first sample; the run closes it
    notes: list[str] = field(default_factory=list)  # warnings to log once the run's log exists
    custom_advantages: Callable | None = None  # --custom-advantage-function-path


def check_inputs(args: Any) -> Inputs:
    """Check output directories, model, plug-ins and data, in that order (cheapest first)."""
    from vime.trainer.checkpoint import latest_checkpoint

    _writable(Path(args.runs_dir), "--runs-dir")
    if args.save:
        _writable(Path(args.save), "--save")
    _debug_rollout_paths(args)
    notes = compat.notes(args) + check_sinks(args)
    if args.load and not _holds_checkpoints(Path(args.load)):
        # slime's scripts pass the same directory to --load and --save: the first run starts fresh
        notes.append(f"--load {args.load} holds no checkpoint yet: starting from --hf-checkpoint {args.hf_checkpoint}")
        args.load = None
    if args.load and latest_checkpoint(Path(args.load), warn=False) is None:
        raise ConfigError(
            f"--load {args.load}: no intact checkpoint inside (expected <step>/trainer_state.pt and the model's safetensors)"
        )

    tokenizer = _model(args)
    model_dir = Path(args.model_dir)
    _check_model_flags(args, model_dir)
    if args.save:
        _room_for_checkpoints(Path(args.save), model_dir)

    rewards = Rewards(args)
    load_function(args.rollout_function_path, "--rollout-function-path")
    if args.custom_generate_function_path:
        load_function(args.custom_generate_function_path, "--custom-generate-function-path")
    load_filter(args)  # a dynamic sampling filter that cannot load fails here, before any model
    if args.custom_advantage_function_path:
        load_function(args.custom_advantage_function_path, "--custom-advantage-function-path")
    # each is tried on made-up input once the data is read (_check_plugins); here a bad path fails first.
    # The loss's hooks are loaded again where the actor builds its objective
    for path, flag in (
        (args.custom_loss_function_path, "--custom-loss-function-path"),
        (args.custom_tis_function_path, "--custom-tis-function-path"),
    ):
        if path:
            load_function(path, flag)

    max_prompt_len = context_length(model_dir) - 1  # room for at least one response token
    data_source = DataSource(args, tokenizer, max_prompt_len=max_prompt_len)
    if args.num_rollout is None:  # from --num-epoch, once the data's size is known (the LR schedule needs it)
        args.num_rollout = math.ceil(args.num_epoch * len(data_source) / args.rollout_batch_size)
    if args.load:
        done = int(latest_checkpoint(Path(args.load), warn=False).name)
        if done >= args.num_rollout:
            raise ConfigError(
                f"--load {args.load} resumes after step {done}, and this run ends at step {args.num_rollout} "
                f"(--num-rollout/--num-epoch): nothing is left to train; raise it above {done}"
            )
    if data_source.skipped_note:
        notes.append(data_source.skipped_note)
    if args.eval_prompt_data:
        load_eval_samples(args, tokenizer, args.eval_prompt_data, limit=args.eval_limit, max_prompt_len=max_prompt_len)
    # every plug-in called as the run calls it, on made-up input (vime/plugin_checks.py)
    checked = check_plugins(args, tokenizer, data_source, rewards)
    notes += checked.notes
    return Inputs(tokenizer, checked.rollout_fn, data_source, rewards, notes, checked.custom_advantages)


def _debug_rollout_paths(args: Any) -> None:
    """--save-/--load-debug-rollout-data templates that format, and a writable directory for
    the saved ones: the first save or load would otherwise fail after the engines started."""
    for template, flag in (
        (args.save_debug_rollout_data, "--save-debug-rollout-data"),
        (args.load_debug_rollout_data, "--load-debug-rollout-data"),
    ):
        if template:
            where = check_template(template, flag)
            if template == args.save_debug_rollout_data:
                _writable(where, flag)


def check_eval_inputs(args: Any) -> Any:
    """What `vime eval` reads, checked before an engine starts; returns the tokenizer."""
    tokenizer = _model(args)
    _check_model_flags(args, Path(args.model_dir))
    load_eval_samples(
        args, tokenizer, args.eval_prompt_data, limit=args.eval_limit, max_prompt_len=context_length(args.model_dir) - 1
    )
    return tokenizer


def _model(args: Any) -> Any:
    """Resolve --hf-checkpoint into `args.model_dir` and load its tokenizer."""
    args.model_dir = str(resolve_model(args.hf_checkpoint))
    try:
        return load_tokenizer(args.model_dir)
    except (OSError, ValueError) as e:
        raise ModelError(
            f"cannot load the tokenizer of {args.model_dir} ({type(e).__name__}: {' '.join(str(e).split())[:200]})"
        ) from None


def _holds_checkpoints(load: Path) -> bool:
    """A `<step>/` directory inside, intact or not (a damaged one is an error, not a fresh start)."""
    return load.is_dir() and any(p.is_dir() and p.name.isdigit() for p in load.iterdir())


def _check_model_flags(args: Any, model_dir: Path) -> None:
    """slime's model-shape and parallel flags against the checkpoint, and the reference model."""
    gpu_bytes = None
    if args.device != "cpu":
        import torch

        if torch.cuda.is_available():
            gpu_bytes = torch.cuda.get_device_properties(0).total_memory
    refusals = compat.check_model(args, model_dir, read_config, gpu_bytes)
    if refusals:
        raise ConfigError(refusals[0])
    if args.ref_load and args.kl_loss_coef > 0:
        ref = Path(args.ref_load)
        if not (ref / "config.json").exists():
            what = "a Megatron torch_dist checkpoint" if ref.is_dir() else "not a directory"
            raise ConfigError(
                f"--ref-load {ref} is {what}: vime reads the reference model from an HF directory; pass the HF "
                "model it was converted from, or leave --ref-load out to use --hf-checkpoint"
            )
        resolve_model(str(ref))


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


def _room_for_checkpoints(save: Path, model_dir: Path) -> None:
    """A checkpoint holds the weights and AdamW's two moments: at least three times the model's
    files. A disk without room for one fails now, not at the first save after hours of steps."""
    need = 3 * sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))
    free = shutil.disk_usage(save).free
    if free < need:
        raise ConfigError(
            f"--save {save} has {free / 2**30:.2f} GiB free, a checkpoint of this model takes about {need / 2**30:.2f} GiB: free some space or pick another directory"
        )
