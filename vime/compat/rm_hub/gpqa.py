"""`from slime.rollout.rm_hub.gpqa import compute_gpqa_reward`: slime's multiple-choice grader, on
vime's (`--rm-type gpqa`): the option letter the response picks against the label's letter.

slime finds the right letter from, in order, `metadata["correct_letter"]`, a label that is a
letter or an option's 0-based index, or a label whose text is one of `metadata["choices"]`; so
does this. Where none names a letter, slime looks for the answer's text in the response instead;
vime grades letters only, so such a label is a ValueError naming it rather than a silent 0.
"""

from __future__ import annotations

import re
import string
from typing import Any

from vime.rollout.rewards.grading import builtin_score, choice_label


def _words(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", " ", text.lower()).strip()


def _right_letter(label: Any, metadata: dict[str, Any]) -> str | None:
    given = metadata.get("correct_letter")
    if isinstance(given, str) and given.strip():
        return given.strip().upper()
    letter = choice_label(label)
    if letter is not None:
        return letter
    choices = metadata.get("choices")
    options = list(choices.values()) if isinstance(choices, dict) else list(choices or [])
    wanted = _words(str(label))
    return next((string.ascii_uppercase[i] for i, c in enumerate(options) if _words(str(c)) == wanted), None)


def compute_gpqa_reward(response: str | None, label: Any, metadata: dict[str, Any] | None = None) -> float:
    """1.0 when the response picks the right option's letter, else 0.0."""
    if response is None:
        return 0.0
    letter = _right_letter(label, metadata or {})
    if letter is None:
        raise ValueError(
            f"gpqa label {label!r} names no option letter (a letter, a 0-based index, metadata correct_letter, "
            "or one of metadata choices): vime grades the letter a response picks"
        )
    return builtin_score("gpqa", response, letter)
