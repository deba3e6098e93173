"""Where reward calls run, and for how long: one RewardRunner per run, closed by the run.

Grading is CPU work (sympy) that must not stall generation, and a reward must never hold a run
up: built-in rm types run in a small process pool, each sample under a SIGALRM timer inside its
worker; a synchronous Python reward runs in a daemon thread of its own, abandoned at the
timeout, so a hung one takes no worker a later sample needs and does not keep the process alive
at exit. Pool workers ignore Ctrl-C (the trainer handles it) and exit when the trainer is gone.
Everything here belongs to the runner object, not the module, so two runs in one process (tests,
`vime ab`) never share a pool, a slot count or a broken-pool flag.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import signal
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any

from vime.lifetime import exit_with_parent
from vime.rollout.rewards.grading import builtin_result, math_verify

log = logging.getLogger("vime")

POOL_WORKERS = 2
# Synchronous Python rewards running at once. An abandoned (timed-out) call gives its slot back,
# so hung calls never starve later ones.
THREADS = 16


class _GradeTimeout(BaseException):
    """Raised by SIGALRM; a BaseException so math-verify's `except Exception` cannot swallow it."""


class GradingTimeout(Exception):
    """A pool worker gave up on one sample. Not a TimeoutError on purpose: a timeout of the
    parent's own wait means a wedged worker and kills the pool, this one does not."""


def _on_alarm(signum: int, frame: Any) -> None:
    raise _GradeTimeout()


def score_with_timeout(rm_type: str, response: str, label: str | None, timeout: float) -> dict[str, float]:
    """builtin_result bounded by a SIGALRM timer where that is possible (a main thread).

    In a pool worker this is the real timeout: it interrupts sympy and frees the worker for
    the next sample. In the inline fallback (a helper thread) the caller's wait is the bound.
    """
    if threading.current_thread() is not threading.main_thread() or timeout <= 0:
        return builtin_result(rm_type, response, label)
    previous = signal.signal(signal.SIGALRM, _on_alarm)
    signal.setitimer(signal.ITIMER_REAL, timeout)
    try:
        return builtin_result(rm_type, response, label)
    except _GradeTimeout:
        raise GradingTimeout(f"grading took longer than {timeout:g}s (--reward-timeout)") from None
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _init_worker(parent_pid: int) -> None:
    # Ctrl-C reaches the whole process group; a worker interrupted mid-sample returned the
    # KeyboardInterrupt as its result, which killed the rollout loop and hung the trainer
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    exit_with_parent(parent_pid)  # a SIGKILLed trainer runs no cleanup
    try:
        math_verify()  # pay the sympy import once per worker, not inside the first sample's timeout
    except ImportError:  # rm type `exact` never needs it; a sample that does fails on its own, counted
        pass


async def in_daemon_thread(fn: Callable, *args: Any) -> Any:
    """fn(*args) in a daemon thread of its own. Unlike asyncio.to_thread (a shared pool of
    non-daemon threads), a call that never returns can be abandoned: it holds no worker that a
    later call needs, and the interpreter does not wait for it at exit."""
    loop = asyncio.get_running_loop()
    fut = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if fut.done():  # abandoned: the caller timed out
            return
        if error is not None:
            fut.set_exception(
                error if isinstance(error, Exception) else RuntimeError(f"reward stopped by {type(error).__name__}")
            )
        else:
            fut.set_result(result)

    def work() -> None:
        try:
            result, error = fn(*args), None
        except (
            BaseException
        ) as e:  # SystemExit from user code too: it must reach the caller, not end the thread silently
            result, error = None, e
        try:
            loop.call_soon_threadsafe(settle, result, error)
        except RuntimeError:  # the loop is closed: nobody waits any more
            pass

    threading.Thread(target=work, name="vime-reward", daemon=True).start()
    return await fut


