"""The run's rollout-side live objects: engine clients, the tokenizer, the fully-async worker.

The run creates them once it has placed its engines and closes them at its end; nothing here
is process-wide. Rollout and generate functions keep slime's signatures, which pass `args`
(and the data source) only, so they reach these objects as `args.runtime` (`runtime_of`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vime.engine.client import EngineClient
from vime.rollout import async_loop

if TYPE_CHECKING:
    from vime.rollout.fully_async_rollout import AsyncRolloutWorker

log = logging.getLogger("vime")


@dataclass
class RolloutRuntime:
    clients: tuple[EngineClient, ...]
    tokenizer: Any
    engine_version: int = 0  # the policy version the engines hold (optimizer steps of the pushed weights)
    worker: AsyncRolloutWorker | None = None  # the fully-async worker, started by its rollout function's first call

    def set_engine_version(self, version: int) -> None:
        """After every push (and on resume): a worker held back by --max-staleness starts its
        next groups at once."""
        self.engine_version = version
        if self.worker is not None:
            self.worker.set_engine_version(version)

    def abort_all(self) -> None:
        """Abort every request on every engine, best effort: on the way out of a failed or
        finished run an unreachable engine must not hide the error that got us here."""
        for c in self.clients:
            try:
                c.abort_request(abort_all=True)
            except Exception as e:
                log.debug("abort at %s while stopping failed: %r", c.url, e)

    def close(self) -> None:
        """Stop the worker (its in-flight requests aborted) and close the clients' sessions."""
        if self.worker is not None:
            self.worker.stop()
            self.worker = None
            self.abort_all()
        for c in self.clients:
            async_loop.run(c.close())


def make_clients(urls: list[str], backend: str = "vime", api_key: str | None = None) -> tuple[EngineClient, ...]:
    """One client per engine URL, of the backend's kind (both speak vime's engine protocol)."""
    if backend == "vllm":
        from vime.engine.vllm import VLLMClient

        return tuple(VLLMClient(u) for u in urls)
    return tuple(EngineClient(u, api_key=api_key) for u in urls)


def runtime_of(args: Any) -> RolloutRuntime:
    runtime = args.runtime
    if runtime is None:
        raise RuntimeError(
            "no rollout runtime on args: rollout functions run inside a vime run (vime train / vime eval), which sets args.runtime"
        )
    return runtime
