"""One process-wide asyncio loop in a daemon thread, where all rollout I/O runs.

Rollout functions keep slime's synchronous signature, while HTTP requests to the engines
must be concurrent. Running every coroutine on one long-lived loop lets clients keep their
connection pools and lets the fully-async worker keep requests in flight between calls.
"""
from __future__ import annotations

import asyncio
import threading
from concurrent.futures import Future
from typing import Any, Coroutine, TypeVar

T = TypeVar("T")

_loop: asyncio.AbstractEventLoop | None = None
_lock = threading.Lock()


def get_loop() -> asyncio.AbstractEventLoop:
    global _loop
    with _lock:
        if _loop is None or _loop.is_closed():
            _loop = asyncio.new_event_loop()
            threading.Thread(target=_loop.run_forever, name="vime-rollout-loop", daemon=True).start()
        return _loop


def submit(coro: Coroutine[Any, Any, T]) -> Future[T]:
    """Schedule a coroutine on the rollout loop; returns a concurrent Future."""
    return asyncio.run_coroutine_threadsafe(coro, get_loop())


def run(coro: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine on the rollout loop and block until it finishes."""
    if threading.current_thread().name == "vime-rollout-loop":
        raise RuntimeError("vime.rollout.async_loop.run() called from the rollout loop itself; await the coroutine instead")
    return submit(coro).result()
