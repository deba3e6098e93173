"""Starting a vLLM server for a run: its command (vime's flags merged with --vllm-NAME ones,
`server_command`), the process and the watcher that ends it with the trainer (`launch_vllm`,
`VLLMProcess`), and the wait until it answers (`_wait_ready`)."""

from __future__ import annotations

import asyncio
import logging
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vime.backends.builtin.launch import log_tail
from vime.backends.client import EngineError
from vime.backends.vllm.client import VLLMClient, check_version
from vime.backends.vllm.worker_ext import API_KEY_ENV, EXTENSION_FLAGS

log = logging.getLogger("vime")

# Flags every launched server needs: the token-in/token-out generate route and the RL control
# routes (pause, resume, weight version, collective_rpc) are only served in dev mode with
# scale-out on; log-probs after temperature (what the sampler drew from, as vime's engine returns).
SERVER_FLAGS = ("--enable-scale-out", "--logprobs-mode", "processed_logprobs", *EXTENSION_FLAGS)
SERVER_ENV = {"VLLM_SERVER_DEV_MODE": "1"}

# Flags of a launched server that the adapter relies on (its address, the routes and log-probs
# above, the extension, tensor parallelism, sleep mode for --colocate): a --vllm-NAME that would
# change one is refused. vime's other flags (--dtype, --max-num-seqs, --seed,
# --gpu-memory-utilization, --kv-cache-memory-bytes) are its defaults, and a --vllm-NAME of the
# same name replaces them.
PINNED_FLAGS = frozenset(
    {
        "model",
        "host",
        "port",
        "enable-scale-out",
        "logprobs-mode",
        "enable-sleep-mode",
        "worker-extension-cls",
        "middleware",
        "tensor-parallel-size",
    }
)


# The watcher: a child of the trainer that ends the server's process group when the trainer is
# gone (reparented = parent died, however it died), so no vLLM server outlives a crashed run.
_WATCHER = """
import os, signal, sys, time
parent, pgid = int(sys.argv[1]), int(sys.argv[2])
while os.getppid() == parent:
    time.sleep(0.5)
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        sys.exit(0)
for sig in (signal.SIGTERM, signal.SIGKILL):
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        sys.exit(0)
    time.sleep(10)
"""


