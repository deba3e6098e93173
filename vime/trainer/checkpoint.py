"""Checkpoints: writing and reading them, and which one a resumed run loads.

A checkpoint is an HF directory (the weights as safetensors, the tokenizer) plus
`trainer_state.pt` (optimizer, the optimizer step count that indexes the lr schedule, RNG, the
run's extra state). `save` writes `<dir>.tmp` and renames it only when complete, so a crash mid-save never leaves a half-written `<step>/`. A full disk, a copy cut short or a damaged volume still can
(the issue that led here: a truncated newest checkpoint made `--load` fail with a traceback,
although an intact one sat next to it). So before loading, each candidate's files are checked
from their headers, newest first, and a damaged one is skipped with a warning naming it.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import random
import re
import shutil
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from vime.errors import VimeError
from vime.lifetime import signals_held
from vime.models import weights_problem
from vime.trainer import weights as policy_weights
from vime.trainer.lora import ADAPTER_DIR, adapter_config, merged, read_adapter, write_adapter
from vime.trainer.moe import fused_tensors
from vime.trainer.nonfinite import NonFiniteError

if TYPE_CHECKING:
    from vime.trainer.optimizer_step import OptimizerStep
    from vime.trainer.policy import Policy
    from vime.trainer.ranks import Ranks

log = logging.getLogger("vime")

TRAINER_STATE = "trainer_state.pt"


class Trainer(Protocol):
    """What a checkpoint reads from and restores into the trainer (`vime.trainer.actor.Actor`):
    the policy's weights, the optimizer and its step count, the tokenizer, the ranks."""

    policy: Policy
    optimizer_step: OptimizerStep
    ranks: Ranks
    tokenizer: Any

    @property
    def base_model(self) -> str | None:
        """--hf-checkpoint as given: the base a saved LoRA adapter names."""


class CheckpointError(VimeError, RuntimeError):
    """A checkpoint cannot be written or read; one line naming it and the cause."""


