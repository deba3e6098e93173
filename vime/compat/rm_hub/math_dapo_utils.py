"""`from vime.rollout.rm_hub.math_dapo_utils import compute_score`: DAPO's math verifier, as
vllm-project/vime's retool reward calls it (`compute_score(solution, label, strict_box_verify=True)`).

DAPO grades the end of a solution only (its last 300 characters: an answer comes last) and
scores ±1, never 0, so a wrong answer and no answer are punished alike. Two readings:

* strict (`strict_box_verify=True`): the last `\\boxed{...}` within the final 100 characters is
  the answer, and it must be the label's text exactly (no normalizing, as DAPO's training data
  gives integer answers);
* lenient: the answer is what follows the last `Answer:` (or, failing that, the last box), and it
  matches when vime's normalized forms are equal (`\\$18` and `18`).

The answer is a dict, as DAPO's is: `score` (±1.0, what `--reward-key score` trains on), `acc`
(was it right) and `pred` (the answer read, None when none was found).
"""

from __future__ import annotations

from typing import Any

from vime.rollout.rewards.answers import _answer_line, boxed_contents, normalize

TAIL_CHARS = 300  # DAPO's cut: the longest answer of MATH-500 is 159 characters
STRICT_TAIL_CHARS = 100  # where the strict reading looks for its box


def _strict_answer(tail: str) -> str | None:
    boxes = boxed_contents(tail[-STRICT_TAIL_CHARS:])
    return boxes[-1] if boxes else None


def _lenient_answer(tail: str) -> str | None:
    line = _answer_line(tail)
    if line is not None:
        return line
    boxes = boxed_contents(tail)
    return boxes[-1] if boxes else None


def compute_score(
    solution_str: str,
    ground_truth: Any,
    strict_box_verify: bool = False,
    pause_tokens_index: list[int] | None = None,
) -> dict[str, Any]:
    """`{"score": 1.0 or -1.0, "acc": bool, "pred": str or None}` of one solution against its
    label. `pause_tokens_index` (DAPO's pause-token variant) is taken for the call's sake and
    not used: vime's responses have no pause tokens."""
    del pause_tokens_index
    tail = (solution_str or "")[-TAIL_CHARS:]
    label = "" if ground_truth is None else str(ground_truth)
    if strict_box_verify:
        pred = _strict_answer(tail)
        right = pred is not None and pred == label.strip()
    else:
        pred = _lenient_answer(tail)
        right = pred is not None and bool(label.strip()) and normalize(pred) == normalize(label)
    return {"score": 1.0 if right else -1.0, "acc": right, "pred": pred}


__all__ = ["compute_score"]
