"""Answer extraction, grading, built-in rm types, custom rewards, and reward failures."""

from __future__ import annotations

import asyncio
import logging
import re

import pytest

from vime.config import Config
from vime.datagen import generate
from vime.rollout.rewards import (
    RewardError,
    RewardKeyError,
    Rewards,
    builtin_score,
    extract_answer,
    grade,
    normalize,
    numeric_credit,
    read_reward,
)
from vime.rollout.rewards.runner import RewardRunner
from vime.rollout.types import Sample, Status


def make_args(**kw) -> Config:
    return Config(**{"rm_type": "math", "custom_rm_path": None, "reward_timeout": 10.0, **kw})


# One runner per timeout for the whole module, as a run has one: its grading pool starts once
# (spawn and the sympy import take seconds), not once per test.
_RUNNERS: dict[float, RewardRunner] = {}


@pytest.fixture(scope="module", autouse=True)
def _close_runners():
    yield
    for runner in _RUNNERS.values():
        runner.close()


def score(args, samples: list[Sample]) -> dict:
    timeout = float(args.reward_timeout)
    runner = _RUNNERS.setdefault(timeout, RewardRunner(timeout))
    return asyncio.run(Rewards(args, runner).score(samples))


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


def test_math_and_dapo_scores_through_the_pool():
    def batch():
        return [
            Sample(index=0, response="so \\boxed{\\frac{1}{2}}", label="0.5"),
            Sample(index=1, response="**Answer:** 1,234", label="1234"),
            Sample(index=2, response="the answer is 41", label="42"),
            Sample(index=3, response="no idea", label="42"),
            Sample(index=4, response="\\boxed{42}", label="42", status=Status.FAILED),  # never graded
        ]

    math = batch()
    assert score(make_args(), math) == {"rollout/reward_errors": 0.0, "rollout/reward_timeouts": 0.0}
    assert [s.reward for s in math] == [1.0, 1.0, 0.0, 0.0, 0.0]
    dapo = batch()
    score(make_args(rm_type="dapo"), dapo)
    assert [s.reward for s in dapo] == [1.0, 1.0, -1.0, -1.0, 0.0]


def test_boxed_math_counts_only_boxes():
    samples = [Sample(index=0, response="\\boxed{3}", label="3"), Sample(index=1, response="Answer: 3", label="3")]
    score(make_args(rm_type="boxed_math"), samples)
    assert [s.reward for s in samples] == [1.0, 0.0]


def test_exact_grades_a_list_in_full_and_in_order():
    """math-verify reads a list as a set; `exact` compares the normalized strings only, and
    finds a list on the last line (its trailing number would be the list's last item)."""
    lst = "18, 19, 20, 21"
    assert grade("18, 19, 21, 20", lst) and not grade("18, 19, 21, 20", lst, exact=True)
    responses = {
        "18, 19, 20, 21": 1.0,
        "The integers are:\n18, 19, 20, 21.": 1.0,
        "Answer: 18, 19, 20, 21": 1.0,
        "\\boxed{18, 19, 20, 21}": 1.0,
        "18, 19, 21, 20": 0.0,  # out of order
        "18, 19, 20, 21, 21": 0.0,  # an item twice
        "18, 19, 20, 21, 22": 0.0,  # past the end
        "Answer: 18, 19, 20\n21": 0.0,  # the Answer: line is the answer
        "Counting: 21": 0.0,  # the last item alone is not the list
    }
    samples = [Sample(index=i, response=r, label=lst) for i, r in enumerate(responses)]
    # a one-number label is read as `math` reads it: the trailing number, but never math-verify's
    samples += [Sample(index=len(samples), response="17 + 23 = 40", label="40")]
    samples += [Sample(index=len(samples), response="Answer: 40 or 41", label="40")]
    score(make_args(rm_type="exact"), samples)
    assert [s.reward for s in samples] == [*responses.values(), 1.0, 0.0]