def save(actor: Trainer, final: Path, extra_state: dict[str, Any]) -> Path:
    """Write an HF directory (+ trainer_state.pt) at `final`, atomically; every rank calls.

    Shards are gathered into full tensors and rank 0 writes, so the directory loads in
    transformers, in vLLM, and in a trainer of any rank count. The optimizer state is
    stored full and keyed by parameter name for the same reason. Everything goes to
    `<dir>.tmp` first; only a complete copy replaces an existing checkpoint of the same
    name, so a crash at any point leaves the previous one loadable (at worst renamed to
    `<dir>.old` for the instant between the two renames).
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    policy, ranks = actor.policy, actor.ranks
    _check_finite(actor, final)
    weights = {name: t.detach().cpu() for name, t in policy_weights.named_weights(policy)}
    # LoRA: the adapters too, in PEFT's layout (the weights above are merged)
    adapter = policy_weights.adapter_tensors(policy) if policy.lora is not None else None
    optim = get_optimizer_state_dict(
        policy.model, actor.optimizer_step.optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    error: BaseException | None = None
    if ranks.rank == 0:
        try:
            state = {
                "optimizer": optim,
                "optimizer_steps": actor.optimizer_step.count,
                "rng": _rng_state(),
                "extra": extra_state,
            }
            _write(actor, final, weights, state, adapter)
        except BaseException as e:  # every rank must hear of it, or they would wait for rank 0 at the next collective
            error = e
    if ranks.world > 1:
        # also the barrier: the checkpoint exists for everyone once save returns
        failed = torch.tensor([int(error is not None)])
        dist.all_reduce(failed, group=ranks.cpu_group)
        if int(failed) and error is None:
            raise CheckpointError(f"writing checkpoint {final} failed on rank 0")
    if error is not None:
        raise error
    return final


def _check_finite(actor: Trainer, final: Path) -> None:
    """Refuse to save non-finite weights (NonFiniteError on every rank alike): a checkpoint
    of NaNs would replace the last good one as the newest. Each rank checks its own shards."""
    bad = [
        n
        for n, p in actor.policy.model.named_parameters()
        if not bool(torch.isfinite(p.to_local() if hasattr(p, "to_local") else p).all())
    ]
    count = torch.tensor([len(bad)], dtype=torch.int64)
    if actor.ranks.world > 1:
        dist.all_reduce(count, group=actor.ranks.cpu_group)
    if int(count):
        where = f" (e.g. {bad[0]})" if bad else ""
        raise NonFiniteError(
            f"not writing checkpoint {final}: {int(count)} weight tensors hold non-finite values{where}; the last checkpoint written is intact"
        )


def _write(
    actor: Trainer, final: Path, weights: dict[str, Tensor], state: dict[str, Any], adapter: dict[str, Tensor] | None
) -> None:
    # a signal mid-write would fail or hang the save: it is acted on once the checkpoint is whole
    with signals_held():
        tmp, old = final.with_name(final.name + ".tmp"), final.with_name(final.name + ".old")
        shutil.rmtree(tmp, ignore_errors=True)  # debris of an earlier interrupted save
        try:
            policy = actor.policy
            policy.model.save_pretrained(tmp, state_dict=weights)
            actor.tokenizer.save_pretrained(tmp)
            if adapter is not None:
                config = adapter_config(policy.lora, sorted(policy.lora_modules), str(actor.base_model))
                write_adapter(tmp / ADAPTER_DIR, adapter, config)
            with open(tmp / TRAINER_STATE, "wb") as f:
                torch.save(state, f)
                f.flush()
                os.fsync(f.fileno())
        # a full disk, a directory made read-only mid-run (safetensors and torch raise their own types)
        except Exception as e:
            shutil.rmtree(tmp, ignore_errors=True)
            free = shutil.disk_usage(final.parent).free / 2**20
            detail = " ".join((getattr(e, "strerror", None) or str(e)).split())[:200]
            raise CheckpointError(
                f"writing checkpoint {final} failed ({detail}; {free:.0f} MiB free there): free some space or pick another --save; "
                "the checkpoints written before are intact"
            ) from None
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        if final.exists():
            shutil.rmtree(old, ignore_errors=True)
            final.rename(old)
            tmp.rename(final)
            shutil.rmtree(old)
        else:
            tmp.rename(final)


def load(actor: Trainer, ckpt: Path) -> dict[str, Any]:
    """Restore weights, optimizer, the optimizer step count and RNG from a `save` directory;
    returns its extra_state.

    Every rank reads the full tensors and keeps its shard, so the checkpoint's rank count
    does not matter; every rank restores the step count, so the lr schedule goes on where the
    checkpoint's run left it. The run's current --lr*, --weight-decay settings apply from then
    on (the optimizer's saved values are replaced, as Megatron's scheduler does each step).
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

    state_file = ckpt / TRAINER_STATE
    if not state_file.exists():
        raise CheckpointError(f"{ckpt} is not a complete checkpoint (no {TRAINER_STATE})")
    policy, optimizer = actor.policy, actor.optimizer_step.optimizer
    check_same_kind(ckpt, policy.lora is not None)
    # both files read before either is applied: one that fails to load changes nothing
    # a mixture of experts' per-expert tensors are fused again into the model's parameters
    weights = (
        _lora_weights(actor, ckpt) if policy.lora is not None else fused_tensors(policy.moe, dict(iter_weights(ckpt)))
    )
    expected = {n for n, p in policy.model.named_parameters() if p.requires_grad} | (
        set(policy.model.state_dict()) - policy.tied_aliases if policy.lora is None else set()
    )
    missing, unexpected = expected - set(weights), set(weights) - expected
    if missing or unexpected:
        raise CheckpointError(
            f"checkpoint {ckpt} does not match the model: missing {sorted(missing)[:3]}, unexpected {sorted(unexpected)[:3]}"
        )
    state = read_state(state_file)
    saved, running = (_optimizer_kind(g) for g in (state["optimizer"]["param_groups"][0], optimizer.param_groups[0]))
    if saved != running:
        raise CheckpointError(
            f"checkpoint {ckpt} holds the state of --optimizer {saved}, this run uses {running}: resume with --optimizer {saved}"
        )
    options = StateDictOptions(full_state_dict=True, strict=False)
    set_model_state_dict(policy.model, weights, options=options)
    if state["optimizer"]["state"]:  # SGD without momentum keeps none, and torch's loader then fails
        set_optimizer_state_dict(policy.model, optimizer, state["optimizer"], options=options)
    # a checkpoint from before the count was kept: the run's policy version counts the same slots
    actor.optimizer_step.count = int(state.get("optimizer_steps", state["extra"].get("policy_version", 0)))
    actor.optimizer_step.apply_schedule()
    _set_rng_state(state["rng"])
    return state["extra"]


