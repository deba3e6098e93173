"""slime's launch on one machine, for real: `ray start --head`, then `ray job submit -- python3
train_async.py ...`, with vime as the job's entrypoint (vime starts its own processes; Ray only
runs the command). Run by `make test-ray` in .venv-ray; skipped where ray is not installed.

The head listens on loopback ports of its own (Ray itself turns `--node-ip-address 127.0.0.1`
into this machine's address, which stays on the machine) and is stopped by its process group,
not `ray stop --force`, which would end every Ray process of the machine.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from importlib.util import find_spec
from pathlib import Path

import pytest
from conftest import ROOT

pytestmark = [
    pytest.mark.ray,
    pytest.mark.skipif(find_spec("ray") is None, reason="ray is not installed (make test-ray)"),
]

BIN = Path(sys.executable).parent  # `ray` and the `python3` the job runs: this environment's
# as the seed scripts pass it: env_vars Ray sets for the job, PYTHONPATH replaced (vime still imports)
RUNTIME_ENV = {"env_vars": {"PYTHONPATH": "/root/Megatron-LM/", "CUDA_DEVICE_MAX_CONNECTIONS": "1"}}
TINY = [
    *("--hf-checkpoint", "tiny", "--prompt-data", "examples/data/addition/train.jsonl", "--rm-type", "math"),
    *("--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--rollout-max-response-len", "4"),
]
START_S = 180  # the head's start, on 2 busy cores ~15 s
JOB_S = 300  # a tiny run as a job, ~30 s


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict[str, str]:
    """The head's environment, which its jobs inherit: this environment's bin first on PATH (so
    the job's `python3` is ours); no PYTHONUNBUFFERED, so the job's log streams only if Ray sees
    to it; no usage stats, no W&B error reports."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONUNBUFFERED", "RAY_ADDRESS")}
    path = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    return dict(env, PATH=path, RAY_USAGE_STATS_ENABLED="0", WANDB_ERROR_REPORTING="false")


@pytest.fixture(scope="module")
def head() -> Iterator[str]:
    """A Ray head started as the seed scripts start it, from the repository root (where their
    `python3 train.py` is found); yields the dashboard's address for `ray job submit`."""
    temp = Path(tempfile.mkdtemp(prefix="vray-"))  # short: Ray's socket paths must stay under 108 bytes
    dashboard = _free_port()
    cmd = [
        *(str(BIN / "ray"), "start", "--head", "--block", "--node-ip-address", "127.0.0.1", "--num-gpus", "0"),
        *("--disable-usage-stats", "--temp-dir", str(temp), "--port", str(_free_port())),
        *("--dashboard-host", "127.0.0.1", "--dashboard-port", str(dashboard)),
        *("--dashboard-agent-listen-port", str(_free_port()), "--ray-client-server-port", str(_free_port())),
    ]
    log = temp / "head.log"
    with log.open("w") as out:
        # its own process group, which holds every process Ray starts but its workers (they end with the raylet)
        proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + START_S
        while "Ray runtime started" not in log.read_text():
            assert proc.poll() is None, f"ray start exited {proc.returncode}:\n{log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"no Ray head within {START_S} s:\n{log.read_text()[-3000:]}"
            time.sleep(0.5)
        yield f"http://127.0.0.1:{dashboard}"
    finally:
        # as `ray stop --force` would, but only this head's processes: SIGKILL to its group, then
        # to whatever else it started (workers have groups of their own; they end with the raylet)
        started = {pid: _start_time(pid) for pid in _descendants(proc.pid)}
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        deadline = time.monotonic() + 30
        while _alive(list(started)) and time.monotonic() < deadline:
            time.sleep(0.2)
        for pid, start in started.items():
            if _start_time(pid) == start is not None:  # still that process, not a pid used again
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(temp, ignore_errors=True)


def ray(*argv: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(BIN / "ray"), *argv], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=timeout
    )


def submit(address: str, entrypoint: list[str], *flags: str, timeout: float = JOB_S) -> subprocess.CompletedProcess:
    """`ray job submit` as the seed scripts call it (it waits for the job and tails its log)."""
    return ray(
        *("job", "submit", f"--address={address}", f"--runtime-env-json={json.dumps(RUNTIME_ENV)}", *flags, "--"),
        *entrypoint,
        timeout=timeout,
    )


def status(address: str, job: str) -> str:
    """PENDING, RUNNING, SUCCEEDED, FAILED or STOPPED."""
    from ray.job_submission import JobSubmissionClient

    return str(JobSubmissionClient(address).get_job_status(job).value)


def logs(address: str, job: str) -> str:
    from ray.job_submission import JobSubmissionClient

    return JobSubmissionClient(address).get_job_logs(job)


def wait_for_status(address: str, job: str, states: tuple[str, ...], timeout: float = JOB_S) -> str:
    deadline = time.monotonic() + timeout
    while (state := status(address, job)) not in states:
        assert time.monotonic() < deadline, f"job {job} still {state} after {timeout} s"
        time.sleep(1)
    return state