class RewardRunner:
    """The run's grading pool and reward threads, each call bounded by `timeout` seconds
    (--reward-timeout) from when it starts: a long queue for a worker or a thread is not a timeout."""

    def __init__(self, timeout: float, pool_workers: int = POOL_WORKERS, threads: int = THREADS) -> None:
        self.timeout = timeout
        self.pool_workers = pool_workers
        self.threads = threads
        self._pool: ProcessPoolExecutor | None = None
        self.pool_unavailable = False  # creating the pool failed once: grade inline from then on
        self.closed = False  # after close() nothing starts a pool again
        self._lock = threading.Lock()
        # One slot per worker (per thread) and event loop: a call's timer starts when a worker is free for it.
        self._pool_slots: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore] = (
            weakref.WeakKeyDictionary()
        )
        self._thread_slots: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore] = (
            weakref.WeakKeyDictionary()
        )

    # ---- threads -----------------------------------------------------------------------------

    async def in_thread(self, fn: Callable, *args: Any) -> Any:
        """fn(*args) in a daemon thread, abandoned at the timeout (asyncio.TimeoutError)."""
        slots = self._thread_slots.setdefault(asyncio.get_running_loop(), asyncio.Semaphore(self.threads))
        async with slots:
            return await asyncio.wait_for(in_daemon_thread(fn, *args), self.timeout)

    # ---- the pool ----------------------------------------------------------------------------

    async def grade(self, rm_type: str, response: str, label: str | None) -> dict[str, float]:
        """builtin_result in a pool worker (inline in a thread when no pool can start)."""
        call = (rm_type, response, label, self.timeout)
        slots = self._pool_slots.setdefault(asyncio.get_running_loop(), asyncio.Semaphore(self.pool_workers))
        async with slots:
            pool = self._get_pool()
            fut = self._submit(pool, call) if pool is not None else None
            if fut is None:
                return await asyncio.wait_for(in_daemon_thread(score_with_timeout, *call), self.timeout)
            try:
                # the worker's own timer fires at `timeout`; this backstop catches a worker stuck
                # where signals cannot reach it (C code), which is then killed
                return await asyncio.wait_for(asyncio.wrap_future(fut), 2 * self.timeout + 5)
            except BrokenProcessPool:
                self._discard(pool)
                raise
            except TimeoutError:
                self._discard(pool, kill=True)
                raise
            except (
                KeyboardInterrupt,
                SystemExit,
            ) as e:  # a worker's, sent back as its result: never the loop's to raise
                raise RuntimeError(f"grading worker stopped by {type(e).__name__}") from None

    def _get_pool(self) -> ProcessPoolExecutor | None:
        """The grading pool, created on first use; None once creating it has failed."""
        with self._lock:
            if self.closed:
                raise RuntimeError("the run's rewards are closed")
            if self._pool is None and not self.pool_unavailable:
                try:
                    # spawn, not fork: the parent has threads (event loop, torch) that fork would copy
                    # mid-state. Like any spawn pool, a driver script needs an `if __name__ == "__main__"` guard.
                    self._pool = ProcessPoolExecutor(
                        self.pool_workers,
                        mp_context=multiprocessing.get_context("spawn"),
                        initializer=_init_worker,
                        initargs=(os.getpid(),),
                    )
                except Exception as e:  # e.g. no /dev/shm semaphores in a sandbox
                    self._mark_unavailable(e)
            return self._pool

    def _mark_unavailable(self, e: BaseException) -> None:
        self.pool_unavailable = True
        log.warning(
            "reward process pool unavailable (%s: %s); grading inline in this process",
            type(e).__name__,
            " ".join(str(e).split())[:200],
        )

    def _submit(self, pool: ProcessPoolExecutor, call: tuple) -> Future | None:
        """Hand one sample to the pool; None when the pool cannot run at all (grade inline then)."""
        try:
            return pool.submit(score_with_timeout, *call)
        except BrokenProcessPool:
            self._discard(pool)
            raise
        except Exception as e:  # the workers could not be started
            with self._lock:
                if self._pool is not pool:  # discarded by another caller meanwhile: this sample just fails
                    raise
                self._mark_unavailable(e)
            return None

    def _discard(self, pool: ProcessPoolExecutor, kill: bool = False) -> None:
        """Drop a broken or wedged pool; the next sample starts a fresh one.

        A wedged worker is killed, or the interpreter would wait for it at exit. Python 3.14 has
        `kill_workers()`; before that the executor's process table is the only handle.
        """
        with self._lock:
            if self._pool is pool:
                self._pool = None
        if kill:
            killer = getattr(pool, "kill_workers", None)
            if killer is not None:
                killer()
            else:
                for p in list((getattr(pool, "_processes", None) or {}).values()):
                    p.kill()
        pool.shutdown(wait=False, cancel_futures=True)

    def close(self) -> None:
        """Kill the grading workers (end of a run): at interpreter exit Python would otherwise wait
        for any sample still being graded. Idempotent."""
        with self._lock:
            pool, self.closed = self._pool, True
        if pool is not None:
            self._discard(pool, kill=True)
