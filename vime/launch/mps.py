"""CUDA MPS for a run whose trainer and engines share a GPU (`--gpu-sharing mps`; the default is
time-slicing, which measured faster: bench/RESULTS.md, issue 65).

Two processes on one GPU are time-sliced by default: their kernels never run at once, each
waits out the other's turn. Under MPS (NVIDIA's Multi-Process Service) the processes are
clients of one server and their kernels run side by side, each on the SMs it can get, which is
what lets generation and training overlap on a single GPU.

A client decides at `cuInit` whether it is one: the pipe directory (`CUDA_MPS_PIPE_DIRECTORY`)
must be in its environment before its first CUDA call. So the run starts its daemon before the
trainer touches CUDA (vime/launch/assemble.py: before the checks, which read the GPU's memory),
and every process it starts inherits the environment. vime itself never calls `cuInit` earlier:
torch's `is_available` is answered by NVML (`PYTORCH_NVML_BASED_CUDA_CHECK`, set in vime/__init__.py).

* The daemon is the run's own: its pipe and log directories are fresh, so two runs on one
  machine never meet; its logs are copied into `<run>/mps/` at the end. It is stopped when the
  run closes, on every path, and dies with the trainer if the trainer is killed (it is started
  with the trainer's death as its signal).
* A daemon the user already runs (found through `CUDA_MPS_PIPE_DIRECTORY`, or the default
  /tmp/nvidia-mps) is used as it is and left running.
* Before any process of the run relies on it, a client is tried (`_probe`: a context, a kernel-
  free synchronize). Where MPS cannot start (no binary, a GPU in exclusive-process mode, a
  server that refuses the client), one start-up line says why and the run goes on time-sliced.
* `--mps-trainer-sm-percent` / `--mps-engine-sm-percent` cap the SMs each side may use
  (`CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`); 100 leaves both free to use all of them.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from vime.backends.placement import MPS_THREADS_ENV, engine_devices, shares_trainer_gpu, trainer_device
from vime.backends.settings import PlacementConfig

log = logging.getLogger("vime")

CONTROL = "nvidia-cuda-mps-control"
DEFAULT_PIPE_DIR = "/tmp/nvidia-mps"
SEARCH = ("/usr/local/nvidia/bin", "/usr/bin", "/usr/local/cuda/bin")  # where images keep it off PATH
START_TIMEOUT_S = 10.0
PROBE_TIMEOUT_S = 60.0

# A client: cuInit, a context on GPU 0, a synchronize. Exits 0 when the server took it.
PROBE = """
import ctypes, sys
cuda = ctypes.CDLL("libcuda.so.1")
dev, ctx = ctypes.c_int(), ctypes.c_void_p()
for name, call in (("cuInit", lambda: cuda.cuInit(0)), ("cuDeviceGet", lambda: cuda.cuDeviceGet(ctypes.byref(dev), 0)),
                   ("cuCtxCreate", lambda: cuda.cuCtxCreate_v2(ctypes.byref(ctx), 0, dev)),
                   ("cuCtxSynchronize", lambda: cuda.cuCtxSynchronize())):
    rc = call()
    if rc != 0:
        sys.exit(f"{name} returned CUDA error {rc}")
"""


@dataclass
class Mps:
    """The run's MPS: the daemon it started (None: the user's, left running) and where its
    pipe and logs are."""

    pipe_dir: str
    proc: subprocess.Popen | None = None
    scratch: Path | None = None  # our temporary directory (pipe and logs), removed at close
    run_dir: Path | None = None
    saved_env: dict[str, str | None] | None = None  # what `start` changed in os.environ, as it was

    def close(self) -> None:
        """Stop the daemon we started (its server goes with it), keep its logs in the run, and
        put this process's environment back."""
        for key, value in (self.saved_env or {}).items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        self.saved_env = None
        if self.proc is None:
            return
        proc, self.proc = self.proc, None
        env = dict(os.environ, CUDA_MPS_PIPE_DIRECTORY=self.pipe_dir)
        try:
            servers = _ask(proc.args[0], "get_server_list", env)  # they end after the daemon: waited for below
            subprocess.run([proc.args[0]], input="quit\n", text=True, env=env, timeout=10, capture_output=True)
            proc.wait(10)
            _wait_gone(servers, 10.0)
        except (OSError, subprocess.TimeoutExpired):
            log.warning("the MPS daemon did not quit within 10 s: killing it")
            proc.kill()
            proc.wait()
        if self.scratch is not None:
            if self.run_dir is not None and (self.scratch / "log").is_dir():
                shutil.copytree(self.scratch / "log", self.run_dir / "mps", dirs_exist_ok=True)
            shutil.rmtree(self.scratch, ignore_errors=True)


def shared_gpu(settings: PlacementConfig) -> bool:
    """The trainer is on a GPU and an engine this run launches shares it (engines given by URL
    are the user's processes: vime cannot make them clients)."""
    trainer = trainer_device(settings)
    if not trainer.startswith("cuda") or settings.rollout_engine_urls:
        return False
    return any(shares_trainer_gpu(d, settings) for d in engine_devices(settings, trainer))


