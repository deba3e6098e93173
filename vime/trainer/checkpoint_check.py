"""The checkpoint `--load` resumes from, checked against the model before anything starts.

The trainer reads `trainer_state.pt` and the model file only once the engines have started, and
a crafted or damaged one failed there with a raw traceback: a state without its optimizer
(KeyError), a list where the state should be (TypeError), optimizer moments of another shape
(inside Adam at step 1), a transposed tensor in the model file (a size mismatch); a negative
step was blamed on --global-batch-size. `check_checkpoint` reads both as plain data (the state
memory-mapped, the model file's header only) and holds every key and shape against the model
the run builds from --hf-checkpoint: one line naming the file, the key and what was expected.
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NoReturn

import numpy as np
import torch

from vime.rollout.types import Sample, Status
from vime.trainer.checkpoint import TRAINER_STATE, CheckpointError, check_same_kind, read_state
from vime.trainer.lora import ADAPTER_DIR, read_adapter
from vime.trainer.moe import MoeShape, hub_tensors

STATE_KEYS = ("optimizer", "optimizer_steps", "rng", "extra")  # what `checkpoint.save` writes
SQUARED = ("exp_avg_sq", "max_exp_avg_sq")  # Adam's second moments: their square root is taken
COUNTERS = ("policy_version", "weight_pushes", "weight_version")  # optional whole numbers in `extra`
DATA_POSITION = ("epoch", "offset", "next_index", "next_group")  # the data source's, whole numbers
Fail = Callable[[str], NoReturn]  # raises the file's CheckpointError saying what is wrong


def check_checkpoint(ckpt: Path, model_dir: Path, lora: bool) -> None:
    """CheckpointError unless `ckpt` holds what resuming the model of `model_dir` reads: its
    model file's tensors by name and shape, and a trainer state of vime's layout whose optimizer
    state fits the parameters this run trains (the adapters with `lora`)."""
    check_same_kind(ckpt, lora)
    in_file, weights, aliases = _model_shapes(model_dir)
    _check_model_file(ckpt, in_file, aliases)
    if not lora:
        _check_model_values(ckpt)
    trained = _adapter_shapes(ckpt, weights) if lora else {n: s for n, s in weights.items() if n not in aliases}
    state_file = ckpt / TRAINER_STATE
    try:
        state = read_state(state_file, mmap=True)
    except (RuntimeError, EOFError, ValueError, OSError) as e:  # torch's reader on a file it cannot parse
        raise CheckpointError(f"{state_file} cannot be read ({' '.join(str(e).split())[:160]})") from None
    fail = _failing(state_file)
    if not isinstance(state, dict):
        fail(f"holds {_kind(state)}, where vime writes a dict of optimizer, optimizer_steps, rng and extra")
    unknown = [k for k in state if k not in STATE_KEYS]
    if unknown:
        fail(f"key {unknown[0]!r} is none vime writes (its keys: {', '.join(STATE_KEYS)})")
    for key in ("optimizer", "rng", "extra"):
        if not isinstance(state.get(key), dict):
            fail(f"key '{key}' is {_kind(state.get(key))}, expected a dict")
    steps, version = state.get("optimizer_steps"), state["extra"].get("policy_version")
    if "optimizer_steps" in state and not _count(steps):
        fail(f"key 'optimizer_steps' is {steps!r}, expected a whole number >= 0")
    if steps is not None and version is not None and steps != version:  # one count, kept twice
        fail(f"key 'optimizer_steps' is {steps}, but extra['policy_version'] is {version!r}: they count the same steps")
    _check_optimizer(fail, state["optimizer"], trained)
    _check_rng(fail, state["rng"])
    _check_extra(fail, state["extra"], ckpt.name)


def _failing(path: Path) -> Fail:
    def fail(what: str) -> NoReturn:
        raise CheckpointError(f"{path}: {what}: resume from a checkpoint vime wrote (or its parent --save directory)")

    return fail


def _kind(value: Any) -> str:
    return "missing" if value is None else f"a {type(value).__name__}"


def _hyperparameter(value: Any) -> bool:
    """What an optimizer's parameter group holds besides its parameters: a number, a flag, None, or
    a tuple of numbers (Adam's betas)."""
    if isinstance(value, (tuple, list)):
        return all(isinstance(v, numbers.Real) for v in value)
    return value is None or isinstance(value, numbers.Real) or (isinstance(value, torch.Tensor) and value.numel() == 1)


def _count(value: Any) -> bool:
    """A whole number >= 0 (not a bool, not a float)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= 0


def _model_shapes(model_dir: Path) -> tuple[dict[str, tuple[int, ...]], dict[str, tuple[int, ...]], set[str]]:
    """Name → shape of every tensor the model's state dict holds, built on the meta device from
    --hf-checkpoint's config (nothing allocated): as the model file names them (a mixture of
    experts' one tensor per expert, `moe.hub_tensors`) and as the optimizer does (its parameters);
    and the names a tied weight repeats."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    every = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    aliases = every - {n for n, _ in model.named_parameters()}
    moe, params = MoeShape.of(model), model.state_dict()
    in_file = {h: tuple(t.shape) for n, p in params.items() for h, t in hub_tensors(moe, n, p)}
    return in_file, {n: tuple(t.shape) for n, t in params.items()}, aliases


def _model_files(ckpt: Path) -> list[str]:
    """The model's safetensors files: the index's, or the one file."""
    index = ckpt / "model.safetensors.index.json"
    return (
        sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else ["model.safetensors"]
    )


def _header_shapes(ckpt: Path) -> Iterator[tuple[str, str, tuple[int, ...], str]]:
    """(file, tensor name, shape, dtype) of the model's safetensors, from their headers."""
    from safetensors import safe_open

    for name in _model_files(ckpt):
        with safe_open(str(ckpt / name), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is no mapping)
                part = f.get_slice(key)
                yield name, key, tuple(part.get_shape()), part.get_dtype()


def _check_model_values(ckpt: Path) -> None:
    """Every weight finite, one tensor in memory at a time: a NaN in the model file was loaded,
    and the run ended at its first push blaming the engine that refused the weights."""
    from safetensors import safe_open

    for file in _model_files(ckpt):
        with safe_open(str(ckpt / file), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is no mapping)
                if not bool(torch.isfinite(f.get_tensor(key)).all()):
                    raise CheckpointError(
                        f"{ckpt / file}: tensor '{key}' holds NaN or inf values: the checkpoint is damaged; resume "
                        "from an earlier one"
                    )


def _check_model_file(ckpt: Path, expected: dict[str, tuple[int, ...]], aliases: set[str]) -> None:
    """Every tensor of the model file by name, shape and a floating-point dtype (a tied weight's
    alias may be absent): an int64 tensor was loaded, its values cast to the model's dtype."""
    found: set[str] = set()
    for file, name, shape, dtype in _header_shapes(ckpt):
        if not dtype.startswith(("F", "BF")):
            raise CheckpointError(
                f"{ckpt / file}: tensor '{name}' is of dtype {dtype}, expected floating point (F32, BF16, F16)"
            )
        if name not in expected:
            raise CheckpointError(f"{ckpt / file}: tensor '{name}' is no weight of the model of --hf-checkpoint")
        if shape != expected[name]:
            raise CheckpointError(
                f"{ckpt / file}: tensor '{name}' has shape {list(shape)}, the model's is {list(expected[name])}: "
                "the checkpoint is of another model or damaged; resume with the --hf-checkpoint it was trained from"
            )
        found.add(name)
    missing = sorted(set(expected) - found - aliases)
    if missing:
        raise CheckpointError(f"{ckpt}: the model file lacks '{missing[0]}' (shape {list(expected[missing[0]])})")


def _adapter_shapes(ckpt: Path, weights: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """A LoRA checkpoint's adapters by parameter name, each fitting its layer: A [rank, in],
    B [out, rank] of the layer's weight [out, in]."""
    try:
        shapes = {n: tuple(t.shape) for n, t in read_adapter(ckpt / ADAPTER_DIR).items()}
    except Exception as e:  # safetensors' own error of a damaged file, or a name that is no adapter's
        raise CheckpointError(f"{ckpt / ADAPTER_DIR} cannot be read ({' '.join(str(e).split())[:160]})") from None
    for name, shape in shapes.items():
        module, _, part = name.rpartition(".")
        layer = weights.get(f"{module}.weight")
        fits = (
            layer is not None
            and len(shape) == 2
            and shape[1 if part == "lora_A" else 0] == layer[1 if part == "lora_A" else 0]
        )
        if not fits:
            raise CheckpointError(
                f"{ckpt / ADAPTER_DIR}: adapter '{name}' of shape {list(shape)} fits no layer of the model "
                f"({module}.weight is {list(layer) if layer else 'missing'})"
            )
    return shapes


def _check_optimizer(fail: Fail, optimizer: dict[str, Any], trained: dict[str, tuple[int, ...]]) -> None:
    """optimizer.state keyed by the trained parameters' names, each moment of its parameter's
    shape; param_groups a non-empty list of groups naming trained parameters."""
    groups, state = optimizer.get("param_groups"), optimizer.get("state")
    if not isinstance(groups, list) or not groups or not all(isinstance(g, dict) for g in groups):
        fail(f"optimizer.param_groups is {_kind(groups)}, expected a list of the optimizer's parameter groups")
    if not isinstance(state, dict):
        fail(f"optimizer.state is {_kind(state)}, expected a dict of each parameter's state")
    named = [n for g in groups for n in (g.get("params") if isinstance(g.get("params"), list) else [None])]
    for key, value in ((k, v) for g in groups for k, v in g.items() if k != "params"):
        if not _hyperparameter(value):  # betas, lr, eps, ...: Adam reads them at its first step
            fail(f"optimizer.param_groups holds {key}={value!r}, expected a number (or a pair of numbers)")
    for name in [*named, *state]:
        if name not in trained:
            fail(f"optimizer names {name!r}, which is no parameter this run trains (e.g. {next(iter(trained), '-')!r})")
    unnamed = [n for n in trained if n not in named]  # its parameter would go on with a fresh state, unsaid
    if unnamed:
        fail(f"optimizer.param_groups lack {unnamed[0]!r}: every parameter this run trains has a group")
    for name, entry in state.items():
        if not isinstance(entry, dict):
            fail(f"optimizer.state['{name}'] is {_kind(entry)}, expected a dict of its moments")
        for key, value in entry.items():
            if key == "step":
                ok = isinstance(value, numbers.Real) or (isinstance(value, torch.Tensor) and value.numel() == 1)
                if not ok or not math.isfinite(float(value)) or float(value) < 0:
                    fail(f"optimizer.state['{name}']['step'] is {value!r}, expected a number >= 0")
            elif not isinstance(value, torch.Tensor) or tuple(value.shape) != trained[name]:
                got = list(value.shape) if isinstance(value, torch.Tensor) else _kind(value)
                fail(f"optimizer.state['{name}']['{key}'] is {got}, expected a tensor of shape {list(trained[name])}")
            else:
                _check_moment(fail, f"optimizer.state['{name}']['{key}']", value, squared=key in SQUARED)


def _check_moment(fail: Fail, where: str, value: torch.Tensor, squared: bool) -> None:
    """A moment of floating point, finite, a second moment >= 0: an int64 one was cast unsaid, and
    a NaN or negative one made the first step's weights NaN, the run ending at the push that
    followed with the engine's refusal."""
    if not value.is_floating_point():
        fail(f"{where} is of dtype {value.dtype}, expected floating point")
    if not bool(torch.isfinite(value).all()):
        fail(f"{where} holds NaN or inf values (the checkpoint is damaged)")
    if squared and bool((value < 0).any()):
        fail(f"{where} holds negative values, where a second moment is >= 0 (the checkpoint is damaged)")


def _check_rng(fail: Fail, rng: dict[str, Any]) -> None:
    """Each generator's state, tried on a throwaway generator of its kind (the run's untouched)."""
    try:
        random.Random().setstate(tuple(rng["python"]))
        name, keys, *rest = rng["numpy"]
        np.random.RandomState().set_state((name, np.asarray(keys, dtype=np.uint32), *rest))
        torch.Generator().set_state(rng["torch"])
        for s in rng.get("cuda", []):
            if not (isinstance(s, torch.Tensor) and s.dtype == torch.uint8):
                raise TypeError("a CUDA generator state that is not a byte tensor")
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        fail(
            f"rng is not the random generators' state vime writes ({type(e).__name__}: {' '.join(str(e).split())[:100]})"
        )


def _check_extra(fail: Fail, extra: dict[str, Any], directory: str) -> None:
    """The run's position: the step (the directory's own name), its counters, the data's place."""
    step = extra.get("step")
    if not _count(step):
        fail(f"extra['step'] is {step!r}, expected the step it was written at, a whole number >= 0")
    if directory.isdigit() and step != int(directory):
        fail(f"extra['step'] is {step}, but its directory is step {directory}")
    for key in COUNTERS:
        if key in extra and not _count(extra[key]):
            fail(f"extra['{key}'] is {extra[key]!r}, expected a whole number >= 0")
    wall = extra.get("wall_clock", 0.0)
    if not isinstance(wall, numbers.Real) or isinstance(wall, bool) or not math.isfinite(wall) or wall < 0:
        fail(f"extra['wall_clock'] is {wall!r}, expected seconds >= 0")
    data = extra.get("data_source")
    if not isinstance(data, dict):
        fail(f"extra['data_source'] is {_kind(data)}, expected the data source's position (a dict)")
    for key in DATA_POSITION:
        if not _count(data.get(key)):
            fail(f"extra['data_source']['{key}'] is {data.get(key)!r}, expected a whole number >= 0")
    requeued = data.get("requeued")
    if not isinstance(requeued, list) or not all(isinstance(g, list) for g in requeued):
        fail(f"extra['data_source']['requeued'] is {_kind(requeued)}, expected a list of groups of samples")
    fields = {f.name for f in dataclasses.fields(Sample)}
    statuses = {s.value for s in Status}
    for sample in (s for g in requeued for s in g):
        if not isinstance(sample, dict) or not set(sample) <= fields or sample.get("status") not in statuses:
            fail("extra['data_source']['requeued'] holds a sample that is not one vime wrote (its fields, its status)")
