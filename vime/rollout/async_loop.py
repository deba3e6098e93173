"""One process-wide asyncio loop in a daemon thread, where all rollout I/O runs.

Rollout functions keep slime's synchronous signature, while HTTP requests to the engines
must be concurrent. Running every coroutine on one long-lived loop lets clients keep their
connection pools and lets the fully-async worker keep requests in flight between calls.

The loop outlives any one task: asyncio lets a KeyboardInterrupt or SystemExit raised inside a
task escape `run_forever`, which ended the thread and left every later `run()` (closing the
clients at the end of a run, say) waiting for ever. The exception still reaches whoever awaits
that task; the loop just goes on.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Coroutine
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")

log = logging.getLogger("vime")

_loop: asyncio.AbstractEventLoop | None = None
_lock = threading.Lock()


def _serve(loop: asyncio.AbstractEventLoop) -> None:
    while True:
        try:
            loop.run_forever()
            return
        except BaseException as e:  # escaped one task (which now holds it as its result): keep serving the others
            log.error("rollout event loop: %s escaped a task; the loop goes on", type(e).__name__)


def get_loop() -> asyncio.AbstractEventLoop:
    global _loop
    with _lock:
        if _loop is None or _loop.is_closed():
            _loop = asyncio.new_event_loop()
            threading.Thread(target=_serve, args=(_loop,), name="vime-rollout-loop", daemon=True).start()
        return _loop


def submit(coro: Coroutine[Any, Any, T]) -> Future[T]:
    """Schedule a coroutine on the rollout loop; returns a concurrent Future."""
    return asyncio.run_coroutine_threadsafe(coro, get_loop())


def run(coro: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine on the rollout loop and block until it finishes."""
    if threading.current_thread().name == "vime-rollout-loop":
        raise RuntimeError(
            "vime.rollout.async_loop.run() called from the rollout loop itself; await the coroutine instead"
        )
    return submit(coro).result()


def cancel_all(timeout: float = 10.0) -> None:
    """Cancel every task on the rollout loop and wait (bounded) until they have unwound: at the
    end of a run, so a generate still pending after an error or Ctrl-C (its grading, say) does
    not go on for minutes and keep the process from exiting."""
    with _lock:
        loop = _loop
    if loop is None or loop.is_closed():
        return

    async def cancel() -> None:
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=timeout)

    try:
        submit(cancel()).result(timeout + 5)
    except Exception as e:  # best effort on the way out
        log.debug("cancelling the rollout tasks: %r", e)
