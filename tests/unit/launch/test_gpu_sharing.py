"""--gpu-sharing: the run's CUDA MPS daemon (vime/launch/mps.py), on a machine without a GPU.

The real daemon needs a GPU (tests/gpu/test_runs.py runs it there). Here a stand-in program of the
same name does what the run relies on (`-f` serves a control pipe and writes its pid file; a
plain call passes its stdin to the daemon, `quit` ends it), so the start, the stop, the fallbacks
and the daemon's end with a killed trainer are the code's own. On this machine the client probe
finds no CUDA driver: that is the refused client of the fallback test; the tests that need an
accepted one replace the probe's program with one that succeeds."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from conftest import ROOT

from vime.launch import mps

STAND_IN = textwrap.dedent(
    """\
    #!{python}
    import os, pathlib, sys
    pipe = pathlib.Path(os.environ["CUDA_MPS_PIPE_DIRECTORY"])
    if "-f" in sys.argv:
        if os.environ.get("STAND_IN_FAILS"):
            sys.exit(3)
        (pipe / "nvidia-cuda-mps-control.pid").write_text(str(os.getpid()))
        os.mkfifo(pipe / "control")
        while True:
            with open(pipe / "control") as f:
                if "quit" in f.read():
                    sys.exit(0)
    else:
        with open(pipe / "control", "w") as f:
            f.write(sys.stdin.read())
    """
)


@pytest.fixture
def settings():
    from vime.config import parse_args

    return parse_args(
        ["--config", "examples/tiny.yaml", "--num-rollout", "1", "--gpu-sharing", "mps"], entry="async"
    ).placement


@pytest.fixture
def stand_in(tmp_path, monkeypatch) -> Path:
    """The stand-in daemon first on PATH, the GPU shared, no daemon of the user's."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    exe = bin_dir / mps.CONTROL
    exe.write_text(STAND_IN.format(python=sys.executable))
    exe.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(mps, "shared_gpu", lambda s: True)
    monkeypatch.setattr(mps, "_compute_mode", lambda: "Default")
    monkeypatch.setattr(mps, "DEFAULT_PIPE_DIR", str(tmp_path / "no-daemon"))
    monkeypatch.delenv("CUDA_MPS_PIPE_DIRECTORY", raising=False)
    return exe


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_cpu_run_and_the_default_start_no_daemon(settings):
    assert mps.start(settings, Path("/nonexistent")) is None  # the trainer is on the CPU
    assert "CUDA_MPS_PIPE_DIRECTORY" not in os.environ


def test_time_slice_the_default_starts_none(settings, stand_in, tmp_path):
    import dataclasses

    assert mps.start(dataclasses.replace(settings, gpu_sharing="time-slice"), tmp_path) is None


