"""A compiled trainer's warm-up: every micro-batch shape a step can meet, compiled before a step
meets it, beside the rest of the start-up rather than before it.

Compiling the demo's trainer for its 16 padded sizes took 18 s of a 35 s warm start-up on one
H200, and 78 s of 112 s cold (bench/RESULTS.md, issue 48): longer than the engines' start, the
step-0 eval and the first rollout together, none of which needs the trainer. So on one rank the
warm-up runs on a thread of its own, and the trainer's first use waits for what is left of it
(`CompileWarmUp.wait`, logged). A resumed run (`--load`) and one whose engines are given by URL
use the trainer before step 1 (its checkpoint, the first push), so they wait then. Several ranks
warm up in place: their warm-ups run FSDP collectives, which must not interleave with the calls
rank 0 sends them.

On a GPU, one eager training step of the largest size runs before the thread starts
(`CompileWarmUp.__init__` says why).

The scoring forward (`compute_log_probs`: eval mode, no gradients) is a graph of its own, ~7 s
of Dynamo's warm work on the demo's shape. Default GRPO never runs it (one optimizer step per
rollout: the training forward's own log-probs are π_old), so it is compiled only for runs that
score the policy (`Actor.scores_the_policy`); anything else that scores compiles it at its first
call, which the log says.
"""

from __future__ import annotations

import logging
import threading
import time

import torch

from vime.trainer.optimizer_step import OptimizerStep

log = logging.getLogger("vime")


class CompileWarmUp:
    """The warm-up of one compiled policy, run in place or on a thread (`background`): the
    micro-batches of `step.batches`' padded sizes, through the training forward and backward
    `step` runs and (`scoring`) the scoring forward `Actor.compute_log_probs` runs."""

    def __init__(self, step: OptimizerStep, background: bool, scoring: bool) -> None:
        self._optimizer_step = step
        self._background = background
        self.scoring = scoring  # the scoring forward is compiled (`Actor.scores_the_policy`), or will be
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()  # a run closing before its first step: stop after the current size
        if not background:
            self._run()
            return
        if step.ranks.device.type == "cuda":
            # one training forward and backward of the largest size, eager (a fraction of a second):
            # the caching allocator then holds the trainer's peak activations, so engines that share
            # the GPU and size their KV cache from its free memory once the trainer is built
            # (vime/launch/assemble.py) leave the trainer that memory, as they did when they started
            # after the whole warm-up. An eager step keeps more activations than a compiled one, so
            # that peak is the larger.
            with torch.compiler.set_stance("force_eager"):
                self._step(step.batches.sizes()[-1], scoring=False)
            step.optimizer.zero_grad(set_to_none=True)
        self._thread = threading.Thread(target=self._run_keeping_error, name="vime-compile", daemon=True)
        self._thread.start()

    def wait(self, scoring: bool = False) -> None:
        """Return once every size is compiled; re-raise what the warm-up raised. The first call
        that had to wait logs how long; the first scoring call (`scoring`) of a warm-up that left
        the scoring forward out says that it compiles now."""
        thread, self._thread = self._thread, None
        if thread is not None:
            t0, waits = time.perf_counter(), thread.is_alive()
            thread.join()
            if waits:
                log.info("the trainer waited %.1f s for the rest of its compile", time.perf_counter() - t0)
        if self._error is not None:  # every later use too: the model is compiled for some sizes only
            raise self._error
        if scoring and not self.scoring:
            self.scoring = True  # by the call that follows
            log.info("compiling the trainer's scoring forward now: its warm-up left it out, as these settings run none")

    def cancel(self) -> None:
        """Stop after the size being compiled and wait for that (a run that closes before its
        first step: the process group must not be torn down under a compile)."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _run_keeping_error(self) -> None:
        try:
            self._run()
        except BaseException as e:  # raised to the thread that waits (`wait`)
            self._error = e

    def _run(self) -> None:
        """Each bucket size, with gradients and (`scoring`) without: a scoring pass runs under
        no_grad, which is a graph of its own. The batches are a dummy sequence padded to the
        size; the gradients they leave are dropped."""
        step = self._optimizer_step
        t0 = time.perf_counter()
        was_training = step.policy.scorer.training
        sizes = step.batches.sizes()
        for size in sizes:
            if self._stop.is_set():
                return
            if self.scoring:
                self._step(size, scoring=True)
            self._step(size, scoring=False)
        step.policy.scorer.train(was_training)
        step.optimizer.zero_grad(set_to_none=True)
        step.ranks.sync()
        what = "" if self.scoring else " (training only: these settings never score the policy)"
        where = " beside the start-up" if self._background else ""
        log.info(
            "compiled the trainer for %d micro-batch sizes%s in %.1f s%s",
            len(sizes),
            what,
            time.perf_counter() - t0,
            where,
        )

    def _step(self, size: int, scoring: bool) -> None:
        """One dummy micro-batch of `size` tokens: a scoring forward as `compute_log_probs` runs
        it (eval mode, no gradients: the layers' mode is guarded too), or a training forward and
        backward."""
        step = self._optimizer_step
        scorer, temperature = step.policy.scorer, step.batches.temperature
        mb = step.batches.empty(size)
        if scoring:
            scorer.eval()
            with torch.no_grad():
                scorer(mb, temperature, False)
            return
        scorer.train()
        log_probs, entropy = step.forward(mb, temperature)
        (log_probs.sum() + entropy.sum()).backward()
