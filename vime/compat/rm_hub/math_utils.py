"""slime's `slime.rollout.rm_hub.math_utils` names its plug-ins import (geo3k's tool environment,
reward functions that grade as deepscaler does): the boxed answer of a response, verl's grading
of it and the two equivalence checks deepscaler ORs, on vime's graders."""

from __future__ import annotations

from vime.rollout.rewards.answers import boxed_contents, normalize
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


def grade_answer_mathd(given_answer: str, ground_truth: str) -> bool:
    """slime's string check (MATH's normalizer, then equality): vime's normalized string match."""
    if not str(given_answer).strip() or not str(ground_truth).strip():
        return False
    return normalize(str(given_answer)) == normalize(str(ground_truth))


def grade_answer_sympy(given_answer: str, ground_truth: str) -> bool:
    """slime's symbolic check (sympy on both answers): vime's, a normalized string match then
    math-verify, so `grade_answer_mathd(a, b) or grade_answer_sympy(a, b)` is vime's math grading."""
    return grade(given_answer, ground_truth)


__all__ = ["extract_answer", "grade_answer_mathd", "grade_answer_sympy", "grade_answer_verl"]
