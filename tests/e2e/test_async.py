"""Async training, whole runs: every mode trains and evaluates (one-step-off on the previous
version, sync on policy), decoupled staleness under a slow engine, `vime report` and
`vime bench-ab` on real runs, a failing fully-async producer, zero staleness training exactly
what sync trains, staleness counted in optimizer steps, a fully-async checkpoint resumed, and a
one-step-off run stopped while a generate is pending."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import MODE_ARGS, PLUGINS, ROOT, run_cli, train_here

TINY = ["--config", "examples/tiny.yaml"]


def rows(run_dir: Path) -> list[dict]:
    return [
        r
        for r in (json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines())
        if "perf/step_time" in r
    ]


# the two async-entry modes evaluate two held-out sets (slime's NAME PATH pairs), the others one
TWO_SETS = [
    "--eval-prompt-data",
    "head",
    "examples/data/addition/test.jsonl",
    "tail",
    "examples/data/addition/test.jsonl@[10:20]",
]

EVAL_SETS = {"one-step-off": TWO_SETS, "fully-async": TWO_SETS}


@pytest.fixture(scope="module")
def mode_runs(tmp_path_factory) -> dict[str, Path]:
    """Each mode trains the tiny model for 3 steps; later tests read these run directories."""
    base = tmp_path_factory.mktemp("runs")
    out = {}
    for name, (script, extra) in MODE_ARGS.items():  # in this process (train_here): no fresh interpreter's imports
        train_here(
            script,
            *TINY,
            "--num-rollout",
            "3",
            "--runs-dir",
            str(base),
            "--run-name",
            name,
            "--eval-interval",
            "3",
            "--eval-limit",
            "8",
            "--save",
            str(base / name / "ckpt"),
            *extra,
            *EVAL_SETS.get(name, []),
        )
        out[name] = base / name
    return out


@pytest.mark.parametrize("mode", ["sync", "one-step-off", "fully-async", "decoupled"])
def test_each_mode_trains(mode_runs, mode):
    import torch

    from vime.models import resolve_model

    r = rows(mode_runs[mode])
    assert [x["step"] for x in r] == [1, 2, 3]
    assert all(
        x["train/policy_version"] == x["train/weight_version"] == x["train/weight_pushes"] == x["step"] for x in r
    )
    assert all("perf/train_wait_time" in x and "perf/update_weights_time" in x for x in r)
    # examples/tiny.yaml's reward varies within groups: the weights really moved
    assert any(x["train/grad_norm"] > 0 for x in r)
    initial, final = final_weights(resolve_model("tiny")), final_weights(mode_runs[mode] / "ckpt" / "3")
    assert any(not torch.equal(initial[k], final[k]) for k in initial)


def test_one_step_off_trains_on_the_previous_version(mode_runs):
    r = rows(mode_runs["one-step-off"])
    # step 1 uses the initial weights (version 0); every later batch was generated entirely by the
    # policy one push behind the trainer: all tokens exactly one version old
    assert r[0]["rollout/staleness_max"] == 0
    for x in r[1:]:
        assert x["rollout/staleness_mean"] == 1 and x["rollout/staleness_max"] == 1


@pytest.mark.parametrize("mode", ["sync", "one-step-off", "fully-async", "decoupled"])
def test_each_mode_evaluates_its_held_out_sets(mode_runs, mode):
    evals = [
        r
        for r in (json.loads(line) for line in (mode_runs[mode] / "metrics.jsonl").read_text().splitlines())
        if "eval/accuracy" in r
    ]
    assert [r["step"] for r in evals] == [0, 3]
    for r in evals:
        if mode in EVAL_SETS:  # each set's own metrics (--eval-limit 8 each), and all of them together
            assert (r["eval/head/total"], r["eval/tail/total"], r["eval/total"]) == (8, 8, 16)
            assert r["eval/correct"] == r["eval/head/correct"] + r["eval/tail/correct"]
            assert (mode_runs[mode] / "eval" / "tail" / f"{r['step']}.jsonl").exists()
        else:  # one set: the names it always had
            assert r["eval/total"] == 8 and not [k for k in r if k.count("/") > 1 and k.startswith("eval/")]
            assert (mode_runs[mode] / "eval" / f"{r['step']}.jsonl").exists()


def test_sync_is_on_policy(mode_runs):
    assert all(x["rollout/staleness_max"] == 0 for x in rows(mode_runs["sync"]))


@pytest.mark.slow
def test_decoupled_respects_staleness_under_a_slow_engine(tmp_path):
    train_here(
        "train_async.py",
        *TINY,
        "--num-rollout",
        "5",
        "--max-staleness",
        "1",
        "--rollout-max-response-len",
        "8",
        "--custom-generate-function-path",
        "slow_generate.generate",
        "--runs-dir",
        str(tmp_path),
        "--run-name",
        "d",
    )
    r = rows(tmp_path / "d")
    assert len(r) == 5
    assert all(x["rollout/staleness_max"] <= 1 for x in r)
    # the test means something only if samples really were off-policy
    assert max(x["rollout/staleness_max"] for x in r) == 1


def test_report_renders_from_real_runs(mode_runs, tmp_path):
    order = ["sync", "one-step-off", "fully-async", "decoupled"]
    res = run_cli("-m", "vime.cli", "report", *[str(mode_runs[m]) for m in order], "--plots", str(tmp_path / "plots"))
    assert res.returncode == 0, res.stderr[-2000:]
    assert "speedup" in res.stdout and "held-out accuracy" in res.stdout
    for m in order:
        assert f"| {m} |" in res.stdout
    assert "1.00×" in res.stdout  # the first run is the reference
    assert "accuracy per eval set" in res.stdout and "| fully-async | tail |" in res.stdout
    for png in ["step_time.png", "reward.png", "accuracy_vs_wall_clock.png"]:
        assert (tmp_path / "plots" / png).stat().st_size > 1000


@pytest.mark.slow
def test_bench_ab_runs_each_arm_on_one_config(tmp_path):
    res = run_cli(
        "-m",
        "vime.cli",
        "bench",
        "ab",
        "--config",
        "examples/tiny.yaml",
        "--arms",
        "sync,fully-async",
        "--runs-dir",
        str(tmp_path),
        "--name",
        "q",
        "--num-rollout",
        "2",
        "--no-plots",
    )
    assert res.returncode == 0, res.stderr[-2000:]
    assert "| q-sync | sync |" in res.stdout and "| q-fully-async | fully-async |" in res.stdout
    assert all(len(rows(tmp_path / f"q-{arm}")) == 2 for arm in ("sync", "fully-async"))


def test_bench_ab_rejects_an_unknown_arm(tmp_path):
    res = run_cli(
        "-m",
        "vime.cli",
        "bench",
        "ab",
        "--config",
        "examples/tiny.yaml",
        "--arms",
        "sync,warp-speed",
        "--runs-dir",
        str(tmp_path),
    )
    assert res.returncode == 2 and res.stderr.strip().splitlines()[-1].startswith("error: unknown arm 'warp-speed'")
    assert not any(tmp_path.iterdir())  # nothing ran


def test_fully_async_producer_failure_is_an_error_not_a_hang(tmp_path):
    res = run_cli(
        "train_async.py",
        *TINY,
        "--num-rollout",
        "2",
        "--runs-dir",
        str(tmp_path),
        "--rollout-function-path",
        "vime.rollout.fully_async_rollout.generate_rollout_fully_async",
        "--custom-generate-function-path",
        "nope.missing",
        timeout=90,
    )
    assert res.returncode == 2
    assert "nope.missing" in res.stderr.strip().splitlines()[-1]


# ---- checkpoints and stopping in async runs; their plug-ins are tests/plugins/async_plugins.py ----


def batches(run_dir: Path) -> dict[int, list[tuple[int, str]]]:
    lines = (json.loads(line) for line in (run_dir / "batches.jsonl").read_text().splitlines())
    return {b["rollout_id"]: [tuple(g) for g in b["groups"]] for b in lines}


def batch_samples(run_dir: Path) -> list[list]:
    """[rollout_id, sample index, tokens, reward] of every trained sample, in training order."""
    lines = (json.loads(line) for line in (run_dir / "batches.jsonl").read_text().splitlines())
    return [[b["rollout_id"], *smp] for b in lines for smp in b["samples"]]


def final_weights(ckpt_dir: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(ckpt_dir / "model.safetensors"))


@pytest.mark.slow
def test_zero_staleness_trains_exactly_what_sync_trains(tmp_path):
    """Sync, decoupled at --max-staleness 0 and one-step-off at --max-staleness 0 (a rollout
    function of its own, so generation waits for the push) train the same samples in the same
    order: per-step losses and final weights bit for bit, with a reward that moves them."""
    import torch

    from vime.backends.builtin.launch import launch_engine
    from vime.models import resolve_model

    arms = {
        "sync": ("sync", ["--rollout-function-path", "async_plugins.recorded_rollout"]),
        "one-step-off": (
            "async",
            ["--max-staleness", "0", "--rollout-function-path", "async_plugins.recorded_rollout"],
        ),
        "decoupled": (
            "async",
            ["--max-staleness", "0", "--custom-generate-function-path", "async_plugins.recorded_generate"],
        ),
    }
    # The arms run in this process (train_here: the scripts' runs without their imports) against
    # one engine, started here as a run starts its own (tiny.yaml's --max-num-seqs, the default
    # --rollout-seed 42): a run given engines pushes its starting weights to them before step 1
    # (version 0), so each arm starts from the tiny model whatever the arm before left there.
    # Imports and engine starts were two thirds of each arm's time.
    key = "zero-staleness"
    engine = launch_engine(
        str(resolve_model("tiny")),
        extra_args=["--max-num-seqs", "64", "--seed", "42"],
        log_path=tmp_path / "engine.log",
        api_key=key,
    )
    try:
        for name, (entry, extra) in arms.items():
            where = ["--runs-dir", str(tmp_path), "--run-name", name, "--save", str(tmp_path / f"ckpt-{name}")]
            given = ["--rollout-engine-urls", engine.url, "--api-key", key]
            train_here(entry, *TINY, "--num-rollout", "4", *where, *given, *extra)
    finally:
        engine.shutdown()
    keys = ("train/loss", "train/pg_loss", "train/grad_norm", "rollout/reward_mean", "rollout/staleness_max")
    steps = {name: [[r[k] for k in keys] for r in rows(tmp_path / name)] for name in arms}
    assert len(steps["sync"]) == 4 and steps["one-step-off"] == steps["sync"] and steps["decoupled"] == steps["sync"]
    assert all(s[-1] == 0 for s in steps["sync"])  # every token on-policy
    # the same samples, tokens and rewards in the same order (one-step-off records its batches;
    # decoupled's worker records what it generated, which must be exactly what sync trained)
    trained = batch_samples(tmp_path / "sync")
    assert batch_samples(tmp_path / "one-step-off") == trained
    generated = {
        i: tokens
        for i, tokens, _ in (
            json.loads(line) for line in (tmp_path / "decoupled" / "generated.jsonl").read_text().splitlines()
        )
    }
    trained_tokens = {i: tokens for _, i, tokens, _ in trained}
    assert {i: generated.get(i) for i in trained_tokens} == trained_tokens
    # the worker may finish samples of the next rollout before the run stops it: never trained
    assert all(i > max(trained_tokens) for i in generated.keys() - trained_tokens.keys())
    weights = {name: final_weights(tmp_path / f"ckpt-{name}" / "4") for name in arms}
    for name in ("one-step-off", "decoupled"):
        assert all(torch.equal(weights["sync"][k], weights[name][k]) for k in weights["sync"]), name
    # the reward moved the weights, so the equality above says something
    assert sum(1 for s in steps["sync"] if s[2] > 0) >= 2
    initial = final_weights(resolve_model("tiny"))
    assert any(not torch.equal(initial[k], weights["sync"][k]) for k in initial)


@pytest.mark.slow
def test_staleness_counts_optimizer_steps(tmp_path):
    """Pushing every other step, sync's second step trains tokens one optimizer step old; with two
    optimizer steps per rollout, the second half of each rollout is one step old. The push
    count is kept apart from the policy version."""
    for name, extra in {"interval": ["--update-weights-interval", "2"], "half": ["--global-batch-size", "8"]}.items():
        train_here("sync", *TINY, "--num-rollout", "2", "--runs-dir", str(tmp_path), "--run-name", name, *extra)
    r = rows(tmp_path / "interval")
    assert [x["rollout/staleness_max"] for x in r] == [0, 1] and [x["rollout/staleness_mean"] for x in r] == [0, 1]
    assert [(x["train/policy_version"], x["train/weight_version"], x["train/weight_pushes"]) for x in r] == [
        (1, 0, 0),
        (2, 2, 1),
    ]
    r = rows(tmp_path / "half")
    assert [x["rollout/staleness_max"] for x in r] == [1, 1]
    assert [x["rollout/staleness_mean"] for x in r] == pytest.approx([0.5, 0.5], abs=0.1)  # tokens split about evenly
    assert [(x["train/policy_version"], x["train/weight_version"], x["train/weight_pushes"]) for x in r] == [
        (2, 2, 1),
        (4, 4, 2),
    ]


@pytest.mark.slow
def test_fully_async_checkpoint_saves_the_workers_groups_and_resume_trains_them(tmp_path):
    import torch

    common = [
        *TINY,
        "--runs-dir",
        str(tmp_path),
        "--rollout-function-path",
        "async_plugins.recorded_fully_async_rollout",
        "--rollout-concurrency",
        "4",
    ]
    # both runs in this process (train_here: the script's run without its imports)
    first = [*common, "--num-rollout", "2", "--run-name", "a", "--save", str(tmp_path / "ckpt"), "--save-interval", "1"]
    train_here("async", *first)
    trained = batches(tmp_path / "a")
    state = torch.load(tmp_path / "ckpt" / "1" / "trainer_state.pt", weights_only=False)["extra"]["data_source"]
    saved = [(g[0]["group_index"], g[0]["prompt"]) for g in state["requeued"]]
    # at step 1 the worker held groups queued or in flight, and the batch of step 2 was already
    # drained: every group handed out but not trained at step 1 is saved, once, from its prompt
    assert sorted(gi for gi, _ in saved) == sorted(set(range(state["next_group"])) - {gi for gi, _ in trained[0]})
    assert set(trained[1]) <= set(saved)
    assert all(s["response_length"] == 0 and s["status"] == "pending" for g in state["requeued"] for s in g)

    shutil.copytree(tmp_path / "ckpt" / "1", tmp_path / "load" / "1")
    train_here("async", *common, "--num-rollout", "2", "--run-name", "b", "--load", str(tmp_path / "load"))
    resumed = batches(tmp_path / "b")
    assert list(resumed) == [1]  # only step 2 ran
    # the resumed worker starts the saved groups first, --rollout-concurrency (4) at a time, so
    # the first group it finishes is one of them, with its prompt
    assert resumed[1][0] in saved[:4]
    assert not set(resumed[1]) & set(trained[0])  # nothing trained twice


@pytest.mark.slow
def test_one_step_off_stops_at_once_while_a_generate_is_pending(tmp_path):
    env = dict(
        os.environ,
        PYTHONUNBUFFERED="1",
        PYTHONPATH=os.pathsep.join([str(PLUGINS), str(ROOT), os.environ.get("PYTHONPATH", "")]),
    )
    argv = [
        sys.executable,
        "train_async.py",
        *TINY,
        "--num-rollout",
        "3",
        "--runs-dir",
        str(tmp_path),
        "--run-name",
        "s",
        "--custom-generate-function-path",
        "async_plugins.stall_after_first_batch",
    ]
    proc = subprocess.Popen(
        argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        t0 = time.monotonic()
        while not (tmp_path / "s" / "stalling").exists():  # the generate for step 2 is pending now, for minutes
            assert proc.poll() is None, proc.stderr.read()[-3000:]
            assert time.monotonic() - t0 < 120, "the stalling generate never started"
            time.sleep(0.1)
        proc.send_signal(signal.SIGINT)  # Ctrl-C, to the trainer only: the engines stay up
        stopped = time.monotonic()
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    # A sample of the stalled group may open a new HTTP session after the clients were closed;
    # aiohttp then reports it unclosed at exit (two lines, after ours). Noise, not the error.
    # The report comes bare or through the logging handler ("<time> ERROR asyncio: Unclosed ..."),
    # with continuation lines naming the session, connector and its connections.
    noise = ("Unclosed client session", "Unclosed connector", "client_session:", "connector:", "connections:")
    lines = [line for line in err.strip().splitlines() if not line.split("asyncio: ")[-1].startswith(noise)]
    assert proc.returncode == 130 and lines[-1] == "interrupted", err[-3000:]
    assert time.monotonic() - stopped < 30  # well before the pending generate's 300 s
