"""examples/generative_rm: a reward model that is another checkpoint served by a real vime engine
(a tiny model of another seed), asked through the engine's OpenAI chat route, scored by vime's
reward runner as a `--custom-rm-path` function is in a run."""

from __future__ import annotations

import asyncio

import pytest

from examples.generative_rm.judge import API_KEY_ENV, ask_judge, judge_messages, verdict
from vime.backends.builtin.launch import launch_engine
from vime.config import Config
from vime.models import make_tiny_model
from vime.rollout.rewards import Rewards
from vime.rollout.rewards.runner import RewardRunner
from vime.rollout.types import Sample

KEY = "judge-key-not-secret"
JUDGE = "examples.generative_rm.judge:judge"


@pytest.fixture(scope="module")
def judge_engine(tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("judge") / "qwen3", arch="qwen3", seed=1)
    engine = launch_engine(str(path), api_key=KEY, log_path=tmp_path_factory.mktemp("logs") / "judge.log")
    yield engine
    engine.shutdown()


def _samples() -> list[Sample]:
    return [
        Sample(index=0, prompt="6+9=", response="15", label="15"),
        Sample(index=1, prompt=[{"role": "user", "content": "2+2="}], response="5", label="4"),
        Sample(index=2, prompt="1+1=", response="2", label="2"),
    ]


def _score(url: str, samples: list[Sample]) -> dict[str, float]:
    args = Config(custom_rm_path=JUDGE, rm_url=url, reward_timeout=60.0)
    runner = RewardRunner(60.0)
    try:
        return asyncio.run(Rewards(args, runner).score(samples))
    finally:
        runner.close()


@pytest.mark.parametrize(
    "reply, score",
    [
        ("Yes", 1.0),
        (" yes.", 1.0),
        ("**Yes**, it is", 1.0),
        ("No", 0.0),
        ("", 0.0),
        ("yesterday", 0.0),
        ("I say yes", 0.0),
    ],
)
def test_the_judges_first_word_is_the_verdict(reply, score):
    assert verdict(reply) == score


def test_each_sample_scores_what_the_judge_engine_says_of_it(judge_engine, monkeypatch):
    """The reward of each sample is the verdict on the judge's own greedy reply to that sample's
    question, label and response: the same reply the engine gives when asked directly."""
    monkeypatch.setenv(API_KEY_ENV, KEY)
    samples = _samples()
    counts = _score(judge_engine.url, samples)
    assert counts == {"rollout/reward_errors": 0.0, "rollout/reward_timeouts": 0.0}
    for s in samples:
        reply = asyncio.run(ask_judge(judge_engine.url, judge_messages(s.prompt, s.label, s.response), KEY))
        assert s.reward == verdict(reply) and s.reward_error is None
    assert judge_messages(samples[1].prompt, "4", "5")[1]["content"].startswith("Question: 2+2=\n")


def test_a_judge_that_refuses_costs_the_samples_reward_not_the_run(judge_engine, monkeypatch):
    """A wrong key (the engine answers 401) and a judge that is not there: each sample scores 0 and
    is counted as a reward error; nothing raises out of the runner."""
    monkeypatch.setenv(API_KEY_ENV, "wrong")
    refused = _samples()
    assert _score(judge_engine.url, refused)["rollout/reward_errors"] == len(refused)
    assert all(s.reward == 0.0 and s.reward_error == "error" for s in refused)
    gone = _samples()
    assert _score("http://127.0.0.1:9", gone)["rollout/reward_errors"] == len(gone)
