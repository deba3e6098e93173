"""On-policy distillation (`--use-opd`): the student samples, a frozen teacher scores every token
of its responses, and each token's advantage gains `--opd-kl-coef` × (log π_teacher − log π_student).

The student's log-prob is the one the rollout drew the token with (the engine's), so the term is
a one-sample estimate of the negative reverse KL of the policy that sampled; a token the teacher
finds likelier than the student did is pushed up, one it finds less likely is pushed down. It is
added to the estimator's advantage after the estimator ran (slime adds it before its optional
whitening, vime's estimators whiten in the rollout), so with a constant task reward (every GRPO
advantage 0) the run is pure distillation. The teacher (`--opd-type megatron`, slime's name for a
teacher loaded by the trainer) scores the tokens at train time, so in the async modes too it
scores exactly the tokens trained, however stale they are.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from vime.errors import ConfigError

if TYPE_CHECKING:
    from vime.config.rooms import AlgorithmConfig


def teacher_dir(algo: AlgorithmConfig) -> Path:
    """The HF directory the teacher loads from: `--opd-teacher-load` itself when it is one (an HF
    model, or one `<step>/` checkpoint of a vime run), else the `--opd-teacher-ckpt-step` step of
    that vime `--save` directory, or its newest whole checkpoint."""
    from vime.trainer.checkpoint import checkpoint_steps, latest_checkpoint, problem

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
            f"--opd-teacher-load {load} holds neither an HF model (config.json) nor a whole vime checkpoint: "
            "give the teacher's HF directory or the --save directory of the run that trained it"
        )
    return newest


def check_teacher(args: Any, student_config: dict, read_config: Any) -> Path:
    """The teacher's directory, refused in one line when its vocabulary is not the student's: the
    teacher scores the student's token ids, which mean other tokens (or none) in another vocabulary.
    `args`: the run's config (start-up's check calls this with it)."""
    path = teacher_dir(args.algorithm)
    teacher_config = read_config(path)
    theirs, ours = _vocab_size(teacher_config), _vocab_size(student_config)
    if theirs is not None and ours is not None and theirs != ours:
        raise ConfigError(
            f"--opd-teacher-load {path} has a vocabulary of {theirs} tokens and the student {ours}: the teacher "
            "scores the student's token ids, so it needs the student's tokenizer; give a teacher of the same family"
        )
    return path


def _vocab_size(config: dict) -> int | None:
    size = config.get("vocab_size", (config.get("text_config") or {}).get("vocab_size"))
    return int(size) if size is not None else None


def distill_advantages(
    advantages: Tensor | list[Tensor],
    student: list[Tensor],
    teacher: list[Tensor],
    masks: list[Tensor],
    coef: float,
) -> tuple[list[Tensor], dict[str, float]]:
    """Per-token advantages: the task's (one per sample, or per token) plus `coef` × (teacher −
    student) on every response token; and `train/opd_reverse_kl`, the mean of student − teacher
    over the loss tokens (the reverse KL's estimate, which distillation drives down)."""
    out, kl_sum, n = [], 0.0, 0.0
    for i, (s, t, m) in enumerate(zip(student, teacher, masks, strict=True)):
        s, t = s.float().cpu(), t.float().cpu()
        base = advantages[i].float().cpu()
        gap = t - s
        out.append(base + coef * gap if base.dim() else base.expand_as(gap) + coef * gap)
        kl_sum -= float((gap * m).sum())
        n += float(m.sum())
    return out, {"train/opd_reverse_kl": kl_sum / n if n else 0.0}


def student_log_probs(samples: list[Any], policy: list[Tensor | None]) -> list[Tensor]:
    """The rollout's log-probs of each sample's response, or the policy's where the engine sent
    none (a custom generate that keeps no log-probs): `policy[i]` is only read for those."""
    return [
        torch.tensor(s.rollout_log_probs, dtype=torch.float32) if s.rollout_log_probs is not None else policy[i]
        for i, s in enumerate(samples)
    ]
