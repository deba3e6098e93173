"""Debugging one side without the other (slime's flags): save each rollout, train on saved
rollouts with no engine, or generate with no trainer.

`--save-debug-rollout-data PATH` writes every rollout the trainer receives (after any dynamic
sampling) to `PATH.format(rollout_id=N)`: its samples, flat and in batch order, each with
everything the trainer reads (tokens, masks, the engine's log-probs and weight versions,
temperature, reward), and the rollout's metrics. `--load-debug-rollout-data PATH` reads them back
in place of generating (and turns on `--debug-train-only`: no engine is started, nothing is
pushed, nothing evaluated), so a step trained from a saved rollout computes exactly what the
step that generated it computed: the same weights, bit for bit, where the trainer is
deterministic (tests/unit/test_debug_rollout.py). `--debug-rollout-only` starts no trainer: engines
with the starting weights generate, rewards score, metrics and saved rollouts are written.

The file is `torch.save` of plain values (loaded with weights_only), slime's layout: a dict with
`rollout_id` and `samples` (a list of sample dicts), plus vime's `metrics`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
from array import array
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from vime.config import ConfigError
from vime.plugins import first_line
from vime.rollout.data.rows import DataError
from vime.rollout.types import RolloutOutput, Sample, Status

_FIELDS = {f.name for f in dataclasses.fields(Sample)}


def debug_path(template: str, rollout_id: int) -> Path:
    return Path(template.format(rollout_id=rollout_id))


def check_template(template: str, flag: str) -> Path:
    """A path template that formats (its one placeholder is {rollout_id}, with a format spec or
    not); returns the directory every rollout's file lies in. Checked at start-up: the first
    save or load would otherwise raise Python's KeyError after the engines started."""
    try:
        first, second = debug_path(template, 0), debug_path(template, 1)
    except (KeyError, IndexError, ValueError, AttributeError) as e:
        what = (
            f"{{{e.args[0]}}} is not a placeholder vime fills"
            if isinstance(e, KeyError)
            else f"its placeholders do not format ({first_line(e)})"
        )
        raise ConfigError(
            f"{flag} {template}: {what}; the only one is {{rollout_id}} (write a literal brace as {{{{ or }}}})"
        ) from None
    common = first.parent
    while common not in second.parents:  # {rollout_id} in a directory's name: its parent
        common = common.parent
    return common


def save_rollout(template: str, rollout_id: int, out: RolloutOutput) -> Path:
    """Write one rollout; the file appears whole or not at all (a run stopped mid-write leaves no
    half file that a train-only run would read as a short batch)."""
    path = debug_path(template, rollout_id)
    samples = [{**dataclasses.asdict(s), "status": s.status.value} for g in out.samples for s in g]
    buf = io.BytesIO()
    try:  # what cannot be kept or read back (a custom generate's metadata of other types) fails now, not at replay
        torch.save({"rollout_id": rollout_id, "samples": samples, "metrics": dict(out.metrics)}, buf)
        torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DataError(
            f"--save-debug-rollout-data: rollout {rollout_id}'s samples hold values a saved rollout cannot keep "
            f"({first}); keep Sample.metadata to plain types (str, numbers, lists, dicts)"
        ) from None
    tmp = path.with_name(path.name + ".tmp")
    try:  # bytes written by Python: a full disk is an OSError that says so (torch's own writer hides it)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_bytes(buf.getvalue())
        tmp.replace(path)
    except OSError as e:
        _discard(tmp)
        raise DataError(
            f"--save-debug-rollout-data: cannot write rollout {rollout_id} to {path} ({e.strerror or e}): "
            "make room or pick another path"
        ) from None
    return path


def _discard(tmp: Path) -> None:
    """A half-written file goes, whatever the disk says (it is the one thing left to clean)."""
    with contextlib.suppress(OSError):
        tmp.unlink()


