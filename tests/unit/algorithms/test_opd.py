"""On-policy distillation (--use-opd, vime/algorithms/opd.py): the teacher in the trainer scores
the student's tokens; the advantage gains --opd-kl-coef x (log p_teacher - log p_rollout)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import ROOT, run_cli, train_here

from unit.trainer.actors import make_args, make_samples
from vime.config import Config, ConfigError, parse_args
from vime.models import load_tokenizer, make_tiny_model, resolve_model
from vime.rollout.types import Sample
from vime.trainer.actor import Actor

BASE = ["--hf-checkpoint", "tiny", "--prompt-data", "x.jsonl", "--num-rollout", "2"]
TARGET = "7777"  # what the teacher learned to answer to every prompt


def _prompts(tokenizer, path: Path, n: int) -> list[list[int]]:
    rows = [json.loads(line) for line in path.read_text().splitlines()[:n]]
    return [list(tokenizer.encode(r["input"], add_special_tokens=True)) for r in rows]


# slime's paths of the served teacher's functions, as vllm-project/vime's scripts name them: they load vime's
SERVED_REWARD = "slime.rollout.on_policy_distillation.reward_func"
SERVED_POST = "slime.rollout.on_policy_distillation.post_process_rewards"


def scored_samples() -> list[Sample]:
    """Held-out prompts with responses the teacher finds likely (TARGET) and unlikely, and one
    sample without a response: what a served teacher is asked to score."""
    from vime.rollout.types import Status

    tokenizer = load_tokenizer(resolve_model("tiny"))
    prompts = _prompts(tokenizer, ROOT / "examples/data/addition/test.jsonl", 4)
    out = []
    for i, (p, text) in enumerate(zip(prompts, [TARGET, "15", "3 + x", ""], strict=True)):
        r = list(tokenizer.encode(text, add_special_tokens=False))
        out.append(Sample(index=i, tokens=p + r, response_length=len(r), status=Status.COMPLETED))
    return out


def score_like_a_run(args: Config) -> list[Sample]:
    """`scored_samples` scored as a run scores them: the reward runner (the teacher asked, no
    reward error), then the post-process."""
    import asyncio

    from vime.rollout.rewards import Rewards
    from vime.rollout.rewards.post_process import load_post_process, post_process
    from vime.rollout.rewards.runner import RewardRunner

    samples, runner = scored_samples(), RewardRunner(60.0)
    try:
        counts = asyncio.run(Rewards(args, runner).score(samples))
    finally:
        runner.close()
    assert counts == {"rollout/reward_errors": 0.0, "rollout/reward_timeouts": 0.0}
    post_process(load_post_process(args), args, [samples])
    return samples


def assert_hf_scores(samples: list[Sample], teacher_dir: Path, atol: float) -> None:
    """Each scored sample's teacher_log_probs are the teacher's HF teacher-forced log-probs of its
    response tokens (within `atol`), its reward 0 and the answer dropped once read; and the
    teacher knows TARGET: its log-probs there are far above those of a made-up answer."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(teacher_dir), dtype=torch.float32).eval()
    for s in samples:
        assert s.reward == 0.0 and s.reward_result is None and len(s.teacher_log_probs) == s.response_length
        if not s.response_length:
            continue
        with torch.no_grad():
            logits = hf(torch.tensor([s.tokens])).logits[0, s.prompt_length - 1 : -1]
        want = logits.log_softmax(-1).gather(1, torch.tensor(s.response_tokens)[:, None])[:, 0]
        assert torch.allclose(torch.tensor(s.teacher_log_probs), want, atol=atol), (s.teacher_log_probs, want)
    assert min(samples[0].teacher_log_probs) > max(samples[2].teacher_log_probs)


def served_config(url: str, opd_type: str) -> Config:
    """The settings a run with a served teacher at `url` hands its reward and post-process."""
    return Config(
        custom_rm_path=SERVED_REWARD,
        custom_reward_post_process_path=SERVED_POST,
        rm_url=url,
        reward_timeout=60.0,
        model_dir=str(resolve_model("tiny")),
        use_opd=True,
        opd_type=opd_type,
    )


def train_teacher(student: Path, out: Path) -> Path:
    """A vime --save directory (`out`) whose newest checkpoint is `student` trained, SFT-like, to
    answer every training prompt with TARGET."""
    tokenizer = load_tokenizer(student)
    target = list(tokenizer.encode(TARGET, add_special_tokens=False))
    actor = Actor(make_args(lr=1e-2), student)
    samples = [
        Sample(index=i, tokens=p + target, response_length=len(target))
        for i, p in enumerate(_prompts(tokenizer, ROOT / "examples/data/addition/train.jsonl", 16))
    ]
    for _ in range(4):  # advantage 1 on a fixed response, one step each: p(TARGET's tokens) 0.01 -> ~0.5
        actor.train_step(samples, [1.0] * len(samples))
    actor.save(out / "4", {})
    return out


