"""A training run's state and what its steps do: `Run` drives what `vime.launch.assemble` built
(data, actor, engines, their clients, the weight pusher: a `RunContext`), keeps the policy version
and the metrics, and closes all of it. The loops that drive it, one per mode, are vime/loops.py.

The policy version is the number of optimizer steps taken; every push gives the engines the
current one, they stamp it on each token, and staleness is always the version of the
optimizer step that trains a token minus the version that sampled it.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from vime.algorithms.credit import rollout_credit
from vime.config import ConfigError
from vime.debug_rollout import check_trainable, load_rollout, save_rollout
from vime.errors import EngineError
from vime.launch.context import RunContext
from vime.lifetime import signals_held
from vime.metrics import MetricsLogger
from vime.models import read_config
from vime.modes import MODES
from vime.plugins import Plugin, at_step
from vime.rollout.generate import rollout_metrics
from vime.rollout.on_policy_distillation import check_served
from vime.rollout.rewards.post_process import load_post_process, post_process
from vime.rollout.rewards.watch import FailedRewardSteps
from vime.rollout.types import RolloutOutput, Sample, drop_removed, holds_groups
from vime.trainer.checkpoint import checkpoint_to_load
from vime.trainer.drift import DriftWatch
from vime.trainer.nonfinite import BadSteps, bad_inputs

log = logging.getLogger("vime")


class Run:
    """A training run over its assembled parts (`vime/launch/`): the policy version, pushes,
    steps and metrics, and the pieces the loops share."""

    def __init__(self, ctx: RunContext) -> None:
        self.ctx = ctx
        self.cfg = ctx.cfg  # frozen: what the run reads
        self.args = ctx.args  # what plug-ins and rollout functions are handed (a read-only view)
        self.run_dir = ctx.run_dir
        self.runtime = ctx.runtime
        self.actor = ctx.actor  # None with --debug-rollout-only
        self.pusher = ctx.pusher  # None when nothing is pushed (no trainer, or no engine)
        self.data_source = ctx.data_source
        self.num_rollout: int = ctx.cfg.rollout.num_rollout  # resolved from --num-epoch by check_inputs
        self.bad_steps = BadSteps(ctx.cfg.trainer.max_bad_steps)
        # optimizer steps per rollout: the policy version advances by this much per step
        self.steps_per_rollout = ctx.cfg.trainer.steps_per_rollout
        self.drift = DriftWatch()
        self.failed_rewards = FailedRewardSteps.of(ctx.cfg.rollout, ctx.cfg.output.save)
        self.post_process: Plugin | None = None
        # the embedding's rows: a sample's token id must be below (check_trainable)
        self._vocab_size: int | None = read_config(ctx.cfg.rollout.model_dir).get("vocab_size")
        self.wall_clock_offset = 0.0  # a resumed run's clock goes on from its checkpoint's
        self.last_save_time: float | None = None  # logged in the next row: a step's row precedes its checkpoint
        # LoRA: adapters alone to engines that merge them; (url, restarts) of those that have the base
        self.adapter_push = self.actor is not None and self.actor.policy.lora is not None and ctx.backend.lora_adapters
        self.based: set[tuple[str, int]] = set()
        # optimizer steps taken (every step of a rollout counts, also one with nothing to learn)
        self.policy_version = 0
        self.weight_pushes = 0
        self.start_step = 0
        try:
            self.post_process = load_post_process(self.cfg.rollout)  # --custom-reward-post-process-path
            with ctx.startup.phase("resume and first push") if ctx.startup else contextlib.nullcontext():
                if self.cfg.output.load:
                    self._resume(Path(self.cfg.output.load))
                elif not ctx.placement.engines and self.actor is not None:
                    # engines given by URL hold whatever they were started with: the run's starting
                    # weights and version 0 go to them before step 1
                    self.push_weights(0, count=False)
            self.metrics = MetricsLogger.for_run(self.cfg, self.num_rollout, self.start_step)
            if ctx.startup is not None:
                behind = "; the trainer's compile goes on beside" if getattr(self.actor, "compiling", False) else ""
                log.info("%s%s", ctx.startup.line("before step 1 (and its step-0 eval)"), behind)
        except BaseException:
            self.close()  # never leave engine or trainer processes behind
            raise

    # ---- pieces the loops share ----

    def _resume(self, load_dir: Path) -> None:
        ckpt = checkpoint_to_load(load_dir)  # the newest inside, or the one <step>/ --load names
        if ckpt is None:
            raise ConfigError(f"--load {load_dir}: no complete checkpoint inside (expected <step>/trainer_state.pt)")
        extra = self.actor.load(ckpt)
        self.data_source.load_state_dict(extra["data_source"])
        self.start_step = extra["step"]
        # checkpoints before versions counted optimizer steps saved the push count as weight_version
        self.weight_pushes = extra.get("weight_pushes", extra.get("weight_version", 0))
        self.wall_clock_offset = extra.get("wall_clock", 0.0)
        self.policy_version = extra.get("policy_version", self.start_step * self.steps_per_rollout)
        assert self.actor.optimizer_step.count == self.policy_version, "the lr schedule and the policy version disagree"
        if self.policy_version != self.start_step * self.steps_per_rollout:
            raise ConfigError(
                f"--load {load_dir}: the checkpoint took {self.policy_version} optimizer steps in {self.start_step} rollouts, "
                f"this run takes {self.steps_per_rollout} per rollout: resume with the --global-batch-size it was trained with"
            )
        log.info("resumed from %s at step %d (policy version %d)", ckpt, self.start_step, self.policy_version)
        self.push_weights(
            self.start_step, count=False
        )  # engines started from the base model; give them the resumed weights

    def rollout(self, rollout_id: int) -> RolloutOutput:
        """The batch of rollout `rollout_id`: generated by the rollout function, or read back with
        --load-debug-rollout-data; written out with --save-debug-rollout-data."""
        ro = self.cfg.rollout
        if ro.load_debug_rollout_data:
            vocab = read_config(ro.model_dir).get("vocab_size")  # the embedding's rows: a token id must be below
            return load_rollout(
                ro.load_debug_rollout_data, rollout_id, ro.n_samples_per_prompt, ro.rollout_batch_size, vocab
            )
        with at_step(rollout_id + 1):  # a plug-in's fault (rollout, generate, filter, post-process) names the step
            given = self.ctx.rollout_fn(self.args, rollout_id, self.data_source)
            # slime's older form, the groups alone (its call_rollout_fn takes it too)
            out = RolloutOutput(samples=given) if isinstance(given, list) else given
            if isinstance(self.ctx.rollout_fn, Plugin):
                if not holds_groups(out):
                    raise self.ctx.rollout_fn.error(
                        f"returned {type(given).__name__}: it must return RolloutOutput(samples=[[Sample, ...], ...], "
                        "metrics={}), one non-empty list per prompt group"
                    )
                # a scored batch of a rollout function of one's own is logged as vime's own are (slime
                # logs its rewards and lengths whatever the function); a metric it returned itself wins.
                # A batch without rewards (SFT's conversations) has none to log
                if any(s.reward is not None for g in out.samples for s in g):
                    out.metrics = {**rollout_metrics(out.samples), **out.metrics}
            if self.post_process is not None:  # rewards in, advantages not yet: every mode passes here
                post_process(self.post_process, self.args, out.samples)
            if self.cfg.algorithm.teacher_served:
                check_served([s for g in out.samples for s in g], ro.custom_reward_post_process_path)
            own = isinstance(self.ctx.rollout_fn, Plugin)
            check_trainable(out.samples, self._vocab_size, lambda: _sample_handlers(ro, own))
        if self.ctx.rewards is not None:  # a reward service or teacher down for steps in a row stops the run
            self.failed_rewards.observe(rollout_id + 1, out.samples, self.ctx.rewards.last_failure)
        # a generate's remove_sample: untrained from here on, and so in the rollout saved below
        removed = drop_removed(out.samples)
        if removed:
            out.metrics["rollout/removed_samples"] = removed
        if ro.save_debug_rollout_data:
            save_rollout(ro.save_debug_rollout_data, rollout_id, out)
        return out

    def train_on(self, out: RolloutOutput, step: int) -> dict[str, float]:
        """Advantages → optimizer step(s). Returns train metrics + rollout metrics of this batch."""
        groups, steps = out.samples, self.steps_per_rollout
        n = self.cfg.rollout.n_samples_per_prompt
        credit = rollout_credit(groups, self.cfg.algorithm, n, steps, self.ctx.custom_advantages, self.args)
        samples = credit.samples
        metrics = dict(out.metrics)
        metrics.update(self.guarded_train_step(step, samples, credit.rewards, credit.advantages))
        self.data_source.mark_trained(groups)  # from now on a checkpoint does not regenerate them
        metrics.update(staleness_metrics(samples, self.policy_version, len(samples) // steps))
        if warning := self.drift.observe(step, metrics):
            log.warning("%s", warning)
        self.policy_version += steps
        return metrics

    def push_weights(self, step: int, count: bool = True) -> dict[str, float]:
        """pause → push → continue: the engines get the current policy version, which they
        stamp on every token from now on. In-flight requests wait in place (their next tokens
        come from the new weights), unless --update-in-flight aborts them (the fully-async worker
        then generates them again, or with resume continues them). `count=False`: a resumed
        run's weights re-sent, not a push of training. A failed push stops the run with the
        engine's URL and the step."""
        t0 = time.perf_counter()
        runtime = self.runtime
        if self.pusher is None:  # a debug run with no trainer or no engine: nothing to push
            self.weight_pushes += int(count)
            runtime.set_engine_version(self.policy_version)
            return {}
        engines: list[Any] = []
        for attempt in range(3):
            try:
                with runtime.generation_paused("in_place" if self.cfg.rollout.update_in_flight == "keep" else "abort"):
                    # after the pause: an engine it found gone (dead, or silent for the health
                    # timeout) gets no push to wait out
                    engines = runtime.reachable()  # engines back from a restart get the weights here
                    if not engines:
                        break
                    self.pusher.set_engines([e.client for e in engines], [e.transport for e in engines])
                    metrics = self._push_to(engines)
                break
            except EngineError as e:
                gone = [x for x in engines if runtime.engine_failed(x, e)]
                if not gone or attempt == 2:
                    raise EngineError(f"step {step}: {e}") from None
                log.warning(
                    "step %d: %d engine(s) went away during the weight push; pushing to the others", step, len(gone)
                )
        if not engines:
            raise EngineError(f"step {step}: {runtime.no_engine_message()}")
        runtime.mark_synced(engines)
        metrics["perf/update_weights_time"] = time.perf_counter() - t0
        self.weight_pushes += int(count)
        # the engines' version is kept in one place, the runtime; a worker bounded by --max-staleness waits for it
        runtime.set_engine_version(self.policy_version)
        return metrics

    def _push_to(self, engines: list[Any]) -> dict[str, float]:
        """The current weights to the engines: all of them, or with LoRA and a backend that
        merges adapters, the adapters alone (`vime/engine/core/lora.py`). An engine this run has
        not pushed to yet (a new one, or one back from a restart) first gets the frozen base, so
        whatever it held before, the adapters merge into the weights the trainer adapts."""
        assert self.pusher is not None and self.actor is not None
        if not self.adapter_push:
            return self._push_stream(self.actor.named_weights())
        metrics = {}
        fresh = {(e.client.url, e.restarts) for e in engines} - self.based
        if fresh:
            t0 = time.perf_counter()
            self._push_stream(self.actor.named_weights(merge=False), lora_base=True)
            self.based |= fresh
            metrics["perf/update_weights_base_time"] = time.perf_counter() - t0
        return {**metrics, **self._push_stream(self.actor.adapter_weights())}

    def _push_stream(self, weights: Iterator[tuple[str, Any]], lora_base: bool = False) -> dict[str, float]:
        assert self.pusher is not None
        try:
            return self.pusher.push(weights, self.policy_version, lora_base=lora_base)
        except EngineError:
            _read_to_end(weights)  # a sharded trainer's other ranks gather every tensor
            raise

    def version_metrics(self) -> dict[str, float]:
        """Versions after a step: the trainer's, the engines' (behind it between pushes with
        --update-weights-interval > 1), and the pushes so far."""
        return {
            "train/policy_version": self.policy_version,
            "train/weight_version": self.runtime.engine_version,
            "train/weight_pushes": self.weight_pushes,
            **self.runtime.metrics(),
        }

    def after_step(self, step: int, metrics: dict[str, float]) -> None:
        """Eval and checkpoint; their time is logged apart and kept out of step time.

        In async modes generation would go on during a save and shorten the next step's wait
        by time no step was charged for, so the engines are paused in place while saving. Eval
        cannot pause them (it uses the same engines) and overlaps with generation
        (docs/architecture.md)."""
        ev, out = self.cfg.eval, self.cfg.output  # the eval and output components' settings
        last = step == self.num_rollout
        metrics["perf/wall_clock"] = metrics.get("perf/wall_clock", 0.0) + self.wall_clock_offset
        metrics["rollout/skipped_prompts"] = float(self.data_source.skipped_prompts)
        if ev.eval_interval and (step % ev.eval_interval == 0 or last) and not self.cfg.rollout.debug_train_only:
            metrics.update(self.evaluate(step))
        # the step's metrics row and its checkpoint are one record: Ctrl-C or SIGTERM waits until
        # both are written, and the row goes first (a resume from a checkpoint whose row was never
        # written would never log that step; a row whose checkpoint failed is superseded on resume)
        if self.last_save_time is not None:
            metrics["perf/save_time"] = self.last_save_time  # the checkpoint after the step before
            self.last_save_time = None
        with signals_held():
            self.metrics.log(step, metrics)
            if out.save and ((out.save_interval and step % out.save_interval == 0) or last):
                t0 = time.perf_counter()
                overlaps = MODES[self.cfg.mode].overlaps  # the run's mode: generation goes on while it saves
                with self.runtime.generation_paused("in_place") if overlaps else contextlib.nullcontext():
                    extra = {
                        "step": step,
                        "policy_version": self.policy_version,
                        "weight_pushes": self.weight_pushes,
                        "data_source": self.data_source.state_dict(),
                        "wall_clock": metrics["perf/wall_clock"],
                        "loss_type": self.cfg.algorithm.loss_type,  # an RL run refuses to resume an SFT run's checkpoint (preflight)
                    }
                    self.actor.save(Path(out.save) / str(step), extra)
                self.last_save_time = time.perf_counter() - t0
                log.info("checkpoint %s written in %.1f s", Path(out.save) / str(step), self.last_save_time)
        self.metrics.advance(metrics)

    def evaluate(self, step: int) -> dict[str, float]:
        from vime.eval import evaluate, result_line

        # eval/<step>.jsonl, or with several sets eval/<name>/<step>.jsonl
        m = evaluate(self.args, step, lambda name: self.run_dir / "eval" / (name or "") / f"{step}.jsonl")
        self.metrics.write_line(result_line(m, step, self.cfg.eval.eval_sets[0]["name"]))
        return m

    def close(self) -> None:
        """The run's parts, then its metrics (their sinks get every row written before)."""
        self.ctx.close()
        if hasattr(self, "metrics"):
            self.metrics.close()

    def guarded_train_step(
        self, step: int, samples: list[Sample], rewards: torch.Tensor, advantages: torch.Tensor
    ) -> dict[str, float]:
        """actor.train_step, unless a reward or advantage is not finite (then no optimizer step is
        taken); either way counted towards --max-bad-steps (vime/trainer/nonfinite.py)."""
        why = bad_inputs(rewards, advantages)
        if why is None:
            metrics = self.actor.train_step(
                samples,
                advantages if isinstance(advantages, list) else advantages.flatten(),
                len(samples) // self.steps_per_rollout,
            )
            why = f"loss {metrics.get('train/loss')}, gradient norm {metrics.get('train/grad_norm')}"
        else:
            metrics = {"train/skipped_steps": float(self.steps_per_rollout)}
            self.actor.skip_steps(self.steps_per_rollout)  # the lr schedule stays on the policy version
        self.bad_steps.record(step, metrics["train/skipped_steps"], why)
        return metrics


