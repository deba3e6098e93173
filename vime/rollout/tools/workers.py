"""A user's tools (`--tools module:TOOL`) run in processes of their own, one call at a time each.

A tool is the user's code, called on the model's say-so. Run in a thread of the rollout loop, one
that called `os._exit`, or killed its own process, ended the whole run with that exit code and no
line. Here each tool has a few worker processes (spawned: the run has threads that fork would
copy mid-state), each in a session of its own (a `killpg` of its own group reaches only it): a
worker that dies mid-call (`os._exit`, a signal, a crash in native code) fails that call alone,
as an error the model reads and the rollout counts (`rollout/tool_errors`), and the next call
starts a fresh one; a call past `--tool-timeout` has its worker killed with whatever it started.
`sys.exit` is an error of the call, as any exception is. Workers load their tool by its `--tools`
spec, ignore Ctrl-C (the run handles it) and end with the run's process (`exit_with_parent`).
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import signal
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from vime.lifetime import exit_with_parent

log = logging.getLogger("vime")

WORKERS = min(8, os.cpu_count() or 1)  # calls of one tool at once; more wait for a worker


class ToolError(Exception):
    """A call that failed; its message is what the model reads."""


class ToolDied(Exception):
    """A tool's worker process ended during a call; the message says how (what the model reads)."""


# how a worker loads its tool: vime.rollout.tools.calls.load_tools, handed down (pickled by name) so this
# module, which tools.py builds on, never imports it back
Loader = Callable[[list[str]], dict[str, Any]]


def _serve(spec: str, load_tools: Loader, conn: Connection, parent_pid: int) -> None:
    """A worker: load the tool of `spec`, then answer (arguments, timeout) calls until the pipe
    closes. Each answer is ("ok", text), ("not text", type name) or ("raised", type name,
    message, whether it is the tool's own ToolError)."""
    os.setsid()
    _adopt_orphans()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    exit_with_parent(parent_pid)
    (tool,) = load_tools([spec]).values()
    while True:
        try:
            arguments, timeout = conn.recv()
        except (EOFError, OSError):
            return
        try:
            out = tool.fn(arguments) if tool.in_process else tool.fn(arguments, timeout)
            answer = ("ok", out) if isinstance(out, (str, bytes)) else ("not text", type(out).__name__)
        except BaseException as e:  # sys.exit and KeyboardInterrupt too: an error of this call
            answer = ("raised", type(e).__name__, message_of(e), isinstance(e, ToolError))
        conn.send(answer)


PR_SET_CHILD_SUBREAPER = 36


def _adopt_orphans() -> None:
    """Make the worker the reaper of what its tool starts (Linux's child subreaper): a process
    the tool started in a session of its own (`subprocess.Popen(..., start_new_session=True)`, a
    daemon's double fork) is out of reach of the worker's `killpg`, and outlived the run,
    re-parented to init. Adopted, it stays the worker's descendant, which `_Worker.kill` ends."""
    with contextlib.suppress(OSError, AttributeError):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def _descendants(pid: int) -> list[int]:
    """Every live process below `pid`, read from /proc (empty where there is none)."""
    children: dict[int, list[int]] = {}
    for stat in os.scandir("/proc") if os.path.isdir("/proc") else []:
        if not stat.name.isdigit():
            continue
        try:
            with open(f"/proc/{stat.name}/stat", "rb") as f:
                ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(stat.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def message_of(e: BaseException) -> str:
    """What the model reads of a tool's exception; one whose __str__ raises must not end the run."""
    try:
        return str(e) if not isinstance(e, SystemExit) else f"it called sys.exit({e.code!r})"
    except Exception:
        return "(its message could not be read)"


class _Worker:
    def __init__(self, spec: str, load_tools: Loader) -> None:
        context = multiprocessing.get_context("spawn")
        self.conn, theirs = context.Pipe()
        self.process = context.Process(target=_serve, args=(spec, load_tools, theirs, os.getpid()), daemon=True)
        self.process.start()
        theirs.close()

    def call(self, arguments: dict[str, Any], timeout: float, grace: float) -> tuple[Any, ...]:
        """The worker's answer; TimeoutError past `timeout` + `grace`, ToolDied when it ended meanwhile."""
        self.conn.send((arguments, timeout))
        if not self.conn.poll(timeout + grace):
            raise TimeoutError()
        try:
            return self.conn.recv()
        except (EOFError, OSError):
            self.process.join(5)
            raise ToolDied(_how_it_ended(self.process.exitcode)) from None

    def kill(self) -> None:
        """The worker and whatever it started: its own session's process group, and what left
        that group (adopted by the worker, `_adopt_orphans`), before the worker goes with it."""
        for pid in _descendants(self.process.pid):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.join(5)
        self.conn.close()


def _how_it_ended(code: int | None) -> str:
    if code is None:
        return "its process stopped answering"
    if code < 0:
        return f"its process was killed by {signal.Signals(-code).name}"
    return f"its process exited with status {code}"


class ToolWorkers:
    """The worker processes of one tool: started as calls need them, up to `size` at once."""

    def __init__(self, spec: str, load_tools: Loader, size: int = WORKERS) -> None:
        self.spec, self.load_tools = spec, load_tools
        self._slots = threading.BoundedSemaphore(size)
        self._idle: list[_Worker] = []
        self._lock = threading.Lock()
        self._warned = False

    def call(self, arguments: dict[str, Any], timeout: float, grace: float = 0.0) -> tuple[Any, ...]:
        """One call in a worker (blocking: run it in a thread). A worker that timed out or died
        is killed and not reused; the timeout counts from when the call reaches a worker (`grace`
        more for a tool that bounds its own time with it)."""
        with self._slots:
            with self._lock:
                worker = self._idle.pop() if self._idle else None
            worker = worker or _Worker(self.spec, self.load_tools)
            try:
                answer = worker.call(arguments, timeout, grace)
            except BaseException as e:
                worker.kill()
                if isinstance(e, ToolDied) and not self._warned:
                    self._warned = True
                    log.warning("--tools %s: %s during a call; each such call is a tool error", self.spec, e)
                raise
            with self._lock:
                self._idle.append(worker)
            return answer

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for worker in idle:
            worker.kill()


_POOLS: dict[str, ToolWorkers] = {}
_POOLS_LOCK = threading.Lock()


def workers_of(spec: str, load_tools: Loader) -> ToolWorkers:
    """The process's workers of the tool `spec` names (made on first use), each loading it with
    `load_tools`."""
    with _POOLS_LOCK:
        pool = _POOLS.get(spec)
        if pool is None:
            pool = _POOLS[spec] = ToolWorkers(spec, load_tools)
        return pool


def close_all() -> None:
    """Every tool's idle workers ended (the run's end): a run in a process that lives on (a notebook,
    tests) leaves none behind."""
    with _POOLS_LOCK:
        pools = list(_POOLS.values())
        _POOLS.clear()
    for pool in pools:
        pool.close()