@pytest.fixture(scope="module")
def teacher_run(tmp_path_factory) -> Path:
    """The tiny student trained to answer TARGET (`train_teacher`): a teacher that differs from
    the student only in weights."""
    return train_teacher(resolve_model("tiny"), tmp_path_factory.mktemp("teacher"))


def _reverse_kl(student: Path, teacher: Path) -> float:
    """KL(student || teacher) over the whole vocabulary, at each answer position of held-out
    prompts followed by the teacher's answer: measured apart from the run and its rollouts."""
    from transformers import AutoModelForCausalLM

    tokenizer = load_tokenizer(student)
    target = list(tokenizer.encode(TARGET, add_special_tokens=False))
    s_model, t_model = (
        AutoModelForCausalLM.from_pretrained(str(p), dtype=torch.float32).eval() for p in (student, teacher)
    )
    total, n = 0.0, 0
    with torch.no_grad():
        for prompt in _prompts(tokenizer, ROOT / "examples/data/addition/test.jsonl", 10):
            ids = torch.tensor([prompt + target])
            span = slice(len(prompt) - 1, ids.shape[1] - 1)
            s = torch.log_softmax(s_model(ids).logits[0, span], -1)
            t = torch.log_softmax(t_model(ids).logits[0, span], -1)
            total += float((s.exp() * (s - t)).sum())
            n += span.stop - span.start
    return total / n


def test_advantage_is_teacher_minus_rollout_log_prob_per_token(tiny_model, tmp_path):
    """A hand-built sample: each token's advantage is the task's plus coef x (log p_teacher -
    log p_rollout), the teacher's log-prob computed independently with its own Actor."""
    teacher_dir = make_tiny_model(tmp_path / "teacher", seed=1)
    samples = make_samples(3)
    for s in samples:
        s.rollout_log_probs = [-1.0 - 0.1 * k for k in range(s.response_length)]
    args = make_args(use_opd=True, opd_type="megatron", opd_teacher_load=str(teacher_dir), opd_kl_coef=0.5)
    actor = Actor(args, tiny_model)
    advantages, metrics = actor.distill(samples, torch.tensor([1.0, 0.0, -2.0]))
    teacher = Actor(make_args(), teacher_dir).compute_log_probs(samples)
    kl, n = 0.0, 0
    for s, base, adv, t in zip(samples, [1.0, 0.0, -2.0], advantages, teacher):
        rollout = torch.tensor(s.rollout_log_probs)
        assert torch.allclose(adv, base + 0.5 * (t - rollout), atol=1e-5)
        kl += float((rollout - t).sum())
        n += s.response_length
    assert metrics["train/opd_reverse_kl"] == pytest.approx(kl / n, rel=1e-5)
    # a sample the engine sent no log-probs for: the student's are the current policy's
    bare = make_samples(1)
    (adv,), _ = actor.distill(bare, torch.tensor([0.0]))
    want = 0.5 * (teacher[0] - actor.compute_log_probs(bare)[0])
    assert torch.allclose(adv, want, atol=1e-5)


@pytest.mark.parametrize("rows", [None, 300])
def test_train_step_logs_the_reverse_kl_and_moves_the_weights(tiny_model, tmp_path, rows):
    """Also with a teacher whose table is padded past the student's (300 rows, the same tokenizer)."""
    teacher_dir = make_tiny_model(tmp_path / "teacher", seed=1, vocab_size=rows)
    actor = Actor(make_args(use_opd=True, opd_type="megatron", opd_teacher_load=str(teacher_dir)), tiny_model)
    samples = make_samples(3)
    before = {n: p.detach().clone() for n, p in actor.model.named_parameters()}
    metrics = actor.train_step(samples, [0.0, 0.0, 0.0])  # no task signal: the teacher's alone
    assert metrics["train/opd_reverse_kl"] != 0.0 and metrics["train/grad_norm"] > 0
    assert any(not torch.equal(p, before[n]) for n, p in actor.model.named_parameters())


def test_two_ranks_distill_as_one_rank(tiny_model, tmp_path):
    """FSDP2 over two gloo ranks: the teacher is sharded like the policy, and the step's
    loss, reverse KL and weights are one rank's."""
    from vime.trainer.distributed import launch_actor

    teacher_dir = make_tiny_model(tmp_path / "teacher", seed=1)
    args = make_args(
        use_opd=True, opd_type="megatron", opd_teacher_load=str(teacher_dir), max_tokens_per_gpu=24, actor_num_procs=2
    )
    samples = make_samples(4)
    one = Actor(args, tiny_model)
    two = launch_actor(args, tiny_model, "cpu")
    try:
        m1, m2 = one.train_step(samples, [0.0] * 4), two.train_step(samples, [0.0] * 4)
        for k in ("train/loss", "train/grad_norm", "train/opd_reverse_kl"):
            assert abs(m1[k] - m2[k]) < 1e-5, (k, m1[k], m2[k])
        w1, w2 = dict(one.named_weights()), dict(two.named_weights())
        assert all(torch.allclose(t, w2[n], atol=1e-5) for n, t in w1.items())
    finally:
        two.close()


