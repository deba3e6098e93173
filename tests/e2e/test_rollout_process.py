"""--rollout-process: generation and rewards in a process of their own (vime/rollout/process.py).

What must hold: the run trains as it does without one (the same samples and weights where the
mode is deterministic), a plug-in's fault and the process's own end are one line each, the
process never outlives the trainer, and an engine it finds gone is restarted by the trainer and
followed by the process."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import PLUGINS, ROOT, run_cli, train_here

TINY = ["--config", "examples/tiny.yaml"]
FULLY_ASYNC = ["--rollout-function-path", "vime.rollout.fully_async_rollout.generate_rollout_fully_async"]


def rows(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "perf/step_time" in r]


def process_pid(run_dir: Path) -> int | None:
    """The rollout process's pid, from the line it logs once it serves."""
    log = run_dir / "log.txt"
    found = re.search(r"rollout process (\d+): generating", log.read_text()) if log.exists() else None
    return int(found.group(1)) if found else None


def weights(model_dir: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(model_dir / "model.safetensors"))


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"  # a zombie has ended (its parent, gone, cannot reap it)


# ---- when a run has one


def test_auto_chooses_a_process_only_where_generation_overlaps_a_gpu_trainer():
    from vime.config import parse_args
    from vime.rollout.process import wanted

    def cfg(entry: str, *extra: str):
        return parse_args([*TINY, "--num-rollout", "2", *extra], entry=entry)

    assert wanted(cfg("async", *FULLY_ASYNC), "cuda:0")
    assert wanted(cfg("async"), "cuda")  # one-step-off overlaps too
    assert wanted(cfg("async", "--max-staleness", "1"), "cuda")
    assert not wanted(cfg("async", *FULLY_ASYNC), "cpu")
    assert not wanted(cfg("sync"), "cuda")  # nothing runs beside a sync train step
    assert not wanted(cfg("async", "--rollout-process", "off"), "cuda")
    assert wanted(cfg("sync", "--rollout-process", "on"), "cpu")
    # a custom generate may reach the engines through the run's router, in the trainer's process
    assert not wanted(cfg("async", "--custom-generate-function-path", "varied_reward.digit_share"), "cuda")


def test_on_with_a_custom_generate_is_refused_in_one_line():
    from vime.config import ConfigError, parse_args

    with pytest.raises(ConfigError, match=r"--rollout-process on runs the default generate .* drop one of them"):
        parse_args(
            [*TINY, "--num-rollout", "2", "--rollout-process", "on", "--custom-generate-function-path", "x.y"],
            entry="async",
        )


# ---- a run with one


def test_fully_async_trains_with_its_rollout_in_a_process_that_ends_with_the_run(tmp_path):
    import multiprocessing

    from vime.models import resolve_model

    train_here(
        "async", *TINY, *FULLY_ASYNC, "--rollout-process", "on", "--num-rollout", "4",
        "--custom-rm-path", "varied_reward.digit_share", "--save", str(tmp_path / "ckpt"),
        "--runs-dir", str(tmp_path), "--run-name", "r",
    )  # fmt: skip
    steps = rows(tmp_path / "r")
    assert len(steps) == 4 and all(r["rollout/num_samples"] == 16 for r in steps)
    assert max(r["rollout/staleness_max"] for r in steps) >= 1  # generation ran ahead of training
    pid = process_pid(tmp_path / "r")
    assert pid is not None and pid != os.getpid()
    assert not multiprocessing.active_children(), "the rollout process outlived its run"
    # the rewards it computed trained the model
    assert any(r["train/grad_norm"] > 0 for r in steps)
    before, after = weights(resolve_model("tiny")), weights(tmp_path / "ckpt" / "4")
    assert any(not before[k].equal(after[k]) for k in before)


def test_a_rollout_process_that_dies_stops_the_run_in_one_line(tmp_path):
    res = run_cli(
        "train_async.py", *TINY, *FULLY_ASYNC, "--rollout-process", "on", "--num-rollout", "6",
        "--custom-rm-path", "process_plugins.die_in_step_two", "--runs-dir", str(tmp_path), "--run-name", "r",
    )  # fmt: skip
    assert res.returncode == 2, res.stderr[-3000:]
    last = res.stderr.strip().splitlines()[-1]
    assert re.fullmatch(
        r"error: (step \d+: )?the rollout process ended \(exit code -9\); its log lines are in .*log\.txt", last
    ), res.stderr[-2000:]
    assert "Traceback" not in res.stderr