def load_rollout(
    template: str, rollout_id: int, n_per_prompt: int, n_groups: int | None = None, vocab_size: int | None = None
) -> RolloutOutput:
    """One saved rollout back as groups (consecutive samples of one group index). Keys a sample
    dict has that vime's Sample does not (a file of another version) are left out. A sample the
    trainer could not take (`check_sample`: token ids outside [0, vocab_size), per-token lists
    of the wrong length) is refused here, in one line naming it, not as an index error deep in
    the trainer."""
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
    for i, s in enumerate(samples):
        problem = check_sample(s, vocab_size)
        if problem:
            raise DataError(
                f"{flag}: {path} sample {i} (index {s.index}, group {s.group_index}) {problem}: it is not a rollout "
                "this model can train on; save it again with --save-debug-rollout-data"
            )
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


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float))


def _typed(code: str, values: Any) -> array | None:
    """`values` as an array of C type `code` ('q': int64, 'd': double), or None where one is no
    such number: array refuses a float among ints, a string, None, an int past 64 bits. A loss
    mask of bools trains as one of ints, so bools pass."""
    if not isinstance(values, list):
        return None
    try:
        return array(code, values)
    except (TypeError, OverflowError):
        return None


def check_sample(s: Sample, vocab_size: int | None) -> str | None:
    """What makes a sample untrainable, or None: what the trainer indexes with (token ids, below
    `vocab_size` where given) and the per-token lists it lines up with the response."""
    # every rollout's samples pass here before training (check_trainable): the per-value checks
    # run at C speed, by array's typed copy and min/max, not a Python loop over every token
    ids = _typed("q", s.tokens)
    if ids is None or not ids:
        return "has tokens that are not a non-empty list of ints"
    lo, hi = min(ids), max(ids)
    if lo < 0 or (vocab_size is not None and hi >= vocab_size):
        bad = [t for t in ids if t < 0 or (vocab_size is not None and t >= vocab_size)]
        where = "negative" if bad[0] < 0 else f"outside the model's vocabulary of {vocab_size}"
        return f"holds token id {bad[0]} ({where}; {len(bad)} such ids)"
    if not _is_int(s.response_length) or not 0 <= s.response_length < len(s.tokens):
        return f"has response_length {s.response_length!r} for {len(s.tokens)} tokens (a prompt and a response)"
    for name in ("loss_mask", "rollout_log_probs", "weight_versions", "teacher_log_probs"):
        values = getattr(s, name)
        if values is None:
            continue
        if isinstance(values, torch.Tensor) and values.dim() == 1 and not values.is_complex():
            values = values.tolist()  # a plug-in's tensor (slime's OPD post-process stores one)
        if not isinstance(values, list) or len(values) != s.response_length:
            n = len(values) if isinstance(values, list) else type(values).__name__
            return f"has {name} of {n} values for a response of {s.response_length} tokens"
        if _typed("d", values) is None:
            return f"has {name} values that are not numbers"
    routed = s.rollout_routed_experts
    if routed is not None and not (
        isinstance(routed, torch.Tensor)
        and routed.dim() == 2
        and not routed.is_floating_point()
        and routed.shape[0] <= len(s.tokens) - 1
    ):
        shape = list(routed.shape) if isinstance(routed, torch.Tensor) else type(routed).__name__
        return (
            f"has rollout_routed_experts {shape} for {len(s.tokens)} tokens: expected at most "
            f"{len(s.tokens) - 1} rows of expert ids"
        )
    if s.reward is not None and not _is_number(s.reward):
        return f"has reward {s.reward!r}, not a number"
    return None


def check_trainable(groups: list[list[Sample]], vocab_size: int | None, made_by: Callable[[], str]) -> None:
    """Every sample of a rollout, before the trainer packs it, held as a saved one is
    (`check_sample`): a plug-in's sample the trainer cannot index (a reward that set
    `sample.response_length = 50`, a generate's token id past the vocabulary) ended the step in an
    IndexError's traceback from inside the trainer. `made_by()`: the plug-ins that handle samples,
    asked only for a sample that fails."""
    from vime.plugins import PluginError

    for group in groups:
        for s in group:
            problem = check_sample(s, vocab_size)
            if problem:
                raise PluginError(
                    f"sample {s.index} (group {s.group_index}) {problem}, and the trainer cannot train on it: {made_by()}"
                )
