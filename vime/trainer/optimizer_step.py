"""One optimizer step of the policy: the forward and backward of its micro-batches into the
gradients (`accumulate`), then clip and step (`run`); and the count of the steps so far, which
indexes the learning-rate schedule.

The loss of each micro-batch is divided by the loss-token count of the whole optimizer step on
all ranks, so gradient accumulation and data parallelism give the gradient of one big batch,
whatever the budget, the sample cap or the rank count. Only the response positions go through
the LM head, in token chunks (`vime.trainer.logprobs`), so no batch × vocabulary logits ever
exist. The optimizer and the schedule are built by `vime.trainer.optim`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import Tensor

from vime.algorithms.objective import Objective
from vime.config import AlgorithmConfig, RolloutConfig, TrainerConfig
from vime.rollout.types import Sample
from vime.trainer.micro_batches import MicroBatches
from vime.trainer.optim import LRSchedule, clip_and_step, make_optimizer, set_lr_and_decay
from vime.trainer.packing import PackedBatch
from vime.trainer.policy import Policy
from vime.trainer.step_loss import Advantages, StepLoss, as_advantages


class OptimizerStep:
    """The policy's optimizer (`optimizer`, fused on CUDA: one kernel for all parameters instead
    of a launch per tensor), its schedule, and the steps it takes."""

    def __init__(
        self,
        trainer: TrainerConfig,
        rollout: RolloutConfig,
        algo: AlgorithmConfig,
        policy: Policy,
        batches: MicroBatches,
        objective: Objective,
    ) -> None:
        self.policy, self.batches, self.objective = policy, batches, objective
        self.ranks = policy.ranks
        self.optimizer = make_optimizer(trainer, policy.model, fused=self.ranks.device.type == "cuda")
        self.schedule = LRSchedule.of(trainer, rollout.num_rollout)
        self.weight_decay, self.clip_grad = trainer.weight_decay, trainer.clip_grad
        self.aux_loss_coeff = trainer.moe_aux_loss_coeff  # a mixture of experts' load-balancing loss
        self.max_response_len = rollout.rollout_max_response_len  # Dr. GRPO's loss divides by it
        # optimizer step slots so far, a skipped one too, as the run's policy version counts them:
        # the index into the lr schedule, kept in checkpoints
        self.count = 0
        self.apply_schedule()
        # coupled PPO (--use-rollout-logprobs): the engine's log-probs are π_old
        self.coupled: bool = algo.use_rollout_logprobs
        self.entropy_grad: bool = algo.entropy_coef != 0  # the entropy carries gradient only when the loss uses it
        # the loss's gradient is taken chunk by chunk inside the head's forward, which saves the
        # head's logits recomputation (`chunked_loss`), unless the loss mixes tokens: a ratio,
        # weight or mask per sequence (GSPO, OPSM, sequence-level TIS or rejection, the veto, a
        # custom hook) needs the whole sequence, which a chunk may cut
        self.grad_in_forward: bool = not objective.per_sequence
        # one rank: reduce-scattering (casting, copying) every layer's gradient after each
        # micro-batch and re-casting its weights for the next buys nothing, since the shard is
        # the whole tensor; so gradients accumulate unsharded (in float32, FSDP's reduce dtype)
        # and are reduced once, after the last micro-batch. With several ranks that would hold
        # a whole unsharded float32 gradient per rank, so they reduce per micro-batch.
        self.defer_grad_sync: bool = self.ranks.sharded and self.ranks.world == 1

    def apply_schedule(self) -> None:
        """The learning rate (and weight decay) of the next optimizer step, `count`."""
        set_lr_and_decay(self.optimizer, self.schedule(self.count), self.weight_decay)

    def skip(self, n: int) -> None:
        """Count `n` step slots that were never run, so the lr schedule stays on the run's policy
        version."""
        self.count += n
        self.apply_schedule()

    def run(
        self, samples: list[Sample], advantages: Advantages, old: list[Tensor] | None, ref: list[Tensor] | None
    ) -> dict[str, float]:
        """One optimizer step on `samples` (every rank holds them all); its metrics, summed over
        ranks. Its slot is counted, and its lr set, whether or not the step is taken."""
        self.policy.scorer.train()
        self.optimizer.zero_grad(set_to_none=True)
        self.apply_schedule()
        self.count += 1
        # the weights this step trains are those of count - 1 steps (counted above)
        totals = self.accumulate(samples, advantages, old, ref, version=self.count - 1)
        if not any(sum(s.effective_loss_mask()) for s in samples):
            # nothing to learn from (e.g. every response aborted): the optimizer's momentum would
            # still move the weights on zero gradients, so skip the step (every rank sees the same batch)
            self.optimizer.zero_grad(set_to_none=True)
            return {
                **self.ranks.read(totals),
                "train/grad_norm": 0.0,
                "train/lr": float(self.optimizer.param_groups[0]["lr"]),
                "train/skipped_steps": 0.0,
            }
        if self.ranks.world == 1:
            # clip and step are queued before the host first waits for the GPU (reading the
            # metrics, the norm), so the host's optimizer work overlaps the backward's last kernels
            step = self.clip_and_step(loss=totals["train/loss"])
            return {**self.ranks.read(totals), **step}
        metrics = self.ranks.read(totals)  # several ranks skip a step together: on the loss summed over them
        return {**metrics, **self.clip_and_step(loss=metrics["train/loss"])}

    def clip_and_step(self, loss: Tensor | float = 0.0) -> dict[str, float]:
        """Clip, then step unless the loss or the gradient norm is not finite (`optim.clip_and_step`)."""
        return clip_and_step(self.policy.model, self.optimizer, self.clip_grad, loss)

    def accumulate(
        self,
        samples: list[Sample],
        advantages: Advantages,
        old_log_probs: list[Tensor] | None,
        ref_log_probs: list[Tensor] | None = None,
        version: int | None = None,
    ) -> dict[str, Tensor]:
        """Forward/backward this rank's micro-batches of one optimizer step into `.grad` (no step).
        `old_log_probs` None: the weights have not moved since the rollout's first step, so the
        forward's own detached log-probs are the old ones (see `Actor.train_step`); with
        --use-rollout-logprobs the engine's are.

        Each micro-batch's loss is divided by the step's loss-token count over all ranks (or
        the Dr.GRPO constant), so the accumulated gradient is that of the step's true token
        mean. FSDP averages gradients over ranks; the backward is scaled by the world size to
        turn that average into the sum the global normalizer calls for. Metrics are summed over
        ranks for the same reason. Returns this rank's metric sums, on the device.

        The same constant denominators make the loss a plain sum over tokens, so with
        `grad_in_forward` the head computes it chunk by chunk (`StepLoss.chunk_loss`) and
        takes its gradient there (`chunked_loss`); otherwise over the whole micro-batch after
        the head. `version`: the policy version being trained, for the staleness split of the
        metrics (`step_metrics.stale_bucket_metrics`); None leaves it out.
        """
        step = StepLoss(
            self.objective,
            samples,
            as_advantages(samples, advantages),
            old_log_probs,
            ref_log_probs,
            version,
            self.ranks.device,
            self.max_response_len,
            coupled=self.coupled,
        )
        scorer, world = self.policy.scorer, self.ranks.world
        temperature = self.batches.temperature_of(samples)
        plan = self.batches.plan(samples)
        tokens = sum(len(s.tokens) for s in samples)
        with self._routed():
            for i, idx in enumerate(plan):
                # packed while the GPU runs the previous micro-batch's backward: a long queue of
                # kernels, where the short gap between a forward and its backward would idle it
                mb = self.batches.pack(samples, idx)
                if self.defer_grad_sync:
                    last = i == len(plan) - 1  # set at every micro-batch: a step that raised leaves nothing to undo
                    scorer.set_requires_gradient_sync(last)
                    scorer.set_reshard_after_backward(last)
                if self.policy.routing is not None:  # the balance loss's share: the micro-batch's tokens
                    share = sum(len(samples[j].tokens) for j in idx) / tokens
                    self.policy.routing.balance(share, self.aux_loss_coeff * share * world)
                # the backward is scaled by the world size (see above)
                if self.grad_in_forward:
                    scaled_loss = scorer(mb, temperature, True, step.chunk_loss(mb, world))
                else:
                    log_probs, entropy = self.forward(mb, temperature)
                    scaled_loss = step(log_probs, entropy, step.inputs(mb)) * world
                scaled_loss.backward()
        return step.totals

    @contextlib.contextmanager
    def _routed(self) -> Iterator[None]:
        """A mixture of experts' training forwards: they count the routing mismatch where they do
        not replay, and add the balance loss (set per micro-batch), which ends with them."""
        routing = self.policy.routing
        if routing is None:
            yield
            return
        with routing.measuring():
            try:
                yield
            finally:
                routing.balance(0.0, 0.0)

    def forward(self, mb: PackedBatch, temperature: float) -> tuple[Tensor, Tensor]:
        """The training forward of a micro-batch: log-probs and entropies of its response
        tokens, flat in sample order (what the loss reads when it is taken after the head)."""
        log_probs, entropy = self.policy.scorer(mb, temperature, True)
        if not self.entropy_grad:
            entropy = entropy.detach()
        return log_probs, entropy