def check_same_kind(ckpt: Path, lora: bool) -> None:
    """A LoRA run resumes only a LoRA run's checkpoint (its optimizer holds the adapters' state
    alone), a full fine-tune only a full fine-tune's."""
    if lora and not (ckpt / ADAPTER_DIR).is_dir():
        raise CheckpointError(
            f"checkpoint {ckpt} holds no LoRA adapter ({ADAPTER_DIR}/): it is a full fine-tune; resume it without --lora-rank"
        )
    if not lora and (ckpt / ADAPTER_DIR).is_dir():
        raise CheckpointError(
            f"checkpoint {ckpt} was trained with LoRA (its optimizer holds only the adapters'): resume with the same "
            "--lora-rank, or start a full fine-tune from it with --hf-checkpoint (its weights are merged)"
        )


def _lora_weights(actor: Trainer, ckpt: Path) -> dict[str, Tensor]:
    """A LoRA run resumes its adapters; its base is the run's --hf-checkpoint, already loaded.
    That base is checked against the checkpoint: one adapted layer's saved (merged) weight must
    equal the base's plus the adapter, or the run would train adapters made for another model."""
    adapter = read_adapter(ckpt / ADAPTER_DIR)
    policy = actor.policy
    _check_same_lora(policy, ckpt, adapter)
    module = min(policy.lora_modules)
    layer = policy.model.get_submodule(module)
    base = layer.weight.detach()
    base = base.full_tensor() if hasattr(base, "full_tensor") else base
    a, b = adapter.get(f"{module}.lora_A"), adapter.get(f"{module}.lora_B")
    saved = dict(iter_weights(ckpt)).get(f"{module}.weight")
    if a is not None and b is not None and saved is not None:
        expect = merged(base.cpu(), a, b, policy.lora.scaling)
        if expect.shape != saved.shape or not torch.allclose(expect.float(), saved.float(), atol=1e-4):
            raise CheckpointError(
                f"checkpoint {ckpt}'s adapters were trained on another base model than --hf-checkpoint "
                f"{actor.base_model} ({module}.weight differs): resume with the base it was trained on"
            )
    return adapter


def _check_same_lora(policy: Policy, ckpt: Path, adapter: dict[str, Tensor]) -> None:
    """The checkpoint's adapters against this run's --lora-rank, --lora-alpha and layers. A rank
    or alpha of their own used to fail the base-model check below (the merged weights differ
    too), which blamed --hf-checkpoint for what a LoRA flag had changed."""
    config_file = ckpt / ADAPTER_DIR / "adapter_config.json"
    config = json.loads(config_file.read_text()) if config_file.exists() else {}
    rank = next((t.shape[0] for n, t in adapter.items() if n.endswith(".lora_A")), policy.lora.rank)
    alpha = float(config.get("lora_alpha", policy.lora.alpha))
    modules = {n.rsplit(".", 1)[0] for n in adapter}
    differ, flags = [], []
    if rank != policy.lora.rank:
        differ.append(f"rank {rank}, this run's --lora-rank {policy.lora.rank}")
        flags.append(f"--lora-rank {rank}")
    if alpha != policy.lora.alpha:
        differ.append(f"alpha {alpha:g}, this run's --lora-alpha {policy.lora.alpha:g}")
        flags.append(f"--lora-alpha {alpha:g}")
    if modules != policy.lora_modules:
        kinds = " ".join(sorted({m.rsplit(".", 1)[-1] for m in modules}))
        differ.append(f"{len(modules)} layers ({kinds}), this run adapts {len(policy.lora_modules)}")
        flags.append("the --target-modules/--exclude-modules it was trained with")
    if differ:
        raise CheckpointError(
            f"checkpoint {ckpt}'s LoRA adapters differ from this run's: {'; '.join(differ)}: resume with {' and '.join(flags)}"
        )


def _numpy_globals() -> list[Any]:
    """What an older trainer_state.pt needs besides plain data: numpy's RNG key was saved as an
    array. Rebuilding an array runs no code of the file's choosing."""
    core = getattr(np, "_core", None) or np.core  # numpy 2 renamed it
    rebuild = core.multiarray._reconstruct
    # a file names the function as the numpy that wrote it did: allow both names
    return [
        (rebuild, "numpy.core.multiarray._reconstruct"),
        (rebuild, "numpy._core.multiarray._reconstruct"),
        np.ndarray,
        np.dtype,
        type(np.dtype(np.uint32)),
    ]


def loss_type(ckpt: Path) -> str:
    """The --loss-type of the run that wrote `ckpt` (policy_loss where it recorded none, as before
    SFT), read with its tensors memory-mapped, not loaded: cheap at any model size."""
    return read_state(ckpt / TRAINER_STATE, mmap=True)["extra"].get("loss_type", "policy_loss")