def test_math_shaped_gives_wrong_numbers_credit_by_closeness():
    # right → 1; 41 for 42: 0.5 × (1 − 1/42) = 0.488095; 3/4 for 1/2: 0.5 × (1 − 0.25/1) = 0.375
    # (|label| < 1 counts as 1); 100 for 42 is off by more than 42 → 0; no number → 0
    samples = [
        Sample(index=0, response="\\boxed{42}", label="42"),
        Sample(index=1, response="the answer is 41", label="42"),
        Sample(index=2, response="3/4", label="1/2"),
        Sample(index=3, response="100", label="42"),
        Sample(index=4, response="no idea", label="42"),
    ]
    score(make_args(rm_type="math_shaped"), samples)
    assert [round(s.reward, 6) for s in samples] == [1.0, 0.488095, 0.375, 0.0, 0.0]


def test_unknown_rm_type_lists_the_known_ones():
    with pytest.raises(RewardError) as e:
        Rewards(make_args(rm_type="nonsense"))
    assert "nonsense" in str(e.value) and "math" in str(e.value) and "dapo" in str(e.value)


def test_bad_custom_rm_path(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "rm_missing_attr.py").write_text("x = 1\n")
    for path in ["no_such_module_xyz.fn", "rm_missing_attr:reward", "rm_missing_attr.x", "noseparator"]:
        with pytest.raises(RewardError, match="custom-rm-path"):
            Rewards(make_args(custom_rm_path=path))


CUSTOM_RM = """
import asyncio

calls = []

def sync_rm(args, sample):
    calls.append(sample.index)
    return 0.25 if sample.label == "a" else 0.75

async def async_rm(args, sample):
    await asyncio.sleep(0)
    calls.append(sample.index)
    return len(sample.response)

def broken_rm(args, sample):
    if sample.index == 1:
        raise KeyError("boom")
    return 1.0

async def slow_rm(args, sample):
    await asyncio.sleep(5 if sample.index == 0 else 0)
    return 1.0

def dict_rm(args, sample):
    return {"score": 0.5 * sample.index, "r": 2.0, "acc": sample.index % 2 == 0, "pred": "x", "n": float("nan")}

async def pred_rm(args, sample):
    return {"score": "high", "pred": "x"} if sample.index == 1 else {"score": 1.0}
"""


@pytest.fixture
def custom_module(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "my_custom_rm.py").write_text(CUSTOM_RM)
    import importlib

    import my_custom_rm

    yield importlib.reload(my_custom_rm)


def test_custom_rm_sync_and_async(custom_module):
    samples = [Sample(index=0, label="a"), Sample(index=1, label="b"), Sample(index=2, label="a", status=Status.FAILED)]
    score(make_args(custom_rm_path="my_custom_rm:sync_rm"), samples)
    assert [s.reward for s in samples] == [0.25, 0.75, 0.0]
    assert sorted(custom_module.calls) == [0, 1]  # the FAILED sample never reached the reward
    samples = [Sample(index=3, response="abc"), Sample(index=4, response="")]
    score(make_args(custom_rm_path="my_custom_rm.async_rm"), samples)  # dotted form works too
    assert [s.reward for s in samples] == [3.0, 0.0]


def test_failing_rewards_score_zero_and_are_counted(custom_module, caplog):
    rewards = Rewards(make_args(custom_rm_path="my_custom_rm:broken_rm"))
    samples = [Sample(index=i) for i in range(4)]
    with caplog.at_level(logging.WARNING, logger="vime"):
        metrics = asyncio.run(rewards.score(samples))
        asyncio.run(rewards.score([Sample(index=1)]))
    assert [s.reward for s in samples] == [1.0, 0.0, 1.0, 1.0]
    assert metrics == {"rollout/reward_errors": 1.0, "rollout/reward_timeouts": 0.0}
    assert sum("KeyError" in r.getMessage() for r in caplog.records) == 1  # logged once per exception type


def test_slow_reward_times_out(custom_module):
    samples = [Sample(index=0), Sample(index=1)]
    metrics = score(make_args(custom_rm_path="my_custom_rm:slow_rm", reward_timeout=0.2), samples)
    assert [s.reward for s in samples] == [0.0, 1.0]
    assert metrics == {"rollout/reward_errors": 0.0, "rollout/reward_timeouts": 1.0}


