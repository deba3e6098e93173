"""The train loops, one per kind of mode, over a `vime.run.Run`; `train(cfg)` runs one.

The mode is `cfg.mode`, decided in `Config.validate`: sync and decoupled run `_sequential_loop`,
one-step-off and fully-async `_one_step_off_loop` (the fully-async rollout function makes the
difference), --debug-rollout-only `_rollout_only_loop`.

Every loop measures the same things the same way (docs/architecture.md, the timing):
  train_wait_time   trainer ready for the batch → batch in hand (the bubble)
  train_time        log-prob recompute + forward/backward + optimizer
  update_weights_time  pause → push → resume, all engines
  step_time         end of previous step → end of this one (eval and checkpoints excluded)
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from vime.config import Config
from vime.launch.assemble import assemble
from vime.modes import MODES
from vime.plugins import at_step
from vime.rollout.types import RolloutOutput
from vime.run import Run


def train(args: Config) -> Path:
    """Train for num_rollout steps in the config's mode; returns the run directory."""
    run = Run(assemble(args))
    ro, ev = run.cfg.rollout, run.cfg.eval
    try:
        if ev.eval_interval and run.start_step == 0 and not (ev.skip_eval_before_train or ro.debug_train_only):
            run.metrics.log(0, run.evaluate(0))
        if ro.debug_rollout_only:
            _rollout_only_loop(run)
        else:
            loop = {"sequential": _sequential_loop, "one-step-off": _one_step_off_loop}[MODES[run.cfg.mode].loop]
            loop(run)
    finally:
        run.close()
    return run.run_dir


class StepClock:
    """Step and wall-clock time with eval/checkpoint time cut out (the timing above)."""

    def __init__(self) -> None:
        self.start = self.prev_end = time.perf_counter()
        self.wall = 0.0

    def close(self, m: dict[str, float]) -> None:
        end = time.perf_counter()
        m["perf/step_time"] = end - self.prev_end
        self.wall += m["perf/step_time"]
        m["perf/wall_clock"] = self.wall
        # what a stopwatch would show since the loop began (evals and saves included): in async
        # modes generation goes on during an eval, so only this clock charges every second
        m["perf/elapsed"] = end - self.start
        parts = ("perf/train_wait_time", "perf/train_time", "perf/update_weights_time", "perf/push_wait_time")
        m["perf/other_time"] = max(0.0, m["perf/step_time"] - sum(m.get(k, 0.0) for k in parts))

    def restart(self) -> None:
        """Call after eval/checkpoint: the next step starts counting now."""
        self.prev_end = time.perf_counter()


def _sequential_loop(run: Run) -> None:
    """get batch → train → push, in sequence.

    sync: getting the batch *is* generating it, so the trainer waits for all of it.
    decoupled: the rollout function drains a continuously running worker (samples at most
    --max-staleness versions old), and weights are pushed right after every step without
    waiting for generation; the worker is paused only for the push itself."""
    clock = StepClock()
    for rollout_id in range(run.start_step, run.num_rollout):
        ready = time.perf_counter()
        out = run.rollout(rollout_id)
        m = {"perf/train_wait_time": time.perf_counter() - ready}
        m.update(_train_and_push(run, out, rollout_id + 1))
        clock.close(m)
        run.after_step(rollout_id + 1, m)
        clock.restart()


def _rollout_only_loop(run: Run) -> None:
    """--debug-rollout-only: generate and score each batch with the starting weights, log its
    metrics (and save it, with --save-debug-rollout-data); no trainer, no push."""
    clock = StepClock()
    for rollout_id in range(run.start_step, run.num_rollout):
        ready = time.perf_counter()
        out = run.rollout(rollout_id)
        m = {"perf/train_wait_time": time.perf_counter() - ready, **out.metrics}
        run.data_source.mark_trained(out.samples)
        clock.close(m)
        run.after_step(rollout_id + 1, m)
        clock.restart()


def _one_step_off_loop(run: Run) -> None:
    """generate(N+1) runs while step N trains; the in-flight generate finishes before any push,
    so each batch is generated entirely by one policy version (one rollout behind the trainer).

    Under a --max-staleness too small for that (a rollout function of one's own; 0 with one
    step per rollout), generate(N+1) is submitted only after step N's push: nothing overlaps,
    and the run trains what sync trains.

    On an error or Ctrl-C the pending generate may have minutes to go: its requests are aborted
    and it is not waited for, so Run.close() stops the engines at once."""
    bound = run.cfg.rollout.max_staleness
    overlap = bound is None or bound >= run.cfg.min_staleness + run.steps_per_rollout
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vime-generate")

    def submit(rollout_id: int) -> Future | None:
        # a run resumed at its last step has nothing to generate
        return pool.submit(run.rollout, rollout_id) if rollout_id < run.num_rollout else None

    try:
        pending = submit(run.start_step)
        clock = StepClock()
        for rollout_id in range(run.start_step, run.num_rollout):
            ready = time.perf_counter()
            out = pending.result()
            m = {"perf/train_wait_time": time.perf_counter() - ready}
            if overlap:
                pending = submit(rollout_id + 1)
                m.update(_train_and_push(run, out, rollout_id + 1, before_push=pending.result if pending else None))
            else:
                m.update(_train_and_push(run, out, rollout_id + 1))
                pending = submit(rollout_id + 1)
            clock.close(m)
            run.after_step(rollout_id + 1, m)
            clock.restart()
    except BaseException:
        run.runtime.abort_all()
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown()  # the last step submits no generate: nothing is left to wait for


def _train_and_push(
    run: Run, out: RolloutOutput, step: int, before_push: Callable[[], object] | None = None
) -> dict[str, float]:
    t0 = time.perf_counter()
    settings = run.cfg.placement
    released: list[dict] = []  # each engine's answer; the built-in one says how many bytes it gave back
    if settings.colocate:
        run.runtime.on_each(lambda c: released.append(c.release_memory_occupation()))
    with at_step(step):  # a custom advantage, loss or TIS hook's fault names the step
        m = run.train_on(out, step)
    m["perf/train_time"] = time.perf_counter() - t0
    if released and all("released_bytes" in r for r in released):  # vLLM's sleep does not say
        m["perf/engine_released_bytes"] = float(sum(r["released_bytes"] for r in released))
    if settings.colocate:
        run.runtime.on_each(lambda c: c.resume_memory_occupation())
    if step % settings.update_weights_interval == 0:
        if before_push is not None:
            w0 = time.perf_counter()
            before_push()
            m["perf/push_wait_time"] = time.perf_counter() - w0
        m.update(run.push_weights(step))
    m.update(run.version_metrics())
    return m
