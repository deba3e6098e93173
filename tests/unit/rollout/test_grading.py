"""Answer extraction and grading (vime/rollout/rewards/grading.py), pure functions: boxes and
Answer: lines, equivalent and different answers, normalization, words, units and currency,
numeric credit, slime's own extraction, grading and scoring cases, and deepscaler's text after
the reasoning. Rewards computed as a run computes them: test_reward_runner.py."""

from __future__ import annotations

import re

import pytest

from vime.datagen import generate
from vime.rollout.rewards import (
    builtin_score,
    extract_answer,
    grade,
    normalize,
    numeric_credit,
)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("so the result is \\boxed{\\frac{1}{2}}.", "\\frac{1}{2}"),
        ("first \\boxed{3}, on reflection \\boxed{4}", "4"),  # the last box wins
        ("\\boxed{\\{1, 2\\} \\cup {3}}", "\\{1, 2\\} \\cup {3}"),  # nested braces
        ("\\boxed{7} then a truncated \\boxed{8", "7"),  # an unclosed box is not an answer
        ("\\fbox{12}", "12"),
        ("\\boxed{5}\nAnswer: 6", "5"),  # a box beats an Answer: line
        ("work...\n**Answer:** 42.", "42"),
        ("**Answer**: $-3$", "$-3$"),
        ("final answer: 17", "17"),
        ("Answer:\n\n 99", "99"),  # answer on the line below the marker
        ("answer: 1\nchecking... Answer: 2", "2"),
        ("5-3 makes 2", "2"),  # binary minus is not a sign
        ("the temperature fell to -7", "-7"),
        ("it costs $1,234.50 in total.", "1234.50"),
        ("three quarters: 3/4", "3/4"),
        ("In 2023, 45 people came.", "45"),
        ("I don't know", None),
        ("", None),
        # a number with words after it is the number: units, or a remark after the answer
        ("Answer: 48 marbles", "48"),
        ("Answer: 48 dollars.", "48"),
        ("Answer: 8. I double checked the sum.", "8"),
        ("**Answer:** **8.** I double checked", "8"),
        ("Answer: 8, I think", "8"),
        ("Answer:\n48 marbles. Done.", "48"),
        ("Answer: \\$100 dollars", "\\$100"),
        ("Answer: $48$ marbles", "$48$"),
        ("Answer: 1,000 marbles", "1,000"),
        ("Answer: 50\\% of them", "50\\%"),
        ("Answer: 12 km per hour", "12"),
        ("\\boxed{5\\text{ cm}}", "5"),
        ("\\boxed{\\text{48 marbles}}", "48"),
        # ... unless a word could change or hedge it, or the words are not plain words
        ("Answer: 48 or 49", "48 or 49"),
        ("Answer: 48. Or 49.", "48. Or 49"),  # a sentence opening with a hedge stays with the answer
        ("Answer: 48 thousand", "48 thousand"),
        ("Answer: 3 and a half", "3 and a half"),
        ("Answer: 48 marbles and 2 left", "48 marbles and 2 left"),
        ("Answer: 5 x", "5 x"),  # a one-letter word is a variable, not a unit
        ("Answer: Maria has 48 marbles.", "Maria has 48 marbles"),  # words before the number are not read
    ],
)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


@pytest.mark.parametrize(
    "pred, label",
    [
        ("\\boxed{\\frac{1}{2}}", "0.5"),
        ("\\frac{1}{2}", "0.5"),
        ("\\dfrac{1}{2}", "\\frac12"),
        ("1,234", "1234"),
        ("1234", "1,234"),
        ("5.0", "5"),
        ("-3", "-3.00"),
        ("\\text{yes}", "yes"),
        ("\\left(1,2\\right)", "(1,2)"),
        ("x+1", "1+x"),
        ("3/4", "0.75"),
        ("$42$", "42"),
    ],
)
def test_grade_equivalent(pred, label):
    assert grade(pred, label)


@pytest.mark.parametrize(
    "pred, label", [("41", "42"), ("-5", "5"), ("0.51", "0.5"), (None, "1"), ("", "1"), ("1", None)]
)
def test_grade_different(pred, label):
    assert not grade(pred, label)


def test_normalize():
    assert normalize("$\\text{1,000}.$") == "1000"
    assert normalize("\\left( \\dfrac{1}{2} \\right)") == "(\\frac{1}{2})"
    assert normalize("\\$18.90") == "18.90"  # `\\$` before `$`, or a stray backslash is left
    assert normalize("100 dollars") == "100"  # labels too may carry a unit
    assert normalize("4.2e1") == "42"


