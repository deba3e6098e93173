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
  which directory it loads from, and start-up's check of its vocabulary, are the trainer's
  (vime/trainer/teacher.py);
* `--opd-type sglang`: a teacher engine scored them when the rollout was scored, and the
  post-process stored them on each sample (`Sample.teacher_log_probs`,
  vime/rollout/on_policy_distillation.py); `served_log_probs` reads them. A sample the teacher
  could not score (its reward failed, counted in `rollout/reward_errors`) gets no teacher term.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


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
    mean; `train/opd_unscored_samples` counts them. `advantages` is [samples] or, per sample, [its
    response tokens]; the other lists, and the answer, hold per sample [its response tokens]."""
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
        None if s.teacher_log_probs is None else torch.as_tensor(s.teacher_log_probs, dtype=torch.float32)
        for s in samples
    ]


def student_log_probs(samples: list[Any], policy: list[Tensor | None]) -> list[Tensor]:
    """The rollout's log-probs of each sample's response, or the policy's where the engine sent
    none (a custom generate that keeps no log-probs): `policy[i]` is only read for those."""
    return [
        torch.tensor(s.rollout_log_probs, dtype=torch.float32) if s.rollout_log_probs is not None else policy[i]
        for i, s in enumerate(samples)
    ]