def start(settings: PlacementConfig, run_dir: Path) -> Mps | None:
    """MPS for the run, or None (time-sliced), per --gpu-sharing; sets the environment every
    process of the run inherits. Call before anything in this process touches CUDA."""
    if settings.gpu_sharing != "mps" or not shared_gpu(settings):
        return None
    why_not = _unavailable()
    if why_not is not None:
        log.warning("--gpu-sharing mps: MPS cannot start (%s); trainer and engines share the GPU time-sliced", why_not)
        return None
    users = os.environ.get("CUDA_MPS_PIPE_DIRECTORY", DEFAULT_PIPE_DIR)
    if _daemon_at(users):
        log.info("MPS: using the daemon already running at %s (left running at the end)", users)
        mps = Mps(users)
    else:
        mps = _own_daemon(run_dir)
        if mps is None:
            return None
    env = {"CUDA_MPS_PIPE_DIRECTORY": mps.pipe_dir}
    if mps.scratch is not None:
        env["CUDA_MPS_LOG_DIRECTORY"] = str(mps.scratch / "log")
    if settings.mps_trainer_sm_percent < 100:
        env[MPS_THREADS_ENV] = str(settings.mps_trainer_sm_percent)
    mps.saved_env = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    return mps


def _unavailable() -> str | None:
    if _binary() is None:
        return f"{CONTROL} is not installed or not on PATH"
    mode = _compute_mode()
    if mode is not None and "exclusive" in mode.lower() and "process" not in mode.lower():
        return f"the GPU's compute mode is {mode}, which admits one context only"
    return None


def _binary() -> str | None:
    found = shutil.which(CONTROL)
    return found or next((str(p) for d in SEARCH if (p := Path(d) / CONTROL).is_file()), None)


def _compute_mode() -> str | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=compute_mode", "--format=csv,noheader", "-i", "0"],
            capture_output=True, text=True, timeout=10,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None


def _daemon_at(pipe_dir: str) -> bool:
    """A control daemon answers at pipe_dir (its pid file names a live process)."""
    pid_file = Path(pipe_dir) / "nvidia-cuda-mps-control.pid"
    try:
        os.kill(int(pid_file.read_text().strip()), 0)
        return True
    except (OSError, ValueError):
        return False


def _own_daemon(run_dir: Path) -> Mps | None:
    # a short temporary path, not one under the run's directory: the pipe directory holds a UNIX
    # socket, whose path may not be longer than 108 bytes
    scratch = Path(tempfile.mkdtemp(prefix="vime-mps-"))
    (scratch / "pipe").mkdir()
    (scratch / "log").mkdir()
    env = dict(os.environ, CUDA_MPS_PIPE_DIRECTORY=str(scratch / "pipe"), CUDA_MPS_LOG_DIRECTORY=str(scratch / "log"))
    env.pop(MPS_THREADS_ENV, None)
    proc = subprocess.Popen(
        [_binary(), "-f"], env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        preexec_fn=_die_with_parent, start_new_session=True,
    )  # fmt: skip
    mps = Mps(str(scratch / "pipe"), proc, scratch, run_dir)
    why = _wait_for_control(mps) or _probe(env)
    if why is not None:
        mps.close()
        log.warning("MPS could not start (%s); trainer and engines share the GPU time-sliced", why)
        return None
    log.info(
        "MPS: a daemon of this run's (pid %d), so the trainer's and the engines' kernels run side by side", proc.pid
    )
    return mps


def _ask(binary: str, command: str, env: dict[str, str]) -> list[int]:
    """The pids a control daemon answers a command with (get_server_list, get_client_list PID)."""
    out = subprocess.run([binary], input=command + "\n", text=True, env=env, timeout=10, capture_output=True)
    return [int(x) for x in out.stdout.split() if x.isdigit()]


def _wait_gone(pids: list[int], timeout: float) -> None:
    """Until none of `pids` runs (a server ends once its daemon quit); then SIGKILL what is left."""
    deadline = time.monotonic() + timeout
    for pid in pids:
        while _running(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        if _running(pid):
            log.warning("the MPS server %d did not end with its daemon: killing it", pid)
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _die_with_parent() -> None:
    """In the daemon, before exec: SIGTERM when the process that started it ends (PR_SET_PDEATHSIG)."""
    ctypes.CDLL(None).prctl(1, signal.SIGTERM)


def _wait_for_control(mps: Mps) -> str | None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while not (Path(mps.pipe_dir) / "control").exists():
        if mps.proc is not None and mps.proc.poll() is not None:
            return f"{CONTROL} -f exited with code {mps.proc.returncode}"
        if time.monotonic() > deadline:
            return f"{CONTROL} made no control pipe within {START_TIMEOUT_S:.0f} s"
        time.sleep(0.05)
    return None


def _probe(env: dict[str, str]) -> str | None:
    try:
        out = subprocess.run(
            [sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=PROBE_TIMEOUT_S
        )
    except subprocess.TimeoutExpired:
        return f"a client got no context within {PROBE_TIMEOUT_S:.0f} s"
    if out.returncode != 0:
        return "a client was refused: " + (" ".join(out.stderr.split())[-200:] or f"exit code {out.returncode}")
    return None
