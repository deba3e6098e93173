"""slime's `slime.rollout.rm_hub.math_utils` names its plug-ins import (geo3k's tool environment):
the boxed answer of a response and verl's grading of it, on vime's graders."""

from __future__ import annotations

from vime.rollout.rewards.answers import boxed_contents
from vime.rollout.rewards.grading import grade


def extract_answer(passage: str) -> str | None:
    """The contents of the last `\\boxed{}` (or `\\fbox{}`) of `passage`; None without one."""
    boxes = boxed_contents(passage or "")
    return boxes[-1] if boxes else None


def grade_answer_verl(solution_str: str, ground_truth: object) -> bool:
    """slime's (verl's) math check: the response's last boxed answer against the label (itself
    read from its last box when it has one); no box, or an empty label, is wrong. Equivalence is
    vime's: a normalized string match, then math-verify (slime: MATH's normalizer, then sympy)."""
    if not ground_truth:
        return False
    truth = str(ground_truth)
    if "\\boxed" in truth:
        truth = extract_answer(truth) or ""
    given = extract_answer(solution_str)
    return given is not None and grade(given, truth)


__all__ = ["extract_answer", "grade_answer_verl"]
