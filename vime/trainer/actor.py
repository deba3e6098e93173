"""The policy being trained: an HF causal LM, its AdamW optimizer, log-probs, steps, checkpoints.

One process, one device for now (FSDP2 comes with multi-GPU training). Sequences are
right-padded into micro-batches that fit `--max-tokens-per-gpu`; the loss of each micro-batch
is divided by the loss-token count of the whole optimizer step, so gradient accumulation gives
the same gradients as one big batch, whatever the budget.
"""
from __future__ import annotations

import json
import os
import random
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch
from torch import Tensor

from vime.models import load_tokenizer
from vime.rollout.types import Sample
from vime.trainer.loss import aggregate, entropy_from_logits, kl_penalty, policy_loss

TRAINER_STATE = "trainer_state.pt"


@dataclass
class MicroBatch:
    """Right-padded sequences plus where their response tokens are.

    Token t of sequence b is predicted by the logits at position t - 1, so `rows`/`cols` index
    the hidden states whose logits score each response token, in sample order.
    """

    indices: list[int]  # positions of these samples in the caller's list
    input_ids: Tensor  # [B, L]
    attention_mask: Tensor  # [B, L]
    rows: Tensor  # [T] batch row of each response token
    cols: Tensor  # [T] position whose logits predict it
    targets: Tensor  # [T] the response token ids
    response_lengths: list[int]


