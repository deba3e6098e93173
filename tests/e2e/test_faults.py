"""Whole runs under faults (issue 12): a plug-in that fails mid-run, a signal in every mode, an
engine killed or silent mid-step or lost while a checkpoint is written, non-finite rewards,
Ctrl-C during a checkpoint, a resume past a damaged checkpoint. Each run ends within seconds of
the fault, in one line, with its checkpoints intact, its record kept and no process left
behind. (Killing an engine in the middle of a broadcast push is
tests/unit/transport/test_weight_sync.py's.)"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from conftest import PLUGINS, ROOT, child_pids, run_cli, train_here
from unit.test_preflight import CUSTOM_LOSS

from vime.metrics import progress_postfix

TINY = ["--config", "examples/tiny.yaml", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2"]
FULLY_ASYNC = ["--rollout-function-path", "vime.rollout.fully_async_rollout.generate_rollout_fully_async"]


# Seconds a run may take to stop after a fault, on a machine as fast as a quiet one (observed:
# 2-3 s). A loaded machine stretches every step of a stop (signals handled, engines and workers
# ended, processes reaped) as it stretched the run's start, so the bound grows with the ratio of
# the run's own time from its command to the fault over a quiet machine's (QUIET_START_S; a fixed
# 30 s failed once under heavy load). Which path stopped the run is asserted by its last line (the
# signal, the health probe's "no answer ... within 2s", "unreachable after 3 tries"), and the slow
# paths these tests guard against wait 120 s (a push), 600 s (a request) or for ever: still caught.
EXIT_BOUND_S = 30
QUIET_START_S = 15  # the tiny run's command to its first steps on a quiet machine (observed: 10-12 s)


@pytest.mark.parametrize(
    "flags, fault",
    [
        (
            ["--dynamic-sampling-filter-path", "fault_plugins.filter_failing_in_step_two"],
            r"step 2: --dynamic-sampling-filter-path fault_plugins.filter_failing_in_step_two on group \d+ raised "
            r"KeyError: 'difficulty' \(VIME_DEBUG=1 shows its traceback\)",
        ),
        (
            [*CUSTOM_LOSS, "fault_plugins.loss_failing_in_step_two"],
            r"step 2: --custom-loss-function-path fault_plugins.loss_failing_in_step_two raised "
            r"ZeroDivisionError: float division by zero \(VIME_DEBUG=1 shows its traceback\)",
        ),
    ],
    ids=["filter", "loss"],
)
def test_a_plugin_that_fails_mid_run_stops_it_in_one_line_and_keeps_the_checkpoints(tmp_path, flags, fault):
    res = run_cli(
        "train.py", *TINY, *flags, "--num-rollout", "3", "--save", str(tmp_path / "ckpt"), "--save-interval", "1",
        "--runs-dir", str(tmp_path), "--run-name", "r",
    )  # fmt: skip
    assert res.returncode == 2, res.stderr[-3000:]
    assert re.fullmatch("error: " + fault, res.stderr.strip().splitlines()[-1]), res.stderr[-2000:]
    assert "Traceback" not in res.stderr
    _intact_checkpoints(tmp_path / "ckpt", at_least=1)
    assert [json.loads(x)["step"] for x in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()] == [1]


def test_a_rollout_function_that_returns_no_rollout_output_stops_the_run_in_one_line(tmp_path):
    res = run_cli(
        "train.py", *TINY, "--rollout-function-path", "fault_plugins.rollout_as_a_flat_list", "--debug-rollout-only",
        "--num-rollout", "2", "--runs-dir", str(tmp_path), "--run-name", "r",
    )  # fmt: skip
    assert res.returncode == 2, res.stderr[-3000:]
    assert res.stderr.strip().splitlines()[-1] == (
        "error: step 1: --rollout-function-path fault_plugins.rollout_as_a_flat_list returned list: it must return "
        "RolloutOutput(samples=[[Sample, ...], ...], metrics={}), one non-empty list per prompt group"
    ), res.stderr[-2000:]


# ---- whole runs: faults, signals, resume ---------------------------------------------------


def _group_alive(pgid: int) -> list[str]:
    """Processes of a process group that still run (zombies waiting for a reaper do not)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
            fields = text.rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[2] == str(pgid) and fields[0] != "Z":
            out.append(text.split(")")[0])
    return out


