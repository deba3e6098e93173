"""Fully-async rollout: one process-wide worker keeps prompt groups in flight across calls.

`generate_rollout_fully_async(args, rollout_id, data_source)` drains exactly
`--rollout-batch-size` finished groups from the worker's queue and returns; the worker goes on
generating meanwhile, so the next call usually finds its batch already there (warm queue) and
slow requests (the long tail) never hold a step up.

Rules the worker keeps:
* at most `--rollout-concurrency` groups in flight (default: 2 × rollout-batch-size);
* a group with an aborted sample (`--update-in-flight abort` aborts them at every push) goes
  back to the data source, to be generated again from the start; with `--update-in-flight
  resume` (`--partial-rollout`) its aborted samples continue from the tokens they already have;
* a batch is the finished groups of lowest group index (the data order), handed out sorted
  by it, never in the order they happened to finish;
* without a staleness bound, back-pressure: no new prompt is taken while a full batch of
  finished groups is waiting;
* with `--dynamic-sampling-filter-path`, a group the filter drops is done with as soon as it is
  scored: it never enters the queue, so the worker starts another in its place;
* with `--max-staleness K` (decoupled mode), admission instead (AReaL's rule): a prompt is
  started only if, trained in the rollout its place in the queue gives it, its tokens would be
  at most K optimizer steps old. So at K = 0 the worker holds exactly the next batch of the
  data order and starts it only once the weights that sync would generate it with are pushed:
  the same groups, seeds and order as sync, by construction. A group that still ends up
  staler than K (a slow one overtaken by later groups) is dropped when drained, its prompt
  re-queued, and counted.

Every group the worker holds (queued, in flight, or drained but not yet trained) is still
outstanding in the data source, so a checkpoint saves it for the resumed run to generate again.

The worker belongs to the run (`args.runtime.worker`): started by the first call, told of every
push through `RolloutRuntime.set_engine_version`, stopped when the run closes.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import threading
import time

from vime.rollout import async_loop
from vime.rollout.filters import GroupSieve, load_filter
from vime.rollout.generate import generate_fn, generated, rollout_metrics, sampling_params, scored
from vime.rollout.runtime import runtime_of
from vime.rollout.types import RolloutOutput, Sample, Status

log = logging.getLogger("vime")


class AsyncRolloutWorker:
    """Producer side of the fully-async pipeline; lives on the shared rollout event loop."""

    def __init__(self, args, data_source, first_rollout: int, engine_version: int = 0) -> None:
        self.args = args  # what the generate functions and the filter (plug-ins) are called with
        self.settings = rollout = args.rollout  # the rollout component's settings (`cfg.rollout`)
        self.data_source = data_source
        self.concurrency = rollout.rollout_concurrency or 2 * rollout.rollout_batch_size
        self.batch = rollout.rollout_batch_size
        self.max_staleness: int | None = rollout.max_staleness
        self.steps_per_rollout: int = args.trainer.steps_per_rollout
        # finished groups as a heap on group index (the data order), with a tie-breaker so
        # groups themselves are never compared
        self.ready: list[tuple[int, int, list[Sample]]] = []
        self._arrival = itertools.count()
        self.cond = threading.Condition()  # guards everything below; the data source has its own lock
        self.inflight = 0
        self.counts = {"requeued": 0, "dropped_stale": 0, "resumed": 0}
        # dynamic sampling: the groups the filter dropped since the last drain, guarded by cond
        judge = load_filter(args)
        self.sieve = GroupSieve(judge, data_source, self.batch) if judge is not None else None
        self.engine_version = engine_version  # kept current by set_engine_version after each push
        # group index → (first request, scored), for the batch's rollout time
        self.spans: dict[int, tuple[float, float]] = {}
        self.next_rollout = first_rollout  # the rollout the next (or current) drain hands out
        self.taken = 0  # groups the drain in progress has taken: still that rollout's
        self.max_inflight_seen = 0
        self._stop = False
        self._wake: asyncio.Event | None = None
        self.error: BaseException | None = None
        self._task = async_loop.submit(self._run())

    # ---- producer (rollout loop thread) ----

    async def _run(self) -> None:
        self._wake = asyncio.Event()
        tasks: set[asyncio.Task] = set()
        try:
            fn, params = generate_fn(self.args), sampling_params(self.args)
            while not self._stop:
                while self._may_start():
                    with self.cond:
                        group = self.data_source.get_samples(1)[0]
                        self.inflight += 1
                        self.max_inflight_seen = max(self.max_inflight_seen, self.inflight)
                    task = asyncio.create_task(self._one_group(group, fn, params))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                self._wake.clear()
                await self._wake.wait()
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # e.g. a bad custom generate function: fail drain(), never hang it
            with self.cond:
                self.error = e
                self.cond.notify_all()
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def _may_start(self) -> bool:
        with self.cond:
            if self._stop or self.inflight >= self.concurrency:
                return False
            if self.max_staleness is None:
                return len(self.ready) < self.batch
            queued = self.taken + len(self.ready) + self.inflight  # untrained groups ahead of a new one
            return self._lag(self.next_rollout + queued // self.batch, self.engine_version) <= self.max_staleness

    def _lag(self, rollout: int, version: int) -> int:
        """Staleness in optimizer steps of a token sampled by weights `version` when the last
        optimizer step of `rollout` trains it (the policy version is then
        (rollout + 1) × steps_per_rollout − 1)."""
        return (rollout + 1) * self.steps_per_rollout - 1 - version

    def _stale(self, group: list[Sample], rollout: int) -> bool:
        if self.max_staleness is None:
            return False
        oldest = min((v for s in group for v in (s.weight_versions or [])), default=self.engine_version)
        return self._lag(rollout, oldest) > self.max_staleness

    async def _one_group(self, group: list[Sample], fn, params) -> None:
        args = self.args
        started = time.perf_counter()
        try:
            group = await generated(args, group, params, fn)
            while any(s.status == Status.ABORTED for s in group):
                if self.settings.update_in_flight != "resume" or self._stale(group, self.next_rollout):
                    with self.cond:
                        self.data_source.add_samples([group])
                        self.counts["requeued"] += 1
                    return
                # partial rollout: aborted samples continue from the tokens they already have
                self.counts["resumed"] += sum(s.status == Status.ABORTED for s in group)
                group = await generated(args, group, params, fn, resume=True)
            group = await scored(args, group)
            verdict = self.sieve.judge(group) if self.sieve is not None else None
            with self.cond:
                # a dropped group is done with (the worker starts another), a fallback one too:
                # the worker always has more coming
                if verdict is not None and not self.sieve.settle(group, verdict):
                    self.sieve.check(len(self.ready))
                    return
                self.spans[group[0].group_index] = (started, time.perf_counter())
                heapq.heappush(self.ready, (group[0].group_index, next(self._arrival), group))
                self.cond.notify_all()
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # surfaces in the train thread instead of dying silently
            with self.cond:
                self.error = e
                self.cond.notify_all()
        finally:
            with self.cond:
                self.inflight -= 1
            self._poke()

    def _poke(self) -> None:
        if self._wake is not None:
            async_loop.get_loop().call_soon_threadsafe(self._wake.set)

    # ---- consumer (train thread) ----

    def drain(self, rollout: int, n: int) -> tuple[list[list[Sample]], dict[str, float]]:
        """Block until n trainable groups are ready; return those of lowest group index, in
        group-index order, with queue metrics. `rollout` is the index of the batch being drained."""
        out: list[list[Sample]] = []
        with self.cond:
            self.next_rollout, self.taken = rollout, 0
            while len(out) < n:
                while not self.ready and self.error is None:
                    self._poke()  # the producer may be holding back (back-pressure) on groups we just dropped
                    self.cond.wait(timeout=1.0)
                if self.error is not None:
                    raise self.error
                group = heapq.heappop(self.ready)[-1]
                if self._stale(group, rollout):
                    self.spans.pop(group[0].group_index, None)
                    self.counts["dropped_stale"] += 1
                    self.data_source.add_samples([group])
                    continue
                out.append(group)
                self.taken += 1
            self.next_rollout, self.taken = rollout + 1, 0
            spans = [self.spans.pop(g[0].group_index) for g in out if g[0].group_index in self.spans]
            metrics = {
                "rollout/queue_depth": float(len(self.ready)),
                "rollout/inflight": float(self.inflight),
                "rollout/max_inflight": float(self.max_inflight_seen),
                **{f"rollout/{k}": float(v) for k, v in self.counts.items()},
            }
            if self.sieve is not None:
                metrics.update(self.sieve.metrics(out))
        self._poke()
        if spans:  # first request to last completion of this batch's samples (docs/architecture.md, timing)
            metrics["perf/rollout_time"] = max(e for _, e in spans) - min(b for b, _ in spans)
        # the heap hands out the lowest index first, but a lower one may have finished mid-drain
        out.sort(key=lambda g: g[0].group_index)
        return out, metrics

    def set_engine_version(self, version: int) -> None:
        """The policy version the engines generate with now; a worker held back by the
        staleness bound starts its next groups at once."""
        with self.cond:
            self.engine_version = version
        self._poke()

    def stop(self) -> None:
        """Cancel the producer and its in-flight groups (the run then aborts their requests at the
        engines, `RolloutRuntime.close`, so nothing keeps generating for a worker that is gone)."""
        self._stop = True
        self._poke()
        try:
            self._task.result(timeout=30)
        except Exception as e:  # a failed producer has already reported through drain()
            log.debug("rollout worker ended with %r", e)


def generate_rollout_fully_async(args, rollout_id: int, data_source, evaluation: bool = False) -> RolloutOutput:
    if evaluation:
        raise ValueError(
            "the fully-async rollout function does not evaluate: evaluation runs through vime.eval (greedy, one batch)"
        )
    runtime = runtime_of(args)
    worker = runtime.worker
    if not isinstance(
        worker, AsyncRolloutWorker
    ):  # the first call starts the run's worker at the rollout it serves first
        worker = runtime.worker = AsyncRolloutWorker(args, data_source, rollout_id, runtime.engine_version)
    t0 = time.perf_counter()
    groups, metrics = worker.drain(rollout_id, args.rollout.rollout_batch_size)
    metrics.update(rollout_metrics(groups))
    metrics["perf/rollout_drain_time"] = time.perf_counter() - t0
    return RolloutOutput(samples=groups, metrics=metrics)
