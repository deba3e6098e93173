"""The trainer tests' builders: an Actor's Config of small settings, samples of varied lengths to
train on, and the long samples and measures of the gradient-checkpointing checks (here and on a
GPU, tests/gpu/)."""

from __future__ import annotations

import math
import random

import torch

from vime.config import Config
from vime.rollout.types import Sample
from vime.trainer.actor import Actor


def make_args(**overrides) -> Config:
    base = dict(
        lr=1e-3,
        weight_decay=0.0,
        adam_beta1=0.9,
        adam_beta2=0.98,
        clip_grad=1.0,
        eps_clip=0.2,
        eps_clip_high=None,
        kl_loss_coef=0.0,
        kl_loss_type="low_var_kl",
        entropy_coef=0.0,
        advantage_estimator="grpo",
        use_tis=False,
        tis_clip=2.0,
        max_tokens_per_gpu=4096,
        global_batch_size=None,
        seed=0,
        gradient_checkpointing=False,
        rollout_temperature=1.0,
        rollout_max_response_len=8,
    )
    base.update(overrides)
    return Config(**base)


def make_samples(n: int = 4, seed: int = 0) -> list[Sample]:
    """Samples of different prompt and response lengths (so micro-batches need padding)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = [rng.randrange(4, 100) for _ in range(3 + 2 * i)]
        response = [rng.randrange(4, 100) for _ in range(2 + (i * 3) % 7)]
        out.append(Sample(index=i, tokens=prompt + response, response_length=len(response)))
    return out


def long_samples(n: int, length: int = 400) -> list[Sample]:
    """Sequences long enough that a tiny model's activations outweigh its weights (~0.1M
    parameters against ~8 kB of float32 activations per token and layer), so what a forward
    keeps for the backward is mostly activations."""
    rng = random.Random(n)
    out = []
    for i in range(n):
        tokens = [rng.randrange(4, 100) for _ in range(length - 7 * i)]
        out.append(Sample(index=i, tokens=tokens, response_length=len(tokens) // 2))
    return out


def saved_bytes_and_grads(actor: Actor, samples: list[Sample], advantages: list[float]) -> tuple[int, dict]:
    """One accumulation of gradients in training mode, as train_step runs it: the bytes autograd
    kept for the backward, and the gradients as full host tensors. Under --compile transformers 5
    checkpoints inside the compiled layer, so Dynamo turns the recomputation into part of the
    compiled backward: no second Python forward runs for a hook to count, and what the forward
    keeps is what shows that the activations are recomputed."""
    saved = [0]

    def pack_hook(t: torch.Tensor) -> torch.Tensor:
        saved[0] += t.numel() * t.element_size()
        return t

    actor.optimizer_step.optimizer.zero_grad(set_to_none=True)
    actor.policy.scorer.train()  # checkpointing applies in training mode only
    with torch.autograd.graph.saved_tensors_hooks(pack_hook, lambda t: t):
        actor.accumulate_gradients(samples, advantages, None)
    grads = {}
    for name, p in actor.model.named_parameters():
        g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        grads[name] = g.detach().float().cpu().clone()
    return saved[0], grads


def relative_gap(a: dict, b: dict) -> float:
    """‖a − b‖ / ‖b‖ over all the tensors of two name → tensor maps together."""
    diff = sum(float((a[n] - b[n]).pow(2).sum()) for n in b)
    return math.sqrt(diff / sum(float(t.pow(2).sum()) for t in b.values()))
