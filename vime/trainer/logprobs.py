"""Log-probs (and entropies) of chosen tokens straight from hidden states, in token chunks.

The LM head of a 150k-token vocabulary turns R scored positions into R × V float logits:
16k response tokens of a Qwen3 vocabulary are 10 GB in float32, more than the rest of the
step. Here the logits of at most `chunk_size` positions exist at a time, in the forward and
again (recomputed) in the backward, so peak memory is chunk × V whatever the batch. Only the
hidden states and the head's weight are kept for the backward.

Gradients, per position with z = h Wᵀ / τ, p = softmax(z), y the chosen token and
H = −Σ p log p:
  d log p_y / dz = onehot(y) − p
  d H / dz       = −p ⊙ (log p + H)
then dh = (dz / τ) W and dW = Σ (dz / τ)ᵀ h.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

DEFAULT_CHUNK = 1024


def _chunk_stats(h: Tensor, weight: Tensor, targets: Tensor, temperature: float, with_entropy: bool) -> tuple[Tensor, Tensor, Tensor | None]:
    """log-softmax of one chunk in float32: (log_probs [n, V], chosen [n], entropy [n] | None)."""
    logits = (h @ weight.t()).float()
    if temperature != 1.0:
        logits = logits / temperature
    log_p = torch.log_softmax(logits, dim=-1)
    del logits
    chosen = log_p.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(log_p.exp() * log_p).sum(-1) if with_entropy else None
    return log_p, chosen, entropy


class _ChunkedLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, hidden: Tensor, weight: Tensor, targets: Tensor, temperature: float, with_entropy: bool, chunk: int) -> tuple[Tensor, Tensor]:
        chosen = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        entropy = torch.zeros_like(chosen)
        for a in range(0, hidden.shape[0], chunk):
            _, c, e = _chunk_stats(hidden[a : a + chunk], weight, targets[a : a + chunk], temperature, with_entropy)
            chosen[a : a + chunk] = c
            if e is not None:
                entropy[a : a + chunk] = e
        ctx.save_for_backward(hidden, weight, targets)
        ctx.temperature, ctx.chunk = temperature, chunk
        ctx.set_materialize_grads(False)
        if not with_entropy:
            ctx.mark_non_differentiable(entropy)
        return chosen, entropy

    @staticmethod
    def backward(ctx: Any, grad_chosen: Tensor | None, grad_entropy: Tensor | None) -> tuple[Tensor | None, ...]:
        hidden, weight, targets = ctx.saved_tensors
        temperature, chunk = ctx.temperature, ctx.chunk
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        for a in range(0, hidden.shape[0], chunk):
            h = hidden[a : a + chunk]
            log_p, _, ent = _chunk_stats(h, weight, targets[a : a + chunk], temperature, grad_entropy is not None)
            p = log_p.exp()
            dz = torch.zeros_like(log_p)
            if grad_chosen is not None:
                g = grad_chosen[a : a + chunk].unsqueeze(-1)
                dz -= p * g
                dz.scatter_add_(-1, targets[a : a + chunk].unsqueeze(-1), g)
            if grad_entropy is not None:
                dz -= grad_entropy[a : a + chunk].unsqueeze(-1) * p * (log_p + ent.unsqueeze(-1))
            del p, log_p
            if temperature != 1.0:
                dz /= temperature
            dz = dz.to(weight.dtype)
            if grad_h is not None:
                grad_h[a : a + chunk] = dz @ weight
            if grad_w is not None:
                if weight.dtype == torch.float32:
                    grad_w.addmm_(dz.t(), h)
                else:  # low-precision product, float32 accumulation over chunks
                    grad_w += (dz.t() @ h).float()
        return grad_h, None if grad_w is None else grad_w.to(weight.dtype), None, None, None, None


def chunked_log_probs(
    hidden: Tensor, weight: Tensor, targets: Tensor, temperature: float = 1.0, with_entropy: bool = False, chunk_size: int = DEFAULT_CHUNK
) -> tuple[Tensor, Tensor | None]:
    """log softmax(h Wᵀ / τ)[y] for each row of `hidden` [R, H], and the entropy when asked.

    `weight` is the LM head's [V, H] (no bias, as in every model family supported). Results are
    float32 whatever the compute dtype, like the full-logit path they replace. `temperature`
    ≤ 0 means greedy sampling, scored at τ = 1.
    """
    tau = float(temperature) if temperature > 0 else 1.0
    chosen, entropy = _ChunkedLogProbs.apply(hidden, weight, targets, tau, with_entropy, max(1, int(chunk_size)))
    return chosen, entropy if with_entropy else None
