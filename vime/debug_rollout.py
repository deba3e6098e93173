"""Debugging one side without the other (slime's flags): save each rollout, train on saved
rollouts with no engine, or generate with no trainer.

`--save-debug-rollout-data PATH` writes every rollout the trainer receives (after any dynamic
sampling) to `PATH.format(rollout_id=N)`: its samples, flat and in batch order, each with
everything the trainer reads (tokens, masks, the engine's log-probs and weight versions,
temperature, reward), and the rollout's metrics. `--load-debug-rollout-data PATH` reads them back
in place of generating (and turns on `--debug-train-only`: no engine is started, nothing is
pushed, nothing evaluated), so a step trained from a saved rollout computes exactly what the
step that generated it computed: the same weights, bit for bit, where the trainer is
deterministic (tests/test_debug_rollout.py). `--debug-rollout-only` starts no trainer: engines
with the starting weights generate, rewards score, metrics and saved rollouts are written.

The file is `torch.save` of plain values (loaded with weights_only), slime's layout: a dict with
`rollout_id` and `samples` (a list of sample dicts), plus vime's `metrics`.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch

from vime.rollout.data_source import DataError
from vime.rollout.types import RolloutOutput, Sample, Status

_FIELDS = {f.name for f in dataclasses.fields(Sample)}


def debug_path(template: str, rollout_id: int) -> Path:
    return Path(template.format(rollout_id=rollout_id))


def save_rollout(template: str, rollout_id: int, out: RolloutOutput) -> Path:
    """Write one rollout; the file appears whole or not at all (a run stopped mid-write leaves no
    half file that a train-only run would read as a short batch)."""
    path = debug_path(template, rollout_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    samples = [{**dataclasses.asdict(s), "status": s.status.value} for g in out.samples for s in g]
    tmp = path.with_name(path.name + ".tmp")
    torch.save({"rollout_id": rollout_id, "samples": samples, "metrics": dict(out.metrics)}, tmp)
    try:  # what cannot be read back (a custom generate's metadata of other types) fails now, not at replay
        torch.load(tmp, weights_only=True)
    except Exception as e:
        tmp.unlink(missing_ok=True)
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DataError(
            f"--save-debug-rollout-data: rollout {rollout_id}'s samples hold values a saved rollout cannot keep "
            f"({first}); keep Sample.metadata to plain types (str, numbers, lists, dicts)"
        ) from None
    tmp.replace(path)
    return path


def load_rollout(template: str, rollout_id: int, n_per_prompt: int, n_groups: int | None = None) -> RolloutOutput:
    """One saved rollout back as groups (consecutive samples of one group index). Keys a sample
    dict has that vime's Sample does not (a file of another version) are left out."""
    path = debug_path(template, rollout_id)
    flag = "--load-debug-rollout-data"
    if not path.is_file():
        raise DataError(f"{flag}: no saved rollout {rollout_id} at {path} (saved by --save-debug-rollout-data)")
    try:
        data: dict[str, Any] = torch.load(path, weights_only=True)
        samples = [
            Sample(**{**{k: v for k, v in d.items() if k in _FIELDS}, "status": Status(d["status"])})
            for d in data["samples"]
        ]
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise DataError(f"{flag}: {path} is not a saved rollout ({type(e).__name__}: {first})") from None
    groups: list[list[Sample]] = []
    for s in samples:
        if groups and groups[-1][0].group_index == s.group_index:
            groups[-1].append(s)
        else:
            groups.append([s])
    if any(len(g) != n_per_prompt for g in groups):
        raise DataError(
            f"{flag}: {path} holds groups of {sorted({len(g) for g in groups})} samples, "
            f"this run's --n-samples-per-prompt is {n_per_prompt}: train with the settings it was saved with"
        )
    if n_groups is not None and len(groups) != n_groups:
        raise DataError(
            f"{flag}: {path} holds {len(groups)} groups, this run's --rollout-batch-size is {n_groups}: "
            "train with the settings it was saved with"
        )
    return RolloutOutput(samples=groups, metrics=dict(data.get("metrics", {})))
