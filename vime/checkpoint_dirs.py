"""The --load and --save directories, read before anything starts: the checkpoint a run resumes
from (or why it starts afresh, or a one-line refusal naming what the directory holds), and the
checkpoints a --save would write over. `vime train` reads --load before it locks --save."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from vime.config import ConfigError
from vime.models import torch_dist_refusal


def resume_point(args: Any) -> tuple[Path | None, list[str]]:
    """What --load names, read only: (the checkpoint the run resumes from, or None to start from
    --hf-checkpoint; notes for the log). `vime train` calls it before it locks --save as well,
    so a directory it refuses (a Megatron checkpoint given as --load and --save) gets nothing.

    `--load CK/3` (a step, not its parent) and `--load` of a Megatron checkpoint were both taken
    for an empty directory: the run started from the base model and saved over what was there.
    Now --load resumes from what it names or is refused in one line; only a directory that is
    new or empty starts a run afresh (slime's `--load X --save X` on a first run)."""
    from vime.trainer.checkpoint import checkpoint_to_load, is_step_checkpoint, problem

    if not args.output.load:
        return None, []
    load = Path(args.output.load)
    if load.exists() and not load.is_dir():  # it was taken for an empty directory: the run started afresh
        raise ConfigError(
            f"--load {load} is a file: give the --save directory of a vime run or one of its <step>/ directories"
        )
    ckpt = checkpoint_to_load(load, warn=False)
    if is_step_checkpoint(load):
        if ckpt is None:
            raise ConfigError(
                f"--load {load} is a damaged checkpoint ({problem(load)}): pass its parent {load.parent} to resume "
                "from the newest intact one"
            )
        return ckpt, [f"--load {load} is the checkpoint of step {load.name}: resuming from that step"]
    if ckpt is None:
        _nothing_to_resume(load, args.rollout.hf_checkpoint)
        return None, [
            f"--load {load} holds no checkpoint yet: starting from --hf-checkpoint {args.rollout.hf_checkpoint}"
        ]
    return ckpt, []


def _nothing_to_resume(load: Path, base: str | None) -> None:
    """--load names no checkpoint vime can resume from: fine for a directory that is new or empty
    (hidden files, such as the lock of the run that made it, and the debris of an interrupted save
    aside); anything else is refused, naming what is there."""
    from vime.trainer.checkpoint import checkpoint_steps, foreign_checkpoint

    if checkpoint_steps(load):
        raise ConfigError(
            f"--load {load}: no intact checkpoint inside (expected <step>/trainer_state.pt and the model's safetensors)"
        )
    if line := torch_dist_refusal("--load", load, base, "--hf-checkpoint (and --load/--save a new directory)"):
        raise ConfigError(line)  # its weights start a run as an HF directory
    foreign = foreign_checkpoint(load)
    if foreign:
        raise ConfigError(
            f"--load {load} holds a Megatron/slime checkpoint ({', '.join(foreign[:3])}), which vime cannot resume: "
            "vime resumes from its own --save directories; give its weights as an HF directory to --hf-checkpoint "
            "and --load/--save a new directory"
        )
    found = (
        sorted(
            p.name for p in load.iterdir() if not p.name.startswith(".") and not re.fullmatch(r"\d+\.(tmp|old)", p.name)
        )
        if load.is_dir()
        else []
    )
    if found:
        raise ConfigError(
            f"--load {load} holds no vime checkpoint (found {', '.join(found[:3])}{', ...' if len(found) > 3 else ''}): "
            "give the --save directory of a vime run or one of its <step>/ directories (an HF model goes to --hf-checkpoint)"
        )


def check_save(save: Path, ckpt: Path | None, overwrite: bool) -> list[str]:
    """A --save that already held checkpoints (of this run or another) had them replaced one by
    one as the run reached their steps, unsaid. Now a --save whose checkpoints this run would
    write over is refused in one line: any, unless it is the directory the run resumes from;
    there, any whole one newer than the step resumed (`--load CK/3` with CK/5 there; a damaged
    one, which the resume skipped, is replaced as before). --overwrite-save lets them all be
    replaced, and the log says which."""
    from vime.trainer.checkpoint import checkpoint_steps, problem

    steps = checkpoint_steps(save)
    resuming_here = ckpt is not None and save.resolve() == ckpt.parent.resolve()
    at_risk = (
        sorted(s for s in steps if s > int(ckpt.name) and problem(steps[s]) is None) if resuming_here else sorted(steps)
    )
    if not at_risk:
        return []
    listed = ", ".join(map(str, at_risk[:5])) + (", ..." if len(at_risk) > 5 else "")
    if overwrite:
        return [
            f"--overwrite-save: the checkpoints of steps {listed} in --save {save} are replaced as this run saves those steps"
        ]
    if resuming_here:
        raise ConfigError(
            f"--load {ckpt} resumes from step {ckpt.name}, and --save {save} holds newer checkpoints (steps {listed}) this "
            f"run would overwrite: resume from the newest with --load {save}, pick another --save, or pass --overwrite-save"
        )
    raise ConfigError(
        f"--save {save} already holds checkpoints (steps {listed}) this run would overwrite: resume them with "
        f"--load {save}, pick another --save, or pass --overwrite-save to replace them"
    )
