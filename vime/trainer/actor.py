"""The policy being trained: an HF causal LM, its AdamW optimizer, log-probs, steps, checkpoints.

Runs as one process or as one rank of many (FSDP2, `vime.trainer.distributed` launches them).
Every rank receives the whole batch and derives, without talking to the others, the same split:
samples go to ranks balanced by tokens, each rank packs its share into micro-batches of at most
`--max-tokens-per-gpu` real tokens (no padding), and ranks with fewer micro-batches run empty
ones so the FSDP collectives stay in step. The loss of each micro-batch is divided by the
loss-token count of the whole optimizer step on all ranks, so gradient accumulation and data
parallelism give the gradient of one big batch, whatever the budget or the rank count. Only the
response positions go through the LM head, in token chunks (`vime.trainer.logprobs`), so no
batch × vocabulary logits ever exist.
"""
from __future__ import annotations

import itertools

import json
import math
import os
import random
import shutil
import time
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor, nn

from vime.models import load_tokenizer
from vime.rollout.types import Sample
from vime.trainer.logprobs import DEFAULT_CHUNK, chunked_log_probs
from vime.trainer.loss import OffPolicyCorrection, aggregate, kl_penalty, policy_loss
from vime.trainer.packing import PackedBatch, pack, plan_packed_micro_batches, register_packed_attention, shard_by_tokens, to_device
from vime.trainer.perf import mfu, train_flops

TRAINER_STATE = "trainer_state.pt"


class CheckpointError(RuntimeError):
    """A checkpoint could not be written; one line naming it and the cause."""


def _arg(args: Any, name: str, default: Any) -> Any:
    value = getattr(args, name, default)
    return default if value is None else value


class TokenScorer(nn.Module):
    """HF causal LM → log-probs (and entropies) of the response tokens of a packed batch.

    A module of its own so that, under FSDP2, it is the root unit: its forward unshards the
    embedding, final norm and LM head that the chunked head reads directly.
    """

    def __init__(self, hf: nn.Module, chunk_size: int) -> None:
        super().__init__()
        self.hf = hf
        self.chunk_size = chunk_size

    def forward(self, mb: PackedBatch, temperature: float, with_entropy: bool) -> tuple[Tensor, Tensor | None]:
        hidden = self.hf.get_decoder()(
            input_ids=mb.input_ids, position_ids=mb.position_ids, use_cache=False, cu_seq_lens_q=mb.cu_seqlens, max_length_q=mb.max_seqlen
        ).last_hidden_state[0]
        head = self.hf.get_output_embeddings()
        if getattr(head, "bias", None) is not None:
            raise NotImplementedError("the chunked LM head assumes no bias (true of the Llama/Qwen families)")
        return chunked_log_probs(hidden[mb.select], head.weight, mb.targets, temperature, with_entropy, self.chunk_size)


