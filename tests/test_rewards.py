"""Answer extraction, grading, built-in rm types, custom rewards, and reward failures."""
from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace

import pytest

from vime.rollout.rewards import RewardError, extract_answer, get_reward_fn, grade, normalize, score_samples
from vime.rollout.types import Sample, Status


def make_args(**kw) -> SimpleNamespace:
    return SimpleNamespace(**{"rm_type": "math", "custom_rm_path": None, "reward_timeout": 10.0, **kw})


def score(args, samples: list[Sample]) -> dict:
    return asyncio.run(score_samples(args, samples))


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


@pytest.mark.parametrize("pred, label", [("41", "42"), ("-5", "5"), ("0.51", "0.5"), (None, "1"), ("", "1"), ("1", None)])
def test_grade_different(pred, label):
    assert not grade(pred, label)


def test_normalize():
    assert normalize("$\\text{1,000}.$") == "1000"
    assert normalize("\\left( \\dfrac{1}{2} \\right)") == "(\\frac{1}{2})"


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
        get_reward_fn(make_args(rm_type="nonsense"))
    assert "nonsense" in str(e.value) and "math" in str(e.value) and "dapo" in str(e.value)


def test_bad_custom_rm_path(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "rm_missing_attr.py").write_text("x = 1\n")
    for path in ["no_such_module_xyz.fn", "rm_missing_attr:reward", "rm_missing_attr.x", "noseparator"]:
        with pytest.raises(RewardError, match="custom-rm-path"):
            get_reward_fn(make_args(custom_rm_path=path))


CUSTOM_RM = '''
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
'''


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


def test_failing_rewards_score_zero_and_are_counted(custom_module, caplog, monkeypatch):
    import vime.rollout.rewards as rewards

    monkeypatch.setattr(rewards, "_logged_error_types", set())
    samples = [Sample(index=i) for i in range(4)]
    with caplog.at_level(logging.WARNING, logger="vime"):
        metrics = score(make_args(custom_rm_path="my_custom_rm:broken_rm"), samples)
        score(make_args(custom_rm_path="my_custom_rm:broken_rm"), [Sample(index=1)])
    assert [s.reward for s in samples] == [1.0, 0.0, 1.0, 1.0]
    assert metrics == {"rollout/reward_errors": 1.0, "rollout/reward_timeouts": 0.0}
    assert sum("KeyError" in r.getMessage() for r in caplog.records) == 1  # logged once per exception type


def test_slow_reward_times_out(custom_module):
    samples = [Sample(index=0), Sample(index=1)]
    metrics = score(make_args(custom_rm_path="my_custom_rm:slow_rm", reward_timeout=0.2), samples)
    assert [s.reward for s in samples] == [0.0, 1.0]
    assert metrics == {"rollout/reward_errors": 0.0, "rollout/reward_timeouts": 1.0}


def test_inline_fallback_without_a_pool(monkeypatch):
    import vime.rollout.rewards as rewards

    monkeypatch.setattr(rewards, "_get_pool", lambda: None)
    samples = [Sample(index=0, response="\\boxed{2}", label="2"), Sample(index=1, response="\\boxed{3}", label="2")]
    assert score(make_args(), samples) == {"rollout/reward_errors": 0.0, "rollout/reward_timeouts": 0.0}
    assert [s.reward for s in samples] == [1.0, 0.0]


def test_worker_timer_interrupts_slow_grading(monkeypatch):
    import time

    import vime.rollout.rewards as rewards

    monkeypatch.setattr(rewards, "builtin_score", lambda *a: time.sleep(5))
    t0 = time.perf_counter()
    with pytest.raises(rewards.GradingTimeout):
        rewards._score_with_timeout("math", "", "1", 0.1)  # as in a pool worker: the main thread
    assert time.perf_counter() - t0 < 2


def test_reasoning_gym_reward_uses_the_tasks_own_scorer(tmp_path):
    from vime.datagen import write_dataset
    from vime.rollout.data_source import load_prompts

    row = load_prompts(write_dataset("rg:chain_sum", tmp_path, n_train=1, n_test=0, seed=0)[0])[0]
    answer = row["metadata"]["reasoning_gym"]["entry"]["answer"]
    responses = [f"Adding up: Answer: {answer}", f"so \\boxed{{{answer}}}", f"Answer: {int(answer) + 1}", "no idea", f"Answer: {answer}"]
    samples = [Sample(index=i, response=r, label=row["label"], metadata=row["metadata"]) for i, r in enumerate(responses)]
    samples[-1].metadata = {}  # not a reasoning-gym row: an error, counted, never a crash
    metrics = score(make_args(rm_type="reasoning_gym"), samples)
    assert [s.reward for s in samples] == [1.0, 1.0, 0.0, 0.0, 0.0]
    assert metrics == {"rollout/reward_errors": 1.0, "rollout/reward_timeouts": 0.0} and samples[-1].reward_error == "error"


def test_reasoning_gym_scores_are_the_tasks_own():
    from vime.rollout import rg

    # gcd keeps reasoning-gym's default scorer: an answer that contains the right one earns
    # len(right) / len(answer), partial credit no label match gives
    entry = {"question": "Find the GCD of 12, 18.", "answer": "6", "metadata": {}}
    metadata = {"reasoning_gym": {"task": "gcd", "config": {}, "entry": entry}}
    assert [rg.score(r, metadata) for r in ["Answer: 6", "Answer: 6 apples", "Answer: 3"]] == [1.0, 1 / 8, 0.0]
    with pytest.raises(RewardError, match="reasoning_gym"):
        get_reward_fn(make_args(rm_type="reasoning-gym"))  # the unknown-type message lists it