@pytest.mark.parametrize(
    "response, label, right",
    [
        ("Answer: 48 marbles", "48", True),
        ("Answer: 48 dollars.", "48", True),
        ("Answer: 8. I double checked the sum.", "8", True),
        ("\\boxed{\\$18.90}", "18.90", True),
        ("\\boxed{\\$18.90}", "18.9", True),
        ("Answer: 18.9", "\\$18.90", True),
        ("Answer: \\$100", "100", True),
        ("Answer: 100 dollars", "100", True),
        ("Answer: 100", "100 dollars", True),
        ("Answer: $1,000 in total", "1000", True),
        ("Answer: 25\\%", "25", True),
        ("\\boxed{48 \\text{ marbles}}", "48", True),
        ("Answer: 42", "4.2e1", True),
        ("Answer: 48 or 49", "48", False),
        ("Answer: 48 or more", "48", False),  # math-verify alone reads this as 48
        ("Answer: 48 more or less", "48", False),
        ("Answer: 48. Or 49.", "48", False),
        ("Answer: 48 marbles, or 49 marbles", "48", False),
        ("Answer: 48 thousand", "48", False),
        ("Answer: 48 thousand", "48000", False),  # number words are not read: not credited either way
        ("Answer: 3 and a half", "3", False),
        ("\\boxed{48 \\text{ or } 49}", "48", False),
        ("Answer: 480", "48", False),
        ("Answer: 480 marbles", "48", False),
        ("Answer: -48 marbles", "48", False),
        ("Answer: \\$1,001", "1000", False),
    ],
)
def test_answers_with_words_units_and_currency(response, label, right):
    assert builtin_score("math", response, label) == (1.0 if right else 0.0)


def test_gsm_symbolic_answers_with_their_unit_score():
    """Our own gsm_symbolic questions ask `How many marbles...`: `Answer: 48 marbles.` is right."""
    rows = generate("gsm_symbolic", 60, seed=0)
    units = {re.search(r"How many (\w+)", r["input"]).group(1) for r in rows}
    assert {"dollars", "km"} <= units and len(units) >= 5  # every kind of unit the templates use is covered
    for r in rows:
        unit = re.search(r"How many (\w+)", r["input"]).group(1)
        label = r["label"]
        assert builtin_score("math", f"So that is it.\nAnswer: {label} {unit}.", label) == 1.0, r
        assert builtin_score("math", f"Answer: {int(label) + 1} {unit}.", label) == 0.0, r


def test_numeric_credit_reads_currency_and_separators():
    # 1,200 for 1,234: 0.5 × (1 − 34/1234); before, `$1,200` was not a number and earned 0
    assert round(numeric_credit("\\$1,200", "1234"), 6) == 0.486224
    assert numeric_credit("x", "1234") == 0.0


# ---------------------------------------------------------------- slime's reward cases
# The cases of slime's public reward tests (THUDM/slime tests/test_rm_math.py and
# tests/test_rm_math_dapo.py), restated against vime's functions. Cases on slime's internal
# helpers (remove_boxed, _strip_string, normalize_final_answer) are kept where vime has the
# same meaning: an extraction, or two answers graded equal. DIFFERS marks a case where vime
# scores otherwise on purpose; docs/architecture.md (rewards.py) gives the reasons.


