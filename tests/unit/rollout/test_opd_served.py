"""On-policy distillation from a served teacher (--use-opd --opd-type sglang,
vime/rollout/on_policy_distillation.py): a real engine of the teacher (the tiny student trained to
answer TARGET, tests/unit/algorithms/test_opd.py's) scores the student's response tokens through the reward
runner, the post-process stores them on the samples, and the trainer adds the reverse-KL term.
Also slime's --custom-reward-post-process-path hook on its own, in every mode."""

from __future__ import annotations

import asyncio
import json
import threading
import urllib.request
from pathlib import Path

import pytest
import torch
from conftest import MODE_ARGS, ROOT, run_cli, train_here
from safetensors.torch import load_file

from unit.algorithms.test_opd import SERVED_POST as POST
from unit.algorithms.test_opd import SERVED_REWARD as REWARD
from unit.algorithms.test_opd import (  # noqa: F401 (teacher_run: a fixture)
    _reverse_kl,
    assert_hf_scores,
    score_like_a_run,
    scored_samples,
    served_config,
    teacher_run,
)
from vime.algorithms.opd import distill_advantages
from vime.backends.builtin.launch import launch_engine
from vime.compat import parse_args  # slime's paths of the teacher's functions
from vime.config import Config, ConfigError
from vime.models import make_tiny_model, resolve_model
from vime.plugins import PluginError, as_plugin
from vime.rollout.opd_teacher import Teacher, TeacherError, teacher_log_probs
from vime.rollout.rewards.post_process import post_process

ATOL = 1e-4  # float32 on CPU (tests/unit/engine/test_scoring.py)
BASE = ["--hf-checkpoint", "tiny", "--prompt-data", "x.jsonl", "--num-rollout", "2"]


@pytest.fixture(scope="module")
def teacher_engine(teacher_run, tmp_path_factory):  # noqa: F811 (the fixture imported above)
    engine = launch_engine(str(teacher_run / "4"), log_path=tmp_path_factory.mktemp("logs") / "teacher.log")
    yield engine
    engine.shutdown()


def _args(url: str) -> Config:
    return served_config(url, "sglang")


def test_teacher_log_probs_on_the_samples_are_hfs_teacher_forced_ones(teacher_engine, teacher_run):  # noqa: F811
    """Scored as a run scores them (the reward runner, then the post-process the run calls): each
    sample's teacher_log_probs equal HF's teacher-forced log-probs of the teacher, token for token;
    the reward is 0 and the teacher's answer is dropped once read."""
    samples = score_like_a_run(_args(teacher_engine.url))  # a bare host:port: /generate is added
    assert_hf_scores(samples, teacher_run / "4", ATOL)


def test_an_answer_that_does_not_score_the_response_is_one_line(teacher_engine):
    """The real engine asked slime's way (the whole sequence, logprob_start_len 0): more log-probs
    than response tokens, refused in one line; so is an answer without log-probs."""
    s = scored_samples()[1]
    body = {
        "input_ids": s.tokens,
        "sampling_params": {"max_new_tokens": 0, "temperature": 0},
        "return_logprob": True,
        "logprob_start_len": 0,
    }
    req = urllib.request.Request(f"{teacher_engine.url}/generate", json.dumps(body).encode(), method="POST")
    with urllib.request.urlopen(req, timeout=60) as r:
        whole = json.load(r)
    with pytest.raises(TeacherError, match=f"with {len(s.tokens)} log-probs for its {s.response_length} response"):
        teacher_log_probs(whole, s, teacher_engine.url)
    with pytest.raises(TeacherError, match="without meta_info.input_token_logprobs: --rm-url must be") as e:
        teacher_log_probs({"score": 1.0}, s, teacher_engine.url)
    assert "\n" not in str(e.value)
    for bad in (float("nan"), True, "x"):  # a bool is an int to Python, not a log-prob
        items = [[-0.5, t, None] for t in s.response_tokens]
        items[-1][0] = bad
        with pytest.raises(TeacherError, match=f"with the log-prob {bad!r}: every response token needs a finite one"):
            teacher_log_probs({"meta_info": {"input_token_logprobs": items}}, s, teacher_engine.url)


