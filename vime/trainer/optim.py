"""How the weights move: the optimizer (`--optimizer adam|sgd`) and the learning rate of each
optimizer step (Megatron's schedule), so slime/Megatron run scripts train as they did there.

The learning rate is a pure function of the optimizer step's index (`LRSchedule`): the actor
counts every optimizer step slot, a skipped one too, and keeps that count in its checkpoints,
so a resumed run goes on with the schedule where it stopped.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from vime.config import TrainerConfig

DecayStyle = Literal["constant", "linear", "cosine"]


@dataclass(frozen=True, kw_only=True)
class LRSchedule:
    """Megatron's learning-rate schedule (its `OptimizerParamScheduler`, in optimizer steps).

    Step k (0-based) runs at `lr * k / warmup_iters` while k < warmup_iters (so step 0 runs at 0,
    and the first step reaches `lr` at k = warmup_iters); then `constant` stays at `lr`, and
    `linear` / `cosine` go from `lr` down to `min_lr` by the decay ratio
    (k - warmup_iters) / (decay_iters - warmup_iters), i.e. over `decay_iters` steps counted from
    step 0 with the warm-up inside them; after `decay_iters` the rate stays at `min_lr`.
    """

    lr: float
    min_lr: float = 0.0
    warmup_iters: int = 0
    decay_iters: int | None = None  # needed by linear and cosine
    decay_style: DecayStyle = "constant"

    def __post_init__(self) -> None:
        """The flags are checked with their names in `Config.validate`; this guards direct use."""
        if self.decay_style not in ("constant", "linear", "cosine"):
            raise ValueError(f"lr decay style {self.decay_style!r}: use constant, linear or cosine")
        if self.warmup_iters < 0:
            raise ValueError(f"lr warm-up of {self.warmup_iters} steps: give 0 or more")
        if self.decay_style != "constant" and (self.decay_iters is None or self.decay_iters < 1):
            raise ValueError(f"{self.decay_style} lr decay over {self.decay_iters} steps: give at least 1")

    @classmethod
    def of(cls, trainer: TrainerConfig, num_rollout: int | None) -> LRSchedule:
        """The run's schedule. The decay spans every optimizer step of the run's `num_rollout`
        rollouts (--num-rollout, or --num-epoch's, resolved before the actor is built) unless
        --lr-decay-iters says otherwise."""
        decay = trainer.lr_decay_iters
        if decay is None and num_rollout is not None:
            decay = num_rollout * trainer.steps_per_rollout
        warmup = trainer.lr_warmup_iters
        if trainer.lr_warmup_fraction is not None and decay is not None:  # Megatron: a share of the decay's steps
            warmup = int(trainer.lr_warmup_fraction * decay)
        return cls(
            lr=trainer.lr,
            min_lr=trainer.min_lr,
            warmup_iters=warmup,
            decay_iters=decay,
            decay_style=trainer.lr_decay_style,
        )

    def __call__(self, step: int) -> float:
        """The learning rate of optimizer step `step` (0-based)."""
        w = self.warmup_iters
        if w > 0 and step <= w:  # at step w both branches give lr
            return self.lr * step / w
        if self.decay_style == "constant":
            return self.lr
        assert self.decay_iters is not None  # __post_init__
        if step > self.decay_iters:  # also each step after a warm-up as long as the decay or longer: never 0 / 0
            return self.min_lr
        ratio = (step - w) / (self.decay_iters - w)
        coeff = 1.0 - ratio if self.decay_style == "linear" else 0.5 * (math.cos(math.pi * ratio) + 1.0)
        return self.min_lr + coeff * (self.lr - self.min_lr)


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Two groups: the weight matrices, embeddings and LM head included (ndim >= 2), decay; biases
    and norm weights do not, as in Megatron and HF's Trainer (decaying a norm's gain towards 0
    shrinks the layer's output, which no data asks for). Always both groups, in this order, so a
    checkpoint's layout does not depend on --weight-decay. Under FSDP2 a parameter is a DTensor,
    whose ndim is the full tensor's. Frozen parameters (the base model under LoRA) are left out:
    the optimizer holds state only for what trains."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]


def make_optimizer(trainer: TrainerConfig, model: nn.Module, fused: bool) -> torch.optim.Optimizer:
    """AdamW (Megatron's `adam`: decoupled weight decay) or SGD with momentum (its weight decay is
    the L2 term added to the gradient, as in Megatron's SGD). `fused` (one kernel for all
    parameters) applies to AdamW only: the fused SGD kernel has no sharding rule for FSDP2's
    DTensors in torch 2.13, and with momentum it leaves the buffers it allocates uninitialized
    when its first step is skipped for a non-finite gradient."""
    groups = param_groups(model, trainer.weight_decay)
    if trainer.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=trainer.lr, momentum=trainer.sgd_momentum)
    if trainer.optimizer != "adam":
        raise ValueError(f"--optimizer {trainer.optimizer!r}: use adam or sgd")
    return torch.optim.AdamW(
        groups, lr=trainer.lr, betas=(trainer.adam_beta1, trainer.adam_beta2), eps=trainer.adam_eps, fused=fused
    )


def set_lr_and_decay(optimizer: torch.optim.Optimizer, lr: float, weight_decay: float) -> None:
    """Give every group the step's learning rate, and the decaying group (the first,
    `param_groups`) the run's weight decay: also after a checkpoint load, which brings back the
    values the checkpoint's run used (one group decaying everything, before the split)."""
    for i, group in enumerate(optimizer.param_groups):
        group["lr"] = lr
        group["weight_decay"] = weight_decay if i == 0 else 0.0


def clip_and_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, clip: float, loss: torch.Tensor | float = 0.0
) -> dict[str, float]:
    """Clip by the norm of the whole gradient, all shards together, then step; unless the
    step's `loss` or the norm is not finite, when the step is skipped and counted
    (`train/skipped_steps`): clipping scales a NaN gradient to NaN weights, and the
    optimizer's moments would carry it into every later step. Loss and norm are the same on
    every rank (summed and reduced), so all ranks skip together.

    With AdamW on CUDA the check runs on the device: the fused AdamW skips itself, moments and
    step count included, where `found_inf` is set (GradScaler's mechanism, without the
    scaling), so clip and step are queued without the host waiting for the norm or the loss
    first. SGD is never fused (`make_optimizer`): the host waits for the check."""
    params = [p for p in model.parameters() if p.grad is not None]
    grad_norm = torch.nn.utils.get_total_norm([p.grad for p in params], 2.0)
    if hasattr(grad_norm, "full_tensor"):  # a DTensor: the partial norms of each shard, reduced here
        grad_norm = grad_norm.full_tensor()
    lr = float(optimizer.param_groups[0]["lr"])
    finite = torch.isfinite(grad_norm) & torch.isfinite(torch.as_tensor(loss, device=grad_norm.device))
    if optimizer.defaults.get("fused"):
        optimizer.found_inf = (~finite).float()
    elif not bool(finite):
        optimizer.zero_grad(set_to_none=True)
        return {"train/grad_norm": float(grad_norm), "train/lr": lr, "train/skipped_steps": 1.0}
    if clip > 0:
        torch.nn.utils.clip_grads_with_norm_(params, clip, grad_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)  # gradients are not needed until the next step
    skipped = 0.0 if bool(finite) else 1.0  # read once the step is queued
    return {"train/grad_norm": float(grad_norm), "train/lr": lr, "train/skipped_steps": skipped}