def plan_micro_batches(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Group sequence indices so that (sequences × longest length) stays within `max_tokens`.

    Longest first, so sequences of similar length share a batch and padding stays small; a
    sequence longer than the budget gets a batch of its own rather than an error.
    """
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches: list[list[int]] = []
    for i in order:
        if batches and (len(batches[-1]) + 1) * lengths[batches[-1][0]] <= max_tokens:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches


def _arg(args: Any, name: str, default: Any) -> Any:
    value = getattr(args, name, default)
    return default if value is None else value


class Actor:
    """Policy model + optimizer (+ frozen reference model when `kl_loss_coef > 0`)."""

    def __init__(self, args: Any, model_path: str | Path, device: str = "cpu") -> None:
        from transformers import AutoModelForCausalLM

        self.args = args
        self.device = torch.device(device)
        dtype = getattr(torch, _arg(args, "dtype", "float32"))
        self.model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=dtype).to(self.device)
        self.model.config.use_cache = False  # training never decodes; a KV cache only costs memory
        if _arg(args, "gradient_checkpointing", False):
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.tokenizer = load_tokenizer(model_path)
        pad = self.tokenizer.pad_token_id
        self.pad_token_id: int = pad if pad is not None else (self.tokenizer.eos_token_id or 0)
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(),
            lr=_arg(args, "lr", 1e-6),
            betas=(_arg(args, "adam_beta1", 0.9), _arg(args, "adam_beta2", 0.98)),
            weight_decay=_arg(args, "weight_decay", 0.0),
        )
        self.ref_model = None
        if _arg(args, "kl_loss_coef", 0.0) > 0:
            self.ref_model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=dtype).to(self.device)
            self.ref_model.requires_grad_(False)
            self.ref_model.eval()

    # ---- forward ---------------------------------------------------------------------

    def _micro_batches(self, samples: list[Sample]) -> Iterator[MicroBatch]:
        budget = _arg(self.args, "max_tokens_per_gpu", 4096)
        for idx in plan_micro_batches([len(s.tokens) for s in samples], budget):
            batch = [samples[i] for i in idx]
            width = max(len(s.tokens) for s in batch)
            ids = torch.full((len(batch), width), self.pad_token_id, dtype=torch.long)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            rows, cols = [], []
            for b, s in enumerate(batch):
                ids[b, : len(s.tokens)] = torch.tensor(s.tokens, dtype=torch.long)
                mask[b, : len(s.tokens)] = 1
                rows += [b] * s.response_length
                cols += range(s.prompt_length - 1, len(s.tokens) - 1)
            rows_t, cols_t = torch.tensor(rows, dtype=torch.long), torch.tensor(cols, dtype=torch.long)
            yield MicroBatch(
                indices=idx,
                input_ids=ids.to(self.device),
                attention_mask=mask.to(self.device),
                rows=rows_t.to(self.device),
                cols=cols_t.to(self.device),
                targets=ids[rows_t, cols_t + 1].to(self.device),
                response_lengths=[s.response_length for s in batch],
            )

    def _forward(self, model: torch.nn.Module, mb: MicroBatch, with_entropy: bool) -> tuple[Tensor, Tensor | None]:
        """Log-probs (and entropies) of a micro-batch's response tokens, flat in sample order.

        Only the hidden states of response positions go through the LM head, so the full-vocab
        logits exist for T response tokens instead of B × L positions, and only until the
        gather. Logits are divided by the rollout temperature, as the engine did when it
        sampled, so trainer and engine score the same distribution (top-p/top-k truncation is
        not reproduced).
        """
        hidden = model.get_decoder()(input_ids=mb.input_ids, attention_mask=mb.attention_mask, use_cache=False).last_hidden_state
        logits = model.get_output_embeddings()(hidden[mb.rows, mb.cols]).float()
        temperature = _arg(self.args, "rollout_temperature", 1.0)
        if temperature > 0:
            logits = logits / temperature
        log_probs = torch.log_softmax(logits, dim=-1)
        del logits
        chosen = log_probs.gather(-1, mb.targets.unsqueeze(-1)).squeeze(-1)
        entropy = None
        if with_entropy:
            if _arg(self.args, "entropy_coef", 0.0) != 0:
                entropy = entropy_from_logits(log_probs)
            else:  # only a metric: keep it out of the autograd graph
                with torch.no_grad():
                    entropy = entropy_from_logits(log_probs)
        return chosen, entropy

    @torch.no_grad()
    def compute_log_probs(self, samples: list[Sample], model: torch.nn.Module | None = None) -> list[Tensor]:
        """Per-sample log-probs of the response tokens under `model` (default: the policy)."""
        model = self.model if model is None else model
        was_training = model.training
        model.eval()
        out: list[Tensor | None] = [None] * len(samples)
        try:
            for mb in self._micro_batches(samples):
                flat, _ = self._forward(model, mb, with_entropy=False)
                for i, part in zip(mb.indices, flat.split(mb.response_lengths)):
                    out[i] = part
        finally:
            model.train(was_training)
        return out  # type: ignore[return-value]

    # ---- training --------------------------------------------------------------------

    def train_step(self, samples: list[Sample], advantages: list[float]) -> dict[str, float]:
        """Train on one rollout: `len(samples) // global_batch_size` optimizer steps.

        Old log-probs are recomputed once, before the first step, with the current weights; on
        the first step they equal the new log-probs (ratio 1, on-policy), later steps of the
        same rollout are off-policy by the earlier steps and the clip applies. Returns metrics
        averaged over the steps.
        """
        if len(samples) != len(advantages):
            raise ValueError(f"{len(samples)} samples but {len(advantages)} advantages")
        gbs = _arg(self.args, "global_batch_size", len(samples))
        if gbs < 1 or len(samples) % gbs != 0:
            raise ValueError(f"{len(samples)} samples do not split into optimizer steps of --global-batch-size {gbs}")
        old = self.compute_log_probs(samples)
        ref = self.compute_log_probs(samples, model=self.ref_model) if self.ref_model is not None else None
        steps = []
        for start in range(0, len(samples), gbs):
            sl = slice(start, start + gbs)
            steps.append(self._optimizer_step(samples[sl], advantages[sl], old[sl], None if ref is None else ref[sl]))
        metrics = {k: sum(m[k] for m in steps) / len(steps) for k in steps[0]}
        diff = rollout_logprob_abs_diff(samples, old)
        if diff is not None:
            metrics["train/train_rollout_logprob_abs_diff"] = diff
        return metrics

    def _optimizer_step(self, samples: list[Sample], advantages: list[float], old: list[Tensor], ref: list[Tensor] | None) -> dict[str, float]:
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        metrics = self.accumulate_gradients(samples, advantages, old, ref)
        if not any(sum(s.effective_loss_mask()) for s in samples):
            # nothing to learn from (e.g. every response aborted): AdamW's momentum would still
            # move the weights on zero gradients, so skip the step
            self.optimizer.zero_grad(set_to_none=True)
            return {**metrics, "train/grad_norm": 0.0, "train/lr": float(self.optimizer.param_groups[0]["lr"])}
        metrics.update(self._clip_and_step())
        return metrics

    def accumulate_gradients(
        self, samples: list[Sample], advantages: list[float], old_log_probs: list[Tensor], ref_log_probs: list[Tensor] | None = None
    ) -> dict[str, float]:
        """Forward/backward every micro-batch of one optimizer step into `.grad` (no step).

        Each micro-batch's loss is divided by the step's loss-token count (or the Dr.GRPO
        constant), so the accumulated gradient is that of the step's true token mean.
        """
        a = self.args
        masks = [torch.tensor(s.effective_loss_mask(), dtype=torch.float32) for s in samples]
        num_tokens = float(sum(m.sum() for m in masks))
        agg = "seq_sum_const" if _arg(a, "advantage_estimator", "grpo") == "dr_grpo" else "token_mean"
        max_len = _arg(a, "rollout_max_response_len", max((s.response_length for s in samples), default=1))
        const = float(max_len * len(samples))
        use_tis = _arg(a, "use_tis", False)
        if use_tis and any(s.rollout_log_probs is None for s in samples):
            raise ValueError("--use-tis needs the engine's log-probs on every sample (rollout_log_probs)")
        kl_coef = _arg(a, "kl_loss_coef", 0.0)
        ent_coef = _arg(a, "entropy_coef", 0.0)
        totals: dict[str, float] = {}
        for mb in self._micro_batches(samples):
            log_probs, entropy = self._forward(self.model, mb, with_entropy=True)

            def flat(per_sample: list) -> Tensor:
                return torch.cat([torch.as_tensor(per_sample[i], dtype=torch.float32) for i in mb.indices]).to(self.device)

            mask = flat(masks)
            adv = torch.cat([torch.full((samples[i].response_length,), float(advantages[i])) for i in mb.indices]).to(self.device)
            pg, m = policy_loss(
                log_probs,
                flat(old_log_probs),
                adv,
                mask,
                eps_clip=_arg(a, "eps_clip", 0.2),
                eps_clip_high=getattr(a, "eps_clip_high", None),
                rollout_log_probs=flat([s.rollout_log_probs for s in samples]) if use_tis else None,
                use_tis=use_tis,
                tis_clip=_arg(a, "tis_clip", 2.0),
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
            loss.backward()
            for k, v in m.items():
                totals[f"train/{k}"] = totals.get(f"train/{k}", 0.0) + float(v)
        return totals

    def _clip_and_step(self) -> dict[str, float]:
        clip = _arg(self.args, "clip_grad", 1.0)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip if clip > 0 else float("inf"))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)  # gradients are not needed until the next step
        return {"train/grad_norm": float(grad_norm), "train/lr": float(self.optimizer.param_groups[0]["lr"])}

    def sft_step(self, samples: list[Sample]) -> dict[str, float]:
        """One optimizer step of cross-entropy on the loss-masked response tokens (token mean)."""
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        masks = [torch.tensor(s.effective_loss_mask(), dtype=torch.float32) for s in samples]
        num_tokens = float(sum(m.sum() for m in masks))
        total = 0.0
        for mb in self._micro_batches(samples):
            log_probs, _ = self._forward(self.model, mb, with_entropy=False)
            mask = torch.cat([masks[i] for i in mb.indices]).to(self.device)
            loss = aggregate(-log_probs, mask, "token_mean", num_tokens=num_tokens)
            loss.backward()
            total += float(loss.detach())
        return {"train/sft_loss": total, **self._clip_and_step()}

    # ---- weights and checkpoints -----------------------------------------------------

    def named_weights(self) -> Iterator[tuple[str, Tensor]]:
        """(HF name, tensor) as in the checkpoint files, for weight pushes.

        A tensor shared by several names (tied embeddings) is yielded once, under its first
        name (`model.embed_tokens.weight`), which is the one save_pretrained keeps.
        """
        seen: set[int] = set()
        for name, tensor in self.model.state_dict().items():
            ptr = tensor.untyped_storage().data_ptr()
            if ptr in seen:
                continue
            seen.add(ptr)
            yield name, tensor

    def save(self, ckpt_dir: str | Path, extra_state: dict[str, Any]) -> Path:
        """Write an HF directory (+ trainer_state.pt) at `ckpt_dir`, atomically.

        Everything goes to `<dir>.tmp` first; only a complete copy replaces an existing
        checkpoint of the same name, so a crash at any point leaves the previous one loadable
        (at worst renamed to `<dir>.old` for the instant between the two renames).
        """
        final = Path(ckpt_dir)
        tmp, old = final.with_name(final.name + ".tmp"), final.with_name(final.name + ".old")
        shutil.rmtree(tmp, ignore_errors=True)  # debris of an earlier interrupted save
        try:
            self.model.save_pretrained(tmp)
            self.tokenizer.save_pretrained(tmp)
            state = {"optimizer": self.optimizer.state_dict(), "rng": _rng_state(), "extra": extra_state}
            with open(tmp / TRAINER_STATE, "wb") as f:
                torch.save(state, f)
                f.flush()
                os.fsync(f.fileno())
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
        return final

    def load(self, ckpt_dir: str | Path) -> dict[str, Any]:
        """Restore weights, optimizer and RNG from a `save` directory; returns its extra_state."""
        ckpt = Path(ckpt_dir)
        state_file = ckpt / TRAINER_STATE
        if not state_file.exists():
            raise FileNotFoundError(f"{ckpt} is not a complete checkpoint (no {TRAINER_STATE})")
        weights = dict(_iter_checkpoint(ckpt))
        missing, unexpected = self.model.load_state_dict(weights, strict=False)
        tied = {name for name, _ in self.model.state_dict().items()} - {name for name, _ in self.named_weights()}
        if unexpected or set(missing) - tied:
            raise ValueError(f"checkpoint {ckpt} does not match the model: missing {sorted(set(missing) - tied)[:3]}, unexpected {unexpected[:3]}")
        state = torch.load(state_file, map_location=self.device, weights_only=False)  # our own file: holds python objects
        self.optimizer.load_state_dict(state["optimizer"])
        _set_rng_state(state["rng"])
        return state["extra"]


def rollout_logprob_abs_diff(samples: list[Sample], log_probs: list[Tensor]) -> float | None:
    """Mean |trainer − engine| log-prob over the loss tokens of samples that carry engine log-probs.

    The engine/trainer mismatch in one number: ~0 when both run the same weights in the same
    precision, and what TIS corrects for when it is not.
    """
    total, count = 0.0, 0.0
    for s, lp in zip(samples, log_probs):
        if s.rollout_log_probs is None:
            continue
        mask = torch.tensor(s.effective_loss_mask(), dtype=torch.float32)
        diff = (lp.float().cpu() - torch.tensor(s.rollout_log_probs, dtype=torch.float32)).abs()
        total += float((diff * mask).sum())
        count += float(mask.sum())
    return total / count if count else None


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
