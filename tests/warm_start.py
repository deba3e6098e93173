"""A supervised step for the tests' warm starts: GRPO then improves a model that already answers
in the right form. Not part of vime: nothing in a run fine-tunes on labels."""

from __future__ import annotations

import torch

from vime.algorithms.objective import aggregate
from vime.rollout.types import Sample
from vime.trainer.actor import Actor


def sft_step(actor: Actor, samples: list[Sample]) -> dict[str, float]:
    """One optimizer step of cross-entropy on the loss-masked response tokens (token mean): the
    tests' warm start."""
    actor.scorer.train()
    actor.optimizer.zero_grad(set_to_none=True)
    masks = [torch.tensor(s.effective_loss_mask(), dtype=torch.float32) for s in samples]
    num_tokens = float(sum(m.sum() for m in masks))
    total = 0.0
    for idx in actor._plan(samples):
        mb = actor._pack(samples, idx)
        log_probs, _ = actor._forward(actor.scorer, mb, with_entropy=False)
        parts = [masks[i] for i in mb.indices] or [torch.zeros(len(mb.targets))]
        loss = aggregate(-log_probs, torch.cat(parts).to(actor.device), "token_mean", num_tokens=num_tokens)
        (loss * actor.world).backward()
        total += float(loss.detach())
    return {**actor._sum_over_ranks({"train/sft_loss": total}), **actor._clip_and_step()}