@dataclass
class VLLMProcess:
    """A vLLM server started by `launch_vllm`: its own process group (the API server and its
    engine-core workers), and the watcher that ends that group if the trainer dies."""

    url: str
    proc: subprocess.Popen
    watcher: subprocess.Popen
    log_path: Path
    api_key: str

    def shutdown(self, timeout: float = 15.0) -> None:
        """SIGTERM to the whole group, SIGKILL to what is left after `timeout` s."""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            if not _group_alive(self.proc.pid):
                break
            try:
                os.killpg(self.proc.pid, sig)
                os.killpg(self.proc.pid, signal.SIGCONT)  # a stopped server acts on the SIGTERM now
            except ProcessLookupError:
                break
            deadline = time.monotonic() + timeout
            while _group_alive(self.proc.pid) and time.monotonic() < deadline:
                self.proc.poll()  # reap the leader: a zombie still counts as a member of the group
                time.sleep(0.1)
        self.proc.poll()
        if self.watcher.poll() is None:
            self.watcher.kill()
            self.watcher.wait()


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, timeout: float = 5.0) -> bytes | None:
    """The body of a GET, or None while the server does not answer 200 yet."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.read() if resp.status == 200 else None
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return None


def _flag_tokens(name: str, value: Any) -> list[str]:
    """One `--vllm-NAME VALUE` as vLLM's command line takes it: True a bare switch, False its
    `--no-` form (vLLM's boolean flags have both), a list several values."""
    if value is True:
        return [f"--{name}"]
    if value is False:
        return [f"--no-{name}"]
    if isinstance(value, (list, tuple)):
        return [f"--{name}", *map(str, value)]
    return [f"--{name}", str(value)]


def _split_flags(tokens: list[str]) -> dict[str, list[str]]:
    """vime's own command line (flags and their values) as {name: tokens}, in order; a `--no-X`
    switch under X, so the user's X (either form) replaces it."""
    flags: dict[str, list[str]] = {}
    name = None
    for tok in tokens:
        if tok.startswith("--"):
            name = tok[2:].removeprefix("no-")
            flags[name] = [tok]
        else:
            assert name is not None, f"a value without a flag: {tok}"
            flags[name].append(tok)
    return flags


def merge_vllm_args(own: list[str], vllm_args: dict[str, Any]) -> list[str]:
    """vime's server flags `own` with the user's `--vllm-NAME VALUE` flags (`Config.vllm_args`):
    a NAME vime does not set is added; one it sets is replaced by the user's value, except the
    PINNED_FLAGS, which are refused in one line unless the value is vime's own (then it is
    simply not passed twice). Names are compared as vLLM reads them (`_` and `-` alike)."""
    from vime.errors import ConfigError

    flags = _split_flags(own)
    for raw, value in vllm_args.items():
        name = str(raw).replace("_", "-")
        if name.startswith("no-") and value is True:  # --vllm-no-X: the X switch, off
            name, value = name[len("no-") :], False
        tokens = _flag_tokens(name, value)
        mine = flags.get(name)
        if name in PINNED_FLAGS and mine is not None and mine != tokens:
            raise ConfigError(
                f"--vllm-{raw}: vime starts its vLLM servers with {' '.join(mine)} and relies on it: drop --vllm-{raw}"
            )
        flags[name] = tokens
    return [tok for tokens in flags.values() for tok in tokens]


def server_command(
    model_path: str,
    *,
    port: int,
    host: str = "127.0.0.1",
    device: str = "cpu",
    dtype: str = "float32",
    max_num_seqs: int = 256,
    seed: int = 0,
    kv_cache_bytes: int = 1 << 30,
    tp_size: int = 1,
    extra_args: Iterable[str] = (),
    vllm_args: dict[str, Any] | None = None,
    python: str = sys.executable,
) -> list[str]:
    """The command line of one vLLM server (launch_vllm's; see merge_vllm_args for `vllm_args`)."""
    own = [
        "--model",
        str(model_path),
        "--host",
        host,
        "--port",
        str(port),
        *SERVER_FLAGS,
        "--dtype",
        dtype,
        "--max-num-seqs",
        str(max_num_seqs),
        "--seed",
        str(seed),
        *map(str, extra_args),
    ]
    if tp_size > 1:
        own += ["--tensor-parallel-size", str(tp_size)]
    if device == "cpu":
        own += ["--kv-cache-memory-bytes", str(kv_cache_bytes), *cpu_compile_flags(vllm_args or {})]
        own += cpu_prefill_flags(model_path, vllm_args or {})
    return [python, "-m", "vllm.entrypoints.openai.api_server", *merge_vllm_args(own, vllm_args or {})]


# vLLM's flags that choose how it compiles the model: a user who gives one decides, on CPU too.
COMPILE_FLAGS = frozenset({"enforce-eager", "compilation-config", "optimization-level"})


def cpu_compile_flags(vllm_args: dict[str, Any]) -> list[str]:
    """On CPU, no torch.compile unless the user asks for it (`--vllm-no-enforce-eager`, or a
    `--vllm-compilation-config`). vLLM compiled the model at every start there (its default compile
    cache did not load, and a cache that loads still re-traces the model), so a compiled start took
    1.6-2.8 times the CPU of an eager one with a fresh cache (what CI and a new user have) and
    1.1-2.1 times with a warm one, for generation of about the same CPU (bench/vllm_startup.py,
    bench/RESULTS.md)."""
    given = {str(k).replace("_", "-").removeprefix("no-") for k in vllm_args}
    return [] if given & COMPILE_FLAGS else ["--enforce-eager"]


def cpu_prefill_flags(model_path: str, vllm_args: dict[str, Any]) -> list[str]:
    """On CPU, prefills are never split over engine steps. vLLM rewinds a seeded request's
    random generator after a split prefill's step (`set_offset`), which CPU generators do not
    have: the engine core died ("CPU Generator does not use offset") as soon as a step's
    prompts passed its default 2048-token budget, e.g. when a batch of multi-turn requests
    came back with their tool answers. Unsplit, a step takes every prompt whole, so its budget
    is the context (`--vllm-max-model-len` where given, else the model's)."""
    from vime.models import context_length

    given = {str(k).replace("_", "-"): v for k, v in vllm_args.items()}
    context = int(given.get("max-model-len") or context_length(model_path))
    return ["--no-enable-chunked-prefill", "--max-num-batched-tokens", str(max(context, 2048))]


def launch_vllm(
    model_path: str,
    *,
    device: str = "cpu",
    dtype: str = "float32",
    port: int | None = None,
    host: str = "127.0.0.1",
    max_num_seqs: int = 256,
    seed: int = 0,
    cpu_cores: str | None = None,
    kv_cache_bytes: int = 1 << 30,
    extra_args: Iterable[str] = (),
    vllm_args: dict[str, Any] | None = None,
    api_key: str | None = None,
    log_path: str | Path | None = None,
    startup_timeout: float = 900.0,
    python: str = sys.executable,
) -> VLLMProcess:
    """Start `python -m vllm.entrypoints.openai.api_server` for one engine and return once it
    answers /health at a supported version (its weight version set to 0, as vime counts).

    Start-up takes a minute or more on CPU (three processes that each import vLLM, then the model's
    load; eager there: `cpu_compile_flags`), hence the long timeout; progress is printed every 15 s.
    `device` "cpu", "cuda:N" (the server sees only GPU N) or "cuda:N,M,..." (one tensor-parallel
    engine over those GPUs), N counted among the GPUs this process sees (its CUDA_VISIBLE_DEVICES,
    as Ray sets it for an actor). `host`: where it listens, loopback unless other machines must
    reach it (a Ray actor's). `api_key`: the key every route but /health then requires
    (worker_ext.require_api_key); default: a fresh one. Once up, the server generates one token, so
    a model vLLM cannot run fails here with vLLM's reason, not at the first rollout. On CPU, vLLM
    reserves `--gpu-memory-utilization` of the node's *CPU* memory unless the KV cache is sized, so
    it is sized (`kv_cache_bytes`); its OpenMP threads are pinned to `cpu_cores` ("1", "0-3";
    default: $VLLM_CPU_OMP_THREADS_BIND if set, else the second half of the cores, the trainer has
    the first).
    `vllm_args` (`--vllm-NAME VALUE` flags) go on its command line: `merge_vllm_args`.
    """
    port = port or _free_port()
    api_key = api_key or secrets.token_urlsafe(24)
    gpus = device.split(":")[1] if ":" in device else "0"
    cmd = server_command(
        model_path,
        port=port,
        host=host,
        device=device,
        dtype=dtype,
        max_num_seqs=max_num_seqs,
        seed=seed,
        kv_cache_bytes=kv_cache_bytes,
        tp_size=1 if device == "cpu" else len(gpus.split(",")),
        extra_args=extra_args,
        vllm_args=vllm_args,
        python=python,
    )  # a refused --vllm-NAME fails here, before anything starts
    log_path = Path(log_path) if log_path is not None else Path(tempfile.mkstemp(prefix="vime-vllm-", suffix=".log")[1])
    log_path.parent.mkdir(parents=True, exist_ok=True)
    url = f"http://127.0.0.1:{port}"
    env = _server_env(device, gpus, api_key, cpu_cores)
    with open(log_path, "w") as logf:
        # a session of its own: the API server and its workers form one process group to end
        proc = subprocess.Popen(
            cmd, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, start_new_session=True
        )
    watcher = subprocess.Popen(
        [sys.executable, "-c", _WATCHER, str(os.getpid()), str(proc.pid)], stdin=subprocess.DEVNULL
    )
    server = VLLMProcess(url, proc, watcher, log_path, api_key)
    try:
        _wait_ready(server, startup_timeout)
        _check_started(server, model_path, device)
    except BaseException:
        server.shutdown()
        raise
    return server


def _server_env(device: str, gpus: str, api_key: str, cpu_cores: str | None) -> dict[str, str]:
    """The server's environment: dev mode, the key, and what it runs on (its OpenMP threads'
    cores on CPU, its GPUs otherwise)."""
    env = dict(os.environ, **SERVER_ENV, PYTHONUNBUFFERED="1")
    env[API_KEY_ENV] = api_key  # in the environment, not on the command line (ps shows that)
    if device == "cpu":
        n = os.cpu_count() or 2
        # an explicit choice wins: the argument, then vLLM's own variable if the user set it
        default = str(n - 1) if n <= 2 else f"{n // 2}-{n - 1}"
        env["VLLM_CPU_OMP_THREADS_BIND"] = cpu_cores or os.environ.get("VLLM_CPU_OMP_THREADS_BIND") or default
        # For a compiled CPU server (--vllm-no-enforce-eager): vLLM's default cache there, PyTorch's
        # AOT-compiled artifacts, failed to load at every start ("'function' object has no
        # attribute 'finalize_loading'"), so it compiled again; its older cache (vLLM's own and
        # Inductor's) loads, and a second start took the CPU of an eager one (bench/RESULTS.md).
        env.setdefault("VLLM_USE_AOT_COMPILE", "0")
    else:  # the server sees only its GPUs: N of "cuda:N" is this process's N-th visible one
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        ids = visible.split(",") if visible else None
        env["CUDA_VISIBLE_DEVICES"] = ",".join(ids[int(i)] if ids else i for i in gpus.split(","))
    return env


def _check_started(server: VLLMProcess, model_path: str, device: str) -> None:
    """A server that answers /health: at a supported version, running vime's extension, and able
    to generate one token (else vLLM's reason, in one line); its weight version set to 0."""
    client = VLLMClient(server.url, timeout=120, device="cpu" if device == "cpu" else "cuda", api_key=server.api_key)
    check_version(client.version(), server.url)
    client.hello()
    try:
        asyncio.run(_one_token(client))
    except EngineError as e:
        raise EngineError(
            f"vLLM cannot run {model_path}: {_startup_reason(server.log_path) or e} (log {server.log_path})"
        ) from None
    client.set_weight_version(0)


async def _one_token(client: VLLMClient) -> None:
    try:
        await client.generate([1, 2, 3], {"max_new_tokens": 1, "temperature": 0.0})
    finally:
        await client.close()


# vLLM's log prefix: "(Worker pid=12) ERROR 12-01 18:42:25 [file.py:1063] "
_LOG_PREFIX = re.compile(r"^(\(\w+ pid=\d+\) )?(\w+ \d\d-\d\d \d\d:\d\d:\d\d \[[^\]]*\] )?")


def _startup_reason(log_path: Path) -> str | None:
    """The line of a server's log that says why it failed: an argument error, else the first
    exception line (the root cause: the worker's; the engine core and the API server log
    their own wrappers of it after)."""
    lines = [_LOG_PREFIX.sub("", line.strip()) for line in log_tail(log_path, 2000).splitlines()]
    for line in reversed(lines):
        if "error: unrecognized arguments" in line or re.search(r": error: argument ", line):
            return line.split(": error: ", 1)[1]
    for line in lines:
        if re.match(r"^[\w.]*(Error|Exception): ", line):
            return line
    return None


def _wait_ready(server: VLLMProcess, timeout: float) -> None:
    t0 = time.monotonic()
    last_note = t0
    while _get(server.url + "/health", timeout=2.0) is None:
        if server.proc.poll() is not None:
            reason = _startup_reason(server.log_path)
            if reason and ("unrecognized arguments" in reason or reason.startswith("argument ")):
                from vime.errors import ConfigError

                raise ConfigError(
                    f"vLLM refused its command line ({reason}): check the --vllm-* flags against `vllm serve --help`"
                )
            if reason:
                raise EngineError(f"vLLM server exited during start: {reason} (log {server.log_path})")
            raise EngineError(
                f"vLLM server exited with code {server.proc.returncode} during start (log {server.log_path}):\n{log_tail(server.log_path, 25)}"
            )
        now = time.monotonic()
        if now - t0 > timeout:
            raise EngineError(
                f"vLLM server did not answer /health within {timeout:g}s (log {server.log_path}):\n{log_tail(server.log_path, 25)}"
            )
        if now - last_note >= 15:
            print(
                f"waiting for the vLLM server at {server.url} ({now - t0:.0f}s; log {server.log_path})",
                file=sys.stderr,
                flush=True,
            )
            last_note = now
        time.sleep(0.5)
    log.info("vLLM server ready at %s after %.0fs", server.url, time.monotonic() - t0)
