"""The trainer of one run: the policy, its optimizer steps, and what a run asks of them
(`train_step`, `compute_log_probs`, the weights, checkpoints).

Runs as one process or as one rank of many (FSDP2, `vime.trainer.distributed` launches them and
calls the same methods on every rank). The actor builds its parts and tells the story of a
rollout's training; each part is a file of its own:

* `Ranks` (ranks.py): this process's device and place among the ranks;
* `Policy` (policy.py): the model, its LoRA adapters, compile and FSDP2 wrapping, and the frozen
  reference and teacher; its weights as they leave the trainer (weights.py);
* `MicroBatches` (micro_batches.py): a step's samples split over the ranks and packed;
* `OptimizerStep` (optimizer_step.py): one optimizer step's forward and backward, clip and step,
  and the step count the lr schedule reads; its loss a micro-batch at a time (step_loss.py);
* `CompileWarmUp` (warm_up.py): the compile of every micro-batch size, beside the start-up;
* checkpoints (checkpoint.py), the metrics of a step (step_metrics.py).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from vime.algorithms import opd
from vime.algorithms.objective import Objective
from vime.config import AlgorithmConfig, Config, TrainerConfig
from vime.models import load_tokenizer
from vime.rollout.types import Sample
from vime.trainer import checkpoint, weights
from vime.trainer.micro_batches import MicroBatches
from vime.trainer.optimizer_step import OptimizerStep
from vime.trainer.perf import mfu, train_flops
from vime.trainer.policy import Policy
from vime.trainer.ranks import Ranks
from vime.trainer.routing import routing_metrics
from vime.trainer.step_loss import Advantages, as_advantages
from vime.trainer.step_metrics import merge_steps
from vime.trainer.teacher import teacher_dir
from vime.trainer.warm_up import CompileWarmUp


class Actor:
    """Policy model + optimizer (+ frozen reference model when `kl_loss_coef > 0`: `--ref-load`,
    else the policy's own starting weights; + the frozen OPD teacher with `--use-opd`).

    `fsdp=True` shards both over the default process group (which must exist), with bf16
    compute and float32 master weights on CUDA; `fsdp=False` is a plain single-device model.

    It reads its settings from the run's sub-configs (`cfg.trainer`, `cfg.algorithm`); the flat
    `args` is kept only for the custom loss and TIS hooks, which slime calls with it.
    """

    def __init__(
        self,
        args: Config,
        model_path: str | Path,
        device: str = "cpu",
        fsdp: bool = False,
        cpu_group: Any = None,
        tokenizer: Any = None,
    ) -> None:
        self.args = args
        trainer = self.settings
        self.algo: AlgorithmConfig = args.algorithm  # fixed for the run: none of it is set after validation
        self.ranks = Ranks.of(device, fsdp, cpu_group)
        self.policy = Policy(trainer, model_path, self.ranks, self.algo.use_rollout_routing_replay)
        # the run's tokenizer on rank 0; other ranks load their own
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(model_path)
        compiled, temperature = self.policy.compiled, args.rollout.rollout_temperature
        self.batches = MicroBatches.of(
            trainer, self.ranks, self.model.config, self.tokenizer, compiled, temperature, self.policy.moe
        )
        self.objective = Objective.of(args)  # the loss of a micro-batch's tokens; its hooks get args
        self.optimizer_step = OptimizerStep(trainer, args.rollout, self.algo, self.policy, self.batches, self.objective)
        self.ref_scorer = self.policy.frozen(self.algo.ref_load or model_path) if self.algo.kl_loss_coef > 0 else None
        # --use-opd --opd-type megatron: the frozen teacher that scores the trained tokens (trainer/teacher.py;
        # its term: algorithms/opd.py); a served teacher (sglang) scored them in the rollout
        self.teacher_scorer = self.policy.frozen(teacher_dir(self.algo)) if self.algo.teacher_in_trainer else None
        # compiled: every padded size, on a thread of its own when this is the only rank (warm_up.py)
        self.warm_up = (
            CompileWarmUp(self.optimizer_step, background=self.ranks.world == 1, scoring=self.scores_the_policy())
            if self.policy.compiled
            else None
        )

    @property
    def settings(self) -> TrainerConfig:
        """The trainer's settings, read from the run's config as it is now (built on access)."""
        return self.args.trainer

    @property
    def base_model(self) -> str | None:
        """--hf-checkpoint as given: the base a saved LoRA adapter names."""
        return self.args.rollout.hf_checkpoint

    @property
    def model(self) -> nn.Module:
        """The HF model being trained (the policy's)."""
        return self.policy.model

    def scores_the_policy(self) -> bool:
        """Whether a run's `train_step` runs the policy's scoring forward (`compute_log_probs`):
        to recompute π_old when a rollout makes several optimizer steps (the run passes one step's
        samples as `step_size`), or for OPD's student log-probs an engine did not send. Default
        GRPO does neither, so its warm-up leaves that graph out. The frozen reference and
        teacher are not compiled."""
        return self._recomputes(self.settings.steps_per_rollout > 1) or self.algo.use_opd

    def _recomputes(self, several_steps: bool) -> bool:
        """Whether π_old is scored anew: with several optimizer steps per rollout, unless the
        engine's log-probs are π_old (coupled PPO) or the loss reads none (SFT)."""
        return several_steps and not self.algo.use_rollout_logprobs and not self.objective.sft

    def ready(self, scoring: bool = False) -> None:
        """Block until the compile warm-up is done (every use of the model does this first;
        `scoring`: a scoring forward follows)."""
        if self.warm_up is not None:
            self.warm_up.wait(scoring)

    @property
    def compiling(self) -> bool:
        """The warm-up is still compiling on its thread."""
        return self.warm_up is not None and self.warm_up.running

    # ---- scoring ---------------------------------------------------------------------

    @torch.no_grad()
    def compute_log_probs(self, samples: list[Sample], scorer: nn.Module | None = None) -> list[Tensor]:
        """Per-sample log-probs of the response tokens under `scorer` (default: the policy), on
        every rank, at the temperature the responses were drawn at (`MicroBatches.temperature_of`)."""
        self.ready(scoring=scorer is None)
        scorer = self.policy.scorer if scorer is None else scorer
        world = self.ranks.world
        was_training = scorer.training
        scorer.eval()
        mine: dict[int, Tensor] = {}
        temperature = self.batches.temperature_of(samples)
        try:
            for idx in self.batches.plan(samples):
                mb = self.batches.pack(samples, idx)
                flat, _ = scorer(mb, temperature, False)
                for i, part in zip(mb.indices, flat.split(mb.response_lengths)):
                    mine[i] = part.cpu() if world > 1 else part
        finally:
            scorer.train(was_training)
        if world > 1:
            gathered = self.ranks.gather(mine)
            return [gathered[i].to(self.ranks.device) for i in range(len(samples))]
        return [mine[i] for i in range(len(samples))]

    # ---- training --------------------------------------------------------------------

    def train_step(
        self, samples: list[Sample], advantages: Advantages, step_size: int | None = None
    ) -> dict[str, float]:
        """Train on one rollout: `len(samples) // global_batch_size` optimizer steps, or of
        `step_size` samples each when given (a rollout whose generate returned several samples
        per prompt keeps its number of steps: vime/algorithms/credit.py).

        Old log-probs are those of the current weights (the proximal policy), or with
        --use-rollout-logprobs the engine's. With several optimizer steps the proximal ones are
        recomputed once, before the first step, because later steps of the same rollout are
        off-policy by the earlier ones and the clip applies. With one step (the usual GRPO
        setting: --global-batch-size = all samples) they would equal the training forward's own
        log-probs, so that forward's detached values serve and the recompute pass is skipped:
        the same loss and gradient, a whole forward less. Returns metrics
        averaged over the steps, plus throughput (`perf/actor_train_tok_per_s`, and on CUDA
        `perf/mfu`).
        """
        self.ready()
        advantages = as_advantages(samples, advantages)
        gbs = step_size or self.settings.global_batch_size or len(samples)
        if gbs < 1 or len(samples) % gbs != 0:
            raise ValueError(f"{len(samples)} samples do not split into optimizer steps of --global-batch-size {gbs}")
        self.ranks.sync()
        t0 = time.perf_counter()
        other_gap = self._routing_gap(samples)
        old = self.compute_log_probs(samples) if self._recomputes(gbs != len(samples)) else None
        ref = self.compute_log_probs(samples, scorer=self.ref_scorer) if self.ref_scorer is not None else None
        distilled: dict[str, float] = {}
        if self.algo.use_opd:
            advantages, distilled = self.distill(samples, advantages)
        steps = []
        for start in range(0, len(samples), gbs):
            sl = slice(start, start + gbs)
            steps.append(
                self.optimizer_step.run(
                    samples[sl], advantages[sl], None if old is None else old[sl], None if ref is None else ref[sl]
                )
            )
        self.ranks.sync()
        elapsed = time.perf_counter() - t0
        metrics = merge_steps(steps, samples, self.optimizer_step.count - len(steps), gbs)
        metrics.update(distilled)
        if self.policy.routing is not None:
            sums, replay = self.ranks.sum(self.policy.routing.take()), self.policy.routing.replay
            trained_gap = metrics.get("train/train_rollout_logprob_abs_diff")
            metrics.update(routing_metrics(sums, replay, trained_gap, other_gap, len(steps)))
        forwards = (old is not None) + (ref is not None) + (self.teacher_scorer is not None)
        metrics.update(self._throughput(samples, elapsed, forwards))
        return metrics

    def _routing_gap(self, samples: list[Sample]) -> float | None:
        """A mixture of experts: the engine/trainer log-prob gap under the routing training does not
        use (without replay when R3 is on, with the engine's when it is only recorded), by one
        scoring forward at the weights the step starts from, which also counts the mismatch when
        it does not replay; None without the engine's routing. R3 with a sample that carries none
        is refused: it would train unreplayed unsaid."""
        routing = self.policy.routing
        if routing is None:
            return None
        routing.take()  # the step's sums start at zero
        missing = sum(s.response_length > 0 and s.rollout_routed_experts is None for s in samples)
        if routing.replay and missing:
            raise ValueError(
                f"--use-rollout-routing-replay: {missing} of the step's {len(samples)} samples carry no routed experts "
                "(Sample.rollout_routed_experts): a custom generate must ask the engine for them "
                "(return_routed_experts) and pass its meta_info to sample.append_response_tokens"
            )
        if missing == len(samples):
            return None
        with routing.replaying(not routing.replay), routing.measuring():
            log_probs = self.compute_log_probs(samples)
        total = count = 0.0
        for s, lp in zip(samples, log_probs):
            if s.rollout_log_probs is not None:
                mask = torch.tensor(s.effective_loss_mask(), dtype=torch.float32)
                gap = (lp.float().cpu() - torch.tensor(s.rollout_log_probs, dtype=torch.float32)).abs()
                total, count = total + float((gap * mask).sum()), count + float(mask.sum())
        return total / count if count else None

    def _throughput(self, samples: list[Sample], elapsed: float, forwards: int) -> dict[str, float]:
        """Tokens trained a second, and on CUDA the model FLOPs utilization (the scoring forwards
        of the step counted)."""
        lengths = [len(s.tokens) for s in samples]
        out = {"perf/actor_train_tok_per_s": sum(lengths) / elapsed}
        if self.ranks.device.type == "cuda":
            flops = train_flops(
                self.model.config,
                lengths,
                [s.response_length for s in samples],
                forwards=forwards,
                frozen=self.policy.lora is not None,
            )
            out["perf/mfu"] = mfu(flops, elapsed, self.ranks.world)
        return out

    def distill(
        self, samples: list[Sample], advantages: Tensor | list[Tensor]
    ) -> tuple[list[Tensor], dict[str, float]]:
        """--use-opd: the teacher's log-probs of the step's tokens (megatron: computed now; sglang:
        the served teacher's, stored on the samples), and the advantages with the reverse-KL term
        (`opd.distill_advantages`). The student's are the rollout's; a sample the engine sent
        none for is scored by the current policy."""
        if self.teacher_scorer is not None:
            teacher: list[Tensor | None] = list(self.compute_log_probs(samples, scorer=self.teacher_scorer))
        else:
            teacher = opd.served_log_probs(samples)
        missing = [i for i, s in enumerate(samples) if s.rollout_log_probs is None]
        policy: list[Tensor | None] = [None] * len(samples)
        for i, lp in zip(missing, self.compute_log_probs([samples[i] for i in missing]) if missing else []):
            policy[i] = lp.cpu()
        student = opd.student_log_probs(samples, policy)
        masks = [torch.tensor(s.effective_loss_mask(), dtype=torch.float32) for s in samples]
        return opd.distill_advantages(advantages, student, teacher, masks, self.algo.opd_kl_coef)

    def accumulate_gradients(
        self,
        samples: list[Sample],
        advantages: Advantages,
        old_log_probs: list[Tensor] | None,
        ref_log_probs: list[Tensor] | None = None,
    ) -> dict[str, float]:
        """One optimizer step's gradients, no step (`OptimizerStep.accumulate`), its metrics read
        (summed over ranks)."""
        self.ready()
        return self.ranks.read(self.optimizer_step.accumulate(samples, advantages, old_log_probs, ref_log_probs))

    def skip_steps(self, n: int) -> None:
        """Count `n` optimizer step slots that were never run (the run skips a rollout whose rewards
        or advantages are not finite without calling `train_step`), so the lr schedule stays on
        the run's policy version."""
        self.optimizer_step.skip(n)

    # ---- weights and checkpoints -----------------------------------------------------

    def named_weights(self, merge: bool = True) -> Iterator[tuple[str, Tensor]]:
        """The policy's weights under their HF names, LoRA merged unless `merge=False`
        (`weights.named_weights`); every rank iterates to the end, rank 0 receives them."""
        self.ready()
        yield from weights.named_weights(self.policy, merge)

    def adapter_weights(self) -> Iterator[tuple[str, Tensor]]:
        """LoRA: the adapters as a push sends them (`weights.adapter_weights`)."""
        self.ready()
        yield from weights.adapter_weights(self.policy)

    def save(self, ckpt_dir: str | Path, extra_state: dict[str, Any]) -> Path:
        """Write a checkpoint (every rank calls; `vime.trainer.checkpoint.save`)."""
        self.ready()
        return checkpoint.save(self, Path(ckpt_dir), extra_state)

    def load(self, ckpt_dir: str | Path) -> dict[str, Any]:
        """Restore a checkpoint; returns its extra state (`vime.trainer.checkpoint.load`)."""
        self.ready()
        return checkpoint.load(self, Path(ckpt_dir))

    def close(self) -> None:
        """Stop a warm-up still compiling (a run that ends before step 1: the process group must not
        be torn down under a compile) and drop it. `DistributedActor.close` calls it."""
        if self.warm_up is not None:
            self.warm_up.cancel()
            self.warm_up = None