def test_a_teacher_of_another_vocabulary_is_refused_at_start_up(tmp_path):
    """A table of 2000 rows for the student's tokenizer of 100 tokens (more than padding adds) is
    another vocabulary; one padded to 300 is the student's, and passes the same check."""
    padded = make_tiny_model(tmp_path / "padded", seed=0, vocab_size=300)
    engine = launch_engine(str(padded), log_path=tmp_path / "padded.log")
    try:
        teacher = Teacher(engine.url, 60.0, str(resolve_model("tiny")))
        asyncio.run(teacher._check_vocabulary())
        assert teacher.checked
    finally:
        engine.shutdown()
    other = make_tiny_model(tmp_path / "other_vocab", seed=0, vocab_size=2000)
    engine = launch_engine(str(other), log_path=tmp_path / "teacher.log")
    try:
        r = run_cli(
            "train.py", "--config", "examples/tiny.yaml", "--num-rollout", "1", "--use-opd", "--opd-type", "sglang",
            "--rm-url", f"{engine.url}/generate", "--custom-rm-path", REWARD, "--custom-reward-post-process-path", POST,
            "--runs-dir", str(tmp_path), "--run-name", "v",
        )  # fmt: skip
    finally:
        engine.shutdown()
    assert r.returncode == 2, r.stderr[-2000:]
    assert "has a vocabulary of 2000 tokens and the student 100 (its tokenizer 100)" in r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("kind", ["sglang", "vllm"])
def test_a_teacher_that_is_not_there_is_refused_at_start_up(tmp_path, kind):
    """Nothing listens at --rm-url: the start-up check waits --reward-timeout, then stops the run
    in one line (the run would otherwise train every sample without the teacher's term)."""
    r = run_cli(
        "train.py", "--config", "examples/tiny.yaml", "--num-rollout", "1", "--use-opd", "--opd-type", kind,
        "--rm-url", "http://127.0.0.1:1", "--custom-rm-path", REWARD, "--custom-reward-post-process-path", POST,
        "--reward-timeout", "2", "--runs-dir", str(tmp_path), "--run-name", "u",
    )  # fmt: skip
    assert r.returncode == 2, r.stderr[-2000:]
    assert (
        f"--opd-type {kind}: the teacher at --rm-url http://127.0.0.1:1 cannot be reached at http://127.0.0.1:1/"
        in r.stderr
    )
    assert "Traceback" not in r.stderr and not (tmp_path / "u" / "metrics.jsonl").exists()


@pytest.mark.parametrize(
    "extra, fragment",
    [
        (["--use-opd", "--opd-type", "sglang"], "give its address, --rm-url http://HOST:PORT/generate"),
        (
            ["--use-opd", "--opd-type", "sglang", "--rm-url", "http://127.0.0.1:1/generate"],
            "add --custom-rm-path vime.rollout.on_policy_distillation.reward_func --custom-reward-post-process-path",
        ),
        (
            ["--use-opd", "--opd-type", "sglang", "--rm-url", "http://h:1", "--custom-rm-path", REWARD],
            "stores its log-probs in the post-process: add",
        ),
        (
            ["--use-opd", "--opd-type", "sglang", "--rm-url", "http://h:1", "--custom-rm-path", REWARD]
            + ["--custom-reward-post-process-path", POST, "--opd-teacher-load", "t"],
            "drop --opd-teacher-load",
        ),
        (["--custom-rm-path", REWARD, "--rm-url", "http://h:1"], "add --use-opd --opd-type sglang"),
        (
            ["--use-opd", "--opd-type", "sglang", "--rm-url", "http://h:1", "--custom-rm-path", REWARD]
            + ["--custom-reward-post-process-path", POST, "--group-rm"],
            "asks the teacher for one sample at a time: drop --group-rm",
        ),
        (["--use-opd", "--opd-type", "vllm"], "give its address, --rm-url http://HOST:PORT/v1/completions"),
        (
            ["--use-opd", "--opd-type", "vllm", "--rm-url", "http://h:1/generate", "--custom-rm-path", REWARD]
            + ["--custom-reward-post-process-path", POST],
            "names neither of the vLLM routes that score tokens",
        ),
        *(
            (
                ["--use-opd", "--opd-type", kind, "--rm-url", "http://h:1", "--custom-rm-path", REWARD]
                + ["--custom-reward-post-process-path", POST, "--dynamic-sampling-filter-path", path],
                f"with --opd-type {kind} every reward is the teacher's answer (0 once post-processed), so it would drop",
            )
            for kind, path in [
                ("sglang", "slime.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std"),
                ("vllm", "vime.rollout.filters.check_reward_nonzero_std_with_fallback"),
            ]
        ),
        (
            ["--rollout-function-path", "vime.rollout.sft_rollout.generate_rollout", "--loss-type", "sft_loss"]
            + ["--custom-reward-post-process-path", "m.f"],
            "--custom-reward-post-process-path acts on generated samples",
        ),
    ],
)
def test_served_teacher_flags_are_checked_in_one_line(extra, fragment):
    with pytest.raises(ConfigError) as e:
        parse_args([*BASE, *extra])
    assert fragment in str(e.value) and "\n" not in str(e.value)


