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
exist.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from vime.algorithms import opd
from vime.algorithms.objective import STALENESS_BUCKETS, STALENESS_STATS, LossInputs, Objective, bucket_label
from vime.config import Config, ConfigError
from vime.models import load_tokenizer
from vime.rollout.types import Sample
from vime.trainer import checkpoint
from vime.trainer.logprobs import ChunkLoss, chunked_log_probs, chunked_loss
from vime.trainer.lora import LoraSpec, add_adapters, is_adapter, merged
from vime.trainer.optim import LRSchedule, make_optimizer, set_lr_and_decay
from vime.trainer.packing import (
    PAD_BUCKETS,
    PackedBatch,
    pack,
    plan_packed_micro_batches,
    register_packed_attention,
    shard_by_tokens,
    to_device,
)
from vime.trainer.perf import mfu, train_flops

log = logging.getLogger("vime")


class TokenScorer(nn.Module):
    """HF causal LM → log-probs (and entropies) of the response tokens of a packed batch.

    A module of its own so that, under FSDP2, it is the root unit: its forward unshards the
    embedding, final norm and LM head that the chunked head reads directly.
    """

    def __init__(self, hf: nn.Module, chunk_size: int) -> None:
        super().__init__()
        self.hf = hf
        self.chunk_size = chunk_size

    def forward(
        self, mb: PackedBatch, temperature: float, with_entropy: bool, loss_fn: ChunkLoss | None = None
    ) -> tuple[Tensor, Tensor | None] | Tensor:
        """(log-probs, entropies) of the scored tokens; given a `loss_fn`, that loss of them
        instead, its gradient taken in the forward (`chunked_loss`)."""
        hidden = self.hf.get_decoder()(
            input_ids=mb.input_ids,
            position_ids=mb.position_ids,
            use_cache=False,
            cu_seq_lens_q=mb.cu_seqlens,
            max_length_q=mb.max_seqlen,
        ).last_hidden_state[0]
        head = self.hf.get_output_embeddings()
        if getattr(head, "bias", None) is not None:
            raise NotImplementedError("the chunked LM head assumes no bias (true of the Llama/Qwen families)")
        if loss_fn is not None:
            return chunked_loss(
                hidden[mb.select], head.weight, mb.targets, loss_fn, temperature, with_entropy, self.chunk_size
            )
        return chunked_log_probs(hidden[mb.select], head.weight, mb.targets, temperature, with_entropy, self.chunk_size)


@dataclass
class _StepTokens:
    """A step's per-sample token tensors, built once (each micro-batch concatenates its own)."""

    masks: list[Tensor]
    rollout_lps: list[Tensor]  # zeros where the engine sent none
    has_rollout_lps: list[Tensor]  # the mask where it did, else zeros
    num_tokens: float  # loss tokens in the step
    weights: list[Tensor]  # 1 / the sample's loss tokens on each of its tokens (the sample-mean loss)
    staleness: list[Tensor] | None  # per token: the trained version minus the one that sampled it (-1: unknown)

    @classmethod
    def of(cls, samples: list[Sample], version: int | None = None) -> _StepTokens:
        """`version`: the policy version the step trains (its weights' optimizer-step count);
        None leaves staleness out."""
        masks = [torch.tensor(s.effective_loss_mask(), dtype=torch.float32) for s in samples]
        rollout_lps = [
            torch.tensor(
                s.rollout_log_probs if s.rollout_log_probs is not None else [0.0] * s.response_length,
                dtype=torch.float32,
            )
            for s in samples
        ]
        has = [m if s.rollout_log_probs is not None else torch.zeros_like(m) for s, m in zip(samples, masks)]
        weights = [torch.full_like(m, 1.0 / max(float(m.sum()), 1.0)) for m in masks]
        staleness = None
        if version is not None:
            staleness = [
                torch.tensor(
                    [version - v for v in s.weight_versions]
                    if s.weight_versions is not None and len(s.weight_versions) == s.response_length
                    else [-1] * s.response_length,
                    dtype=torch.float32,
                )
                for s in samples
            ]
        return cls(masks, rollout_lps, has, float(sum(m.sum() for m in masks)), weights, staleness)


