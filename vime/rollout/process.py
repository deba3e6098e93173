"""The rollout's per-sample work in a process of its own (`--rollout-process`).

Why: the trainer's process runs the rollout event loop (`async_loop`) as a thread. Each sample
costs that thread about a millisecond of Python under the GIL (an HTTP request and its JSON, the
decode of the response, its reward sent to the grading pool), and a train step of a small model
is bound by its host's kernel launches, each of which gives up the GIL and has to win it back.
When generation overlaps training (one-step-off, fully-async, decoupled) the two take turns on
the one interpreter, and the train step grows by about the rollout thread's CPU time (bench/
RESULTS.md, issue 65). In a process of its own that work has an interpreter of its own.

What moves: generating a prompt group's samples (the run's generate function and the engines'
clients) and scoring them (the rewards and their grading pool). What stays: everything that
decides *which* groups (the data source, the fully-async worker's queue, staleness, dynamic
sampling), the weight pushes, pauses and evaluation, and the engines' restarts. The trainer
side sends a group and gets it back generated or scored: one message each way per group
instead of one HTTP exchange per sample.

The child is spawned with the frozen config and the engines' URLs and builds its own clients,
tokenizer, rewards and runtime (`vime.rollout.runtime`), whose `args` is a `PluginArgs` over the
same config (plug-ins it runs: the multi-turn generate, a custom reward; a custom generate or
rollout function, which may talk to the engines through the run's router, keeps the rollout in
the trainer's process: `Config` refuses `--rollout-process on` with one). It follows the
trainer's view of the engines: after every push it is sent each engine's URL and state, and an
engine it finds gone is reported back, where the runtime probes it and restarts it.

Messages are pickles framed by their length over a socket pair, read and written by each side's
event loop (writes never block a loop: each side buffers, so neither can wait on the other).
The child ends when the trainer says so, and when its socket closes (the trainer ended, even
killed): it never outlives the run.
"""

from __future__ import annotations

import asyncio
import atexit
import itertools
import logging
import multiprocessing as mp
import os
import pickle
import signal
import socket
import struct
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vime.errors import EngineError, VimeError
from vime.rollout import async_loop
from vime.rollout.runtime import Engine, HealthCheck, RolloutRuntime
from vime.rollout.types import Sample

if TYPE_CHECKING:
    from vime.backends import Backend

log = logging.getLogger("vime")

_HEADER = struct.Struct("!Q")
LogSetup = Callable[[Path, bool], None]
START_TIMEOUT_S = 300.0  # importing torch and transformers on a loaded machine, loading the tokenizer
STOP_TIMEOUT_S = 10.0


def wanted(cfg: Any, trainer_device: str) -> bool:
    """Whether a training run generates and scores in a rollout process: --rollout-process on;
    auto when generation overlaps training and the trainer is on a GPU (a CPU trainer's step is
    its arithmetic, not its launches, and one more process costs a small machine a core)."""
    from vime.modes import MODES, custom_rollout

    ro = cfg.rollout
    if ro.rollout_process == "off" or ro.debug_train_only or custom_rollout(ro):
        return False
    if ro.rollout_process == "on":
        return True
    return MODES[cfg.mode].overlaps and not ro.debug_rollout_only and trainer_device.startswith("cuda")


class RolloutProcessError(VimeError, RuntimeError):
    """The rollout process ended, or could not start; one line with its exit code and where its log is."""


def _frame(message: tuple) -> bytes:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return _HEADER.pack(len(data)) + data


async def _receive(reader: asyncio.StreamReader) -> tuple | None:
    """The next message, or None once the other side has closed."""
    try:
        size = _HEADER.unpack(await reader.readexactly(_HEADER.size))[0]
        return pickle.loads(await reader.readexactly(size))
    except (asyncio.IncompleteReadError, ConnectionError):
        return None


def _portable(e: BaseException) -> BaseException:
    """`e` if it survives a pickle round trip (vime's one-line errors do), else a
    RolloutProcessError with its type and message, so the other side always gets one line."""
    try:
        return pickle.loads(pickle.dumps(e))
    except Exception:  # an exception class whose __init__ takes other arguments than it keeps
        return RolloutProcessError(f"{type(e).__name__}: {' '.join(str(e).split())[:300]}")


def _stream_of(conn: Any) -> socket.socket:
    """The socket under a multiprocessing Connection (a socket pair on POSIX), as asyncio uses it."""
    sock = socket.socket(fileno=os.dup(conn.fileno()))
    conn.close()
    sock.setblocking(False)
    return sock


