"""On-policy distillation from a teacher served by vLLM (--use-opd --opd-type vllm,
vime/rollout/opd_vllm.py), against a real vLLM server on CPU (`make test-vllm`; no mocks).

The teacher: a random Qwen3 with head_dim 32 (vLLM's CPU attention refuses the tiny student's
head_dim 16) of the student's tokenizer, trained to answer TARGET (tests/unit/algorithms/test_opd.py's
`train_teacher`); the student, the tiny model, generates with the built-in engine. They differ in
shape and weights, and share the tokenizer, as a distillation pair does.

Tolerance: the teacher's log-probs through vLLM's prompt_logprobs must equal HF's teacher-forced
ones within ATOL = 1e-4 (float32 on CPU, as tests/unit/backends/test_vllm_server.py; the observed gap is ~5e-7).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from conftest import MODE_ARGS, train_here

from unit.algorithms.test_opd import SERVED_POST as POST
from unit.algorithms.test_opd import SERVED_REWARD as REWARD
from unit.algorithms.test_opd import (
    _reverse_kl,
    assert_hf_scores,
    score_like_a_run,
    scored_samples,
    served_config,
    train_teacher,
)
from unit.backends.vllm_support import ATOL, SHAPE32, needs_vllm
from vime.config import Config
from vime.models import make_tiny_model, resolve_model
from vime.rollout.opd_teacher import API_KEY_ENV, TeacherError
from vime.rollout.opd_vllm import VLLMTeacher, vllm_log_probs
from vime.rollout.types import Sample, Status

ROUTES = ["/v1/completions", "/inference/v1/generate"]
SLOW = pytest.mark.slow


@pytest.fixture(scope="module")
def teacher32(tmp_path_factory) -> Path:
    """The teacher's HF directory: a head_dim-32 Qwen3 of the tiny tokenizer, trained to answer TARGET."""
    root = tmp_path_factory.mktemp("teacher32")
    base = make_tiny_model(root / "base", seed=1, **SHAPE32)
    return train_teacher(base, root / "run") / "4"


@pytest.fixture(scope="module")
def vllm_teacher(teacher32, tmp_path_factory):
    """The teacher in a vLLM server (vime's launcher: scale-out routes on, an API key), its key in
    the environment as a run reads it."""
    from vime.backends.vllm.launch import launch_vllm

    proc = launch_vllm(str(teacher32), max_num_seqs=32, log_path=tmp_path_factory.mktemp("vllm") / "teacher.log")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(API_KEY_ENV, proc.api_key)
        yield proc
    proc.shutdown()


def _args(url: str) -> Config:
    return served_config(url, "vllm")


@needs_vllm
@pytest.mark.parametrize("route", ROUTES)
def test_teacher_log_probs_on_the_samples_are_hfs_teacher_forced_ones(vllm_teacher, teacher32, route):
    """Scored as a run scores them (the reward runner, then the post-process), on either route:
    each sample's teacher_log_probs equal HF's teacher-forced log-probs, token for token, the
    reward is 0, and the teacher knows TARGET far better than a made-up answer."""
    assert_hf_scores(score_like_a_run(_args(vllm_teacher.url + route)), teacher32, ATOL)


@needs_vllm
def test_what_the_teacher_cannot_score_is_one_line(vllm_teacher):
    """Another tokenizer (the student SmolLM2's) is refused by the /tokenize probe, the student's
    own passes; a token id past the teacher's table is vLLM's 400, one line; an answer for another
    sequence, a reward model's, or one without the token sent, is refused in one line."""
    url = vllm_teacher.url + "/v1/completions"
    ours = VLLMTeacher(url, 60.0, str(resolve_model("tiny")))
    asyncio.run(ours._check_vocabulary())
    assert ours.checked
    theirs = VLLMTeacher(url, 60.0, str(resolve_model("smollm2")))
    with pytest.raises(TeacherError, match="tokenizes text otherwise than the student") as e:
        asyncio.run(theirs._check_vocabulary())
    assert "\n" not in str(e.value)
    away = VLLMTeacher("http://127.0.0.1:1", 5.0, str(resolve_model("tiny")))
    asyncio.run(away._check_vocabulary())  # not up (yet): asked again at the next sample
    assert not away.checked

    s = scored_samples()[1]
    past = Sample(index=9, tokens=s.tokens + [5000], response_length=s.response_length + 1, status=Status.COMPLETED)
    with pytest.raises(TeacherError, match=r"answered 400: .*Token id 5000 is out of vocabulary") as e:
        asyncio.run(ours.score(past))
    assert "\n" not in str(e.value)
    answer = asyncio.run(ours.score(s))
    longer = Sample(index=3, tokens=s.tokens + [40], response_length=s.response_length + 1)
    with pytest.raises(TeacherError, match=f"with {len(s.tokens)} prompt log-probs for the {len(longer.tokens)} tok"):
        vllm_log_probs(answer, longer, url)
    with pytest.raises(TeacherError, match="without prompt_logprobs: --rm-url must be a vLLM server's"):
        vllm_log_probs({"score": 1.0}, s, url)
    other = Sample(index=4, tokens=s.tokens[:-1] + [s.tokens[-1] + 1], response_length=s.response_length)
    with pytest.raises(TeacherError, match=f"without the log-prob of token {other.tokens[-1]} at position"):
        vllm_log_probs(answer, other, url)
    bad = json.loads(json.dumps(answer))
    bad["choices"][0]["prompt_logprobs"][-1] = {str(s.tokens[-1]): {"logprob": None}}
    with pytest.raises(TeacherError, match="with the log-prob None: every response token needs a finite one"):
        vllm_log_probs(bad, s, url)


@needs_vllm
@pytest.mark.parametrize("mode, steps, keep", [("sync", 6, 0.5), pytest.param("fully-async", 3, 0.9, marks=SLOW)])
def test_distillation_from_a_vllm_teacher_brings_the_student_to_it(
    vllm_teacher, teacher32, tmp_path, mode, steps, keep
):
    """vllm-project/vime's command line, the teacher a vLLM server (a bare host:port: its
    /v1/completions): every sample is scored, and the student's KL to the teacher, measured apart
    from the run, falls (sync, 6 steps: to under half, and so does the logged one; fully-async,
    3 steps, whose first batches are the same stale policy's: it distills too)."""
    script, flags = MODE_ARGS[mode]
    train_here(  # in this process: the test reads what the run wrote
        script, "--config", "examples/tiny.yaml", "--num-rollout", str(steps), "--runs-dir", str(tmp_path),
        "--run-name", "opd", *flags, "--lr", "1e-2", "--rollout-batch-size", "16", "--use-opd", "--opd-type", "vllm",
        "--rm-url", vllm_teacher.url, "--custom-rm-path", REWARD, "--custom-reward-post-process-path", POST,
        "--save", str(tmp_path / "ckpt"), "--save-interval", str(steps),
    )  # fmt: skip
    rows = [json.loads(line) for line in (tmp_path / "opd" / "metrics.jsonl").read_text().splitlines()]
    logged = [row for row in rows if "train/opd_reverse_kl" in row]
    assert len(logged) == steps
    assert all(row["rollout/reward_errors"] == 0 and row["train/opd_unscored_samples"] == 0 for row in logged)
    if mode == "sync":
        assert logged[-1]["train/opd_reverse_kl"] < 0.5 * logged[0]["train/opd_reverse_kl"]
    before = _reverse_kl(resolve_model("tiny"), teacher32)
    after = _reverse_kl(tmp_path / "ckpt" / str(steps), teacher32)
    assert after < keep * before, (before, after)
