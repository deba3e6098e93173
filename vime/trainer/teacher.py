"""The OPD teacher's weights (`--use-opd`, vime/algorithms/opd.py): which directory the trainer
loads the frozen teacher from (an HF model, or a checkpoint of a vime run's `--save` directory,
read as vime/trainer/checkpoint.py writes them), and start-up's check that it scores the
student's token ids."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from vime.errors import ConfigError
from vime.models import load_tokenizer, read_config, table_fits, torch_dist_refusal, vocab_size_of
from vime.trainer.checkpoint import checkpoint_steps, latest_checkpoint, problem

if TYPE_CHECKING:
    from vime.algorithms.settings import AlgorithmConfig


def teacher_dir(algo: AlgorithmConfig) -> Path:
    """The HF directory the teacher loads from: `--opd-teacher-load` itself when it is one (an HF
    model, or one `<step>/` checkpoint of a vime run), else the `--opd-teacher-ckpt-step` step of
    that vime `--save` directory, or its newest whole checkpoint."""
    load = Path(algo.opd_teacher_load).expanduser()
    step = algo.opd_teacher_ckpt_step
    if not load.is_dir():
        raise ConfigError(f"--opd-teacher-load {load} is not a directory: give the teacher's HF model directory")
    if step is not None:
        ckpt = checkpoint_steps(load).get(step)
        if ckpt is None:
            held = sorted(checkpoint_steps(load))
            raise ConfigError(
                f"--opd-teacher-ckpt-step {step}: {load} holds no step {step} (steps: {held or 'none'}): "
                "give one of them, or drop the flag for the newest"
            )
        why = problem(ckpt)
        if why is not None:
            raise ConfigError(f"--opd-teacher-ckpt-step {step}: {ckpt} is damaged ({why}): give another step")
        return ckpt
    if (load / "config.json").exists():
        return load
    newest = latest_checkpoint(load, warn=False)
    if newest is None:
        raise ConfigError(
            torch_dist_refusal("--opd-teacher-load", load, None, "--opd-teacher-load")
            or f"--opd-teacher-load {load} holds neither an HF model (config.json) nor a whole vime checkpoint: "
            "give the teacher's HF directory or the --save directory of the run that trained it"
        )
    return newest


def check_teacher(algo: AlgorithmConfig, student_dir: str | Path) -> Path:
    """The teacher's directory, refused in one line when it cannot score the student's token ids,
    which in another vocabulary mean other tokens: its tokenizer must be the student's (compared
    token by token where its directory has one, else by `table_fits`), and its embedding table at
    least as large as the student's, whose every row's id the student can draw (a table padded to
    more rows is the same vocabulary). Start-up's check calls it with the run's `cfg.algorithm`."""
    path = teacher_dir(algo)
    theirs, ours = vocab_size_of(read_config(path)), vocab_size_of(read_config(student_dir))
    if theirs is None or ours is None:
        return path
    student_tokenizer, teacher_tokenizer = load_tokenizer(student_dir), _tokenizer_or_none(path)
    if teacher_tokenizer is not None:
        same = teacher_tokenizer.get_vocab() == student_tokenizer.get_vocab()
    else:
        same = table_fits(theirs, ours, len(student_tokenizer))
    if not same:
        raise ConfigError(
            f"--opd-teacher-load {path} has a vocabulary of {theirs} tokens and the student {ours}, of another "
            "tokenizer: the teacher scores the student's token ids, so it needs the student's tokenizer; give a "
            "teacher of the same family"
        )
    if theirs < ours:
        raise ConfigError(
            f"--opd-teacher-load {path} has a table of {theirs} rows and the student {ours}: a token the student "
            "draws past the teacher's rows has no teacher log-prob; give a teacher whose table is at least the "
            "student's (a larger size of the same family)"
        )
    return path


def _tokenizer_or_none(path: Path) -> Any:
    """The tokenizer in `path`, or None where it holds none (a bare weights directory)."""
    try:
        return load_tokenizer(path)
    except (OSError, ValueError):
        return None