# one advantage per sample (spread over its response tokens), or one tensor of per-token
# advantages per sample
Advantages = Tensor | Sequence[float] | list[Tensor]


def _as_advantages(samples: list[Sample], advantages: Advantages) -> Tensor | list[Tensor]:
    """A float tensor with one advantage per sample, or a list of per-token float tensors, each
    as long as its sample's response; anything else is refused here, not deep in a micro-batch."""
    if (
        isinstance(advantages, (list, tuple))
        and advantages
        and all(torch.is_tensor(a) and a.dim() == 1 for a in advantages)
    ):
        out = [a.float() for a in advantages]
        bad = [i for i, (a, s) in enumerate(zip(out, samples)) if len(a) != s.response_length]
        if len(out) != len(samples) or bad:
            raise ValueError(
                f"{len(samples)} samples but {len(out)} per-token advantages (or lengths differ at {bad[:3]})"
            )
        return out
    flat = torch.as_tensor(advantages, dtype=torch.float32).flatten()  # one per sample
    if len(samples) != len(flat):
        raise ValueError(f"{len(samples)} samples but {len(flat)} advantages")
    return flat


def staleness_metrics(
    metrics: dict[str, float], samples: list[Sample], first_version: int, global_batch_size: int
) -> dict[str, float]:
    """`stale/<b>/<stat>`: the loss's per-token sums of each staleness bucket (popped from
    `metrics`) as means over the bucket's tokens, its share of the step's tokens, and the mean
    response length of the samples whose oldest token falls in it. What stale samples do
    differently from fresh ones shows here: how far the weights moved since they were drawn
    (train_rollout_logprob_abs_diff, log_ratio_sq), how much the correction discounts them,
    their advantages and entropy. Buckets with no token are left out."""
    sums = {
        k.removeprefix("train/_stale"): metrics.pop(k) for k in [k for k in metrics if k.startswith("train/_stale")]
    }
    total = sum(sums.get(f"{b}_n", 0.0) for b in range(STALENESS_BUCKETS))
    out: dict[str, float] = {}
    for b in range(STALENESS_BUCKETS):
        n = sums.get(f"{b}_n", 0.0)
        if n > 0:
            label = bucket_label(b)
            out[f"stale/{label}/token_share"] = n / total
            out.update({f"stale/{label}/{stat}": sums[f"{b}_{stat}"] / n for stat in STALENESS_STATS})
    if total > 0:  # over every trained token: the drift vime/trainer/drift.py watches
        out["train/log_ratio_sq"] = sum(sums.get(f"{b}_log_ratio_sq", 0.0) for b in range(STALENESS_BUCKETS)) / total
    lengths: dict[int, list[int]] = {}
    for i, s in enumerate(samples):
        if s.weight_versions:
            lag = first_version + i // global_batch_size - min(s.weight_versions)
            lengths.setdefault(min(max(lag, 0), STALENESS_BUCKETS - 1), []).append(s.response_length)
    for b, ls in lengths.items():
        out[f"stale/{bucket_label(b)}/response_len"] = sum(ls) / len(ls)
    return out


def _full(tensor: Tensor) -> Tensor:
    """The whole tensor of a (possibly FSDP2-sharded) parameter; every rank calls. One rank
    holds the whole tensor already: a gather would cost a collective and a copy."""
    if hasattr(tensor, "full_tensor"):
        return tensor.to_local() if tensor.device_mesh.size() == 1 else tensor.full_tensor()
    return tensor