def staleness_metrics(samples: list[Sample], first_version: int, global_batch_size: int) -> dict[str, float]:
    """Staleness of each trained token, in optimizer steps: the policy version of the optimizer
    step that trains it (`first_version` for the rollout's first `global_batch_size` samples,
    one more for each later slice) minus the version that sampled it. 0 = on-policy."""
    lags = [
        first_version + i // global_batch_size - v for i, s in enumerate(samples) for v in (s.weight_versions or [])
    ]
    if not lags:
        return {}
    return {"rollout/staleness_mean": sum(lags) / len(lags), "rollout/staleness_max": float(max(lags))}


def _read_to_end(weights: Iterator[Any]) -> None:
    """A push that broke off stopped reading the trainer's weights part way; a sharded
    trainer's other ranks are still inside the gathers of the rest, where the next call to them
    (a retried push) would never match. Reading the rest brings them back in step."""
    if inspect.isgenerator(weights) and inspect.getgeneratorstate(weights) == inspect.GEN_SUSPENDED:
        for _ in weights:
            pass


def _sample_handlers(ro: Any, own_rollout: bool) -> str:
    """Who to look at for a sample the trainer cannot take: the run's plug-ins that make or touch
    samples, by flag (the rollout component's settings `ro`; `own_rollout`: the rollout function is
    the user's), or vime itself without any."""
    flags = {
        "--rollout-function-path": ro.rollout_function_path if own_rollout else None,
        "--custom-generate-function-path": ro.custom_generate_function_path,
        "--custom-rm-path": ro.custom_rm_path,
        "--custom-reward-post-process-path": ro.custom_reward_post_process_path,
        "--dynamic-sampling-filter-path": ro.dynamic_sampling_filter_path,
    }
    given = [f"{flag} {path}" for flag, path in flags.items() if path]
    if not given:
        return "vime's own rollout made it so (a bug: please report it with the run's config.yaml)"
    return f"a plug-in of this run made or changed it ({', '.join(given)}): samples must keep their tokens, response_length and per-token lists in step"