@pytest.mark.parametrize(
    "text, expected",
    [
        ("first attempt \\boxed{wrong}, final \\boxed{42}", "42"),
        ("\\boxed{first}, then \\boxed{42}", "42"),
        ("answer: \\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
        ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
        ("answer: \\fbox{7}", "7"),
        ("Solution: \\fbox{42}", "42"),
        ("Solution: \\boxed{42}", "42"),
        ("\\boxed{x+1}", "x+1"),
        ("plain text, no box", None),
        ("not boxed at all", None),
        (None, None),
        ("start \\boxed{never closes", None),
        ("just 42", "42"),  # DIFFERS: slime's boxed extractor finds nothing; vime falls back to the trailing number
    ],
)
def test_slime_extraction_cases(text, expected):
    assert extract_answer(text) == expected


@pytest.mark.parametrize(
    "pred, label, same",
    [
        ("\\frac12", "\\frac{1}{2}", True),
        ("\\tfrac{1}{2}", "\\frac{1}{2}", True),
        ("\\left(1\\right)", "(1)", True),
        ("45^{\\circ}", "45", True),
        ("45^\\circ", "45", True),
        (".7", "0.7", True),
        ("0.5", "\\frac{1}{2}", True),
        (".5", "\\frac{1}{2}", True),
        ("3/4", "\\frac{3}{4}", True),
        ("1 + 1", "1+1", True),
        ("\\frac{1}{2}", "0.5", True),
        ("\\text{42}", "42", True),
        ("x+1", "1+x", True),
        ("x = 42", "42", True),
        ("42 square", "42", True),
        ("100 dollars", "100", True),
        ("\\text{hello}", "hello", True),
        ("\\boxed{42}", "42", True),
        ("1,234,567", "1234567", True),
        ("42<|endoftext|>", "42", True),
        ("42<|im_end|>", "42", True),
        ("42", "43", False),
        (None, "42", False),
        ("\\frac{2}{4}", "\\frac{1}{2}", True),  # DIFFERS: slime wants the reduced fraction; vime grades the value
        ("an answer", "answer", False),  # DIFFERS: slime drops English articles and spaces; vime reads no prose
        ("a b c", "bc", False),  # DIFFERS: as above
    ],
)
def test_slime_grading_cases(pred, label, same):
    assert grade(pred, label) is same


@pytest.mark.parametrize(
    "rm_type, response, label, expected",
    [
        ("math", "answer: \\boxed{42}", "\\boxed{42}", 1.0),
        ("math", "answer: \\fbox{42}", "\\fbox{42}", 1.0),
        ("math", "\\boxed{42}", "", 0.0),
        ("boxed_math", "long preamble … \\boxed{42}", "42", 1.0),
        ("boxed_math", "\\boxed{42}", "42", 1.0),
        ("dapo", "\\boxed{42}", "42", 1.0),
        ("dapo", "\\boxed{43}", "42", -1.0),
        ("dapo", "Long solution. Answer: 42", "42", 1.0),
        ("dapo", "Answer: 42", "42", 1.0),
        ("dapo", "Answer: 42", "42.0", 1.0),
        ("dapo", "Answer: 42", "4.2e1", 1.0),
        ("dapo", "Answer: 9007199254740993", "9007199254740993", 1.0),
        (
            "dapo",
            "Answer: 9007199254740992",
            "9007199254740993",
            -1.0,
        ),  # not slime's: the neighbour shows no float rounding
        ("dapo", "Answer: 41 was a wrong guess.\nAnswer: 42", "42", 1.0),
        ("math", "just 42", "42", 1.0),  # DIFFERS: slime needs a box; vime's `boxed_math` is that rule, below
        ("boxed_math", "just 42", "42", 0.0),  # not slime's: the rule slime applies, as vime spells it
        (
            "dapo",
            "just a number 42",
            "42",
            1.0,
        ),  # DIFFERS: slime's dapo needs `Answer:`; vime falls back to the trailing number
        (
            "boxed_math",
            "plain 42",
            "42",
            0.0,
        ),  # DIFFERS: slime's strict box scores -1; vime's boxed_math scores wrong as 0
        ("dapo", "\\boxed{42}" + " filler" * 60, "42", 1.0),  # DIFFERS: slime reads only the last 300 characters
        # DIFFERS: slime's dapo raises on a label that is not an integer; vime grades any label
        ("dapo", "Answer: 0", "0.5", -1.0),
        ("dapo", "Answer: 0", "1/2", -1.0),
        ("dapo", "Answer: 0", "1+2", -1.0),
        ("dapo", "Answer: 0", "NaN", -1.0),
        ("dapo", "Answer: 0", "Infinity", -1.0),
        ("dapo", "Answer: 1/2", "0.5", 1.0),  # not slime's: a fraction label is graded by value
    ],
)
def test_slime_scoring_cases(rm_type, response, label, expected):
    assert builtin_score(rm_type, response, label) == expected


# ---------------------------------------------------------------- deepscaler (--reward-key: test_reward_runner.py)


@pytest.mark.parametrize(
    "response, expected",
    [
        ("<think>so it is \\boxed{4}</think> I am not sure.", 0.0),  # a box inside the reasoning does not count
        ("<think>maybe \\boxed{5}</think> So the answer is \\boxed{4}.", 1.0),  # after the marker it does
        ("<think>\\boxed{4}</think> So the answer is \\boxed{5}.", 0.0),  # the box after the marker is graded
        ("So the answer is \\boxed{4}.", 0.0),  # no marker: the reasoning never ended
        ("<think>a</think> \\boxed{4} then </think> nothing", 0.0),  # only after the last </think>
        ("<think>a</think> \\boxed{5} </think> \\boxed{4}", 1.0),
        ("<think>a</think> Answer: 4", 0.0),  # only a box is an answer
        ("plan ###Response the answer is \\boxed{4}", 1.0),  # slime's other marker
        ("\\boxed{5} ###Response \\boxed{4} ###Response \\boxed{5}", 1.0),  # up to a second ###Response
        ("<think>a</think> \\boxed{\\frac{8}{2}}", 1.0),  # graded by value
    ],
)
def test_deepscaler_grades_only_the_text_after_the_reasoning(response, expected):
    assert builtin_score("deepscaler", response, "4") == expected