def test_inline_fallback_without_a_pool():
    runner = RewardRunner(10.0)
    runner.pool_unavailable = True  # as after a pool that could not start (no /dev/shm semaphores)
    samples = [Sample(index=0, response="\\boxed{2}", label="2"), Sample(index=1, response="\\boxed{3}", label="2")]
    metrics = asyncio.run(Rewards(make_args(), runner).score(samples))
    assert metrics == {"rollout/reward_errors": 0.0, "rollout/reward_timeouts": 0.0}
    assert runner._pool is None  # graded in this process
    assert [s.reward for s in samples] == [1.0, 0.0]


def test_worker_timer_interrupts_slow_grading(monkeypatch):
    import time

    import vime.rollout.rewards.runner as runner

    monkeypatch.setattr(runner, "builtin_result", lambda *a: time.sleep(5))
    t0 = time.perf_counter()
    with pytest.raises(runner.GradingTimeout):
        runner.score_with_timeout("math", "", "1", 0.1)  # as in a pool worker: the main thread
    assert time.perf_counter() - t0 < 2


def test_reasoning_gym_reward_uses_the_tasks_own_scorer(tmp_path):
    from vime.datagen import write_dataset
    from vime.rollout.data.rows import load_prompts

    row = load_prompts(write_dataset("rg:chain_sum", tmp_path, n_train=1, n_test=0, seed=0)[0])[0]
    answer = row["metadata"]["reasoning_gym"]["entry"]["answer"]
    responses = [
        f"Adding up: Answer: {answer}",
        f"so \\boxed{{{answer}}}",
        f"Answer: {int(answer) + 1}",
        "no idea",
        f"Answer: {answer}",
    ]
    samples = [
        Sample(index=i, response=r, label=row["label"], metadata=row["metadata"]) for i, r in enumerate(responses)
    ]
    samples[-1].metadata = {}  # not a reasoning-gym row: an error, counted, never a crash
    metrics = score(make_args(rm_type="reasoning_gym"), samples)
    assert [s.reward for s in samples] == [1.0, 1.0, 0.0, 0.0, 0.0]
    assert (
        metrics == {"rollout/reward_errors": 1.0, "rollout/reward_timeouts": 0.0}
        and samples[-1].reward_error == "error"
    )


def test_reasoning_gym_scores_are_the_tasks_own():
    from vime.rollout.data import reasoning_gym as rg

    # gcd keeps reasoning-gym's default scorer: an answer that contains the right one earns
    # len(right) / len(answer), partial credit no label match gives (a hedged answer stays
    # whole through vime's extraction; a unit word after the number is dropped by it)
    entry = {"question": "Find the GCD of 12, 18.", "answer": "6", "metadata": {}}
    metadata = {"reasoning_gym": {"task": "gcd", "config": {}, "entry": entry}}
    assert [rg.score(r, metadata) for r in ["Answer: 6", "Answer: 6 apples", "Answer: 6 or 7", "Answer: 3"]] == [
        1.0,
        1.0,
        1 / 6,
        0.0,
    ]
    with pytest.raises(RewardError, match="reasoning_gym"):
        Rewards(make_args(rm_type="reasoning-gym"))  # the unknown-type message lists it


# ---------------------------------------------------------------- deepscaler and --reward-key


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


def test_deepscaler_through_the_pool():
    samples = [
        Sample(index=0, response="<think>\\boxed{7}</think>", label="7"),
        Sample(index=1, response="<think>hmm</think>\\boxed{7}", label="7"),
    ]
    score(make_args(rm_type="deepscaler"), samples)
    assert [s.reward for s in samples] == [0.0, 1.0]
    assert [s.reward_extras for s in samples] == [{"acc": 0.0}, {"acc": 1.0}]