class RolloutProcess:
    """The trainer side: starts the child, and generates and scores groups through it. Its
    coroutines run on the trainer's rollout loop; `follow` and `close` are called from the
    train loop's thread."""

    def __init__(
        self, cfg: Any, runtime: RolloutRuntime, api_key: str | None, log_file: Path, setup_logging: LogSetup
    ) -> None:
        """`cfg`: the run's frozen Config (typed Any: the rollout never imports the config).
        `setup_logging(log_file, quiet)`: how the child logs into the run's log.txt (the run's
        own, `vime.metrics.setup_logging`, handed down: the rollout never imports the metrics)."""
        self.runtime = runtime
        self.log_file = log_file
        ctx = mp.get_context("spawn")  # a fresh interpreter: no CUDA context, no threads inherited
        here, there = ctx.Pipe(duplex=True)
        urls = [e.client.url for e in runtime.engines]
        # not a daemon: it starts a grading pool of its own, which a daemon may not. It ends with its
        # socket; at this process's exit (a run always closes it before) it is killed first, or
        # multiprocessing would wait for it
        self.proc = ctx.Process(
            target=_child_main, args=(there, cfg, urls, api_key, str(log_file), setup_logging), name="vime-rollout"
        )
        self.proc.start()
        atexit.register(_kill, self.proc)
        there.close()
        self._ids = itertools.count()
        self._pending: dict[int, asyncio.Future] = {}
        self._error: BaseException | None = None
        self._closed = False
        self.requests: list[int] = [0] * len(urls)  # sent to each engine by the child, as it last said
        async_loop.run(self._connect(_stream_of(here)))

    async def _connect(self, sock: socket.socket) -> None:
        reader, self._writer = await asyncio.open_unix_connection(sock=sock)
        self._ready: asyncio.Future = asyncio.get_running_loop().create_future()
        self._reading = asyncio.ensure_future(self._read(reader))

    # ---- groups (on the rollout loop) ----

    async def generate(self, group: list[Sample], params: dict, resume: bool) -> list[Sample]:
        """The group with its samples generated (`generate.generate_samples` in the child)."""
        return await self._call("generate", group, params, resume)

    async def score(self, group: list[Sample]) -> list[Sample]:
        """The group scored (`generate.score_group` in the child): the same samples, as new objects."""
        return await self._call("score", group)

    async def _call(self, kind: str, *payload: Any) -> Any:
        await asyncio.wait_for(asyncio.shield(self._ready), START_TIMEOUT_S)
        rid = next(self._ids)
        answer = asyncio.get_running_loop().create_future()
        self._pending[rid] = answer
        self._writer.write(_frame((kind, rid, *payload)))
        try:
            return await answer
        except asyncio.CancelledError:
            if not answer.done() and not self._writer.is_closing():  # the child stops it too (its requests aborted)
                self._writer.write(_frame(("cancel", rid)))
            raise
        finally:
            self._pending.pop(rid, None)

    async def _read(self, reader: asyncio.StreamReader) -> None:
        while (message := await _receive(reader)) is not None:
            kind, *body = message
            if kind == "ready":
                self._ready.set_result(None)
            elif kind in ("done", "failed"):
                answer = self._pending.get(body[0])
                if answer is not None and not answer.done():
                    (answer.set_result if kind == "done" else answer.set_exception)(body[1])
            elif kind == "requests":
                self.requests = body[0]
            elif kind == "engine_down":  # the runtime probes it and restarts it (blocking calls: a thread)
                engine = self.runtime.engines[body[0]]
                asyncio.ensure_future(asyncio.to_thread(self.runtime.engine_failed, engine, EngineError(body[1])))
            elif kind == "fatal":
                self._error = body[0]
        self._ended()

    def _ended(self) -> None:
        """The child's socket closed: every call waiting on it fails with why."""
        if self._closed:
            return
        self.proc.join(2.0)
        error = self._error or RolloutProcessError(
            f"the rollout process ended (exit code {self.proc.exitcode}); its log lines are in {self.log_file}"
        )
        for answer in [self._ready, *self._pending.values()]:
            if not answer.done():
                answer.set_exception(error)
        self._ready.exception()  # retrieved: nothing may ever wait on it again

    # ---- from the train loop ----

    def follow(self, engines: list[Engine]) -> None:
        """The engines as the trainer sees them after a push (URLs after a restart, states)."""
        states = [(e.client.url, e.state) for e in engines]
        async_loop.get_loop().call_soon_threadsafe(self._send, ("engines", states))

    def _send(self, message: tuple) -> None:
        if not self._writer.is_closing():
            self._writer.write(_frame(message))

    def close(self) -> None:
        """Ask the child to stop (its requests are cancelled) and wait; then make sure it has."""
        if self._closed:
            return
        self._closed = True
        try:
            async_loop.run(self._stop())
        finally:
            self.proc.join(STOP_TIMEOUT_S)
            if self.proc.is_alive():
                log.warning("the rollout process did not stop within %.0f s: killing it", STOP_TIMEOUT_S)
                self.proc.kill()
                self.proc.join()

    async def _stop(self) -> None:
        if not self._writer.is_closing():
            try:
                self._writer.write(_frame(("stop",)))
                await self._writer.drain()
            except ConnectionError:  # the child is gone already (killed): no one to ask, and close() joins it
                pass
            self._writer.close()
        self._reading.cancel()
        for answer in self._pending.values():
            answer.cancel()


def _kill(proc: mp.Process) -> None:
    if proc.is_alive():
        proc.kill()
        proc.join()


# ---------------------------------------------------------------- the child


