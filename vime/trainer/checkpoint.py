"""Which checkpoint a resumed run loads: the newest one that is whole.

`Actor.save` writes `<dir>.tmp` and renames it only when complete, so a crash mid-save never
leaves a half-written `<step>/`. A full disk, a copy cut short or a damaged volume still can
(the issue that led here: a truncated newest checkpoint made `--load` fail with a traceback,
although an intact one sat next to it). So before loading, each candidate's files are checked
from their headers, newest first, and a damaged one is skipped with a warning naming it.
"""
from __future__ import annotations

import json
import logging
import re
import zipfile
from pathlib import Path

from vime.trainer.actor import TRAINER_STATE

log = logging.getLogger("vime")


def problem(ckpt: Path) -> str | None:
    """What is wrong with a checkpoint directory, or None if it looks whole.

    Reads headers only: each safetensors file's (a truncated one does not cover its own
    header's offsets) and the zip directory of trainer_state.pt (at the end of the file, so
    any truncation loses it). Damage in the middle of the data shows when it is loaded."""
    from safetensors import safe_open

    state = ckpt / TRAINER_STATE
    if not state.is_file():
        return f"no {TRAINER_STATE}"
    try:
        with zipfile.ZipFile(state):
            pass
    except (zipfile.BadZipFile, OSError) as e:
        return f"{TRAINER_STATE} is damaged ({e})"
    index = ckpt / "model.safetensors.index.json"
    try:
        files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else ["model.safetensors"]
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError, OSError) as e:
        return f"{index.name} is damaged ({type(e).__name__})"
    for name in files:
        try:
            with safe_open(str(ckpt / name), framework="pt"):
                pass
        except Exception as e:  # safetensors' own error type, or an OSError
            return f"{name} is damaged ({' '.join(str(e).split())[:120]})"
    return None


def latest_checkpoint(save_dir: Path, warn: bool = True) -> Path | None:
    """The newest `<step>/` in `save_dir` that is whole; each newer damaged one is named in a
    warning (`warn=False`: silently, for a check that runs before the run's log exists)."""
    steps = sorted((int(p.name) for p in save_dir.glob("*") if p.is_dir() and re.fullmatch(r"\d+", p.name)), reverse=True)
    for step in steps:
        ckpt = save_dir / str(step)
        why = problem(ckpt)
        if why is None:
            return ckpt
        if warn and (ckpt / TRAINER_STATE).exists():  # a directory that never held a checkpoint is not worth a warning
            log.warning("checkpoint %s is damaged (%s): skipped, trying the one before", ckpt, why)
    return None