def _run(mode: str, steps: int, tmp_path: Path, *extra: str) -> list[dict]:
    """A run in this process (train_here): the tests read what it wrote."""
    script, flags = MODES[mode]
    train_here(
        script, "--config", "examples/tiny.yaml", "--num-rollout", str(steps), "--runs-dir", str(tmp_path),
        "--run-name", mode, *flags, *extra,
    )  # fmt: skip
    return [json.loads(line) for line in (tmp_path / mode / "metrics.jsonl").read_text().splitlines()]


MODES = MODE_ARGS  # each mode's entry point and flags (conftest.py)
SLOW = pytest.mark.slow


@pytest.mark.parametrize(
    "mode, steps, keep",
    [("sync", 6, 0.5)] + [pytest.param(m, 3, 0.9, marks=SLOW) for m in ("one-step-off", "fully-async", "decoupled")],
)
def test_distillation_from_a_served_teacher_brings_the_student_to_it(
    teacher_engine,
    teacher_run,  # noqa: F811
    tmp_path,
    mode,
    steps,
    keep,
):
    """slime's command line, the teacher a real engine: task reward 0, the student's reverse KL to
    the teacher, measured apart from the run, falls (sync, 6 steps: to under half; so does the
    logged one), every sample was scored, and the weights moved. The async modes run 3 steps, to
    show they distill too."""
    rows = _run(
        mode, steps, tmp_path, "--lr", "1e-2", "--rollout-batch-size", "16", "--use-opd", "--opd-type", "sglang",
        "--rm-url", f"{teacher_engine.url}/generate", "--custom-rm-path", REWARD,
        "--custom-reward-post-process-path", POST, "--save", str(tmp_path / "ckpt"), "--save-interval", str(steps),
    )  # fmt: skip
    logged = [row for row in rows if "train/opd_reverse_kl" in row]
    assert len(logged) == steps
    assert all(row["rollout/reward_mean"] == 0 and row["rollout/reward_errors"] == 0 for row in logged)
    assert all(row["train/opd_unscored_samples"] == 0 and row["train/grad_norm"] > 0 for row in logged)
    if mode == "sync":  # the async modes' first batches are the same stale policy's
        assert logged[-1]["train/opd_reverse_kl"] < 0.5 * logged[0]["train/opd_reverse_kl"]
    start, end = (
        load_file(str(d / "model.safetensors")) for d in (resolve_model("tiny"), tmp_path / "ckpt" / str(steps))
    )
    assert any(not torch.equal(start[k], end[k]) for k in start)
    before = _reverse_kl(resolve_model("tiny"), teacher_run / "4")
    after = _reverse_kl(tmp_path / "ckpt" / str(steps), teacher_run / "4")
    assert after < keep * before, (before, after)


@pytest.mark.parametrize("mode", ["sync"] + [pytest.param(m, marks=SLOW) for m in list(MODES)[1:]])
def test_the_post_process_runs_on_every_rollout_and_its_rewards_are_trained(tmp_path, monkeypatch, mode):
    """A reward of 0 for every sample would train nothing; the post-process, called once per
    rollout on all its samples with the reward function's answers, returns 0/1 rewards, and the
    weights move on them."""
    log = tmp_path / "calls.jsonl"
    monkeypatch.setenv("VIME_TEST_POST_LOG", str(log))
    rows = _run(
        mode, 2, tmp_path, "--custom-rm-path", "opd_reward.zero_reward",
        "--custom-reward-post-process-path", "post_rewards:alternate",
    )  # fmt: skip
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    # one call at start-up (the plug-in check, on one made-up sample), then one per rollout
    assert [c["n"] for c in calls] == [1, 16, 16] and all(set(c["raw"]) == {0.0} for c in calls)
    trained = [row for row in rows if "train/grad_norm" in row]
    assert len(trained) == 2 and all(row["train/grad_norm"] > 0 for row in trained)


def test_a_post_process_answer_that_is_not_one_reward_per_sample_is_one_line():
    samples = scored_samples()[:2]
    for out in ([1.0], ([0.0, 0.0], [1.0, float("nan")]), "no", None):
        plugin = as_plugin(lambda args, s, out=out: out, "--custom-reward-post-process-path")
        with pytest.raises(PluginError, match=r"return \(raw_rewards, rewards\), two lists of one finite") as e:
            post_process(plugin, None, [samples])
        assert "\n" not in str(e.value)
    # slime's pair (a tensor too), or one list
    post_process(as_plugin(lambda args, s: ([9, 9], torch.tensor([0.5, 1.0])), "f"), None, [samples])
    assert [s.reward for s in samples] == [0.5, 1.0]
    post_process(as_plugin(lambda args, s: [2, 3], "f"), None, [samples])
    assert [s.reward for s in samples] == [2.0, 3.0]


