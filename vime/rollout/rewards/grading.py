"""Grading: is an answer the label's, and what a built-in rm type scores. Pure functions; the
pool that bounds their time is runner.py's."""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from fractions import Fraction
from functools import lru_cache
from typing import NamedTuple

from vime.rollout.rewards.answers import (
    THINK_END,
    boxed_contents,
    extract_answer,
    extract_line_answer,
    final_section,
    hedged,
    normalize,
)


class RmRule(NamedTuple):
    """How a built-in rm type grades: one row of BUILTIN_RM_TYPES."""

    right: float  # score of a right answer
    wrong: float  # score of a wrong or missing one
    boxed_only: bool = False  # only a `\boxed{}` answer counts
    after_thinking: bool = False  # only the text after the reasoning is graded (final_section)
    partial_credit: bool = False  # a wrong number earns up to 0.5 by its closeness (numeric_credit)
    exact: bool = False  # the normalized strings must match: math-verify never asked
    choice: bool = False  # a multiple-choice letter A-J is read (choice_answer, choice_label)


BUILTIN_RM_TYPES: dict[str, RmRule] = {
    "math": RmRule(1.0, 0.0),
    "dapo": RmRule(1.0, -1.0),  # DAPO's verifier: wrong and unanswered both score -1
    "boxed_math": RmRule(1.0, 0.0, boxed_only=True),
    "math_shaped": RmRule(1.0, 0.0, partial_credit=True),
    # DeepScaleR's rule (slime's `deepscaler`): the last box after the reasoning, 1 or 0
    "deepscaler": RmRule(1.0, 0.0, boxed_only=True, after_thinking=True),
    # answers that are not one mathematical object (lists, sequences, words): math-verify reads
    # `37, 39, 38` as the set {37, 38, 39}, so a wrong order or a repeated item would pass. A
    # label that is not one number is looked for on the response's last line, not in its
    # trailing number (extract_line_answer); a numeric label is read as `math` reads it
    "exact": RmRule(1.0, 0.0, exact=True),
    # multiple choice (slime's `gpqa`): the option letter the response picks against the label's
    # letter (or 0-based index); the question and its options are in the prompt
    "gpqa": RmRule(1.0, 0.0, exact=True, choice=True),
}

CHOICE_LETTERS = "ABCDEFGHIJ"
# what names a picked option, strongest first: a boxed letter; an answer cue ("the answer is
# (C)", "Answer: **C**"); an option named correct ("option B", "C is correct")
_LETTER = r"\**\(?([A-J])\)?\**(?![A-Za-z])"
_BOXED_CHOICE = re.compile(r"\\boxed\{\s*\(?([A-J])\)?\s*\}")
_ANSWER_CUE = re.compile(r"(?i:answer)(?:\s+(?i:is))?\s*:?\s*" + _LETTER)
_OPTION_CUE = re.compile(
    r"(?i:option|choice)(?:\s+(?i:is))?\s*:?\s*"
    + _LETTER
    + r"|(?<![A-Za-z])\**\(?([A-J])\)?\**\s+(?i:is)\s+(?i:the\s+)?(?i:correct)"
)
# a capital standing alone that is not a word of the sentence ("I think", "A cat")
_LONE_LETTER = re.compile(r"(?<![A-Za-z])([A-J])(?![A-Za-z])(?!\s+[a-z])")


_NUMBER_LABEL_RE = re.compile(r"-?\d+(?:\.\d+)?(?:/\d+)?")  # a label's normalized form when it is one number


