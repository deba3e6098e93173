"""Rewards as a run computes them (vime/rollout/rewards/): the built-in rm types through the
grading pool, custom rewards (sync and async, failing, slow), the pool's fallback and timer,
reasoning-gym's reward and its tasks' own scorers, deepscaler's and dapo's scores, dict rewards read at --reward-key, the
one-line refusals of an unknown rm type or a bad --custom-rm-path, and closed rewards that start
no pool again."""

from __future__ import annotations

import asyncio
import logging

import pytest

from vime.config import Config
from vime.rollout.rewards import (
    RewardError,
    RewardKeyError,
    Rewards,
    grade,
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


def test_a_reward_too_large_for_a_float_is_the_samples_error_not_a_traceback():
    """10**400 from a custom reward (or as a dict's other value) ended the run in OverflowError's
    traceback: float() of it overflows, where NaN is a number the run already scores 0."""
    args = make_args(rm_type="math", custom_rm_path="m.f")
    with pytest.raises(ValueError, match="is too large for a number"):
        read_reward(args, 10**400)
    with pytest.raises(ValueError, match="is too large for a number|not a number"):
        read_reward(args, {"score": 10**400})
    assert read_reward(args, {"score": 1.0, "acc": 10**400}) == (1.0, {})  # not logged, as a string is not


def test_closed_rewards_start_no_pool_again():
    """After the run closed its rewards, a late sample (a straggler of the rollout loop) is an
    error, counted, and no grading pool is started again to outlive the run."""
    rewards = Rewards(make_args())
    rewards.close()
    samples = [Sample(index=0, response="\\boxed{2}", label="2")]
    assert asyncio.run(rewards.score(samples)) == {"rollout/reward_errors": 1.0, "rollout/reward_timeouts": 0.0}
    assert rewards.runner._pool is None