@pytest.mark.parametrize(
    "extra, fragment",
    [
        (["--opd-kl-coef", "0.5"], "--opd-kl-coef set up on-policy distillation, which is off: add --use-opd"),
        (["--opd-teacher-load", "t", "--opd-type", "megatron"], "add --use-opd"),
        (["--use-opd"], "--use-opd needs --opd-type"),
        (["--use-opd", "--opd-type", "megatron"], "give --opd-teacher-load"),
        (["--use-opd", "--opd-type", "sglang"], "asks a teacher engine for its log-probs: give its address"),
        (["--use-opd", "--opd-type", "vllm"], "--opd-type vllm asks a teacher engine for its log-probs: give its"),
        (["--use-opd", "--opd-type", "megatron", "--opd-teacher-load", "t", "--opd-kl-coef", "0"], "positive"),
    ],
)
def test_opd_flags_are_checked_in_one_line(extra, fragment):
    with pytest.raises(ConfigError, match=None) as e:
        parse_args([*BASE, *extra])
    assert fragment in str(e.value) and "\n" not in str(e.value)


def test_teacher_resolution_and_vocabulary(teacher_run, tmp_path):
    from vime.trainer.teacher import check_teacher, teacher_dir

    def args(load, step=None):
        return parse_args(
            [*BASE, "--use-opd", "--opd-type", "megatron", "--opd-teacher-load", str(load)]
            + (["--opd-teacher-ckpt-step", str(step)] if step is not None else [])
        )

    assert teacher_dir(args(teacher_run)) == teacher_run / "4"  # a --save directory: its newest step
    assert teacher_dir(args(teacher_run, 4)) == teacher_run / "4"
    with pytest.raises(ConfigError, match=r"holds no step 3 \(steps: \[4\]\)"):
        teacher_dir(args(teacher_run, 3))
    with pytest.raises(ConfigError, match="neither an HF model"):
        teacher_dir(args(tmp_path))
    # the student's tokenizer, its table padded to 300 rows: the same vocabulary, accepted
    padded = make_tiny_model(tmp_path / "padded", seed=0, vocab_size=300)
    assert check_teacher(args(padded), resolve_model("tiny")) == padded
    # ... but not as the teacher of a student whose table is larger: the student draws ids it has no row for
    with pytest.raises(ConfigError, match="has a table of 100 rows and the student 300: a token the student") as e:
        check_teacher(args(resolve_model("tiny")), padded)
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="has a vocabulary of 49152 tokens and the student 100, of another") as e:
        check_teacher(args(resolve_model("smollm2")), resolve_model("tiny"))
    assert "\n" not in str(e.value)


def test_cli_refuses_a_teacher_of_another_vocabulary(tmp_path):
    r = run_cli(
        "train.py", "--config", "examples/tiny.yaml", "--num-rollout", "1", "--use-opd", "--opd-type", "megatron",
        "--opd-teacher-load", str(resolve_model("smollm2")), "--runs-dir", str(tmp_path), "--run-name", "v",
    )  # fmt: skip
    assert r.returncode == 2, r.stderr[-2000:]
    assert "vocabulary of 49152 tokens and the student 100, of another tokenizer" in r.stderr
    assert "Traceback" not in r.stderr


# each mode's entry point, flags, rollouts and the share of the reverse KL it must keep at most
MODES = {
    "sync": ("train.py", [], 6, 0.5),
    "one-step-off": ("train_async.py", [], 3, 0.9),
    "fully-async": (
        "train_async.py",
        ["--rollout-function-path", "vime.rollout.fully_async_rollout.generate_rollout_fully_async"],
        3,
        0.9,
    ),
}


@pytest.mark.parametrize("mode", list(MODES))
def test_distillation_brings_the_student_to_the_teacher(teacher_run, tmp_path, mode):
    """Every mode, task reward constant (0): the student's reverse KL to the teacher, measured
    apart from the run, falls (sync, 6 steps: 0.65 -> about 0.05), and the run logs
    train/opd_reverse_kl. The async modes run 3 steps, to show they distill too."""
    script, extra, steps, keep = MODES[mode]
    train_here(  # in this process: the test reads what the run wrote
        script, "--config", "examples/tiny.yaml", "--num-rollout", str(steps), "--lr", "1e-2",
        "--rollout-batch-size", "16", "--custom-rm-path", "opd_reward.zero_reward",
        "--use-opd", "--opd-type", "megatron", "--opd-teacher-load", str(teacher_run),
        "--save", str(tmp_path / "ckpt"), "--save-interval", str(steps),
        "--runs-dir", str(tmp_path), "--run-name", mode, *extra,
    )  # fmt: skip
    rows = [json.loads(line) for line in (tmp_path / mode / "metrics.jsonl").read_text().splitlines()]
    logged = [row for row in rows if "train/opd_reverse_kl" in row]
    assert len(logged) == steps and all(row["rollout/reward_mean"] == 0 for row in logged)
    before = _reverse_kl(resolve_model("tiny"), teacher_run / "4")
    after = _reverse_kl(tmp_path / "ckpt" / str(steps), teacher_run / "4")
    assert after < keep * before, (before, after)
