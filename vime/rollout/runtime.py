"""The run's rollout-side live objects: the engines as the rollout sees them, the tokenizer,
the fully-async worker.

The run creates them once it has placed its engines (`vime/launch/assemble.py`, which keeps
them in the run's RunContext) and closes them at its end; nothing here is process-wide. Rollout
and generate functions keep slime's signatures, which pass `args` (and the data source) only, so
they reach these objects as `args.runtime` (`runtime_of`): the `args` a run hands them is a
read-only view of its config that carries the runtime (`vime.plugin_args.PluginArgs`).

Engines and what happens when one fails (docs/architecture.md, "Engines that fail"):

* Each request goes to an engine that is `up` (answering, holding the pushed weights): the
  one its group already uses (the group's prompt is then in that engine's prefix cache), else
  the one with the fewest tokens in flight.
* A request that fails because its engine is gone (its /health does not answer) goes to
  another engine; the engine is `down`. One the run launched is started again in the
  background (`relaunch`) and is `unsynced` once it answers: it gets no work until the next
  push has given it the current weights and version (`Run.push_weights`). One given by URL
  stays down, with a warning.
* An engine that stops answering altogether (its process stopped, wedged or cut off) would
  keep its requests waiting until their own timeout: while any request waits on it, its
  /health is probed every `HealthCheck.interval` s, and one probe without an answer within
  `HealthCheck.timeout` s fails those requests at once (`EngineSilent`), as if it had died.
* Only when no engine is up does a request fail, and with it the run.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from vime.backends.client import EngineClient, EngineError, EngineSilent
from vime.rollout import async_loop
from vime.rollout.rewards import Rewards

if TYPE_CHECKING:
    from vime.rollout.types import Sample

log = logging.getLogger("vime")

MAX_RESTARTS = 3  # per engine and run: an engine that keeps dying has a cause a restart will not fix

T = TypeVar("T")


class Worker(Protocol):
    """What the runtime asks of the fully-async worker (`fully_async_rollout.AsyncRolloutWorker`)."""

    def set_engine_version(self, version: int) -> None: ...

    def stop(self) -> None: ...


class GroupProcess(Protocol):
    """Where a run with `--rollout-process` generates and scores its groups
    (`vime.rollout.process.RolloutProcess`): another process, with engine clients of its own."""

    requests: list[int]  # requests it sent to each engine

    async def generate(self, group: list[Sample], params: dict, resume: bool) -> list[Sample]: ...

    async def score(self, group: list[Sample]) -> list[Sample]: ...

    def follow(self, engines: list[Engine]) -> None: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class HealthCheck:
    """How long a silent engine may keep requests waiting (--rollout-health-check-*): probed
    every `interval` s while requests wait on it, gone after a probe unanswered for `timeout` s.
    interval 0: no probes, a request waits for its own timeout."""

    interval: float = 10.0
    timeout: float = 30.0

    @classmethod
    def of(cls, placement: Any) -> HealthCheck:
        """The placement's settings (`cfg.placement`): how the runtime probes its engines."""
        return cls(placement.rollout_health_check_interval, placement.rollout_health_check_timeout)


@dataclass
class _Watch:
    """The probes of one engine's client while requests wait on it (on the rollout loop)."""

    client: EngineClient
    loop: asyncio.AbstractEventLoop  # the run has one; tests may run several, one after another
    silent: asyncio.Future  # set to an EngineSilent once a probe goes unanswered
    task: asyncio.Task | None = None
    waiters: int = 0


@dataclass
class Engine:
    """One engine as the rollout sees it."""

    index: int
    client: EngineClient
    transport: str = "auto"  # how the weights reach it (the placement's choice)
    state: str = "up"  # up | down | restarting | unsynced
    inflight_tokens: int = 0  # prompt + budget of the requests it is running for us
    restarts: int = 0
    requests: int = 0  # sent to it so far
    error: str = ""  # why it went down