def test_dapo_with_reward_key_score_is_slimes_plus_minus_one():
    """slime's scripts pass `--rm-type dapo --reward-key score`: slime's dapo reward returns
    {score: ±1, acc, pred} and trains on score; so does vime's, with acc logged."""
    from vime.rollout.generate import rollout_metrics

    def batch() -> list[Sample]:
        return [
            Sample(index=0, response="Answer: 42", label="42"),
            Sample(index=1, response="Answer: 41", label="42"),
            Sample(index=2, response="no idea", label="42"),
            Sample(index=3, response="\\boxed{42}", label="42"),
        ]

    dapo = batch()
    assert score(make_args(rm_type="dapo", reward_key="score"), dapo) == {
        "rollout/reward_errors": 0.0,
        "rollout/reward_timeouts": 0.0,
    }
    assert [s.reward for s in dapo] == [1.0, -1.0, -1.0, 1.0]
    metrics = rollout_metrics([dapo])
    assert metrics["rollout/reward_mean"] == 0.0 and metrics["rollout/reward_acc"] == 0.5
    acc = batch()
    score(make_args(rm_type="dapo", reward_key="acc"), acc)  # slime's other key: 1 right, 0 wrong
    assert [s.reward for s in acc] == [1.0, 0.0, 0.0, 1.0] and all("score" in s.reward_extras for s in acc)
    with pytest.raises(
        RewardKeyError,
        match=r"--rm-type dapo returned a dict without the key 'pred' \(its keys: score, acc\): set --reward-key",
    ):
        score(make_args(rm_type="dapo", reward_key="pred"), batch())


def test_dict_rewards_are_read_at_the_reward_key(custom_module):
    from vime.rollout.generate import rollout_metrics

    samples = [Sample(index=i) for i in range(3)]
    score(make_args(custom_rm_path="my_custom_rm:dict_rm"), samples)  # default key: score
    assert [s.reward for s in samples] == [0.0, 0.5, 1.0]
    # the other finite numbers are kept (bools as 1/0); strings and NaN are not
    assert samples[1].reward_extras == {"r": 2.0, "acc": 0.0}
    metrics = rollout_metrics([samples])
    assert metrics["rollout/reward_r"] == 2.0 and metrics["rollout/reward_acc"] == pytest.approx(2 / 3)
    score(make_args(custom_rm_path="my_custom_rm:dict_rm", reward_key="r"), samples)
    assert [s.reward for s in samples] == [2.0] * 3 and samples[2].reward_extras == {"score": 1.0, "acc": 1.0}
    # a dict without the key stops the run: every sample would score 0
    with pytest.raises(RewardKeyError) as e:
        score(make_args(custom_rm_path="my_custom_rm:dict_rm", reward_key="reward"), samples)
    msg = str(e.value)
    assert "'reward'" in msg and "score, r, acc, pred, n" in msg and "--reward-key" in msg and "\n" not in msg
    # a value at the key that is not a number fails that sample only
    samples = [Sample(index=0), Sample(index=1)]
    assert score(make_args(custom_rm_path="my_custom_rm:pred_rm"), samples)["rollout/reward_errors"] == 1.0
    assert [(s.reward, s.reward_error) for s in samples] == [(1.0, None), (0.0, "error")]


def test_a_number_where_reward_key_asks_for_a_dict(custom_module):
    samples = [Sample(index=0, label="a")]
    score(make_args(custom_rm_path="my_custom_rm:sync_rm"), samples)  # no --reward-key: a number is the score
    assert samples[0].reward == 0.25 and samples[0].reward_extras == {}
    with pytest.raises(
        RewardKeyError,
        match=r"--reward-key score reads a dict, but --custom-rm-path my_custom_rm:sync_rm returned the number 0.25",
    ):
        score(make_args(custom_rm_path="my_custom_rm:sync_rm", reward_key="score"), samples)
    # a built-in's number is its score: --reward-key score fits it, another key does not
    assert read_reward(make_args(rm_type="reasoning_gym", reward_key="score"), 0.5) == (0.5, {})
    with pytest.raises(RewardKeyError, match="--reward-key acc: --rm-type reasoning_gym returns one number"):
        read_reward(make_args(rm_type="reasoning_gym", reward_key="acc"), 0.5)


def test_closed_rewards_start_no_pool_again():
    """After the run closed its rewards, a late sample (a straggler of the rollout loop) is an
    error, counted, and no grading pool is started again to outlive the run."""
    rewards = Rewards(make_args())
    rewards.close()
    samples = [Sample(index=0, response="\\boxed{2}", label="2")]
    assert asyncio.run(rewards.score(samples)) == {"rollout/reward_errors": 1.0, "rollout/reward_timeouts": 0.0}
    assert rewards.runner._pool is None
