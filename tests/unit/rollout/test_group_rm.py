"""--group-rm: a --custom-rm-path reward called once per prompt group, as vllm-project/vime's
batched reward is; what a failing or misfitting one does; a run that trains on it."""

from __future__ import annotations

import asyncio
import json

import group_rm
import pytest
from conftest import run_cli

from vime.config import Config
from vime.rollout.rewards import Rewards, RewardSettingError
from vime.rollout.types import Sample


def rewards_of(path: str) -> Rewards:
    return Rewards(Config(rm_type="math", custom_rm_path=path, group_rm=True, reward_timeout=10.0))


def groups(n_groups: int, n: int) -> list[Sample]:
    return [
        Sample(index=g * n + k, group_index=g, response="x" * (1 + (k * 7 + g) % n))
        for g in range(n_groups)
        for k in range(n)
    ]


def test_a_group_reward_is_called_once_per_group_and_scores_each_sample():
    group_rm.CALLS.clear()
    samples = groups(3, 4)
    metrics = asyncio.run(rewards_of("group_rm:longest_wins").score(samples))
    assert sorted(group_rm.CALLS) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    for g in range(3):
        mine = samples[g * 4 : (g + 1) * 4]
        longest = max(mine, key=lambda s: len(s.response))
        assert [s.reward for s in mine] == [1.0 if s is longest else 0.0 for s in mine]
    assert metrics == {"rollout/reward_errors": 0.0, "rollout/reward_timeouts": 0.0}


def test_a_raising_group_reward_scores_its_group_0_and_counts_every_sample():
    samples = groups(2, 3)
    metrics = asyncio.run(rewards_of("group_rm:raises_on_group_1").score(samples))
    assert [s.reward for s in samples] == [0.5, 0.5, 0.5, 0.0, 0.0, 0.0]
    assert [s.reward_error for s in samples[3:]] == ["error"] * 3
    assert metrics["rollout/reward_errors"] == 3.0


def test_a_group_reward_may_answer_an_array():
    samples = groups(1, 4)
    asyncio.run(rewards_of("group_rm:as_array").score(samples))
    assert [s.reward for s in samples] == [0.0, 0.25, 0.5, 0.75]


def test_a_group_reward_of_the_wrong_length_is_one_line():
    with pytest.raises(
        RewardSettingError,
        match=r"returned 2 answers for a group of 3 samples: it must return a list of one reward per sample",
    ):
        asyncio.run(rewards_of("group_rm:one_short").score(groups(1, 3)))


def test_a_run_with_group_rm_trains_on_whole_groups(tmp_path):
    """The tiny example with a reward only a whole group can give: exactly one sample of each group
    of 4 scores 1, so the mean reward is 1/4 every step (a per-sample call would make it 1), and
    the weights move on it."""
    out = run_cli(
        *("train.py", "--config", "examples/tiny.yaml", "--num-rollout", "2", "--n-samples-per-prompt", "4"),
        *("--group-rm", "--custom-rm-path", "group_rm:longest_wins", "--runs-dir", str(tmp_path), "--run-name", "g"),
        timeout=180,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [json.loads(x) for x in (tmp_path / "g" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "perf/step_time" in r]
    assert len(steps) == 2
    for r in steps:
        assert r["rollout/reward_mean"] == pytest.approx(0.25), r["rollout/reward_mean"]
        assert r["train/grad_norm"] > 0  # one winner per group: every group has an advantage to learn from
