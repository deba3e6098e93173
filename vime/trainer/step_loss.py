"""One optimizer step's loss, a micro-batch (or a chunk of one) at a time: the step's per-sample
token tensors (`StepTokens`), each micro-batch's `LossInputs` cut from them, and the shares of
the loss the actor backpropagates, their metrics summed on the device (`StepLoss`).

The denominators are the whole step's (its loss-token count over all ranks, or the Dr.GRPO
constant), so the shares of its micro-batches add up to the loss of the step, whatever the
split (vime/algorithms/objective.py)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from vime.algorithms.objective import LossInputs, Objective
from vime.rollout.types import Sample
from vime.trainer.packing import PackedBatch, to_device


@dataclass
class StepTokens:
    """A step's per-sample token tensors, built once (each micro-batch concatenates its own)."""

    masks: list[Tensor]
    rollout_lps: list[Tensor]  # zeros where the engine sent none
    has_rollout_lps: list[Tensor]  # the mask where it did, else zeros
    num_tokens: float  # loss tokens in the step
    weights: list[Tensor]  # 1 / the sample's loss tokens on each of its tokens (the sample-mean loss)
    staleness: list[Tensor] | None  # per token: the trained version minus the one that sampled it (-1: unknown)

    @classmethod
    def of(cls, samples: list[Sample], version: int | None = None) -> StepTokens:
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


def as_advantages(samples: list[Sample], advantages: Advantages) -> Tensor | list[Tensor]:
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


class StepLoss:
    """The loss of one optimizer step's tokens, a share at a time, and its metric sums
    (`totals`, kept on the device: a float() per metric would stall the GPU each micro-batch).

    `old_log_probs` None: the forward's own detached log-probs are the old ones (or with
    `coupled`, --use-rollout-logprobs, the engine's); `version`: the policy version being
    trained, for the staleness split of the metrics (None leaves it out)."""

    def __init__(
        self,
        objective: Objective,
        samples: list[Sample],
        advantages: Tensor | list[Tensor],
        old_log_probs: list[Tensor] | None,
        ref_log_probs: list[Tensor] | None,
        version: int | None,
        device: torch.device,
        max_response_len: int,
        coupled: bool,
    ) -> None:
        if (objective.correction.active or coupled) and any(s.rollout_log_probs is None for s in samples):
            raise ValueError(
                "--use-tis, --use-rs and --use-rollout-logprobs need the engine's log-probs on every sample (rollout_log_probs)"
            )
        self.objective, self.samples, self.advantages = objective, samples, advantages
        self.old_log_probs, self.ref_log_probs, self.version = old_log_probs, ref_log_probs, version
        self.device, self.coupled = device, coupled
        self.sample_mean = objective.agg == "sample_mean"
        # the constant denominators: the step's samples (sample mean), Dr.GRPO's otherwise
        self.const = float(len(samples) if self.sample_mean else max_response_len * len(samples))
        self.totals: dict[str, Tensor] = {}
        self._tokens: StepTokens | None = None

    def inputs(self, mb: PackedBatch) -> LossInputs:
        """The micro-batch's loss inputs, flat over its response tokens."""
        if self._tokens is None:  # host work done while the GPU runs the first forward, not before it
            self._tokens = StepTokens.of(self.samples, self.version)
        tokens, advantages = self._tokens, self.advantages

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
            old=rollout_lp if self.coupled else None if self.old_log_probs is None else flat(self.old_log_probs),
            ref=None if self.ref_log_probs is None else flat(self.ref_log_probs),
            weights=flat(tokens.weights) if self.sample_mean else None,
            staleness=None if tokens.staleness is None else flat(tokens.staleness),
            prompt_lens=(
                to_device(
                    torch.tensor([len(self.samples[i].tokens) - self.samples[i].response_length for i in mb.indices])
                    .repeat_interleave(lengths)
                    .float(),
                    self.device,
                )
                if self.objective.correction.custom is not None and mb.indices
                else None
            ),
        )

    def __call__(self, log_probs: Tensor, entropy: Tensor, t: LossInputs) -> Tensor:
        """The loss of these tokens (a share of the step's), its metrics added to `totals`."""
        assert self._tokens is not None
        loss, m = self.objective(log_probs, entropy, t, num_tokens=self._tokens.num_tokens, const=self.const)
        for k, v in m.items():
            self.totals[f"train/{k}"] = self.totals.get(f"train/{k}", 0.0) + torch.as_tensor(v).detach().to(
                self.device, torch.float64
            )
        return loss

    def chunk_loss(self, mb: PackedBatch, scale: float) -> Callable[[Tensor, Tensor | None, slice], Tensor]:
        """The loss of one chunk of the micro-batch's rows, for the LM head to take its gradient
        in the forward (`chunked_loss`), times `scale` (the world size: it scales each token's
        gradient before the head rounds the logits' gradient, as autograd does on the other path)."""
        inputs: LossInputs | None = None

        def loss(log_probs: Tensor, entropy: Tensor | None, rows: slice) -> Tensor:
            nonlocal inputs
            if inputs is None:  # built at the first chunk, once the decoder's forward is queued
                inputs = self.inputs(mb)
            assert entropy is not None
            return self(log_probs, entropy, inputs.rows(rows)) * scale

        return loss