def read_state(state_file: Path, mmap: bool = False) -> dict[str, Any]:
    """trainer_state.pt as plain data (tensors, numbers, strings, lists, dicts). Unpickling may
    call anything the file names, so a file that names anything else (a crafted checkpoint that
    would run a command on `--load`) is refused before any of it runs."""
    try:
        with torch.serialization.safe_globals(_numpy_globals()):
            return torch.load(state_file, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        named = re.search(r"GLOBAL (\S+)", str(e))
        raise CheckpointError(
            f"{state_file} asks to run {named.group(1) if named else 'code'} when loaded; vime loads checkpoints as "
            "plain data only: resume from a checkpoint vime wrote"
        ) from None


def _optimizer_kind(group: dict[str, Any]) -> str:
    return "sgd" if "momentum" in group else "adam"


def iter_weights(ckpt: Path) -> Iterator[tuple[str, Tensor]]:
    """(name, tensor) of an HF safetensors directory, single file or sharded."""
    from safetensors.torch import load_file

    index = ckpt / "model.safetensors.index.json"
    files = (
        sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else ["model.safetensors"]
    )
    for f in files:
        yield from load_file(str(ckpt / f)).items()


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": _plain_numpy_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _plain_numpy_state() -> tuple[Any, ...]:
    """numpy's RNG state with its key array as a list, so the file holds plain data only."""
    name, keys, *rest = np.random.get_state()
    return (name, keys.tolist(), *rest)


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), *rest))
    torch.set_rng_state(state["torch"].cpu())
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"]])


def problem(ckpt: Path) -> str | None:
    """What is wrong with a checkpoint directory, or None if it looks whole.

    Reads headers only: the zip directory of trainer_state.pt (at the end of the file, so any
    truncation loses it) and the weights' (`vime.models.weights_problem`). Damage in the middle
    of the data shows when it is loaded."""
    state = ckpt / TRAINER_STATE
    if not state.is_file():
        return f"no {TRAINER_STATE}"
    try:
        with zipfile.ZipFile(state):
            pass
    except (zipfile.BadZipFile, OSError) as e:
        return f"{TRAINER_STATE} is damaged ({e})"
    return weights_problem(ckpt)


def is_step_checkpoint(path: Path) -> bool:
    """`path` is one `<step>/` checkpoint itself (what `--load DIR/3` names), not a `--save`
    directory of them."""
    return re.fullmatch(r"\d+", path.name) is not None and (path / TRAINER_STATE).is_file()


def checkpoint_to_load(load: Path, warn: bool = True) -> Path | None:
    """The checkpoint `--load` names: the directory itself when it is one `<step>/` checkpoint
    (the run resumes from exactly that step), else the newest whole one inside it."""
    if is_step_checkpoint(load):
        return load if problem(load) is None else None
    return latest_checkpoint(load, warn)


def checkpoint_steps(save_dir: Path) -> dict[int, Path]:
    """step → `<step>/` of every non-empty step directory in `save_dir`, whole or damaged: each is
    a checkpoint a save of the same step would replace."""
    if not save_dir.is_dir():
        return {}
    return {
        int(p.name): p for p in save_dir.iterdir() if p.is_dir() and re.fullmatch(r"\d+", p.name) and any(p.iterdir())
    }


# What marks a Megatron or slime checkpoint (torch_dist): vime cannot resume from one
_FOREIGN = re.compile(r"latest_checkpointed_iteration\.txt|iter_\d+|.*\.distcp|.*torch_dist.*")


def foreign_checkpoint(directory: Path) -> list[str]:
    """The entries of `directory` that mark another framework's checkpoint (Megatron/slime:
    `latest_checkpointed_iteration.txt`, `iter_0000010/`, `*.distcp`, `torch_dist` folders)."""
    if not directory.is_dir():
        return []
    return sorted(p.name + ("/" if p.is_dir() else "") for p in directory.iterdir() if _FOREIGN.fullmatch(p.name))


def latest_checkpoint(save_dir: Path, warn: bool = True) -> Path | None:
    """The newest `<step>/` in `save_dir` that is whole; each newer damaged one is named in a
    warning (`warn=False`: silently, for a check that runs before the run's log exists)."""
    steps = sorted(
        (int(p.name) for p in save_dir.glob("*") if p.is_dir() and re.fullmatch(r"\d+", p.name)), reverse=True
    )
    for step in steps:
        ckpt = save_dir / str(step)
        why = problem(ckpt)
        if why is None:
            return ckpt
        if warn and (ckpt / TRAINER_STATE).exists():  # a directory that never held a checkpoint is not worth a warning
            log.warning("checkpoint %s is damaged (%s): skipped, trying the one before", ckpt, why)
    return None
