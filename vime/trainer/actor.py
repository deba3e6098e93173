"""The policy being trained: an HF causal LM, its optimizer, log-probs and steps (the optimizer
and learning-rate schedule are built by `vime.trainer.optim`; checkpoints are written and read
by `vime.trainer.checkpoint`).

Runs as one process or as one rank of many (FSDP2, `vime.trainer.distributed` launches them).
Every rank receives the whole batch and derives, without talking to the others, the same split:
samples go to ranks balanced by tokens, each rank packs its share into micro-batches of at most
`--max-tokens-per-gpu` real tokens and `--micro-batch-size` samples (padded only when compiled,
see `_pack`), and ranks with fewer micro-batches run empty ones so the FSDP collectives stay in
step. The loss of each micro-batch is divided by the loss-token count of the whole optimizer step
on all ranks, so gradient accumulation and data parallelism give the gradient of one big batch,
whatever the budget, the sample cap or the rank count. Only the response positions go through
the LM head, in token chunks (`vime.trainer.logprobs`), so no batch × vocabulary logits ever
exist. The pieces live beside it: the model and its wrapping (`vime.trainer.model`), one
step's loss a micro-batch at a time (`vime.trainer.step_loss`), its metrics
(`vime.trainer.step_metrics`).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from vime.algorithms import opd
from vime.algorithms.objective import Objective
from vime.config import AlgorithmConfig, Config, ConfigError, TrainerConfig
from vime.models import load_tokenizer
from vime.rollout.types import Sample
from vime.trainer import checkpoint
from vime.trainer.lora import LoraSpec, add_adapters
from vime.trainer.model import TokenScorer, checkpoint_layers, length_limits, load_model, wrap
from vime.trainer.optim import LRSchedule, clip_and_step, make_optimizer, set_lr_and_decay
from vime.trainer.packing import PAD_BUCKETS, PackedBatch, pack, plan_packed_micro_batches, shard_by_tokens
from vime.trainer.perf import mfu, train_flops
from vime.trainer.step_loss import Advantages, StepLoss, as_advantages
from vime.trainer.step_metrics import merge_steps
from vime.trainer.teacher import teacher_dir
from vime.trainer.warm_up import CompileWarmUp
from vime.trainer.weights import WeightExport

log = logging.getLogger("vime")


class Actor(WeightExport):
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
        self.cpu_group = cpu_group  # gloo group for Python objects and metrics (the default one on CPU)
        self.device = torch.device(device)
        self.fsdp = fsdp
        self.rank, self.world = (dist.get_rank(), dist.get_world_size()) if fsdp else (0, 1)
        self.model = load_model(model_path, self.device, trainer.attention_kernel)
        # LoRA: the base frozen, adapters on the target layers (vime/trainer/lora.py); what leaves
        # the trainer (pushes, checkpoints' safetensors) is the merged weight under the HF name
        self.lora = LoraSpec.of(trainer)
        self.lora_modules: set[str] = set()
        if self.lora is not None:
            try:
                self.lora_modules = set(add_adapters(self.model, self.lora, trainer.seed))
            except ValueError as e:
                raise ConfigError(str(e)) from None
        if trainer.gradient_checkpointing:
            checkpoint_layers(self.model, trainer.gradient_checkpointing_layers)
        all_names = {n for n, _ in self.model.named_parameters(remove_duplicate=False)}
        param_names = {n for n, _ in self.model.named_parameters()}
        self.tied_aliases = all_names - param_names  # tied names, e.g. lm_head.weight
        # what a checkpoint holds besides parameters (none in Llama/Qwen: their rotary tables are not persistent)
        self._buffers = [n for n in self.model.state_dict() if n not in all_names]
        # one rank: reduce-scattering (casting, copying) every layer's gradient after each
        # micro-batch and re-casting its weights for the next buys nothing, since the shard is
        # the whole tensor; so gradients accumulate unsharded (in float32, FSDP's reduce dtype)
        # and are reduced once, after the last micro-batch. With several ranks that would hold
        # a whole unsharded float32 gradient per rank, so they reduce per micro-batch.
        self.defer_grad_sync: bool = fsdp and self.world == 1
        self.compiled: bool = trainer.compile if trainer.compile is not None else self.device.type == "cuda"
        if self.compiled:
            # per layer, before FSDP wraps them (as torchtitan does): the layers share one code
            # object, so one compile serves all of them, and packed lengths vary: dynamic shapes
            for layer in self.model.get_decoder().layers:
                layer.compile(dynamic=True)
        self.scorer = self._wrap(TokenScorer(self.model, trainer.logprob_chunk_size))
        # the run's tokenizer on rank 0; other ranks load their own
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(model_path)
        pad = self.tokenizer.pad_token_id
        self.pad_token_id: int = pad if pad is not None else (self.tokenizer.eos_token_id or 0)
        # fused on CUDA: one kernel for all parameters instead of a launch per tensor
        self.optimizer = make_optimizer(trainer, self.model, fused=self.device.type == "cuda")
        self.lr_schedule = LRSchedule.of(trainer)
        # optimizer step slots so far, a skipped one too, as the run's policy version counts them:
        # the index into the lr schedule, kept in checkpoints
        self.optimizer_steps = 0
        self.apply_schedule()
        self.objective = Objective.of(args)  # the loss of a micro-batch's tokens; its hooks get args
        # the loss's gradient is taken chunk by chunk inside the head's forward, which saves the
        # head's logits recomputation (`chunked_loss`), unless the loss mixes tokens: a ratio,
        # weight or mask per sequence (GSPO, OPSM, sequence-level TIS or rejection, the veto, a
        # custom hook) needs the whole sequence, which a chunk may cut
        self.grad_in_forward: bool = not self.objective.per_sequence
        # coupled PPO: the engine's log-probs are π_old, so nothing is recomputed
        self.use_rollout_logprobs: bool = self.algo.use_rollout_logprobs
        self.ref_scorer = self._frozen(self.algo.ref_load or model_path) if self.algo.kl_loss_coef > 0 else None
        # --use-opd --opd-type megatron: the frozen teacher that scores the trained tokens (trainer/teacher.py;
        # its term: algorithms/opd.py); a served teacher (sglang) scored them in the rollout
        self.teacher_scorer = self._frozen(teacher_dir(self.algo)) if self.algo.teacher_in_trainer else None
        self._bucket = -(-trainer.max_tokens_per_gpu // PAD_BUCKETS)
        self._warned_oversize = False
        # compiled: every padded size, on a thread of its own when this is the only rank (warm_up.py)
        self._warm_up = (
            CompileWarmUp(self, background=self.world == 1, scoring=self._scores_the_policy())
            if self.compiled
            else None
        )

    def _scores_the_policy(self) -> bool:
        """Whether a run's `train_step` runs the policy's scoring forward (`compute_log_probs`):
        to recompute π_old when a rollout makes several optimizer steps (the run passes one step's
        samples as `step_size`), or for OPD's student log-probs an engine did not send. Default
        GRPO does neither, so its warm-up leaves that graph out. The frozen reference and
        teacher are not compiled."""
        recompute = self.settings.steps_per_rollout > 1 and not self.use_rollout_logprobs and not self.objective.sft
        return recompute or self.algo.use_opd

    def ready(self, scoring: bool = False) -> None:
        """Block until the compile warm-up is done (every use of the model does this first;
        `scoring`: a scoring forward follows)."""
        if self._warm_up is not None:
            self._warm_up.wait(scoring)

    @property
    def compiling(self) -> bool:
        """The warm-up is still compiling on its thread."""
        return self._warm_up is not None and self._warm_up.running

    @property
    def settings(self) -> TrainerConfig:
        """The trainer's settings, read from the run's config as it is now (built on access)."""
        return self.args.trainer

    def _frozen(self, model_path: str | Path) -> nn.Module:
        """A frozen model's scorer (the KL's reference, the OPD teacher), wrapped as the policy's."""
        model = load_model(model_path, self.device, self.settings.attention_kernel, trained=False)
        model.requires_grad_(False)
        model.eval()
        return self._wrap(TokenScorer(model, self.settings.logprob_chunk_size))

    def _wrap(self, scorer: TokenScorer) -> nn.Module:
        return wrap(scorer, self.device, self.world) if self.fsdp else scorer

    # ---- forward ---------------------------------------------------------------------

    def _plan(self, samples: list[Sample]) -> list[list[int]]:
        """This rank's micro-batches as indices into `samples`. Every rank gets the same number
        (padding with empty ones), so FSDP's collectives pair up."""
        lengths = [len(s.tokens) for s in samples]
        settings = self.settings
        budget = settings.max_tokens_per_gpu
        if self.compiled and max(lengths, default=0) > budget and not self._warned_oversize:
            self._warned_oversize = True
            log.warning(
                "a %d-token sequence is longer than --max-tokens-per-gpu %d: its micro-batch may compile once more "
                "mid-run; raise the budget above prompt + response length",
                max(lengths),
                budget,
            )
        shards = shard_by_tokens(lengths, self.world)
        limits = (settings.micro_batch_size, length_limits(self.model.config, max(lengths, default=0)))
        plans = [
            [[shard[j] for j in mb] for mb in plan_packed_micro_batches([lengths[i] for i in shard], budget, *limits)]
            for shard in shards
        ]
        mine = plans[self.rank]
        return mine + [[] for _ in range(max(len(p) for p in plans) - len(mine))]

    def _pack(self, samples: list[Sample], idx: list[int]) -> PackedBatch:
        """One micro-batch on the device. Compiled layers get its length rounded up to one of
        `PAD_BUCKETS` sizes, all of which the warm-up compiled: each other token count risks a
        compile of its own mid-run (inductor guards ranges of it, e.g. T >= 5120; bench/RESULTS.md,
        issue 16). A sequence longer than the budget gets a micro-batch of its own, of a size the
        warm-up did not see (`_plan` warns once). An empty micro-batch is one dummy sequence that
        nothing scores."""
        pad_to = self._bucket if self.compiled else None
        if not idx:
            return pack([[self.pad_token_id] * 2], [1], [], self.device, pad_to, self.pad_token_id)
        return pack(
            [samples[i].tokens for i in idx],
            [samples[i].response_length for i in idx],
            idx,
            self.device,
            pad_to,
            self.pad_token_id,
        )

    def _forward(
        self, scorer: nn.Module, mb: PackedBatch, with_entropy: bool, temperature: float | None = None
    ) -> tuple[Tensor, Tensor | None]:
        """Log-probs (and entropies) of a micro-batch's response tokens, flat in sample order.

        Scored at the temperature the responses were drawn at (`temperature_of`; the warm-up
        uses --rollout-temperature), so trainer and engine score the same distribution
        (top-p/top-k truncation is not reproduced). The entropy carries gradient only when the
        loss uses it.
        """
        temperature = self.settings.rollout_temperature if temperature is None else temperature
        if not with_entropy:
            return scorer(mb, temperature, False)
        log_probs, entropy = scorer(mb, temperature, True)
        if self.algo.entropy_coef == 0:
            entropy = entropy.detach()
        return log_probs, entropy

    @torch.no_grad()
    def compute_log_probs(self, samples: list[Sample], scorer: nn.Module | None = None) -> list[Tensor]:
        """Per-sample log-probs of the response tokens under `scorer` (default: the policy), on
        every rank."""
        self.ready(scoring=scorer is None)
        scorer = self.scorer if scorer is None else scorer
        was_training = scorer.training
        scorer.eval()
        mine: dict[int, Tensor] = {}
        temperature = self.temperature_of(samples)
        try:
            for idx in self._plan(samples):
                mb = self._pack(samples, idx)
                flat, _ = self._forward(scorer, mb, with_entropy=False, temperature=temperature)
                for i, part in zip(mb.indices, flat.split(mb.response_lengths)):
                    mine[i] = part.cpu() if self.world > 1 else part
        finally:
            scorer.train(was_training)
        if self.world > 1:
            gathered: list[dict[int, Tensor]] = [{} for _ in range(self.world)]
            dist.all_gather_object(gathered, mine, group=self.cpu_group)
            for part in gathered:
                mine.update(part)
            return [mine[i].to(self.device) for i in range(len(samples))]
        return [mine[i] for i in range(len(samples))]

    def temperature_of(self, samples: list[Sample]) -> float:
        """The temperature a step's responses were drawn at: what the generate that drew each
        stamped on it (`Sample.temperature`), or --rollout-temperature for a sample nothing
        stamped (a custom generate function of slime's signature). One step is scored at one."""
        default = self.settings.rollout_temperature
        drawn = {
            default if s.temperature is None else s.temperature
            for s in samples
            if s.response_length  # a sample with nothing drawn scores nothing
        }
        if len(drawn) > 1:
            raise ConfigError(
                f"one step's samples were drawn at temperatures {sorted(drawn)}, and the trainer scores a step at one: "
                "generate a rollout at a single temperature"
            )
        return drawn.pop() if drawn else default

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
        self._sync()
        t0 = time.perf_counter()
        # the SFT loss reads no old log-probs: nothing to recompute
        recompute = gbs != len(samples) and not self.use_rollout_logprobs and not self.objective.sft
        old = self.compute_log_probs(samples) if recompute else None
        ref = self.compute_log_probs(samples, scorer=self.ref_scorer) if self.ref_scorer is not None else None
        distilled: dict[str, float] = {}
        if self.algo.use_opd:
            advantages, distilled = self._distill(samples, advantages)
        steps = []
        for start in range(0, len(samples), gbs):
            sl = slice(start, start + gbs)
            steps.append(
                self._optimizer_step(
                    samples[sl], advantages[sl], None if old is None else old[sl], None if ref is None else ref[sl]
                )
            )
        self._sync()
        elapsed = time.perf_counter() - t0
        metrics = merge_steps(steps, samples, self.optimizer_steps - len(steps), gbs)
        metrics.update(distilled)
        lengths = [len(s.tokens) for s in samples]
        metrics["perf/actor_train_tok_per_s"] = sum(lengths) / elapsed
        if self.device.type == "cuda":
            flops = train_flops(
                self.model.config,
                lengths,
                [s.response_length for s in samples],
                forwards=(old is not None) + (ref is not None) + (self.teacher_scorer is not None),
                frozen=self.lora is not None,
            )
            metrics["perf/mfu"] = mfu(flops, elapsed, self.world)
        return metrics

    def _distill(
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

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _optimizer_step(
        self, samples: list[Sample], advantages: Advantages, old: list[Tensor] | None, ref: list[Tensor] | None
    ) -> dict[str, float]:
        self.scorer.train()
        self.optimizer.zero_grad(set_to_none=True)
        self.apply_schedule()  # this slot's lr, counted whether or not the step is taken
        self.optimizer_steps += 1
        # the weights this step trains are those of optimizer_steps - 1 steps (counted above)
        totals = self._accumulate(samples, advantages, old, ref, version=self.optimizer_steps - 1)
        if not any(sum(s.effective_loss_mask()) for s in samples):
            # nothing to learn from (e.g. every response aborted): the optimizer's momentum would
            # still move the weights on zero gradients, so skip the step (every rank sees the same batch)
            self.optimizer.zero_grad(set_to_none=True)
            return {
                **self._read(totals),
                "train/grad_norm": 0.0,
                "train/lr": float(self.optimizer.param_groups[0]["lr"]),
                "train/skipped_steps": 0.0,
            }
        if self.world == 1:
            # clip and step are queued before the host first waits for the GPU (reading the
            # metrics, the norm), so the host's optimizer work overlaps the backward's last kernels
            step = self._clip_and_step(loss=totals["train/loss"])
            return {**self._read(totals), **step}
        metrics = self._read(totals)  # several ranks skip a step together: on the loss summed over them
        return {**metrics, **self._clip_and_step(loss=metrics["train/loss"])}

    def apply_schedule(self) -> None:
        """The learning rate (and weight decay) of the next optimizer step, `optimizer_steps`."""
        set_lr_and_decay(self.optimizer, self.lr_schedule(self.optimizer_steps), self.settings.weight_decay)

    def skip_steps(self, n: int) -> None:
        """Count `n` optimizer step slots that were never run (the run skips a rollout whose rewards
        or advantages are not finite without calling `train_step`), so the lr schedule stays on
        the run's policy version."""
        self.optimizer_steps += n
        self.apply_schedule()

    def accumulate_gradients(
        self,
        samples: list[Sample],
        advantages: Advantages,
        old_log_probs: list[Tensor] | None,
        ref_log_probs: list[Tensor] | None = None,
    ) -> dict[str, float]:
        """`_accumulate`, its metrics read (summed over ranks)."""
        self.ready()
        return self._read(self._accumulate(samples, advantages, old_log_probs, ref_log_probs))

    def _accumulate(
        self,
        samples: list[Sample],
        advantages: Advantages,
        old_log_probs: list[Tensor] | None,
        ref_log_probs: list[Tensor] | None = None,
        version: int | None = None,
    ) -> dict[str, Tensor]:
        """Forward/backward this rank's micro-batches of one optimizer step into `.grad` (no step).
        `old_log_probs` None: the weights have not moved since the rollout's first step, so the
        forward's own detached log-probs are the old ones (see `train_step`); with
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
            self.device,
            self.settings.rollout_max_response_len,
            coupled=self.use_rollout_logprobs,
        )
        temperature = self.temperature_of(samples)
        plan = self._plan(samples)
        for i, idx in enumerate(plan):
            # packed while the GPU runs the previous micro-batch's backward: a long queue of
            # kernels, where the short gap between a forward and its backward would idle it
            mb = self._pack(samples, idx)
            if self.defer_grad_sync:
                last = i == len(plan) - 1  # set at every micro-batch: a step that raised leaves nothing to undo
                self.scorer.set_requires_gradient_sync(last)
                self.scorer.set_reshard_after_backward(last)
            # the backward is scaled by the world size (see above)
            if self.grad_in_forward:
                scaled_loss = self.scorer(mb, temperature, True, step.chunk_loss(mb, self.world))
            else:
                log_probs, entropy = self._forward(self.scorer, mb, with_entropy=True, temperature=temperature)
                assert entropy is not None
                scaled_loss = step(log_probs, entropy, step.inputs(mb)) * self.world
            scaled_loss.backward()
        return step.totals

    def _read(self, totals: dict[str, Tensor]) -> dict[str, float]:
        """Metric sums from the device, summed over ranks: one wait for the GPU for all of them."""
        keys = sorted(totals)
        values = torch.stack([totals[k] for k in keys]).tolist() if keys else []
        return self._sum_over_ranks(dict(zip(keys, values)))

    def _sum_over_ranks(self, values: dict[str, float]) -> dict[str, float]:
        if self.world == 1:
            return values
        keys = sorted(values)
        t = torch.tensor([values[k] for k in keys], dtype=torch.float64)
        dist.all_reduce(t, group=self.cpu_group)
        return dict(zip(keys, t.tolist()))

    def _clip_and_step(self, loss: Tensor | float = 0.0) -> dict[str, float]:
        """Clip, then step unless the loss or the gradient norm is not finite (`optim.clip_and_step`)."""
        return clip_and_step(self.model, self.optimizer, self.settings.clip_grad, loss)

    # ---- checkpoints (the weights as they leave the trainer: vime/trainer/weights.py) ------

    def save(self, ckpt_dir: str | Path, extra_state: dict[str, Any]) -> Path:
        """Write a checkpoint (every rank calls; `vime.trainer.checkpoint.save`)."""
        self.ready()
        return checkpoint.save(self, Path(ckpt_dir), extra_state)

    def load(self, ckpt_dir: str | Path) -> dict[str, Any]:
        """Restore a checkpoint; returns its extra state (`vime.trainer.checkpoint.load`)."""
        self.ready()
        return checkpoint.load(self, Path(ckpt_dir))

    def close(self) -> None:
        """Stop a warm-up still compiling (a run that ends before step 1) and drop it: it holds this
        Actor, whose GPU memory would wait for a cycle collection. `DistributedActor.close` calls it."""
        if self._warm_up is not None:
            self._warm_up.cancel()
            self._warm_up = None