def _child_main(
    conn: Any, cfg: Any, urls: list[str], api_key: str | None, log_file: str, setup_logging: LogSetup
) -> None:
    """The rollout process: build the rollout's live objects, then serve the trainer until it
    says stop or goes away."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the trainer decides the end
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # nothing here uses a GPU: never a CUDA context on the run's device
    setup_logging(Path(log_file), True)  # quiet: the per-step progress lines are the trainer's to print
    server = _Server(cfg, urls, api_key)
    try:
        async_loop.run(server.serve(_stream_of(conn)))
    finally:
        server.close()


class _ChildRuntime(RolloutRuntime):
    """The child's view of the engines. It restarts none: an engine it finds gone is reported
    to the trainer (`tell`), whose runtime probes it and starts it again; after every push it
    takes the trainer's URLs and states (`follow`), so a restarted engine gets work again once
    it holds the pushed weights."""

    def __init__(self, clients: list[Any], tokenizer: Any, health: HealthCheck, tell: Any) -> None:
        super().__init__(clients, tokenizer, health=health)
        self.tell = tell

    def engine_failed(self, engine: Engine, error: BaseException) -> bool:
        before = engine.state
        gone = super().engine_failed(engine, error)
        if gone and before in ("up", "unsynced"):
            self.tell(("engine_down", engine.index, engine.error or " ".join(str(error).split())[:300]))
        return gone

    def follow(self, states: list[tuple[str, str]], backend: Backend, api_key: str | None) -> None:
        with self._lock:
            for e, (url, state) in zip(self.engines, states):
                if url != e.client.url:  # started again elsewhere: the old client is closed at the end
                    self._replaced.append(e.client)
                    e.client = backend.make_client(url, api_key)
                    e.client.quick_timeout = self.health.timeout
                e.state = state


class _Server:
    """The child's side: one task per group, answered as each ends."""

    def __init__(self, cfg: Any, urls: list[str], api_key: str | None) -> None:
        self.cfg, self.urls, self.api_key = cfg, urls, api_key
        self.runtime: RolloutRuntime | None = None
        self.tasks: dict[int, asyncio.Task] = {}

    def _build(self) -> None:
        from vime.backends import BACKENDS
        from vime.models import load_tokenizer
        from vime.plugin_args import PluginArgs
        from vime.rollout.generate import generate_fn
        from vime.rollout.rewards import Rewards

        cfg = self.cfg
        self.backend = BACKENDS[cfg.placement.rollout_backend]
        clients = [self.backend.make_client(u, self.api_key) for u in self.urls]
        self.runtime = _ChildRuntime(
            clients, load_tokenizer(cfg.rollout.model_dir), health=HealthCheck.of(cfg.placement), tell=self._send
        )
        self.args = PluginArgs(cfg, self.runtime)
        self.runtime.rewards = Rewards(self.args)
        self.fn = generate_fn(self.args)

    async def serve(self, sock: socket.socket) -> None:
        reader, self.writer = await asyncio.open_unix_connection(sock=sock)
        try:
            self._build()
        except BaseException as e:
            self._send(("fatal", _portable(e)))
            await self.writer.drain()
            raise
        self._send(("ready",))
        log.info(
            "rollout process %d: generating and scoring for the trainer (%d engine(s))", os.getpid(), len(self.urls)
        )
        while (message := await _receive(reader)) is not None:
            kind, *body = message
            if kind == "generate":
                rid, group, params, resume = body
                self._start(rid, self._generate(group, params, resume))
            elif kind == "score":
                self._start(body[0], self._score(body[1]))
            elif kind == "cancel":
                if (task := self.tasks.get(body[0])) is not None:
                    task.cancel()
            elif kind == "engines":
                self.runtime.follow(body[0], self.backend, self.api_key)
            elif kind == "stop":
                break
        for task in self.tasks.values():
            task.cancel()
        await asyncio.gather(*self.tasks.values(), return_exceptions=True)

    def _send(self, message: tuple) -> None:
        async_loop.get_loop().call_soon_threadsafe(self._write, message)  # from any thread (an engine's failure)

    def _write(self, message: tuple) -> None:
        if not self.writer.is_closing():
            self.writer.write(_frame(message))

    def _start(self, rid: int, work: Any) -> None:
        self.tasks[rid] = asyncio.ensure_future(self._answer(rid, work))

    async def _answer(self, rid: int, work: Any) -> None:
        try:
            self._write(("done", rid, await work))
        except asyncio.CancelledError:
            pass  # the trainer gave it up: it waits for no answer
        except BaseException as e:
            log.debug("rollout process: request %d failed", rid, exc_info=e)
            self._write(("failed", rid, _portable(e)))
        finally:
            self.tasks.pop(rid, None)

    async def _generate(self, group: list[Sample], params: dict, resume: bool) -> list[Sample]:
        from vime.rollout.generate import generate_samples

        return await generate_samples(self.args, group, params, self.fn, resume=resume)

    async def _score(self, group: list[Sample]) -> list[Sample]:
        from vime.rollout.generate import score_group

        await score_group(self.args, group)
        self._write(("requests", [e.requests for e in self.runtime.engines]))
        return group

    def close(self) -> None:
        if self.runtime is not None:
            self.runtime.close()
            if self.runtime.rewards is not None:
                self.runtime.rewards.close()