class Actor:
    """Policy model + optimizer (+ frozen reference model when `kl_loss_coef > 0`).

    `fsdp=True` shards both over the default process group (which must exist), with bf16
    compute and float32 master weights on CUDA; `fsdp=False` is a plain single-device model.
    """

    def __init__(self, args: Any, model_path: str | Path, device: str = "cpu", fsdp: bool = False, cpu_group: Any = None) -> None:
        self.args = args
        self.cpu_group = cpu_group  # gloo group for Python objects and metrics (the default one on CPU)
        self.device = torch.device(device)
        self.fsdp = fsdp
        self.rank, self.world = (dist.get_rank(), dist.get_world_size()) if fsdp else (0, 1)
        self.model = self._load(model_path)
        if _arg(args, "gradient_checkpointing", False):
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        all_names = {n for n, _ in self.model.named_parameters(remove_duplicate=False)}
        param_names = {n for n, _ in self.model.named_parameters()}
        self._aliases = all_names - param_names  # tied names, e.g. lm_head.weight
        # what a checkpoint holds besides parameters (none in Llama/Qwen: their rotary tables are not persistent)
        self._buffers = [n for n in self.model.state_dict() if n not in all_names]
        self.compiled: bool = _arg(args, "compile", False)
        if self.compiled:
            # per layer, before FSDP wraps them (as torchtitan does): the layers share one code
            # object, so one compile serves all of them, and packed lengths vary: dynamic shapes
            for layer in self.model.get_decoder().layers:
                layer.compile(dynamic=True)
        chunk = _arg(args, "logprob_chunk_size", DEFAULT_CHUNK)
        self.scorer = self._wrap(TokenScorer(self.model, chunk))
        self.tokenizer = load_tokenizer(model_path)
        pad = self.tokenizer.pad_token_id
        self.pad_token_id: int = pad if pad is not None else (self.tokenizer.eos_token_id or 0)
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(),
            lr=_arg(args, "lr", 1e-6),
            betas=(_arg(args, "adam_beta1", 0.9), _arg(args, "adam_beta2", 0.98)),
            weight_decay=_arg(args, "weight_decay", 0.0),
            fused=self.device.type == "cuda",  # one kernel for all parameters instead of a launch per tensor
        )
        self.correction = OffPolicyCorrection(
            use_tis=_arg(args, "use_tis", False), tis_mode=_arg(args, "tis_mode", "truncate"), tis_clip=_arg(args, "tis_clip", 2.0),
            tis_clip_low=_arg(args, "tis_clip_low", 0.0), use_rs=_arg(args, "use_rs", False), rs_level=_arg(args, "rs_level", "token"),
            rs_lower_bound=_arg(args, "rs_lower_bound", 0.5), rs_upper_bound=_arg(args, "rs_upper_bound", 2.0),
        )
        # coupled PPO: the engine's log-probs are π_old, so nothing is recomputed
        self.use_rollout_logprobs: bool = _arg(args, "use_rollout_logprobs", False)
        self.ref_scorer = None
        if _arg(args, "kl_loss_coef", 0.0) > 0:
            ref = self._load(model_path)
            ref.requires_grad_(False)
            ref.eval()
            self.ref_scorer = self._wrap(TokenScorer(ref, chunk))

    def _load(self, model_path: str | Path) -> nn.Module:
        from transformers import AutoModelForCausalLM

        dtype = getattr(torch, _arg(self.args, "dtype", "float32"))
        model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=dtype, attn_implementation=register_packed_attention())
        model.config.use_cache = False  # training never decodes; a KV cache only costs memory
        return model.to(self.device)

    def _wrap(self, scorer: TokenScorer) -> nn.Module:
        """FSDP2 the way torchtitan does it: one unit per decoder layer, the rest in the root."""
        if not self.fsdp:
            return scorer
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if self.device.type == "cuda" else MixedPrecisionPolicy()
        layers = list(scorer.hf.get_decoder().layers)
        for i, layer in enumerate(layers):
            # the last layer's parameters are needed again at once by the backward: keep them; on
            # one rank resharding frees nothing (the shard is the whole tensor) and the backward's
            # re-gather would only cast every weight to bf16 again
            fully_shard(layer, mp_policy=mp, reshard_after_forward=self.world > 1 and i < len(layers) - 1)
        fully_shard(scorer, mp_policy=mp, reshard_after_forward=False)
        return scorer

    # ---- forward ---------------------------------------------------------------------

    def _micro_batches(self, samples: list[Sample]) -> Iterator[PackedBatch]:
        """This rank's packed micro-batches; every rank yields the same number (padding with
        empty ones, whose `indices` is empty), so FSDP's collectives pair up."""
        lengths = [len(s.tokens) for s in samples]
        budget = _arg(self.args, "max_tokens_per_gpu", 4096)
        shards = shard_by_tokens(lengths, self.world)
        plans = [[[shard[j] for j in mb] for mb in plan_packed_micro_batches([lengths[i] for i in shard], budget)] for shard in shards]
        mine = plans[self.rank]
        # compiled layers get one token count, the budget: each other count risks a compile of
        # its own (inductor guards ranges of it, e.g. T >= 5120; bench/RESULTS.md, issue 16)
        pad_to = budget if self.compiled else None
        for idx in mine:
            yield pack([samples[i].tokens for i in idx], [samples[i].response_length for i in idx], idx, self.device, pad_to, self.pad_token_id)
        for _ in range(max(len(p) for p in plans) - len(mine)):
            yield pack([[self.pad_token_id] * 2], [1], [], self.device, pad_to, self.pad_token_id)

    def _forward(self, scorer: nn.Module, mb: PackedBatch, with_entropy: bool) -> tuple[Tensor, Tensor | None]:
        """Log-probs (and entropies) of a micro-batch's response tokens, flat in sample order.

        Scored at the rollout temperature, as the engine did when it sampled, so trainer and
        engine score the same distribution (top-p/top-k truncation is not reproduced). The
        entropy carries gradient only when the loss uses it.
        """
        temperature = _arg(self.args, "rollout_temperature", 1.0)
        if not with_entropy:
            return scorer(mb, temperature, False)
        log_probs, entropy = scorer(mb, temperature, True)
        if _arg(self.args, "entropy_coef", 0.0) == 0:
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
        try:
            for mb in self._micro_batches(samples):
                flat, _ = self._forward(scorer, mb, with_entropy=False)
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

    # ---- training --------------------------------------------------------------------

    def train_step(self, samples: list[Sample], advantages: list[float]) -> dict[str, float]:
        """Train on one rollout: `len(samples) // global_batch_size` optimizer steps.

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
        if len(samples) != len(advantages):
            raise ValueError(f"{len(samples)} samples but {len(advantages)} advantages")
        gbs = _arg(self.args, "global_batch_size", len(samples))
        if gbs < 1 or len(samples) % gbs != 0:
            raise ValueError(f"{len(samples)} samples do not split into optimizer steps of --global-batch-size {gbs}")
        self._sync()
        t0 = time.perf_counter()
        old = None if gbs == len(samples) or self.use_rollout_logprobs else self.compute_log_probs(samples)
        ref = self.compute_log_probs(samples, scorer=self.ref_scorer) if self.ref_scorer is not None else None
        steps = []
        for start in range(0, len(samples), gbs):
            sl = slice(start, start + gbs)
            steps.append(self._optimizer_step(samples[sl], advantages[sl], None if old is None else old[sl], None if ref is None else ref[sl]))
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
        lengths = [len(s.tokens) for s in samples]
        metrics["perf/actor_train_tok_per_s"] = sum(lengths) / elapsed
        if self.device.type == "cuda":
            flops = train_flops(self.model.config, lengths, [s.response_length for s in samples], forwards=(old is not None) + (ref is not None))
            metrics["perf/mfu"] = mfu(flops, elapsed, self.world)
        return metrics

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _optimizer_step(self, samples: list[Sample], advantages: list[float], old: list[Tensor] | None, ref: list[Tensor] | None) -> dict[str, float]:
        self.scorer.train()
        self.optimizer.zero_grad(set_to_none=True)
        metrics = self.accumulate_gradients(samples, advantages, old, ref)
        if not any(sum(s.effective_loss_mask()) for s in samples):
            # nothing to learn from (e.g. every response aborted): AdamW's momentum would still
            # move the weights on zero gradients, so skip the step (every rank sees the same batch)
            self.optimizer.zero_grad(set_to_none=True)
            return {**metrics, "train/grad_norm": 0.0, "train/lr": float(self.optimizer.param_groups[0]["lr"]), "train/skipped_steps": 0.0}
        metrics.update(self._clip_and_step(loss_finite=math.isfinite(metrics["train/loss"])))
        return metrics

    def accumulate_gradients(
        self, samples: list[Sample], advantages: list[float], old_log_probs: list[Tensor] | None, ref_log_probs: list[Tensor] | None = None
    ) -> dict[str, float]:
        """Forward/backward this rank's micro-batches of one optimizer step into `.grad` (no step).
        `old_log_probs` None: the weights have not moved since the rollout's first step, so the
        forward's own detached log-probs are the old ones (see `train_step`); with
        --use-rollout-logprobs the engine's are.

        Each micro-batch's loss is divided by the step's loss-token count over all ranks (or
        the Dr.GRPO constant), so the accumulated gradient is that of the step's true token
        mean. FSDP averages gradients over ranks; the backward is scaled by the world size to
        turn that average into the sum the global normalizer calls for. Metrics are summed over
        ranks for the same reason.
        """
        a = self.args
        # per-sample token tensors, built once per step (each micro-batch concatenates its own)
        masks = [torch.tensor(s.effective_loss_mask(), dtype=torch.float32) for s in samples]
        adv_tokens = [torch.full((s.response_length,), float(adv)) for s, adv in zip(samples, advantages)]
        rollout_lps = [torch.tensor(s.rollout_log_probs if s.rollout_log_probs is not None else [0.0] * s.response_length, dtype=torch.float32) for s in samples]
        has_rollout_lps = [m if s.rollout_log_probs is not None else torch.zeros_like(m) for s, m in zip(samples, masks)]
        num_tokens = float(sum(m.sum() for m in masks))
        agg = "seq_sum_const" if _arg(a, "advantage_estimator", "grpo") == "dr_grpo" else "token_mean"
        max_len = _arg(a, "rollout_max_response_len", max((s.response_length for s in samples), default=1))
        const = float(max_len * len(samples))
        if (self.correction.active or self.use_rollout_logprobs) and any(s.rollout_log_probs is None for s in samples):
            raise ValueError("--use-tis, --use-rs and --use-rollout-logprobs need the engine's log-probs on every sample (rollout_log_probs)")
        kl_coef = _arg(a, "kl_loss_coef", 0.0)
        ent_coef = _arg(a, "entropy_coef", 0.0)
        totals: dict[str, Tensor] = {}
        for mb in self._micro_batches(samples):
            log_probs, entropy = self._forward(self.scorer, mb, with_entropy=True)

            def flat(per_sample: list) -> Tensor:
                if not mb.indices:  # an empty micro-batch: its one dummy token weighs nothing
                    return torch.zeros(len(mb.targets), device=self.device)
                return to_device(torch.cat([torch.as_tensor(per_sample[i], dtype=torch.float32) for i in mb.indices]), self.device)

            mask = flat(masks)
            rollout_lp = flat(rollout_lps)
            if self.use_rollout_logprobs:
                old = rollout_lp
            else:
                old = log_probs.detach() if old_log_probs is None else flat(old_log_probs)
            adv = flat(adv_tokens)
            seq_ids = to_device(torch.repeat_interleave(torch.arange(len(mb.response_lengths)), torch.tensor(mb.response_lengths)), self.device)
            pg, m = policy_loss(
                log_probs,
                old,
                adv,
                mask,
                eps_clip=_arg(a, "eps_clip", 0.2),
                eps_clip_high=getattr(a, "eps_clip_high", None),
                rollout_log_probs=rollout_lp,
                correction=self.correction,
                seq_ids=seq_ids,
                agg=agg,
                const=const,
                num_tokens=num_tokens,
            )
            loss = pg
            # entropy is reported as a token mean whatever the loss aggregation
            m["entropy"] = aggregate(entropy.detach(), mask, "token_mean", num_tokens=num_tokens)
            if ent_coef != 0:
                loss = loss - ent_coef * aggregate(entropy, mask, agg, num_tokens=num_tokens, const=const)
            if ref_log_probs is not None:
                kl = aggregate(kl_penalty(log_probs, flat(ref_log_probs), _arg(a, "kl_loss_type", "low_var_kl")), mask, agg, num_tokens=num_tokens, const=const)
                loss = loss + kl_coef * kl
                m["kl_loss"] = kl.detach()
            m["loss"] = loss.detach()
            has_rollout = flat(has_rollout_lps)
            trainer_lp = log_probs.detach() if self.use_rollout_logprobs else old  # coupled: old is the engine's own
            m["_lp_diff_sum"] = ((trainer_lp - rollout_lp).abs() * has_rollout).sum()
            m["_lp_diff_count"] = has_rollout.sum()
            (loss * self.world).backward()
            for k, v in m.items():  # kept on the device: a float() per metric would stall the GPU each micro-batch
                totals[f"train/{k}"] = totals.get(f"train/{k}", 0.0) + torch.as_tensor(v).detach().to(self.device, torch.float64)
        keys = sorted(totals)
        values = torch.stack([totals[k] for k in keys]).tolist() if keys else []  # the step's one wait for the GPU
        return self._sum_over_ranks(dict(zip(keys, values)))

    def _sum_over_ranks(self, values: dict[str, float]) -> dict[str, float]:
        if self.world == 1:
            return values
        keys = sorted(values)
        t = torch.tensor([values[k] for k in keys], dtype=torch.float64)
        dist.all_reduce(t, group=self.cpu_group)
        return dict(zip(keys, t.tolist()))

    def _clip_and_step(self, loss_finite: bool = True) -> dict[str, float]:
        """Clip by the norm of the whole gradient, all shards together, then step; unless the
        loss or the norm is not finite, when the step is skipped and counted
        (`train/skipped_steps`): clipping scales a NaN gradient to NaN weights, and AdamW's
        moments would carry it into every later step. Loss and norm are the same on every
        rank (summed and reduced), so all ranks skip together."""
        clip = _arg(self.args, "clip_grad", 1.0)
        params = [p for p in self.model.parameters() if p.grad is not None]
        grad_norm = torch.nn.utils.get_total_norm([p.grad for p in params], 2.0)
        if hasattr(grad_norm, "full_tensor"):  # a DTensor: the partial norms of each shard, reduced here
            grad_norm = grad_norm.full_tensor()
        lr = float(self.optimizer.param_groups[0]["lr"])
        if not (loss_finite and math.isfinite(float(grad_norm))):
            self.optimizer.zero_grad(set_to_none=True)
            return {"train/grad_norm": float(grad_norm), "train/lr": lr, "train/skipped_steps": 1.0}
        if clip > 0:
            torch.nn.utils.clip_grads_with_norm_(params, clip, grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)  # gradients are not needed until the next step
        return {"train/grad_norm": float(grad_norm), "train/lr": lr, "train/skipped_steps": 0.0}

    def sft_step(self, samples: list[Sample]) -> dict[str, float]:
        """One optimizer step of cross-entropy on the loss-masked response tokens (token mean)."""
        self.scorer.train()
        self.optimizer.zero_grad(set_to_none=True)
        masks = [torch.tensor(s.effective_loss_mask(), dtype=torch.float32) for s in samples]
        num_tokens = float(sum(m.sum() for m in masks))
        total = 0.0
        for mb in self._micro_batches(samples):
            log_probs, _ = self._forward(self.scorer, mb, with_entropy=False)
            parts = [masks[i] for i in mb.indices] or [torch.zeros(len(mb.targets))]
            loss = aggregate(-log_probs, torch.cat(parts).to(self.device), "token_mean", num_tokens=num_tokens)
            (loss * self.world).backward()
            total += float(loss.detach())
        return {**self._sum_over_ranks({"train/sft_loss": total}), **self._clip_and_step()}

    # ---- weights and checkpoints -----------------------------------------------------

    def named_weights(self) -> Iterator[tuple[str, Tensor]]:
        """(HF name, full tensor) as in the checkpoint files, for weight pushes and saves.

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
                tensor = tensor.detach()
                if hasattr(tensor, "full_tensor"):
                    # one rank holds the whole tensor already: a gather per tensor would cost a
                    # collective and a copy each
                    tensor = tensor.to_local() if tensor.device_mesh.size() == 1 else tensor.full_tensor()
                if self.rank == 0:
                    yield name, tensor

    def save(self, ckpt_dir: str | Path, extra_state: dict[str, Any]) -> Path:
        """Write an HF directory (+ trainer_state.pt) at `ckpt_dir`, atomically; every rank calls.

        Shards are gathered into full tensors and rank 0 writes, so the directory loads in
        transformers, in vLLM, and in a trainer of any rank count. The optimizer state is
        stored full and keyed by parameter name for the same reason. Everything goes to
        `<dir>.tmp` first; only a complete copy replaces an existing checkpoint of the same
        name, so a crash at any point leaves the previous one loadable (at worst renamed to
        `<dir>.old` for the instant between the two renames).
        """
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        final = Path(ckpt_dir)
        self._check_finite(final)
        weights = {name: t.detach().cpu() for name, t in self.named_weights()}
        optim = get_optimizer_state_dict(self.model, self.optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        error: BaseException | None = None
        if self.rank == 0:
            try:
                self._write(final, weights, {"optimizer": optim, "rng": _rng_state(), "extra": extra_state})
            except BaseException as e:  # every rank must hear of it, or they would wait for rank 0 at the next collective
                error = e
        if self.world > 1:
            # also the barrier: the checkpoint exists for everyone once save returns
            failed = torch.tensor([int(error is not None)])
            dist.all_reduce(failed, group=self.cpu_group)
            if int(failed) and error is None:
                raise CheckpointError(f"writing checkpoint {final} failed on rank 0")
        if error is not None:
            raise error
        return final

    def _check_finite(self, final: Path) -> None:
        """Refuse to save non-finite weights (NonFiniteError on every rank alike): a checkpoint
        of NaNs would replace the last good one as the newest. Each rank checks its own shards."""
        from vime.trainer.nonfinite import NonFiniteError

        bad = [n for n, p in self.model.named_parameters() if not bool(torch.isfinite(p.to_local() if hasattr(p, "to_local") else p).all())]
        count = torch.tensor([len(bad)], dtype=torch.int64)
        if self.world > 1:
            dist.all_reduce(count, group=self.cpu_group)
        if int(count):
            where = f" (e.g. {bad[0]})" if bad else ""
            raise NonFiniteError(f"not writing checkpoint {final}: {int(count)} weight tensors hold non-finite values{where}; the last checkpoint written is intact")

    def _write(self, final: Path, weights: dict[str, Tensor], state: dict[str, Any]) -> None:
        tmp, old = final.with_name(final.name + ".tmp"), final.with_name(final.name + ".old")
        shutil.rmtree(tmp, ignore_errors=True)  # debris of an earlier interrupted save
        try:
            self.model.save_pretrained(tmp, state_dict=weights)
            self.tokenizer.save_pretrained(tmp)
            with open(tmp / TRAINER_STATE, "wb") as f:
                torch.save(state, f)
                f.flush()
                os.fsync(f.fileno())
        except Exception as e:  # a full disk, a directory made read-only mid-run (safetensors and torch raise their own types)
            shutil.rmtree(tmp, ignore_errors=True)
            free = shutil.disk_usage(final.parent).free / 2**20
            detail = " ".join((getattr(e, "strerror", None) or str(e)).split())[:200]
            raise CheckpointError(
                f"writing checkpoint {final} failed ({detail}; {free:.0f} MiB free there): free some space or pick another --save; "
                "the checkpoints written before are intact"
            ) from None
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        if final.exists():
            shutil.rmtree(old, ignore_errors=True)
            final.rename(old)
            tmp.rename(final)
            shutil.rmtree(old)
        else:
            tmp.rename(final)

    def load(self, ckpt_dir: str | Path) -> dict[str, Any]:
        """Restore weights, optimizer and RNG from a `save` directory; returns its extra_state.

        Every rank reads the full tensors and keeps its shard, so the checkpoint's rank count
        does not matter.
        """
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

        ckpt = Path(ckpt_dir)
        state_file = ckpt / TRAINER_STATE
        if not state_file.exists():
            raise FileNotFoundError(f"{ckpt} is not a complete checkpoint (no {TRAINER_STATE})")
        # both files read before either is applied: one that fails to load changes nothing
        weights = dict(_iter_checkpoint(ckpt))
        expected = set(self.model.state_dict()) - self._aliases
        missing, unexpected = expected - set(weights), set(weights) - expected
        if missing or unexpected:
            raise ValueError(f"checkpoint {ckpt} does not match the model: missing {sorted(missing)[:3]}, unexpected {sorted(unexpected)[:3]}")
        state = torch.load(state_file, map_location="cpu", weights_only=False)  # our own file: holds python objects
        options = StateDictOptions(full_state_dict=True, strict=False)
        set_model_state_dict(self.model, weights, options=options)
        set_optimizer_state_dict(self.model, self.optimizer, state["optimizer"], options=options)
        _set_rng_state(state["rng"])
        return state["extra"]

    def close(self) -> None:
        """Nothing to release for a single-process actor; the distributed one overrides this."""


def _iter_checkpoint(ckpt: Path) -> Iterator[tuple[str, Tensor]]:
    """(name, tensor) of an HF safetensors directory, single file or sharded."""
    from safetensors.torch import load_file

    index = ckpt / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else ["model.safetensors"]
    for f in files:
        yield from load_file(str(ckpt / f)).items()


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"].cpu())
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"]])