class Actor:
    """Policy model + optimizer (+ frozen reference model when `kl_loss_coef > 0`: `--ref-load`,
    else the policy's own starting weights; + the frozen OPD teacher with `--use-opd`).

    `fsdp=True` shards both over the default process group (which must exist), with bf16
    compute and float32 master weights on CUDA; `fsdp=False` is a plain single-device model.
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
        self.cpu_group = cpu_group  # gloo group for Python objects and metrics (the default one on CPU)
        self.device = torch.device(device)
        self.fsdp = fsdp
        self.rank, self.world = (dist.get_rank(), dist.get_world_size()) if fsdp else (0, 1)
        self.model = self._load(model_path)
        # LoRA: the base frozen, adapters on the target layers (vime/trainer/lora.py); what leaves
        # the trainer (pushes, checkpoints' safetensors) is the merged weight under the HF name
        self.lora = LoraSpec.of(args)
        self.lora_modules: set[str] = set()
        if self.lora is not None:
            try:
                self.lora_modules = set(add_adapters(self.model, self.lora, args.seed))
            except ValueError as e:
                raise ConfigError(str(e)) from None
        if args.gradient_checkpointing:
            self._checkpoint_layers(args.gradient_checkpointing_layers)
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
        self.compiled: bool = args.compile if args.compile is not None else self.device.type == "cuda"
        if self.compiled:
            # per layer, before FSDP wraps them (as torchtitan does): the layers share one code
            # object, so one compile serves all of them, and packed lengths vary: dynamic shapes
            for layer in self.model.get_decoder().layers:
                layer.compile(dynamic=True)
        chunk = args.logprob_chunk_size
        self.scorer = self._wrap(TokenScorer(self.model, chunk))
        # the run's tokenizer on rank 0; other ranks load their own
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(model_path)
        pad = self.tokenizer.pad_token_id
        self.pad_token_id: int = pad if pad is not None else (self.tokenizer.eos_token_id or 0)
        # fused on CUDA: one kernel for all parameters instead of a launch per tensor
        self.optimizer = make_optimizer(args, self.model, fused=self.device.type == "cuda")
        self.lr_schedule = LRSchedule.of(args)
        # optimizer step slots so far, a skipped one too, as the run's policy version counts them:
        # the index into the lr schedule, kept in checkpoints
        self.optimizer_steps = 0
        self.apply_schedule()
        self.objective = Objective.of(args)  # the loss of a micro-batch's tokens
        # the loss's gradient is taken chunk by chunk inside the head's forward, which saves the
        # head's logits recomputation (`chunked_loss`), unless the loss mixes tokens: a ratio,
        # weight or mask per sequence (GSPO, OPSM, sequence-level TIS or rejection, the veto, a
        # custom hook) needs the whole sequence, which a chunk may cut
        self.grad_in_forward: bool = not self.objective.per_sequence
        # coupled PPO: the engine's log-probs are π_old, so nothing is recomputed
        self.use_rollout_logprobs: bool = args.use_rollout_logprobs
        self.ref_scorer = None
        if args.kl_loss_coef > 0:
            ref = self._load(args.ref_load or model_path)
            ref.requires_grad_(False)
            ref.eval()
            self.ref_scorer = self._wrap(TokenScorer(ref, chunk))
        self.teacher_scorer = None  # --use-opd: the frozen teacher that scores the trained tokens (algorithms/opd.py)
        if args.use_opd:
            teacher = self._load(opd.teacher_dir(args))
            teacher.requires_grad_(False)
            teacher.eval()
            self.teacher_scorer = self._wrap(TokenScorer(teacher, chunk))
        self._bucket = -(-args.max_tokens_per_gpu // PAD_BUCKETS)
        self._warned_oversize = False
        if self.compiled:
            self._warm_up()

    def _load(self, model_path: str | Path) -> nn.Module:
        from transformers import AutoModelForCausalLM

        # float32 master weights everywhere; on CUDA, FSDP2 computes in bf16 (`_wrap`)
        model = AutoModelForCausalLM.from_pretrained(
            str(model_path), dtype=torch.float32, attn_implementation=register_packed_attention()
        )
        model.config.use_cache = False  # training never decodes; a KV cache only costs memory
        return model.to(self.device)

    def _checkpoint_layers(self, n: int | None) -> None:
        """Recompute the activations of the first `n` decoder layers in the backward (all of them
        when None): Megatron's `--recompute-method block --recompute-num-layers n`, which trades
        less recompute for the memory of the later layers' activations. transformers' decoder
        layers each carry their own `gradient_checkpointing` flag, which `*_checkpointing_enable`
        sets on all of them; the later ones are turned off again."""
        enable = getattr(self.model, "activation_checkpointing_enable", None)
        if enable is not None:  # transformers 5's name; the old one warns there
            enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if n is not None:
            for layer in self.model.get_decoder().layers[n:]:
                layer.gradient_checkpointing = False

    def _wrap(self, scorer: TokenScorer) -> nn.Module:
        """FSDP2 the way torchtitan does it: one unit per decoder layer, the rest in the root."""
        if not self.fsdp:
            return scorer
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mp = (
            MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            if self.device.type == "cuda"
            else MixedPrecisionPolicy()
        )
        layers = list(scorer.hf.get_decoder().layers)
        for i, layer in enumerate(layers):
            # the last layer's parameters are needed again at once by the backward: keep them; on
            # one rank resharding frees nothing (the shard is the whole tensor) and the backward's
            # re-gather would only cast every weight to bf16 again
            fully_shard(layer, mp_policy=mp, reshard_after_forward=self.world > 1 and i < len(layers) - 1)
        fully_shard(scorer, mp_policy=mp, reshard_after_forward=False)
        return scorer

    # ---- forward ---------------------------------------------------------------------

    def _plan(self, samples: list[Sample]) -> list[list[int]]:
        """This rank's micro-batches as indices into `samples`. Every rank gets the same number
        (padding with empty ones), so FSDP's collectives pair up."""
        lengths = [len(s.tokens) for s in samples]
        budget = self.args.max_tokens_per_gpu
        if self.compiled and max(lengths, default=0) > budget and not self._warned_oversize:
            self._warned_oversize = True
            log.warning(
                "a %d-token sequence is longer than --max-tokens-per-gpu %d: its micro-batch may compile once more "
                "mid-run; raise the budget above prompt + response length",
                max(lengths),
                budget,
            )
        shards = shard_by_tokens(lengths, self.world)
        cap = self.args.micro_batch_size
        plans = [
            [[shard[j] for j in mb] for mb in plan_packed_micro_batches([lengths[i] for i in shard], budget, cap)]
            for shard in shards
        ]
        mine = plans[self.rank]
        return mine + [[] for _ in range(max(len(p) for p in plans) - len(mine))]

    def _pack(self, samples: list[Sample], idx: list[int]) -> PackedBatch:
        """One micro-batch on the device. Compiled layers get its length rounded up to one of
        `PAD_BUCKETS` sizes, all of which `_warm_up` compiled: each other token count risks a
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

    def _warm_up(self) -> None:
        """Compile every shape a step can meet before the first step: each bucket size, with and
        without gradients (a scoring pass runs under no_grad, which is a graph of its own). The
        batches are a dummy sequence padded to the size; the gradients they leave are dropped."""
        t0 = time.perf_counter()
        was_training = self.scorer.training
        for size in range(self._bucket, self._bucket * PAD_BUCKETS + 1, self._bucket):
            mb = pack([[self.pad_token_id] * 2], [1], [], self.device, size, self.pad_token_id)
            self.scorer.eval()  # as `compute_log_probs` runs it: the layers' mode is guarded too
            with torch.no_grad():
                self._forward(self.scorer, mb, with_entropy=False)
            self.scorer.train()
            log_probs, entropy = self._forward(self.scorer, mb, with_entropy=True)
            (log_probs.sum() + entropy.sum()).backward()
        self.scorer.train(was_training)
        self.optimizer.zero_grad(set_to_none=True)
        self._sync()
        log.info("compiled the trainer for %d micro-batch sizes in %.1f s", PAD_BUCKETS, time.perf_counter() - t0)

    def _forward(
        self, scorer: nn.Module, mb: PackedBatch, with_entropy: bool, temperature: float | None = None
    ) -> tuple[Tensor, Tensor | None]:
        """Log-probs (and entropies) of a micro-batch's response tokens, flat in sample order.

        Scored at the temperature the responses were drawn at (`temperature_of`; the warm-up
        uses --rollout-temperature), so trainer and engine score the same distribution
        (top-p/top-k truncation is not reproduced). The entropy carries gradient only when the
        loss uses it.
        """
        temperature = self.args.rollout_temperature if temperature is None else temperature
        if not with_entropy:
            return scorer(mb, temperature, False)
        log_probs, entropy = scorer(mb, temperature, True)
        if self.args.entropy_coef == 0:
            entropy = entropy.detach()
        return log_probs, entropy

    @torch.no_grad()
    def compute_log_probs(self, samples: list[Sample], scorer: nn.Module | None = None) -> list[Tensor]:
        """Per-sample log-probs of the response tokens under `scorer` (default: the policy), on
        every rank."""
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
        drawn = {
            self.args.rollout_temperature if s.temperature is None else s.temperature
            for s in samples
            if s.response_length  # a sample with nothing drawn scores nothing
        }
        if len(drawn) > 1:
            raise ConfigError(
                f"one step's samples were drawn at temperatures {sorted(drawn)}, and the trainer scores a step at one: "
                "generate a rollout at a single temperature"
            )
        return drawn.pop() if drawn else self.args.rollout_temperature

    # ---- training --------------------------------------------------------------------

    def train_step(
        self, samples: list[Sample], advantages: Advantages, step_size: int | None = None
    ) -> dict[str, float]:
        """Train on one rollout: `len(samples) // global_batch_size` optimizer steps, or of
        `step_size` samples each when given (a rollout whose generate returned several samples
        per prompt keeps its number of steps: vime/rollout/compat.py).

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
        advantages = _as_advantages(samples, advantages)
        gbs = step_size or self.args.global_batch_size or len(samples)
        if gbs < 1 or len(samples) % gbs != 0:
            raise ValueError(f"{len(samples)} samples do not split into optimizer steps of --global-batch-size {gbs}")
        self._sync()
        t0 = time.perf_counter()
        # the SFT loss reads no old log-probs: nothing to recompute
        recompute = gbs != len(samples) and not self.use_rollout_logprobs and not self.objective.sft
        old = self.compute_log_probs(samples) if recompute else None
        ref = self.compute_log_probs(samples, scorer=self.ref_scorer) if self.ref_scorer is not None else None
        distilled: dict[str, float] = {}
        if self.teacher_scorer is not None:
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
        metrics = {k: sum(m[k] for m in steps) / len(steps) for k in steps[0]}
        metrics["train/skipped_steps"] = sum(m["train/skipped_steps"] for m in steps)  # a count, not a mean
        # the engine/trainer mismatch in one number, over all the rollout's tokens: ~0 when both
        # run the same weights in the same precision; what TIS corrects for if not
        diff_sum, diff_count = (sum(m.get(f"train/_lp_diff_{k}", 0.0) for m in steps) for k in ("sum", "count"))
        for k in ("train/_lp_diff_sum", "train/_lp_diff_count"):
            metrics.pop(k, None)
        if diff_count:
            metrics["train/train_rollout_logprob_abs_diff"] = diff_sum / diff_count
        metrics.update(staleness_metrics(metrics, samples, self.optimizer_steps - len(steps), gbs))
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
        """--use-opd: the teacher's log-probs of the step's tokens, now, and the advantages with
        the reverse-KL term (`opd.distill_advantages`). The student's are the rollout's; a
        sample the engine sent none for is scored by the current policy."""
        teacher = self.compute_log_probs(samples, scorer=self.teacher_scorer)
        missing = [i for i, s in enumerate(samples) if s.rollout_log_probs is None]
        policy: list[Tensor | None] = [None] * len(samples)
        for i, lp in zip(missing, self.compute_log_probs([samples[i] for i in missing]) if missing else []):
            policy[i] = lp.cpu()
        student = opd.student_log_probs(samples, policy)
        masks = [torch.tensor(s.effective_loss_mask(), dtype=torch.float32) for s in samples]
        return opd.distill_advantages(advantages, student, teacher, masks, self.args.opd_kl_coef)

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
        set_lr_and_decay(self.optimizer, self.lr_schedule(self.optimizer_steps), self.args.weight_decay)

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
        `grad_in_forward` the head computes it chunk by chunk (`loss_of` on a chunk's rows) and
        takes its gradient there (`chunked_loss`); otherwise over the whole micro-batch after
        the head. `version`: the policy version being trained, for the staleness split of the
        metrics (`staleness_metrics`); None leaves it out.
        """
        a = self.args
        advantages = _as_advantages(samples, advantages)
        sample_mean = self.objective.agg == "sample_mean"
        # the constant denominators: the step's samples (sample mean), Dr.GRPO's otherwise
        const = float(len(samples) if sample_mean else a.rollout_max_response_len * len(samples))
        if (self.objective.correction.active or self.use_rollout_logprobs) and any(
            s.rollout_log_probs is None for s in samples
        ):
            raise ValueError(
                "--use-tis, --use-rs and --use-rollout-logprobs need the engine's log-probs on every sample (rollout_log_probs)"
            )
        totals: dict[str, Tensor] = {}
        tokens: _StepTokens | None = None

        def inputs_of(mb: PackedBatch) -> LossInputs:
            nonlocal tokens
            if tokens is None:  # host work done while the GPU runs the first forward, not before it
                tokens = _StepTokens.of(samples, version)

            def flat(per_sample: list) -> Tensor:
                if not mb.indices:  # an empty micro-batch: its one dummy token weighs nothing
                    return torch.zeros(len(mb.targets), device=self.device)
                return to_device(
                    torch.cat([torch.as_tensor(per_sample[i], dtype=torch.float32) for i in mb.indices]), self.device
                )

            rollout_lp = flat(tokens.rollout_lps)
            lengths = torch.tensor(mb.response_lengths)
            return LossInputs(
                mask=flat(tokens.masks),
                # a sample's advantage on each of its response tokens
                advantages=(
                    flat(advantages)  # one per token already (REINFORCE++'s discounted returns)
                    if isinstance(advantages, list)
                    else to_device(advantages[mb.indices].repeat_interleave(lengths), self.device)
                    if mb.indices
                    else flat([])
                ),
                rollout_lp=rollout_lp,
                has_rollout=flat(tokens.has_rollout_lps),
                seq_ids=to_device(torch.repeat_interleave(torch.arange(len(lengths)), lengths), self.device),
                old=rollout_lp if self.use_rollout_logprobs else None if old_log_probs is None else flat(old_log_probs),
                ref=None if ref_log_probs is None else flat(ref_log_probs),
                weights=flat(tokens.weights) if sample_mean else None,
                staleness=None if tokens.staleness is None else flat(tokens.staleness),
            )

        def loss_of(log_probs: Tensor, entropy: Tensor, t: LossInputs) -> Tensor:
            """The loss of these tokens (a share of the step's), its metrics added to `totals`."""
            assert tokens is not None
            loss, m = self.objective(log_probs, entropy, t, num_tokens=tokens.num_tokens, const=const)
            for k, v in m.items():  # kept on the device: a float() per metric would stall the GPU each micro-batch
                totals[f"train/{k}"] = totals.get(f"train/{k}", 0.0) + torch.as_tensor(v).detach().to(
                    self.device, torch.float64
                )
            return loss

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
            if self.grad_in_forward:
                inputs: LossInputs | None = None

                def chunk_loss(log_probs: Tensor, entropy: Tensor | None, rows: slice, mb: PackedBatch = mb) -> Tensor:
                    nonlocal inputs
                    if inputs is None:  # built at the first chunk, once the decoder's forward is queued
                        inputs = inputs_of(mb)
                    assert entropy is not None
                    # the world's factor (see above) scales each token's gradient before the head
                    # rounds the logits' gradient, as autograd does on the other path
                    return loss_of(log_probs, entropy, inputs.rows(rows)) * self.world

                scaled_loss = self.scorer(mb, temperature, True, chunk_loss)
            else:
                log_probs, entropy = self._forward(self.scorer, mb, with_entropy=True, temperature=temperature)
                assert entropy is not None
                scaled_loss = loss_of(log_probs, entropy, inputs_of(mb)) * self.world
            scaled_loss.backward()
        return totals

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
        """Clip by the norm of the whole gradient, all shards together, then step; unless the
        step's `loss` or the norm is not finite, when the step is skipped and counted
        (`train/skipped_steps`): clipping scales a NaN gradient to NaN weights, and the
        optimizer's moments would carry it into every later step. Loss and norm are the same on
        every rank (summed and reduced), so all ranks skip together.

        With AdamW on CUDA the check runs on the device: the fused AdamW skips itself, moments and
        step count included, where `found_inf` is set (GradScaler's mechanism, without the
        scaling), so clip and step are queued without the host waiting for the norm or the loss
        first. SGD is never fused (`optim.make_optimizer`): the host waits for the check."""
        clip = self.args.clip_grad
        params = [p for p in self.model.parameters() if p.grad is not None]
        grad_norm = torch.nn.utils.get_total_norm([p.grad for p in params], 2.0)
        if hasattr(grad_norm, "full_tensor"):  # a DTensor: the partial norms of each shard, reduced here
            grad_norm = grad_norm.full_tensor()
        lr = float(self.optimizer.param_groups[0]["lr"])
        finite = torch.isfinite(grad_norm) & torch.isfinite(torch.as_tensor(loss, device=grad_norm.device))
        if self.optimizer.defaults.get("fused"):
            self.optimizer.found_inf = (~finite).float()
        elif not bool(finite):
            self.optimizer.zero_grad(set_to_none=True)
            return {"train/grad_norm": float(grad_norm), "train/lr": lr, "train/skipped_steps": 1.0}
        if clip > 0:
            torch.nn.utils.clip_grads_with_norm_(params, clip, grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)  # gradients are not needed until the next step
        skipped = 0.0 if bool(finite) else 1.0  # read once the step is queued
        return {"train/grad_norm": float(grad_norm), "train/lr": lr, "train/skipped_steps": skipped}

    # ---- weights and checkpoints -----------------------------------------------------

    def named_weights(self, merge: bool = True) -> Iterator[tuple[str, Tensor]]:
        """(HF name, full tensor) as in the checkpoint files, for weight pushes and saves. With
        LoRA the adapted weights are merged (W + s·B A), unless `merge=False` (the frozen base).

        Every rank must iterate to the end (each sharded tensor is gathered by all ranks, one
        at a time, so at most one full tensor beyond the shards exists); only rank 0 receives
        anything. A tensor shared by several names (tied embeddings) is yielded once, under its
        first name (`model.embed_tokens.weight`), which is the one save_pretrained keeps.
        """
        # named_parameters, not state_dict(): FSDP2's state-dict hooks cost ~45 µs a tensor on the
        # H200 host, 14 ms of a 0.6B push (bench/RESULTS.md)
        tensors = itertools.chain(self.model.named_parameters(), ((n, self.model.get_buffer(n)) for n in self._buffers))
        with torch.no_grad():
            for name, tensor in tensors:
                if is_adapter(name):
                    continue  # LoRA: merged into its layer's weight below
                tensor = _full(tensor.detach())
                module = name.removesuffix(".weight")
                if merge and module in self.lora_modules:
                    assert self.lora is not None
                    layer = self.model.get_submodule(module)
                    tensor = merged(
                        tensor, _full(layer.lora_A.detach()), _full(layer.lora_B.detach()), self.lora.scaling
                    )
                if self.rank == 0:
                    yield name, tensor

    def adapter_weights(self) -> Iterator[tuple[str, Tensor]]:
        """LoRA: the adapters as a push sends them (`vime/engine/core/lora.py`): `<layer>.lora_A`
        and `<layer>.lora_B` in float32 on the trainer's device, the scaling s folded into B. Every
        rank iterates to the end, as with `named_weights`; rank 0 receives them."""
        assert self.lora is not None
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                if is_adapter(name):
                    full = _full(p.detach()).float()
                    if name.endswith(".lora_B"):
                        full = full * self.lora.scaling
                    if self.rank == 0:
                        yield name, full

    def adapter_tensors(self) -> dict[str, Tensor]:
        """LoRA: every adapter tensor, full, by parameter name (rank 0 gets them; every rank calls)."""
        out = {}
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                if is_adapter(name):
                    full = _full(p.detach()).cpu()
                    if self.rank == 0:
                        out[name] = full
        return out

    def save(self, ckpt_dir: str | Path, extra_state: dict[str, Any]) -> Path:
        """Write a checkpoint (every rank calls; `vime.trainer.checkpoint.save`)."""
        return checkpoint.save(self, Path(ckpt_dir), extra_state)

    def load(self, ckpt_dir: str | Path) -> dict[str, Any]:
        """Restore a checkpoint; returns its extra state (`vime.trainer.checkpoint.load`)."""
        return checkpoint.load(self, Path(ckpt_dir))

    def close(self) -> None:
        """Nothing to release for a single-process actor; the distributed one overrides this."""