def test_a_plugin_error_in_the_rollout_process_names_the_plugin_and_the_step(tmp_path):
    res = run_cli(
        "train_async.py", *TINY, "--rollout-process", "on", "--num-rollout", "4",
        "--custom-rm-path", "process_plugins.reward_with_a_wrong_key", "--reward-key", "score",
        "--runs-dir", str(tmp_path), "--run-name", "r",
    )  # fmt: skip
    assert res.returncode == 2, res.stderr[-3000:]
    last = res.stderr.strip().splitlines()[-1]
    assert "--custom-rm-path process_plugins.reward_with_a_wrong_key returned a dict without the key 'score'" in last
    assert "Traceback" not in res.stderr


def test_the_rollout_process_ends_with_a_killed_trainer(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(PLUGINS), str(ROOT)]))
    cmd = [sys.executable, "train_async.py", *TINY, *FULLY_ASYNC, "--rollout-process", "on", "--num-rollout", "500"]
    trainer = subprocess.Popen(
        [*cmd, "--runs-dir", str(tmp_path), "--run-name", "r"], cwd=ROOT, env=env, stderr=subprocess.DEVNULL
    )
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "r" / "metrics.jsonl").exists() or not rows(tmp_path / "r"):
            assert trainer.poll() is None and time.monotonic() < deadline, "the run did not take a step"
            time.sleep(0.2)
        pid = process_pid(tmp_path / "r")
        assert pid is not None and alive(pid)
    finally:
        trainer.kill()
        trainer.wait()
    deadline = time.monotonic() + 15
    while alive(pid):
        assert time.monotonic() < deadline, "the rollout process outlived its killed trainer"
        time.sleep(0.1)


@pytest.mark.slow
def test_decoupled_at_zero_staleness_in_a_process_trains_exactly_what_sync_trains(tmp_path):
    """The same samples, in the same order, and the same weights bit for bit, whether sync
    generates in the trainer's process or decoupled (--max-staleness 0) in a rollout process."""
    import torch

    arms = {"sync": ("sync", []), "decoupled": ("async", ["--max-staleness", "0", "--rollout-process", "on"])}
    for name, (entry, extra) in arms.items():
        where = ["--runs-dir", str(tmp_path), "--run-name", name, "--save", str(tmp_path / f"ckpt-{name}")]
        saved = ["--save-debug-rollout-data", str(tmp_path / name / "batch-{rollout_id}.pt")]
        train_here(
            entry, *TINY, "--num-rollout", "3", "--custom-rm-path", "varied_reward.digit_share", *where, *saved, *extra
        )
    for step in range(3):
        a, b = (torch.load(tmp_path / n / f"batch-{step}.pt", weights_only=False) for n in arms)
        assert [(s["index"], s["tokens"], s["reward"]) for s in a["samples"]] == [
            (s["index"], s["tokens"], s["reward"]) for s in b["samples"]
        ]
    final = {n: weights(tmp_path / f"ckpt-{n}" / "3") for n in arms}
    assert all(torch.equal(final["sync"][k], final["decoupled"][k]) for k in final["sync"])
    assert any(r["train/grad_norm"] > 0 for r in rows(tmp_path / "sync"))


@pytest.mark.slow
def test_an_engine_the_process_finds_gone_is_restarted_and_gets_its_work_again(tmp_path, tiny_model, addition_data):
    """Two engines, one-step-off: a reward in the rollout process kills engine 1 in step 2. Its
    requests go to engine 0; the trainer starts it again, pushes to it, and the process sends it
    work again (from then on, every step's requests are shared by both)."""
    train, _ = addition_data
    train_here(
        "async", "--hf-checkpoint", str(tiny_model), "--prompt-data", str(train), "--rollout-process", "on",
        "--rollout-batch-size", "4", "--n-samples-per-prompt", "4", "--rollout-max-response-len", "6",
        "--num-rollout", "10", "--custom-rm-path", "process_plugins.kill_engine_one_in_step_two",
        "--rollout-num-engines", "2", "--runs-dir", str(tmp_path), "--run-name", "two",
    )  # fmt: skip
    steps = rows(tmp_path / "two")
    assert len(steps) == 10
    assert steps[-1]["rollout/engine_restarts"] == 1 and steps[-1]["rollout/engines_up"] == 2
    served = [r["rollout/engine1_requests"] for r in steps]
    assert served[-1] > max(served[:3]), served  # engine 1 took requests again after its restart
    assert "engine 1 is back at" in (tmp_path / "two" / "log.txt").read_text()