def test_no_mps_program_is_one_line_and_the_gpu_is_shared_by_turns(settings, tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(mps, "shared_gpu", lambda s: True)
    monkeypatch.setattr(mps, "SEARCH", ())
    monkeypatch.setenv("PATH", str(tmp_path))
    with caplog.at_level(logging.WARNING, "vime"):
        assert mps.start(settings, tmp_path) is None
    # vime's lines only: a library's background thread left by another test of the same worker (wandb's
    # service connection, closed) can log through the root logger meanwhile
    assert [r.getMessage() for r in caplog.records if r.name.startswith("vime")] == [
        "--gpu-sharing mps: MPS cannot start (nvidia-cuda-mps-control is not installed or not on PATH); "
        "trainer and engines share the GPU time-sliced"
    ]


def test_a_daemon_that_exits_or_whose_client_is_refused_is_stopped_and_left_behind_nowhere(
    settings, stand_in, tmp_path, monkeypatch, caplog
):
    monkeypatch.setenv("STAND_IN_FAILS", "1")
    with caplog.at_level(logging.WARNING, "vime"):
        assert mps.start(settings, tmp_path) is None
    assert "MPS could not start (nvidia-cuda-mps-control -f exited with code 3)" in caplog.text
    monkeypatch.delenv("STAND_IN_FAILS")
    caplog.clear()
    before = set(Path(os.environ.get("TMPDIR", "/tmp")).glob("vime-mps-*"))
    with caplog.at_level(logging.WARNING, "vime"):
        assert mps.start(settings, tmp_path) is None  # no CUDA driver here: the probe's client is refused
    assert "MPS could not start (a client was refused: " in caplog.text
    assert "CUDA_MPS_PIPE_DIRECTORY" not in os.environ
    assert set(Path(os.environ.get("TMPDIR", "/tmp")).glob("vime-mps-*")) == before  # its scratch removed
    assert not [p for p in Path("/proc").glob("[0-9]*") if _runs(p, stand_in)], "a stand-in daemon was left running"


def _runs(proc: Path, exe: Path) -> bool:
    try:
        return str(exe).encode() in (proc / "cmdline").read_bytes() and alive(int(proc.name))
    except OSError:
        return False


def test_the_runs_daemon_serves_the_run_and_is_stopped_with_its_logs_kept(settings, stand_in, tmp_path, monkeypatch):
    import dataclasses

    monkeypatch.setattr(mps, "PROBE", "pass")  # a client the daemon takes (the GPU test's is real)
    monkeypatch.setenv(mps.MPS_THREADS_ENV, "77")  # the user's, put back at the end
    run = mps.start(dataclasses.replace(settings, mps_trainer_sm_percent=60), tmp_path / "run")
    assert run is not None and run.proc is not None and alive(run.proc.pid)
    pipe = Path(os.environ["CUDA_MPS_PIPE_DIRECTORY"])
    assert (pipe / "control").exists() and len(str(pipe / "control")) < 108  # a UNIX socket's path limit
    assert os.environ[mps.MPS_THREADS_ENV] == "60" and os.environ["CUDA_MPS_LOG_DIRECTORY"].startswith(str(run.scratch))
    (run.scratch / "log" / "control.log").write_text("the daemon's log\n")
    pid = run.proc.pid
    run.close()
    assert not alive(pid) and not run.scratch.exists()
    assert (tmp_path / "run" / "mps" / "control.log").read_text() == "the daemon's log\n"
    assert "CUDA_MPS_PIPE_DIRECTORY" not in os.environ and os.environ[mps.MPS_THREADS_ENV] == "77"


def test_a_daemon_already_running_is_used_and_left_running(settings, stand_in, tmp_path, monkeypatch):
    pipe = tmp_path / "users-mps"
    pipe.mkdir()
    theirs = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (pipe / "nvidia-cuda-mps-control.pid").write_text(str(theirs.pid))
        monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(pipe))
        run = mps.start(settings, tmp_path)
        assert run is not None and run.proc is None and os.environ["CUDA_MPS_PIPE_DIRECTORY"] == str(pipe)
        run.close()
        assert alive(theirs.pid) and os.environ["CUDA_MPS_PIPE_DIRECTORY"] == str(pipe)
    finally:
        theirs.kill()
        theirs.wait()


def test_the_daemon_ends_with_a_killed_trainer(stand_in, tmp_path):
    """The trainer SIGKILLed: nothing of it runs its cleanup, and the daemon still goes."""
    script = textwrap.dedent(
        f"""\
        import sys, time
        from pathlib import Path
        from vime.config import parse_args
        from vime.launch import mps
        mps.shared_gpu = lambda s: True
        mps._compute_mode = lambda: "Default"
        mps.DEFAULT_PIPE_DIR = {str(tmp_path / "no-daemon")!r}
        mps.PROBE = "pass"
        settings = parse_args(["--config", "examples/tiny.yaml", "--num-rollout", "1", "--gpu-sharing", "mps"], entry="async").placement
        run = mps.start(settings, Path({str(tmp_path)!r}))
        print(run.proc.pid, flush=True)
        time.sleep(120)
        """
    )
    trainer = subprocess.Popen(
        [sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE, text=True, env=dict(os.environ)
    )
    try:
        daemon = int(trainer.stdout.readline())
        assert alive(daemon)
    finally:
        trainer.send_signal(signal.SIGKILL)
        trainer.wait()
    deadline = time.monotonic() + 10
    while alive(daemon):
        assert time.monotonic() < deadline, "the MPS daemon outlived its killed trainer"
        time.sleep(0.1)