class _MathVerifyQuiet(logging.Filter):
    """Drop math-verify's warning that its signal timeouts are off: we turn them off on purpose."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Timeout is disabled")


@lru_cache(maxsize=1)
def math_verify() -> tuple[Callable, Callable]:
    from math_verify import parse, verify

    for name in ("math_verify.parser", "math_verify.grader"):
        logging.getLogger(name).addFilter(_MathVerifyQuiet())
    return parse, verify


def _as_latex(s: str) -> str:
    """math-verify reads delimited LaTeX most reliably; bare text like `1+x` would parse as 1."""
    return s if ("$" in s or "\\boxed" in s or "\\(" in s or "\\[" in s) else f"${s}$"


def grade(pred: str | None, label: str | None, exact: bool = False) -> bool:
    """Is `pred` the same answer as `label`? Normalized string match, then math-verify.

    The cheap string match runs first only because it is cheap: the result is their OR either
    way; `exact` (rm type `exact`) stops after it. math-verify's own timeouts use signals, which
    fail outside the main thread, so they are off here; callers bound the time instead (the
    pool's per-sample timeout).
    """
    if pred is None or label is None or not str(pred).strip() or not str(label).strip():
        return False
    pred, label = str(pred), str(label)
    if normalize(pred) == normalize(label):
        return True
    if exact or hedged(pred):
        return False
    parse, verify = math_verify()
    # math-verify reads `\\$` as a stray command, so `\\$18.90` would not be 18.9
    gold = parse(_as_latex(label.replace("\\$", "")), parsing_timeout=None)
    target = parse(_as_latex(pred.replace("\\$", "")), parsing_timeout=None)
    return bool(gold and target and verify(gold, target, timeout_seconds=None))


def numeric_credit(pred: str | None, label: str | None) -> float:
    """Partial credit of a wrong numeric answer: 0.5 × (1 − relative error), floored at 0, so
    any right answer (1) beats every wrong one and an answer off by the label's size or more
    earns nothing; 0 when either side is not a plain number or fraction.

    Why it exists: with exact-match rewards a model that never answers right gets the same
    score on every sample, so GRPO's advantages are all 0 and nothing trains. The closeness of
    a numeric answer differs between samples long before any is right, which gives small or
    random models (the tiny example, tests) a signal; on a real run it is a shaping term."""
    try:
        p, y = Fraction(normalize(str(pred))), Fraction(normalize(str(label)))  # `$1,234` is a number too
    except (TypeError, ValueError, ZeroDivisionError):
        return 0.0
    return 0.5 * max(0.0, 1.0 - float(abs(p - y) / max(abs(y), 1)))


def exact_answer(text: str | None, label: str | None) -> str | None:
    """What rm type `exact` compares with the label: a label that is one number is looked for as
    `math` looks for it (trailing number last), any other on the response's last line."""
    if _NUMBER_LABEL_RE.fullmatch(normalize(str(label or ""))):
        return extract_answer(text)
    return extract_line_answer(text)


def choice_answer(response: str) -> str | None:
    """The option letter a multiple-choice response picks: in the text after the reasoning when
    it closed (else all of it), the last boxed letter, else the last an answer cue names, else
    the last option named correct, else the last capital A-J that stands alone and is no word
    of a sentence (None: no letter at all)."""
    text = response.rpartition(THINK_END)[2] if THINK_END in response else response
    for cue in (_BOXED_CHOICE, _ANSWER_CUE, _OPTION_CUE):
        found = [next(g for g in m.groups() if g) for m in cue.finditer(text)]
        if found:
            return found[-1]
    alone = _LONE_LETTER.findall(text)
    return alone[-1] if alone else None


def choice_label(label: object) -> str | None:
    """A multiple-choice label as its letter: a letter A-J (either case, bracketed or not) or the
    option's 0-based index, as slime's gpqa reads them; None for anything else."""
    text = str(label).strip().strip("()").upper() if label is not None else ""
    if len(text) == 1 and text in CHOICE_LETTERS:
        return text
    if text.isdigit() and int(text) < len(CHOICE_LETTERS):
        return CHOICE_LETTERS[int(text)]
    return None


def rule_label(rm_type: str, label: str | None) -> str | None:
    """The label as a built-in rm type compares it: a multiple-choice one as its letter."""
    return choice_label(label) if BUILTIN_RM_TYPES[rm_type].choice else label


def rule_answer(rm_type: str, response: str, label: str | None) -> str | None:
    """The answer a built-in rm type reads from a response (None: it commits to none)."""
    rule = BUILTIN_RM_TYPES[rm_type]
    if rule.choice:
        return choice_answer(response or "")
    text = final_section(response or "") if rule.after_thinking else response or ""
    if text is None:
        return None
    if rule.boxed_only:
        boxes = boxed_contents(text)
        return boxes[-1] if boxes else None
    return exact_answer(text, label) if rule.exact else extract_answer(text)


def builtin_result(rm_type: str, response: str, label: str | None) -> dict[str, float]:
    """`{"score": ..., "acc": 1.0 or 0.0}` of one response under a built-in rm type (see
    BUILTIN_RM_TYPES): `score` trains (the default --reward-key), `acc` says whether the
    answer was right (it differs from the score for dapo and math_shaped)."""
    rule = BUILTIN_RM_TYPES[rm_type]
    pred = rule_answer(rm_type, response, label)
    if grade(pred, rule_label(rm_type, label), exact=rule.exact):
        return {"score": rule.right, "acc": 1.0}
    return {"score": numeric_credit(pred, label) if rule.partial_credit else rule.wrong, "acc": 0.0}


def builtin_score(rm_type: str, response: str, label: str | None) -> float:
    """Score of one response under a built-in rm type (see BUILTIN_RM_TYPES)."""
    return builtin_result(rm_type, response, label)["score"]


# ---------------------------------------------------------------- the process pool
