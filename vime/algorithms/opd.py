"""On-policy distillation (`--use-opd`): the student samples, a frozen teacher scores every token
of its responses, and each token's advantage gains `--opd-kl-coef` × (log π_teacher − log π_student).

The student's log-prob is the one the rollout drew the token with (the engine's), so the term is
a one-sample estimate of the negative reverse KL of the policy that sampled; a token the teacher
finds likelier than the student did is pushed up, one it finds less likely is pushed down. It is
added to the estimator's advantage after the estimator ran (slime adds it before its optional
whitening, vime's estimators whiten in the rollout), so with a constant task reward (every GRPO
advantage 0) the run is pure distillation. The teacher (`--opd-type megatron`, slime's name for a
teacher loaded by the trainer) scores the tokens at train time, so in the async modes too it
scores exactly the tokens trained, however stale they are. Which directory it loads from, and
start-up's check of its vocabulary, are the trainer's (vime/trainer/teacher.py).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


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
