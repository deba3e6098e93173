"""On-policy distillation (`--use-opd`): the student samples, a frozen teacher scores every token
of its responses, and each token's advantage gains `--opd-kl-coef` × (log π_teacher − log π_student).

The student's log-prob is the one the rollout drew the token with (the engine's), so the term is
a one-sample estimate of the negative reverse KL of the policy that sampled; a token the teacher
finds likelier than the student did is pushed up, one it finds less likely is pushed down. It is
added to the estimator's advantage after the estimator ran (slime adds it before its optional
whitening, vime's estimators whiten in the rollout), so with a constant task reward (every GRPO
advantage 0) the run is pure distillation. Where the teacher's log-probs come from is the one
thing the two types differ in; `distill_advantages` is the same for both:
* `--opd-type megatron` (slime's name for a teacher loaded by the trainer) scores the tokens at
  train time, so in the async modes too it scores exactly the tokens trained, however stale;
* `--opd-type sglang`: a teacher engine scored them when the rollout was scored, and the
  post-process stored them on each sample (`Sample.teacher_log_probs`,
  vime/rollout/on_policy_distillation.py); `served_log_probs` reads them. A sample the teacher
  could not score (its reward failed, counted in `rollout/reward_errors`) gets no teacher term.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from vime.errors import ConfigError
from vime.plugins import PluginError
from vime.rollout.types import Status

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
    theirs, ours = vocab_size_of(teacher_config), vocab_size_of(student_config)
    if theirs is not None and ours is not None and theirs != ours:
        raise ConfigError(
            f"--opd-teacher-load {path} has a vocabulary of {theirs} tokens and the student {ours}: the teacher "
            "scores the student's token ids, so it needs the student's tokenizer; give a teacher of the same family"
        )
    return path


def vocab_size_of(config: dict) -> int | None:
    size = config.get("vocab_size", (config.get("text_config") or {}).get("vocab_size"))
    return int(size) if size is not None else None


def distill_advantages(
    advantages: Tensor | list[Tensor],
    student: list[Tensor],
    teacher: list[Tensor | None],
    masks: list[Tensor],
    coef: float,
) -> tuple[list[Tensor], dict[str, float]]:
    """Per-token advantages: the task's (one per sample, or per token) plus `coef` × (teacher −
    student) on every response token; and `train/opd_reverse_kl`, the mean of student − teacher
    over the loss tokens (the reverse KL's estimate, which distillation drives down). A sample
    without the teacher's log-probs (None) keeps the task's advantage and is left out of the
    mean; `train/opd_unscored_samples` counts them."""
    out, kl_sum, n, unscored = [], 0.0, 0.0, 0
    for i, (s, t, m) in enumerate(zip(student, teacher, masks, strict=True)):
        s = s.float().cpu()
        base = advantages[i].float().cpu()
        if t is None:
            gap = torch.zeros_like(s)
            unscored += 1
        else:
            gap = t.float().cpu() - s
            kl_sum -= float((gap * m).sum())
            n += float(m.sum())
        out.append(base + coef * gap if base.dim() else base.expand_as(gap) + coef * gap)
    return out, {"train/opd_reverse_kl": kl_sum / n if n else 0.0, "train/opd_unscored_samples": float(unscored)}


def served_log_probs(samples: list[Any]) -> list[Tensor | None]:
    """`--opd-type sglang`: the teacher's log-probs the post-process stored on each sample."""
    return [
        None if s.teacher_log_probs is None else torch.tensor(s.teacher_log_probs, dtype=torch.float32) for s in samples
    ]


def check_served(samples: list[Any], post_process: str) -> None:
    """`--opd-type sglang`, once the post-process ran: every sample whose reward (the teacher's
    answer) came has the teacher's log-prob of each response token; one line otherwise, naming
    the sample, before anything is trained on it."""
    for s in samples:
        scores = s.teacher_log_probs
        if scores is None and (s.reward_error is not None or s.status == Status.FAILED):
            continue  # the teacher was not reached: counted in rollout/reward_errors, trained without it
        if scores is None or len(scores) != s.response_length:
            what = "no" if scores is None else f"{len(scores)}"
            raise PluginError(
                f"--custom-reward-post-process-path {post_process} left sample {s.index} with {what} teacher log-probs "
                f"for its {s.response_length} response tokens: --opd-type sglang trains on sample.teacher_log_probs, "
                "one per response token (vime.rollout.on_policy_distillation.post_process_rewards sets them)"
            )


def student_log_probs(samples: list[Any], policy: list[Tensor | None]) -> list[Tensor]:
    """The rollout's log-probs of each sample's response, or the policy's where the engine sent
    none (a custom generate that keeps no log-probs): `policy[i]` is only read for those."""
    return [
        torch.tensor(s.rollout_log_probs, dtype=torch.float32) if s.rollout_log_probs is not None else policy[i]
        for i, s in enumerate(samples)
    ]