def test_train_async_runs_as_a_ray_job(head, tmp_path):
    """train_async.py submitted to Ray as the seed scripts do: the job succeeds, the run's
    metrics.jsonl has each step, and the job's log has vime's progress lines and last line."""
    job = "vime-train-async"
    out = submit(
        head,
        ["python3", "train_async.py", *TINY, "--num-rollout", "2", "--runs-dir", str(tmp_path), "--run-name", "r"],
        f"--submission-id={job}",
    )
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    assert wait_for_status(head, job, ("SUCCEEDED", "FAILED", "STOPPED"), timeout=60) == "SUCCEEDED"
    rows = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all("perf/step_time" in r for r in rows)
    log = logs(head, job)
    assert "step 2/2 |" in log and f"run written to {tmp_path / 'r'}" in log, log[-3000:]
    assert "dropped Ray's OMP_NUM_THREADS=1" in log  # vime's CPU ops are not held to one thread


def test_a_job_whose_training_fails_fails(head, tmp_path):
    """A run that stops on a user's mistake fails its Ray job, `ray job submit` exits non-zero
    (a script running it under `set -e` stops), and the job's log ends with vime's one line."""
    job = "vime-bad-flag"
    argv = ["python3", "train.py", *TINY, "--prompt-data", "missing.jsonl", "--num-rollout", "1"]
    out = submit(head, [*argv, "--runs-dir", str(tmp_path)], f"--submission-id={job}", timeout=120)
    assert out.returncode != 0, out.stdout[-3000:]
    assert status(head, job) == "FAILED"
    log = logs(head, job)
    last = log.strip().splitlines()[-1]
    assert last.startswith("error: ") and "missing.jsonl" in last and "Traceback" not in log, log[-3000:]


def _descendants(pid: int) -> list[int]:
    """`pid` and every process below it, now."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def _alive(pids: list[int]) -> list[str]:
    alive = []
    for pid in pids:
        try:
            text = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        if text.rsplit(")", 1)[1].split()[0] != "Z":
            alive.append(text.split(")")[0])
    return alive


def _start_time(pid: int) -> str | None:
    """When `pid` started (clock ticks since boot), or None once it is gone or a zombie."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] == "Z" else fields[19]


def _trainer_pid(marker: str) -> int | None:
    """The job's python3 process: the one whose command line holds `marker` (its --runs-dir)."""
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            argv = cmdline.read_bytes().split(b"\0")
        except OSError:
            continue
        if argv[0].endswith(b"python3") and b"train_async.py" in argv and marker.encode() in argv:
            return int(cmdline.parent.name)
    return None


@pytest.mark.parametrize("mode", ["one-step-off", "fully-async"])
def test_ray_job_stop_stops_the_run_and_everything_it_started(head, tmp_path, mode):
    """`ray job stop` (SIGTERM to every process of the job at once, SIGKILL to those left 3 s
    later): the job is STOPPED, the trainer, its engine, its reward workers and W&B's service are
    all gone within seconds, nothing prints a traceback, and the rows of the steps it finished
    are intact. (vime unwinds a SIGTERM in 2-3 s here, so the run's last line is "terminated", an
    engine error when it met its engine already gone, or none when Ray's SIGKILL came first.)"""
    job = f"vime-stop-{mode}"
    extra = (
        ["--rollout-function-path", "vime.rollout.fully_async_rollout.generate_rollout_fully_async"]
        if mode == "fully-async"
        else []
    )
    # W&B too, as the seed scripts log: its service process is signalled with the rest
    wandb = ["--use-wandb", "--wandb-mode", "offline"] if find_spec("wandb") else []
    argv = ["python3", "train_async.py", *TINY, "--num-rollout", "100000", *extra, *wandb, "--runs-dir", str(tmp_path)]
    out = submit(head, [*argv, "--run-name", "r"], f"--submission-id={job}", "--no-wait", timeout=60)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    metrics = tmp_path / "r" / "metrics.jsonl"
    deadline = time.monotonic() + JOB_S
    while not (metrics.exists() and metrics.stat().st_size > 0):
        assert status(head, job) in ("PENDING", "RUNNING"), logs(head, job)[-3000:]
        assert time.monotonic() < deadline, "no step within the time limit"
        time.sleep(0.5)
    trainer = _trainer_pid(str(tmp_path))
    assert trainer is not None
    time.sleep(1)  # reward workers and the fully-async worker are busy now
    started = _descendants(trainer)
    assert len(started) > 1  # at least the engine

    t0 = time.monotonic()
    stop = ray("job", "stop", f"--address={head}", job, timeout=60)
    assert stop.returncode == 0, stop.stdout + stop.stderr
    assert wait_for_status(head, job, ("STOPPED", "FAILED", "SUCCEEDED"), timeout=30) == "STOPPED"
    while _alive(started) and time.monotonic() - t0 < 15:
        time.sleep(0.2)
    assert not _alive(started), f"left behind after ray job stop: {_alive(started)}"
    log = logs(head, job)
    assert "Traceback" not in log, log[-3000:]
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert rows and [r["step"] for r in rows] == list(range(1, len(rows) + 1))
