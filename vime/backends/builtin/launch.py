"""Start the engine server as a subprocess from Python: `launch_engine` and `EngineProcess`.

Kept apart from `vime/engine/server.py` because it runs in the trainer's process, not the engine's: it execs
`python -m vime.engine.server`, waits for the server's ready line and /health, and gives the
log's tail when the start fails.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from vime.backends.client import EngineClient, EngineError
from vime.backends.placement import MPS_THREADS_ENV
from vime.engine.http_common import API_KEY_ENV
from vime.engine.server import READY_LINE
from vime.transport.group import apply_gpu_safe_env


@dataclass
class EngineProcess:
    url: str
    proc: subprocess.Popen
    log_path: Path
    api_key: str | None = None

    def shutdown(self, timeout: float = 10.0) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGCONT)  # a stopped engine (SIGSTOP) acts on the SIGTERM now
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def log_tail(path: Path, lines: int = 20) -> str:
    """The last lines of a server's log, for the error that says why it did not start."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def launch_engine(
    model_path: str,
    *,
    port: int | None = None,
    host: str = "127.0.0.1",
    device: str = "cpu",
    dtype: str = "auto",
    extra_args: Iterable[str] = (),
    log_path: str | Path | None = None,
    startup_timeout: float = 120.0,
    api_key: str | None = None,
    gate: Path | None = None,
    sm_percent: int = 100,
) -> EngineProcess:
    """Start `python -m vime.engine.server` and return once it answers /health.

    dtype "auto" is bfloat16 on a GPU and float32 on CPU, as for the server itself. `api_key`
    reaches the server through its environment, never its command line (which any local user
    can read).

    The server exits by itself when this process does (--parent-pid), so a crashed trainer
    leaves no engine behind. `host` is where it listens: loopback unless other machines must
    reach it (a Ray engine actor's, `vime/launch/ray.py`). `gate`: a file the engine waits for
    before sizing its KV cache (`--wait-for-file`); `startup_timeout` counts from its creation.
    `sm_percent`: the share of the GPU's SMs it may use as an MPS client (vime/launch/mps.py).
    """
    if log_path is None:
        fd, name = tempfile.mkstemp(prefix="vime-engine-", suffix=".log")
        os.close(fd)
        log_path = name
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "vime.engine.server",
        "--model-path",
        str(model_path),
        "--host",
        host,
        "--port",
        str(port or 0),
        "--device",
        device,
        "--dtype",
        dtype,
        "--parent-pid",
        str(os.getpid()),
        *map(str, extra_args),
        *(["--wait-for-file", str(gate)] if gate is not None else []),
    ]
    root = str(Path(__file__).resolve().parents[3])  # so the child imports this same vime
    env = dict(
        os.environ,
        PYTHONUNBUFFERED="1",
        PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p),
    )
    env.pop(API_KEY_ENV, None)
    if api_key:
        env[API_KEY_ENV] = api_key
    env.pop(MPS_THREADS_ENV, None)  # the trainer's own share, where it has one
    if sm_percent < 100:
        env[MPS_THREADS_ENV] = str(sm_percent)
    apply_gpu_safe_env(env)  # NVLink multicast stays off in the engine's NCCL (device README)
    with open(log_path, "w") as logf:
        proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
    engine = EngineProcess(_ready_url(proc, log_path, startup_timeout, gate), proc, log_path, api_key)
    try:
        EngineClient(engine.url, timeout=10, api_key=api_key).health()
    except EngineError:
        engine.shutdown()
        raise
    return engine


def _ready_url(proc: subprocess.Popen, log_path: Path, startup_timeout: float, gate: Path | None = None) -> str:
    """The URL in the server's ready line, once its log has it; an EngineError with the log's tail
    if the process exits first or the line is not there within `startup_timeout` s (of the
    `gate` file's existence: until then the engine waits for a trainer's build, however long)."""
    deadline = time.monotonic() + startup_timeout
    pattern = re.compile(re.escape(READY_LINE) + r" (http://\S+)")
    while True:
        if gate is not None and not gate.exists():
            deadline = time.monotonic() + startup_timeout
        m = pattern.search(log_path.read_text(errors="replace"))
        if m:
            return m.group(1)
        if proc.poll() is not None:
            raise EngineError(
                f"engine process exited with code {proc.returncode} during start (log {log_path}):\n{log_tail(log_path)}"
            )
        if time.monotonic() > deadline:
            EngineProcess("", proc, log_path).shutdown()
            raise EngineError(
                f"engine did not start within {startup_timeout:g}s (log {log_path}):\n{log_tail(log_path)}"
            )
        time.sleep(0.1)