class RolloutRuntime:
    def __init__(
        self,
        clients: tuple[EngineClient, ...] | list[EngineClient],
        tokenizer: Any,
        transports: list[str] | None = None,
        relaunch: Callable[[int], EngineClient] | None = None,
        health: HealthCheck | None = None,
        rewards: Rewards | None = None,
    ) -> None:
        """`relaunch(i)` starts engine i again and returns a client for it (launched engines
        only; None: engines are not restarted). `rewards` scores what the rollout functions
        generate (score_samples); the run owns and closes it (None: evaluation, nothing scored)."""
        transports = transports or ["auto"] * len(clients)
        self.engines = [Engine(i, c, t) for i, (c, t) in enumerate(zip(clients, transports))]
        self.tokenizer = tokenizer
        self.relaunch = relaunch
        self.health = health or HealthCheck()
        self.rewards = rewards
        for e in self.engines:
            e.client.quick_timeout = self.health.timeout
        self._watches: dict[int, _Watch] = {}  # engine index → its probes (rollout loop only)
        self.engine_version = 0  # the policy version the engines hold (optimizer steps of the pushed weights)
        self.worker: Worker | None = None  # the fully-async worker, started by its rollout function's first call
        self.process: GroupProcess | None = None  # --rollout-process: where groups are generated and scored
        self._groups: dict[int, Engine] = {}  # group index → the engine its samples go to
        self._lock = threading.Lock()
        self._restart_threads: list[threading.Thread] = []
        self._replaced: list[Any] = []  # clients of engines that were started again
        self.closed = False  # the run is over: a plug-in's own worker that outlives it generates nothing more

    # ---- who is up ---------------------------------------------------------------------------

    @property
    def clients(self) -> tuple[EngineClient, ...]:
        """The clients of the engines that are up (the ones that get requests)."""
        return tuple(e.client for e in self.engines if e.state == "up")

    def reachable(self) -> list[Engine]:
        """Engines a push goes to: those up, and those back from a restart waiting for it."""
        return [e for e in self.engines if e.state in ("up", "unsynced")]

    def mark_synced(self, engines: list[Engine]) -> None:
        """After a push reached them: they hold the current weights and may get work."""
        with self._lock:
            for e in engines:
                if e.state == "unsynced":
                    log.warning("engine %d (%s) holds the current weights again and takes work", e.index, e.client.url)
                    e.state = "up"

    def metrics(self) -> dict[str, float]:
        out = {
            "rollout/engines_up": float(sum(e.state == "up" for e in self.engines)),
            "rollout/engine_restarts": float(sum(e.restarts for e in self.engines)),
        }
        if len(self.engines) > 1:  # how the load spreads (the rollout process's requests and this one's)
            theirs = self.process.requests if self.process is not None else [0] * len(self.engines)
            out.update(
                {f"rollout/engine{e.index}_requests": float(e.requests + n) for e, n in zip(self.engines, theirs)}
            )
        return out

    # ---- routing -----------------------------------------------------------------------------

    def pick(self, group_index: int, cost: int) -> Engine:
        """The engine for a request of `cost` tokens of group `group_index` (see the module
        docstring); its in-flight count is raised by `cost` until `release`."""
        with self._lock:
            e = self._groups.get(group_index)
            if e is None or e.state != "up":
                up = [x for x in self.engines if x.state == "up"]
                if not up:
                    raise EngineError(self.no_engine_message())
                e = min(up, key=lambda x: (x.inflight_tokens, x.index))
                self._groups[group_index] = e
            e.inflight_tokens += cost
            e.requests += 1
            return e

    def release(self, engine: Engine, cost: int) -> None:
        with self._lock:
            engine.inflight_tokens -= cost

    def forget_group(self, group_index: int) -> None:
        """A group is done: its engine choice is no longer needed."""
        with self._lock:
            self._groups.pop(group_index, None)

    def no_engine_message(self) -> str:
        states = "; ".join(f"{e.client.url} {e.state}{': ' + e.error if e.error else ''}" for e in self.engines)
        return f"no engine left to generate with ({states}): resume the run with --load from its last checkpoint"

    # ---- calls the run makes to every engine ---------------------------------------------------

    def call(self, engine: Engine, fn: Callable[[EngineClient], object]) -> bool:
        """`fn(engine.client)`; True once the engine answered, False when it is gone (found now,
        or before by another call: down, and restarted while another engine is up), so a pause,
        a continue or a memory release skips a dead engine in every mode as a request does.
        Raises when the engine answered with a refusal."""
        if engine.state not in ("up", "unsynced"):
            return False
        try:
            fn(engine.client)
            return True
        except EngineError as e:
            if self.engine_failed(engine, e):
                return False
            raise

    def on_each(self, fn: Callable[[EngineClient], object]) -> None:
        """`fn` on every reachable engine, skipping those gone (`call`)."""
        for e in self.reachable():
            self.call(e, fn)

    @contextlib.contextmanager
    def generation_paused(self, mode: str) -> Iterator[None]:
        """All reachable engines paused for the block (`in_place`: requests keep their place and
        KV; `abort`: they return with their partial tokens). Every engine paused is continued,
        also when a later pause or the block fails, so none is left paused; one that died
        meanwhile (killed during a checkpoint write, say) is gone like any other, and the run
        goes on with the rest. A refused continue is raised after all the others are continued,
        unless an error is already on its way out."""
        paused: list[Engine] = []
        try:
            for e in self.reachable():
                if self.call(e, lambda c: c.pause_generation(mode=mode)):
                    paused.append(e)
            yield
        except BaseException:
            self._continue(paused)
            raise
        refused = self._continue(paused)
        if refused is not None:
            raise refused

    def _continue(self, engines: list[Engine]) -> EngineError | None:
        refused = None
        for e in engines:
            try:
                self.call(e, lambda c: c.continue_generation())
            except EngineError as err:
                refused = refused or err
        return refused

    # ---- failures ----------------------------------------------------------------------------

    async def watched(self, engine: Engine, request: Awaitable[T]) -> T:
        """`request`'s answer, or EngineSilent as soon as a probe of `engine` goes unanswered
        (the module docstring). One probe loop per engine serves all its waiting requests."""
        if self.health.interval <= 0:
            return await request
        loop = asyncio.get_running_loop()
        watch = self._watches.get(engine.index)
        if watch is None or watch.client is not engine.client or watch.silent.done() or watch.loop is not loop:
            watch = _Watch(engine.client, loop, loop.create_future())
            self._watches[engine.index] = watch
        if watch.task is None or watch.task.done():
            watch.task = asyncio.ensure_future(self._probe(watch))
        answer = asyncio.ensure_future(request)
        watch.waiters += 1
        try:
            await asyncio.wait([answer, watch.silent], return_when=asyncio.FIRST_COMPLETED)
            if answer.done():
                return answer.result()
            raise EngineSilent(str(watch.silent.exception()))
        finally:
            watch.waiters -= 1
            if answer.done() and not answer.cancelled():
                answer.exception()  # read, so an error that lost the race to a cancellation is not reported as unread
            answer.cancel()  # no-op once done; on EngineSilent or our own cancellation it ends the request

    async def _probe(self, watch: _Watch) -> None:
        while True:
            await asyncio.sleep(self.health.interval)
            if watch.waiters == 0:
                return  # nothing waits: the next request starts the probes again
            try:
                why = await watch.client.unanswered(self.health.timeout)
            except Exception as e:  # a probe that cannot even be made proves nothing: the engine stays up
                log.debug("health probe of %s: %r", watch.client.url, e)
                continue
            if why is not None:
                watch.silent.set_exception(EngineSilent(f"engine at {watch.client.url} stopped answering ({why})"))
                watch.silent.exception()  # retrieved: asyncio need not warn when no waiter is left to see it
                return

    def engine_failed(self, engine: Engine, error: BaseException) -> bool:
        """After a request to `engine` failed: True when the engine is gone (now marked down,
        and restarted if the run launched it), so the request may go to another engine; False
        when it still answers (the error was the request's own)."""
        if engine.state not in ("up", "unsynced"):
            return True  # already handled by another request's failure
        if not isinstance(error, EngineSilent):  # silent was the watch's verdict: no second wait
            try:
                engine.client.health()
                return False
            except EngineError:
                pass
        with self._lock:
            if engine.state not in ("up", "unsynced"):
                return True
            engine.state = "down"
            engine.error = " ".join(str(error).split())[:300]
            for g in [g for g, e in self._groups.items() if e is engine]:
                del self._groups[g]
            # with no other engine up the run stops now, and a restart would only outlive it
            others_up = any(e.state == "up" for e in self.engines)
            restart = self.relaunch is not None and engine.restarts < MAX_RESTARTS and others_up
            if restart:
                engine.state = "restarting"
                engine.restarts += 1
        if others_up:
            log.warning(
                "engine %d at %s is gone (%s): its requests go to the other engines%s",
                engine.index,
                engine.client.url,
                engine.error,
                "; starting it again" if restart else ", it stays out of the run",
            )
        if restart:
            t = threading.Thread(target=self._restart, args=(engine,), name=f"vime-restart-{engine.index}", daemon=True)
            self._restart_threads.append(t)
            t.start()
        return True

    def _restart(self, engine: Engine) -> None:
        assert self.relaunch is not None
        try:
            client = self.relaunch(engine.index)
        except BaseException as e:  # noqa: BLE001 (a thread: whatever it was, the engine stays down)
            log.error("engine %d could not be started again: %s", engine.index, " ".join(str(e).split())[:300])
            with self._lock:
                engine.state = "down"
            return
        client.quick_timeout = self.health.timeout
        with self._lock:
            self._replaced.append(engine.client)  # its session is closed with the others, at the end
            engine.client = client
            engine.state = "unsynced"
        log.warning("engine %d is back at %s; it gets work after the next weight push", engine.index, client.url)

    # ---- versions and the end ----------------------------------------------------------------

    def set_engine_version(self, version: int) -> None:
        """After every push (and on resume): a worker held back by --max-staleness starts its
        next groups at once; a rollout process takes the engines as they are now."""
        self.engine_version = version
        if self.process is not None:
            self.process.follow(self.engines)
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
        """Stop the worker (its in-flight requests aborted), then the rollout process, and close
        the clients' sessions."""
        self.closed = True
        if self.worker is not None:
            self.worker.stop()
            self.worker = None
            self.abort_all()
        if self.process is not None:
            self.process.close()
            self.process = None
        for c in [e.client for e in self.engines] + self._replaced:
            async_loop.run(c.close())


def runtime_of(args: Any) -> RolloutRuntime:
    runtime = args.runtime
    if runtime is None:
        raise RuntimeError(
            "no rollout runtime on args: rollout functions run inside a vime run (vime train / vime eval), whose args carry it"
        )
    return runtime