def _start(script: str, tmp_path: Path, *argv: str) -> subprocess.Popen:
    env = dict(
        os.environ,
        PYTHONUNBUFFERED="1",
        PYTHONPATH=os.pathsep.join([str(PLUGINS), str(ROOT), os.environ.get("PYTHONPATH", "")]),
    )
    cmd = [
        sys.executable,
        script,
        *TINY,
        "--runs-dir",
        str(tmp_path),
        "--run-name",
        "r",
        "--save",
        str(tmp_path / "ckpt"),
        "--save-interval",
        "1",
        *argv,
    ]
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    proc.started = time.time()  # type: ignore[attr-defined]  # the start-up that scales _ended's bound
    return proc


def _wait_for(proc: subprocess.Popen, path: Path, timeout: float = 120) -> None:
    """Until `path` holds something (a metrics row, a plug-in's marker); the run may end meanwhile."""

    def there() -> bool:
        return path.exists() and path.stat().st_size > 0

    t0 = time.monotonic()
    while not there():
        if proc.poll() is not None and not there():
            pytest.fail(f"the run ended before {path.name}: {proc.stderr.read()[-3000:]}")
        assert time.monotonic() - t0 < timeout, f"{path} never came"
        time.sleep(0.1)


def _ended(proc: subprocess.Popen, since: float | None) -> tuple[int, list[str]]:
    """Exit code and stderr lines of a run that must end within the exit bound of `since` (the
    fault, wall clock: time.time()), leaving no process. `since` None: a run that ends by itself,
    with no claim on how fast (a hang guard only)."""
    if since is None:
        bound, slower = 180.0, 1.0
    else:
        slower = max(1.0, (since - proc.started) / QUIET_START_S)  # type: ignore[attr-defined]
        bound = EXIT_BOUND_S * slower
    try:
        _, err = proc.communicate(timeout=max(1.0, bound - (time.time() - (since or time.time()))))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"still running {bound:.0f} s after the fault (start-up {slower:.1f} x a quiet machine's)")
    if since is not None:
        assert time.time() - since < bound, f"{time.time() - since:.0f} s > {bound:.0f} s"
    deadline = time.monotonic() + 10 * slower  # children notice their parent is gone within a second or two
    while _group_alive(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = _group_alive(proc.pid)
    if left:
        os.killpg(proc.pid, signal.SIGKILL)
    assert not left, f"left behind: {left}"
    assert "Traceback" not in err, err[-3000:]
    # torch's exit-time note that a trainer rank left a collective unwaited (one that SIGTERM cut
    # short in a two-rank run, the other rank then ended): true, and nothing vime can wait on now
    err = re.sub(
        r"\[W\d+ [^\]]*ProcessGroup\.cpp:\d+\] Warning: At the time of process termination.*?~WorkRegistry\)\n?",
        "",
        err,
        flags=re.S,
    )
    # aiohttp may report a session a cancelled request reopened (tests/e2e/test_async.py has the story)
    noise = ("Unclosed client session", "Unclosed connector", "client_session:", "connector:", "connections:")
    return proc.returncode, [
        line for line in err.strip().splitlines() if not line.split("asyncio: ")[-1].startswith(noise)
    ]


def _intact_checkpoints(save: Path, at_least: int) -> None:
    """Every checkpoint written is whole and finite, and no half-written one is left."""
    from safetensors.torch import load_file

    from vime.trainer.checkpoint import problem

    written = [p for p in save.glob("*") if p.name.isdigit()]
    assert len(written) >= at_least
    for ckpt in written:
        assert problem(ckpt) is None
        assert all(torch.isfinite(t).all() for t in load_file(str(ckpt / "model.safetensors")).values())
    assert not list(save.glob("*.tmp"))


@pytest.mark.slow
@pytest.mark.parametrize(
    "script, extra, fault, marker",
    [
        ("train.py", [], "SIGTERM", "metrics.jsonl"),
        # Ctrl-C while the pool grades batch 2 (seconds a sample) and step 1 trains
        ("train_async.py", ["--custom-generate-function-path", "fault_plugins.slow_grading"], "SIGINT", "grading"),
        ("train_async.py", FULLY_ASYNC, "SIGTERM", "metrics.jsonl"),
        ("train_async.py", ["--max-staleness", "1"], "SIGINT", "metrics.jsonl"),
        ("train.py", ["--actor-num-procs", "2"], "SIGTERM", "metrics.jsonl"),
    ],
    ids=[
        "sync-sigterm",
        "one-step-off-ctrl-c-while-grading",
        "fully-async-sigterm",
        "decoupled-ctrl-c",
        "two-ranks-sigterm",
    ],
)
def test_a_signal_stops_every_mode_within_seconds(tmp_path, script, extra, fault, marker):
    """SIGTERM to the trainer (what `kill` and schedulers send) or Ctrl-C (SIGINT to the whole
    process group, engine and reward workers included): out within seconds, one line, the
    checkpoint of step 1 intact, no process left."""
    # far more steps than run before the signal: the tiny model's async steps take ~20 ms, and 20
    # of them ended before a signal sent 1 s after the first row (the test then raced the exit)
    proc = _start(script, tmp_path, "--num-rollout", "100000", *extra)
    _wait_for(proc, tmp_path / "r" / marker)
    time.sleep(1)  # the group's generation ends, its grading begins
    if fault == "SIGINT":
        os.killpg(proc.pid, signal.SIGINT)
    else:
        proc.send_signal(signal.SIGTERM)
    code, lines = _ended(proc, time.time())
    assert (code, lines[-1]) == ((130, "interrupted") if fault == "SIGINT" else (143, "terminated")), lines[-5:]
    _intact_checkpoints(tmp_path / "ckpt", at_least=1 if marker == "metrics.jsonl" else 0)


@pytest.mark.slow
def test_bench_ab_stopped_by_sigterm_stops_its_running_arm(tmp_path):
    """bench/bench_ab.py (its CPU smoke settings) stopped by SIGTERM while an arm trains: by the
    time the bench has exited, the arm and everything it started have ended. The arm used to run
    on, holding the bench's output pipe open for minutes."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "bench/bench_ab.py", "--device", "cpu", "--tiny", "--steps", "100000", "--arms", "sync"]
    with open(tmp_path / "out.txt", "w") as out, open(tmp_path / "err.txt", "w") as err:
        proc = subprocess.Popen(
            [*cmd, "--out", str(tmp_path)], cwd=ROOT, env=env, stdout=out, stderr=err, start_new_session=True
        )
    arm: list[int] = []
    try:
        t0 = time.monotonic()
        while not (rows := list((tmp_path / "runs").glob("*-sync/metrics.jsonl"))) or not rows[0].stat().st_size:
            assert proc.poll() is None, (tmp_path / "err.txt").read_text()[-3000:]
            assert time.monotonic() - t0 < 180, "no arm step"
            time.sleep(0.2)
        arm = [p for p in child_pids(proc.pid) if b"vime.cli" in Path(f"/proc/{p}/cmdline").read_bytes()]
        assert len(arm) == 1
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(EXIT_BOUND_S) == 143
        assert _group_alive(arm[0]) == [] and _group_alive(proc.pid) == []  # nothing outlives the bench
        assert (tmp_path / "err.txt").read_text().strip().splitlines()[-1] == "terminated"
    finally:
        for group in [*arm, proc.pid]:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(group, signal.SIGKILL)
        proc.wait()


@pytest.mark.slow
@pytest.mark.parametrize(
    "plugin",
    [
        "--custom-generate-function-path fault_plugins.kill_engine_mid_step",
        "--rollout-function-path fault_plugins.kill_engine_after_rollout",
    ],
    ids=["mid-generation", "before-the-push"],
)
def test_an_engine_killed_mid_step_ends_the_run_in_one_line(tmp_path, plugin):
    proc = _start("train.py", tmp_path, "--num-rollout", "4", *plugin.split())
    _wait_for(proc, tmp_path / "r" / "engine-killed")
    code, lines = _ended(proc, (tmp_path / "r" / "engine-killed").stat().st_mtime)
    assert code == 2 and lines[-1].startswith("error: ") and "unreachable after 3 tries" in lines[-1], lines[-5:]
    assert (lines[-1].startswith("error: step 2: ")) == ("after" in plugin)  # a failed push names its step
    _intact_checkpoints(tmp_path / "ckpt", at_least=1)


@pytest.mark.slow
@pytest.mark.parametrize(
    "script, extra",
    [
        ("train.py", ["--custom-generate-function-path", "fault_plugins.stop_engine_mid_step"]),
        # fully-async generates through the push, so the stop may land in one: bounded by its own flag
        (
            "train_async.py",
            [*FULLY_ASYNC, "--custom-generate-function-path", "fault_plugins.stop_engine_mid_step"]
            + ["--update-weights-timeout", "5"],
        ),
        # stopped while the trainer trains: the push's pause finds it silent, and no push waits on
        # it for --update-weights-timeout (120 s) after a second probe (the run used to take 181 s
        # at the default health flags)
        (
            "train_async.py",
            [*FULLY_ASYNC, "--custom-advantage-function-path", "fault_plugins.stop_engines_while_training"],
        ),
    ],
    ids=["sync", "fully-async", "fully-async-while-training"],
)
def test_an_engine_that_stops_answering_ends_the_run_in_one_line(tmp_path, script, extra):
    """SIGSTOP leaves the engine's port open and its requests waiting for ever (the run used to
    stall for the 600 s request timeout): the health watch finds it silent within interval +
    timeout, and with no other engine the run stops in one line, its checkpoints intact and the
    stopped engine ended."""
    probes = ["--rollout-health-check-interval", "1", "--rollout-health-check-timeout", "2"]
    proc = _start(script, tmp_path, "--num-rollout", "8", *probes, *extra)
    marker = tmp_path / "r" / "engine-stopped"
    _wait_for(proc, marker)
    code, lines = _ended(proc, marker.stat().st_mtime)
    assert code == 2 and lines[-1].startswith("error: "), lines[-5:]
    assert re.search(r"stopped answering \(no answer to /\w+ within 2s\)|timed out after 5s", lines[-1]), lines[-5:]
    assert "resume the run with --load" in lines[-1]
    _intact_checkpoints(tmp_path / "ckpt", at_least=1)


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "stopped"])
def test_an_engine_lost_while_a_checkpoint_is_written_comes_back(tmp_path, tiny_model, addition_data, monkeypatch, sig):
    """Two engines, fully-async, a checkpoint every step: engine 1 is killed (or stopped) while
    step 2's checkpoint is written, the engines paused for it. The continue after the save finds
    it gone (a stopped one silent within the health timeout) and the run goes on with engine 0,
    nothing lost; engine 1 is started again and a later push re-syncs it. The continue's error
    used to end the run, with or without another engine up."""
    from fault_plugins import engine_server_pid

    import vime.loops
    from vime.config import parse_args
    from vime.loops import train
    from vime.trainer.actor import Actor

    real_save, real_assemble, runs = Actor.save, vime.loops.assemble, []
    monkeypatch.setattr(vime.loops, "assemble", lambda cfg: runs.append(real_assemble(cfg)) or runs[-1])

    def save_and_lose_engine_one(self, final, extra):
        if extra["step"] == 2:
            os.kill(engine_server_pid(args, 1), sig)
        if extra["step"] == 3:  # engine 1 back before the last step, whose push re-syncs it
            deadline = time.monotonic() + 120
            while runs[0].runtime.engines[1].state != "unsynced":
                assert time.monotonic() < deadline, "engine 1 did not come back"
                time.sleep(0.1)
        return real_save(self, final, extra)

    monkeypatch.setattr(Actor, "save", save_and_lose_engine_one)
    argv = ["--hf-checkpoint", str(tiny_model), "--prompt-data", str(addition_data[0]), "--num-rollout", "4"]
    argv += ["--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--rollout-max-response-len", "4"]
    argv += [*FULLY_ASYNC, "--rollout-num-engines", "2", "--device", "cpu", "--quiet"]
    argv += ["--rollout-health-check-interval", "1", "--rollout-health-check-timeout", "2"]
    argv += ["--runs-dir", str(tmp_path), "--run-name", "r", "--save", str(tmp_path / "ckpt"), "--save-interval", "1"]
    args = parse_args(argv, entry="async")
    assert args.mode == "fully-async"
    train(args)
    rows = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "perf/step_time" in r]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert [r["rollout/engines_up"] for r in rows][::3] == [2, 2] and rows[-1]["rollout/engine_restarts"] == 1
    assert "holds the current weights again" in (tmp_path / "r" / "log.txt").read_text()
    _intact_checkpoints(tmp_path / "ckpt", at_least=4)


@pytest.mark.slow
def test_non_finite_rewards_skip_steps_and_stop_the_run_with_finite_checkpoints(tmp_path):
    proc = _start(
        "train.py",
        tmp_path,
        "--num-rollout",
        "6",
        "--max-bad-steps",
        "2",
        "--rollout-function-path",
        "fault_plugins.inf_rewards_from_step_two",
    )
    code, lines = _ended(proc, None)  # the run stops itself: what it says and leaves, not how fast
    assert code == 2 and lines[-1].startswith(
        "error: step 3: 2 steps in a row had non-finite numbers (2 rewards are not finite"
    ), lines[-5:]
    rows = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["train/skipped_steps"]) for r in rows] == [
        (1, 0),
        (2, 1),
    ]  # step 3 stopped the run before its row
    assert progress_postfix(rows[1])["skipped_steps"] == "1"  # and the progress line shows it
    # step 2 skipped its optimizer step: its checkpoint holds step 1's (finite) weights
    _intact_checkpoints(tmp_path / "ckpt", at_least=2)


@pytest.mark.slow
def test_a_resume_keeps_the_record_and_steps_past_a_damaged_checkpoint(tmp_path, capfd):
    """Run 3 steps (checkpoints 2 and 3), cut the newest checkpoint short, resume in the same run
    directory: it starts from step 2 with a warning, each step is in metrics.jsonl once (the
    replaced row kept aside), the wall clock goes on, and no log or config is overwritten."""
    rows_file = tmp_path / "rows.jsonl"
    rows_file.write_text(
        "".join(
            json.dumps({"input": f"{i}+1=" if i != 2 else "9" * 600, "label": str(i + 1)}) + "\n" for i in range(12)
        )
    )
    common = [
        *TINY,
        "--prompt-data",
        str(rows_file),
        "--skip-overlong-prompts",
        "--runs-dir",
        str(tmp_path),
        "--run-name",
        "r",
        "--save",
        str(tmp_path / "ckpt"),
    ]
    # both runs in this process (train_here: train.py's run without its imports); stderr read by capfd
    train_here("sync", *common, "--num-rollout", "3", "--save-interval", "2")
    before = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    newest = tmp_path / "ckpt" / "3" / "model.safetensors"
    with open(newest, "r+b") as f:
        f.truncate(newest.stat().st_size // 2)
    capfd.readouterr()
    train_here("sync", *common, "--num-rollout", "4", "--load", str(tmp_path / "ckpt"))
    err = capfd.readouterr().err
    assert (
        "checkpoint " + str(tmp_path / "ckpt" / "3") + " is damaged" in err
        and "resumed from " + str(tmp_path / "ckpt" / "2") in err
    ), err[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert [
        json.loads(line)["step"] for line in (tmp_path / "r" / "metrics.superseded.jsonl").read_text().splitlines()
    ] == [3]
    clock = [r["perf/wall_clock"] for r in rows]
    assert clock[:2] == [r["perf/wall_clock"] for r in before[:2]] and clock == sorted(clock) and clock[2] > clock[1]
    assert all(r["rollout/skipped_prompts"] == 1 for r in rows)
    files = {p.name for p in (tmp_path / "r").iterdir()}
    assert {"config.yaml", "config.1.yaml", "engine0.log", "engine0.1.log"} <= files
    assert (
        yaml.safe_load((tmp_path / "r" / "config.yaml").read_text())["api_key"] is None
    )  # the key made for the engines is not written


def test_ctrl_c_during_a_checkpoint_keeps_that_steps_metrics_row(tmp_path, tiny_model, addition_data, monkeypatch):
    """The checkpoint of step 2 and step 2's metrics row are written together: a signal that
    lands while the checkpoint is written acts after the row (it used to act in between, and a
    run resumed from that checkpoint never logged step 2)."""
    from vime.config import parse_args
    from vime.loops import train
    from vime.trainer.actor import Actor

    real_save = Actor.save

    def save_then_interrupt(self, final, extra):
        if extra["step"] == 2:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.1)
        return real_save(self, final, extra)

    monkeypatch.setattr(Actor, "save", save_then_interrupt)
    argv = ["--hf-checkpoint", str(tiny_model), "--prompt-data", str(addition_data[0]), "--num-rollout", "4"]
    argv += ["--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--rollout-max-response-len", "4"]
    argv += ["--runs-dir", str(tmp_path), "--run-name", "r", "--save", str(tmp_path / "ckpt"), "--save-interval", "1"]
    argv += ["--device", "cpu", "--quiet"]
    with pytest.raises(KeyboardInterrupt):
        train(parse_args(argv))
    rows = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "perf/step_time" in r] == [1, 2]
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["1", "2"]
