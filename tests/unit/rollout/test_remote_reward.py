"""--rm-type remote_rm against a real HTTP reward server on loopback (aiohttp, in a thread):
the body slime sends, rewards read like any other, a busy server retried, a refusal and a hung
server scored 0 and counted, and the settings checked before anything starts."""

from __future__ import annotations

import asyncio
import re
import threading
from collections.abc import Iterator

import pytest
from aiohttp import web

from vime.config import Config, ConfigError, parse_args
from vime.rollout.rewards import Rewards
from vime.rollout.rewards.remote import MAX_ANSWER_BYTES
from vime.rollout.rewards.runner import RewardRunner
from vime.rollout.types import Sample

BASE = ["--hf-checkpoint", "tiny", "--prompt-data", "x.jsonl", "--num-rollout", "2"]


class RewardServer:
    """Grades `response == label` (1/0); `busy` answers 503 that many times first; a label of
    "hang" never answers; a label of "refuse" answers 400; "dict" answers {"score", "acc"}; "huge"
    answers a number padded past what is read of an answer; "deep" JSON nested 100,000 deep."""

    def __init__(self) -> None:
        self.bodies: list[dict] = []
        self.busy = 0
        self.loop = asyncio.new_event_loop()
        started = threading.Event()
        threading.Thread(target=self._serve, args=(started,), daemon=True).start()
        assert started.wait(10)

    def _serve(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        app = web.Application()
        app.router.add_post("/reward", self._reward)
        runner = web.AppRunner(app)
        self.loop.run_until_complete(runner.setup())
        site = web.TCPSite(runner, "127.0.0.1", 0)
        self.loop.run_until_complete(site.start())
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}/reward"
        started.set()
        self.loop.run_forever()

    async def _reward(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.bodies.append(body)
        if self.busy > 0:
            self.busy -= 1
            return web.Response(status=503, text="warming up")
        if body["label"] == "hang":
            await asyncio.sleep(60)
        if body["label"] == "refuse":
            return web.Response(status=400, text="bad request: no such task")
        if body["label"] == "huge":
            return web.Response(text="1" + " " * (MAX_ANSWER_BYTES + 1), content_type="application/json")
        if body["label"] == "deep":
            return web.Response(text="[" * 100_000 + "]" * 100_000, content_type="application/json")
        right = float(body["response"] == body["label"])
        return web.json_response({"score": right, "acc": right} if body["label"] == "dict" else right)


@pytest.fixture(scope="module")
def server() -> Iterator[RewardServer]:
    yield RewardServer()


def _score(server: RewardServer, samples: list[Sample], timeout: float = 5.0) -> dict:
    args = Config(rm_type="remote_rm", rm_url=server.url, custom_rm_path=None, reward_timeout=timeout)
    runner = RewardRunner(timeout)
    try:
        return asyncio.run(Rewards(args, runner).score(samples))
    finally:
        runner.close()


def _sample(i: int, response: str, label) -> Sample:
    return Sample(index=i, prompt=f"question {i}", response=response, label=label)


def test_each_sample_is_posted_as_slime_does_and_its_answer_is_the_reward(server):
    server.bodies.clear()
    samples = [_sample(0, "42", "42"), _sample(1, "41", "42"), _sample(2, "dict", "dict")]
    counts = _score(server, samples)
    assert [s.reward for s in samples] == [1.0, 0.0, 1.0]
    assert samples[2].reward_extras == {"acc": 1.0}  # a dict is read at --reward-key, its rest logged
    assert counts == {"rollout/reward_errors": 0.0, "rollout/reward_timeouts": 0.0}
    assert sorted(server.bodies, key=lambda b: b["prompt"])[0] == {
        "prompt": "question 0",
        "response": "42",
        "label": "42",
    }


def test_a_busy_server_is_asked_again_and_a_refusal_or_a_hang_scores_zero(server):
    server.busy = 2  # two 503s, then answers: within the timeout, so the sample is scored
    busy = [_sample(0, "7", "7")]
    assert _score(server, busy) == {"rollout/reward_errors": 0.0, "rollout/reward_timeouts": 0.0}
    assert busy[0].reward == 1.0 and server.busy == 0
    bad = [_sample(1, "7", "refuse"), _sample(2, "7", "hang"), _sample(3, "7", "7")]
    counts = _score(server, bad, timeout=1.0)
    assert [s.reward for s in bad] == [0.0, 0.0, 1.0]
    assert [s.reward_error for s in bad] == ["error", "timeout", None]
    assert counts == {"rollout/reward_errors": 1.0, "rollout/reward_timeouts": 1.0}


def test_an_answer_too_large_or_nested_too_deeply_is_the_samples_error(server):
    """An answer of any size was read whole (64 samples at once, into the rollout's memory); one
    nested too deeply failed on the way as RecursionError. Each is now a refusal of that sample."""
    samples = [_sample(0, "7", "huge"), _sample(1, "7", "deep"), _sample(2, "7", "7")]
    runner = RewardRunner(20.0)
    try:
        args = Config(rm_type="remote_rm", rm_url=server.url, custom_rm_path=None, reward_timeout=20.0)
        rewards = Rewards(args, runner)
        counts = asyncio.run(rewards.score(samples))
    finally:
        runner.close()
    assert [s.reward_error for s in samples] == ["error", "error", None] and samples[2].reward == 1.0
    assert counts == {"rollout/reward_errors": 2.0, "rollout/reward_timeouts": 0.0}
    assert "answered more than 64 MiB: not a reward" in rewards.last_failure or "not JSON" in rewards.last_failure


def test_a_server_that_is_not_there_scores_zero_within_the_timeout_as_an_error():
    """Nothing listens: the sample scores 0 once --reward-timeout is spent, counted as an error
    (it was counted as a timeout, which hid that the service is down), its cause kept."""
    samples = [_sample(0, "1", "1")]
    args = Config(rm_type="remote_rm", rm_url="http://127.0.0.1:9/reward", custom_rm_path=None, reward_timeout=1.0)
    runner = RewardRunner(1.0)
    try:
        rewards = Rewards(args, runner)
        counts = asyncio.run(rewards.score(samples))
    finally:
        runner.close()
    assert samples[0].reward == 0.0 and samples[0].reward_error == "error"
    assert counts == {"rollout/reward_errors": 1.0, "rollout/reward_timeouts": 0.0}
    assert rewards.last_failure.startswith("Unreachable: cannot be reached at http://127.0.0.1:9/reward for 1s (")


def test_a_reward_service_that_stays_down_stops_the_run_in_one_line(tmp_path, monkeypatch):
    """Every sample's reward failing step after step (a dead service) used to train the run to its
    end on zeros, exit 0; now --max-failed-reward-steps such steps in a row stop it in one line:
    what failed, since when, how to resume. The steps before are kept."""
    import json

    from conftest import ROOT

    from vime.cli import train_main
    from vime.rollout.rewards import RewardError

    monkeypatch.chdir(ROOT)
    runs, save = tmp_path / "runs", tmp_path / "ck"
    argv = ["--config", "examples/tiny.yaml", "--num-rollout", "6", "--rm-type", "remote_rm"]
    argv += ["--rm-url", "http://127.0.0.1:9/reward", "--reward-timeout", "0.5", "--max-failed-reward-steps", "2"]
    argv += ["--save", str(save), "--save-interval", "1", "--runs-dir", str(runs), "--run-name", "down"]
    with pytest.raises(RewardError) as e:
        train_main(argv, "sync")
    said = str(e.value)
    assert re.match(
        r"step 2: every sample's reward failed in 2 steps in a row, since step 1 \(\d{4}-\d\d-\d\d [\d:]{8}\): "
        r"Unreachable: cannot be reached at http://127\.0\.0\.1:9/reward for 0\.5s \(.*\); check the service at "
        rf"--rm-url http://127\.0\.0\.1:9/reward, then resume with --load {save} ",
        said,
    ), said
    assert "\n" not in said
    rows = [json.loads(line) for line in (runs / "down" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1] and rows[0]["rollout/reward_errors"] == 16
    assert sorted(p.name for p in save.iterdir() if not p.name.startswith(".")) == ["1"]


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--rm-type", "remote_rm"], "--rm-type remote_rm needs --rm-url"),
        (["--rm-type", "remote_rm", "--rm-url", "localhost:8000"], "is not an http(s) URL"),
        (["--rm-url", "http://127.0.0.1:8000/reward"], "add --rm-type remote_rm"),
    ],
)
def test_remote_settings_that_cannot_work_are_one_line_errors(extra, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_args([*BASE, *extra])
