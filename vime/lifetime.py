"""How processes end: children never outlive the trainer, and SIGTERM stops a run as Ctrl-C does.

A killed trainer (SIGKILL, OOM) runs no cleanup at all, so every child must notice on its own
that its parent is gone: engines have `--parent-pid`, and the processes Python starts for us
(reward-pool workers, trainer ranks) call `exit_with_parent`. Once they are gone,
multiprocessing's resource tracker sees its last user leave and exits too.

Python's default SIGTERM handling kills the process without unwinding, which skips every
`finally:` that stops engines and workers; `stop_on_sigterm` turns it into an exception that
unwinds like Ctrl-C.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import NoReturn

from vime.errors import VimeError

PARENT_POLL_S = 0.5

log = logging.getLogger("vime")


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread: every handler that stops a run on Ctrl-C stops it the same way."""


_sigterm_received = False


def sigterm_received() -> bool:
    """A SIGTERM came: an error that follows it (an engine killed by the same signal, as Ray's
    `job stop` sends it to the whole job) is the termination, not a failure of its own."""
    return _sigterm_received


def stop_on_sigterm() -> None:
    """From now on SIGTERM raises `Terminated` in the main thread (call from the main thread)."""

    def handler(signum: int, frame: object) -> None:
        global _sigterm_received
        _sigterm_received = True
        raise Terminated()

    signal.signal(signal.SIGTERM, handler)


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """Ctrl-C and SIGTERM wait until the block is done, then act as they would have.

    For writes that must finish once begun: a signal that lands inside torch's or safetensors'
    writer interrupts its write() (Python's handlers do not restart system calls), and the save
    fails with an I/O error, or hangs in a writer thread, instead of the run stopping. Blocked in
    this thread, a signal either waits or goes to another thread, which only flags it for the main
    thread's Python handler; so, in the main thread, the handlers are swapped for one that notes
    the signal, and the noted one runs the real handler after the block."""
    sigs = (signal.SIGINT, signal.SIGTERM)
    noted: list[int] = []
    handlers = {}
    if threading.current_thread() is threading.main_thread():
        handlers = {s: signal.signal(s, lambda signum, frame: noted.append(signum)) for s in sigs}
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, sigs)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)  # runs the handlers of pending signals
        for s, handler in handlers.items():
            signal.signal(s, handler)
        if noted:
            handler = handlers[noted[0]]
            if callable(handler):  # Python's default_int_handler raises KeyboardInterrupt; ours, Terminated
                handler(noted[0], None)
            elif handler == signal.SIG_DFL:
                signal.raise_signal(noted[0])


def exit_with_parent(parent_pid: int | None = None, last_words: str | None = None) -> None:
    """End this process within PARENT_POLL_S of its parent's death, however it died, saying
    `last_words` (one line on stderr) if given.

    Polls `getppid()` (a dead parent's children are re-parented) from a daemon thread; Linux's
    PR_SET_PDEATHSIG would tie the child to the parent *thread* that started it, which for a
    process pool is whichever thread submitted first."""
    parent = os.getppid() if parent_pid is None else parent_pid

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_S)
        leave(last_words)

    threading.Thread(target=watch, name="vime-parent-watch", daemon=True).start()


_leaving = threading.Lock()


def leave(last_words: str | None = None) -> NoReturn:
    """Exit now (code 1, no cleanup), with `last_words` on stderr: from any thread, and once,
    however many threads decide to at the same moment."""
    with _leaving:
        if last_words:
            sys.stderr.write(last_words + "\n")
            sys.stderr.flush()
        os._exit(1)


class InUse(VimeError):
    """Another live process holds a directory this run would write (one line, exit 2)."""


@contextlib.contextmanager
def owned(locks: list[tuple[Path, str]]) -> Iterator[None]:
    """Hold an exclusive lock on each (lock file, what it guards) for the block: two runs given
    the same --save or --run-name would overwrite each other's checkpoints and interleave their
    metrics, so the second is refused. The kernel drops a lock when its process dies (even by
    SIGKILL), so a crashed run never leaves its directories locked. Trainer ranks other than 0
    belong to rank 0's run and take none."""
    if os.environ.get("RANK", "0") != "0":
        yield
        return
    fds: list[int] = []
    try:
        for path, what in locks:
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError:  # not a writable directory: the run's input checks say so in one line
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.read(fd, 32).decode(errors="replace").strip() or "?"
                os.close(fd)
                raise InUse(f"{what} is in use by another vime run (pid {holder}): give this run its own") from None
            except OSError as e:  # a filesystem without flock (some Lustre mounts): run unguarded
                os.close(fd)
                log.warning("cannot lock %s (%s): a second run given it would not be refused", what, e.strerror)
                continue
            os.ftruncate(fd, 0)
            os.write(fd, str(os.getpid()).encode())
            fds.append(fd)
        yield
    finally:
        for fd in fds:
            os.close(fd)