def test_a_sample_the_teacher_did_not_score_keeps_its_task_advantage():
    """Its teacher request failed (a counted reward error): no teacher term, left out of the KL's
    mean, counted; the other sample gets coef x (teacher - rollout) per token."""
    student = [torch.tensor([-1.0, -2.0]), torch.tensor([-1.0, -1.0, -1.0])]
    teacher = [None, torch.tensor([-0.5, -1.0, -2.0])]
    masks = [torch.ones(2), torch.ones(3)]
    adv, metrics = distill_advantages(torch.tensor([1.0, 2.0]), student, teacher, masks, 0.5)
    assert torch.equal(adv[0], torch.tensor([1.0, 1.0]))
    assert torch.allclose(adv[1], torch.tensor([2.25, 2.0, 1.5]))
    assert metrics == {"train/opd_reverse_kl": pytest.approx((-0.5 + 0 + 1) / 3), "train/opd_unscored_samples": 1.0}


def _score_one(url: str) -> tuple[list, dict, str | None]:
    """One sample with a response scored by the OPD reward at `url`, as a run scores it."""
    from vime.rollout.rewards import Rewards
    from vime.rollout.rewards.runner import RewardRunner

    samples, runner = scored_samples()[:1], RewardRunner(1.0)
    try:
        rewards = Rewards(served_config(url, "sglang").derived(reward_timeout=1.0), runner)
        counts = asyncio.run(rewards.score(samples))
    finally:
        runner.close()
    return samples, counts, rewards.last_failure


def test_a_teacher_that_dies_counts_its_samples_as_reward_errors():
    """A teacher not answering at all (killed) was counted in rollout/reward_timeouts, where the
    docs say rollout/reward_errors; its cause is kept for the line that stops the run."""
    samples, counts, why = _score_one("http://127.0.0.1:1")
    assert counts == {"rollout/reward_errors": 1.0, "rollout/reward_timeouts": 0.0}
    assert samples[0].reward_error == "error" and samples[0].reward_result is None
    assert why.startswith("Unreachable: cannot be reached at http://127.0.0.1:1/generate for 1s")


def test_a_teacher_answering_log_probs_above_zero_is_an_error_of_the_sample():
    """A teacher that answers +7.5 (a probability above 1) was accepted: only finiteness was
    checked. Now the sample's reward is an error and it trains without the teacher's term."""
    import http.server

    class Lying(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 (http.server's name)
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            start = body["logprob_start_len"]
            items = [[7.5, t, None] for t in body["input_ids"][start:]]
            answer = json.dumps({"text": "", "meta_info": {"input_token_logprobs": items}}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Lying)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        samples, counts, why = _score_one(f"http://127.0.0.1:{server.server_address[1]}")
    finally:
        server.shutdown()
    assert counts == {"rollout/reward_errors": 1.0, "rollout/reward_timeouts": 0.0}
    assert samples[0].reward_error == "error"
    assert "answered sample 0 with the log-prob 7.5, above 0 (a probability above 1)" in why


def test_a_teacher_killed_mid_run_stops_the_run_in_one_line(tmp_path, monkeypatch):
    """A served teacher killed after step 1: the run went on to its end with exit 0, every later
    sample unscored (counted as timeouts) behind one warning. Now each such sample is a reward
    error, and --max-failed-reward-steps steps of them stop the run in one line: what failed,
    since when, how to resume; the steps before are kept."""
    import teacher_killer

    from vime.cli import train_main
    from vime.rollout.rewards import RewardError

    monkeypatch.chdir(ROOT)
    teacher = launch_engine(str(resolve_model("tiny")), log_path=tmp_path / "teacher.log")
    monkeypatch.setattr(teacher_killer, "teacher", teacher)
    monkeypatch.setattr(teacher_killer, "calls", 0)
    save, url = tmp_path / "ck", f"{teacher.url}/generate"
    try:
        with pytest.raises(RewardError) as e:
            train_main(
                ["--config", "examples/tiny.yaml", "--num-rollout", "6", "--use-opd", "--opd-type", "sglang",
                 "--rm-url", url, "--custom-rm-path", REWARD, "--reward-timeout", "1",
                 "--custom-reward-post-process-path", "teacher_killer.post_process_then_kill",
                 "--max-failed-reward-steps", "2", "--save", str(save), "--runs-dir", str(tmp_path), "--run-name", "k"],
                "sync",
            )  # fmt: skip
    finally:
        teacher.shutdown()
    said = str(e.value)
    assert (
        said.startswith("step 3: every sample's reward failed in 2 steps in a row, since step 2 (") and "\n" not in said
    )
    assert f"Unreachable: cannot be reached at {url} for 1s" in said
    assert f"check the service at --rm-url {url}, then resume with --load {save} " in said
    rows = [json.loads(line) for line in (tmp_path / "k" / "metrics.jsonl").read_text().splitlines()]
    assert [r["rollout/reward_errors"] for r in rows] == [0, 16] and [r["step"] for r in rows] == [1, 2]
