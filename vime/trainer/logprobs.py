"""Log-probs (and entropies) of chosen tokens straight from hidden states, in token chunks.

The LM head of a 150k-token vocabulary turns R scored positions into R × V float logits:
16k response tokens of a Qwen3 vocabulary are 10 GB in float32, more than the rest of the
step. Here the logits of at most `chunk_size` positions exist at a time, in the forward and
again (recomputed) in the backward, so peak memory is chunk × V whatever the batch. Only the
hidden states and the head's weight are kept for the backward.

Gradients, per position with z = h Wᵀ / τ, p = softmax(z), y the chosen token and
H = −Σ p log p (the forward keeps log Σ exp z per position, so the backward recomputes z but
not its normalizer):
  d log p_y / dz = onehot(y) − p
  d H / dz       = −p ⊙ (log p + H)
then dh = (dz / τ) W and dW = Σ (dz / τ)ᵀ h.

Training does not need the log-probs themselves, only a loss of them; when that loss is a sum
over positions (as every loss of `vime.algorithms.objective` is, its denominators being the step's
constants), `chunked_loss` takes d loss / d log p of each chunk while the chunk's logits still
exist and finishes dh and dW in the forward: the backward's recomputation of the logits, one
of the head's four [R, H] × [H, V] GEMMs, is never run.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the head's arithmetic runs in PyTorch
    triton = None

DEFAULT_CHUNK = 4096


def _stats(logits: Tensor, targets: Tensor, inv_tau: float, with_entropy: bool) -> tuple[Tensor, Tensor, Tensor]:
    """(chosen log-prob, log-sum-exp, entropy) of each row of a chunk's logits, in float32.

    The PyTorch version, run on CPU; CUDA runs `_stats_kernel`, one read of the logits."""
    z = logits.float() * inv_tau
    lse = torch.logsumexp(z, dim=-1)
    chosen = z.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse
    entropy = (
        lse - (torch.exp(z - lse.unsqueeze(-1)) * z).sum(-1) if with_entropy else torch.zeros_like(lse)
    )  # −Σ p log p
    return chosen, lse, entropy


def _grad_logits(
    logits: Tensor, targets: Tensor, lse: Tensor, entropy: Tensor, g_chosen: Tensor, g_entropy: Tensor, inv_tau: float
) -> Tensor:
    """d loss / d logits of a chunk, in the logits' dtype. The PyTorch version, run on CPU; CUDA
    runs `_grad_kernel`, in place."""
    log_p = logits.float() * inv_tau - lse.unsqueeze(-1)
    p = torch.exp(log_p)
    onehot = torch.arange(logits.shape[-1], device=logits.device) == targets.unsqueeze(-1)
    dz = (onehot.to(p.dtype) - p) * g_chosen.unsqueeze(-1) - g_entropy.unsqueeze(-1) * p * (
        log_p + entropy.unsqueeze(-1)
    )
    return (dz * inv_tau).to(logits.dtype)


if triton is not None:

    @triton.jit
    def _stats_kernel(
        logits_ptr, stride, targets_ptr, chosen_ptr, lse_ptr, ent_ptr, n_cols, inv_tau,
        WITH_ENTROPY: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        """One row per program, one pass over it: each lane keeps a running max m, Σ exp(z − m)
        and Σ exp(z − m)·z (online softmax), merged across lanes at the end."""
        row = tl.program_id(0).to(tl.int64)
        base = logits_ptr + row * stride
        cols = tl.arange(0, BLOCK)
        m = tl.full((BLOCK,), -1e30, tl.float32)
        s = tl.zeros((BLOCK,), tl.float32)
        t = tl.zeros((BLOCK,), tl.float32)
        for start in range(0, n_cols, BLOCK):
            mask = start + cols < n_cols
            z = tl.load(base + start + cols, mask=mask, other=0.0).to(tl.float32) * inv_tau
            z = tl.where(mask, z, -1e30)
            m_new = tl.maximum(m, z)
            scale = tl.exp(m - m_new)
            e = tl.where(mask, tl.exp(z - m_new), 0.0)
            s = s * scale + e
            if WITH_ENTROPY:
                t = t * scale + e * tl.where(mask, z, 0.0)
            m = m_new
        top = tl.max(m, axis=0)
        scale = tl.exp(m - top)
        total = tl.sum(s * scale, axis=0)
        lse = top + tl.log(total)
        y = tl.load(targets_ptr + row)
        tl.store(chosen_ptr + row, tl.load(base + y).to(tl.float32) * inv_tau - lse)
        tl.store(lse_ptr + row, lse)
        if WITH_ENTROPY:  # H = lse − Σ p z
            tl.store(ent_ptr + row, lse - tl.sum(t * scale, axis=0) / total)

    @triton.jit
    def _grad_kernel(
        logits_ptr, stride, targets_ptr, lse_ptr, ent_ptr, g_chosen_ptr, g_entropy_ptr, n_cols, inv_tau,
        BLOCK: tl.constexpr,
    ):  # fmt: skip
        """d loss / d logits over one block of one row, written over the logits it read."""
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < n_cols
        ptr = logits_ptr + row * stride + cols
        log_p = tl.load(ptr, mask=mask, other=0.0).to(tl.float32) * inv_tau - tl.load(lse_ptr + row)
        p = tl.exp(log_p)
        onehot = tl.where(cols == tl.load(targets_ptr + row), 1.0, 0.0)
        dz = (onehot - p) * tl.load(g_chosen_ptr + row) - tl.load(g_entropy_ptr + row) * p * (
            log_p + tl.load(ent_ptr + row)
        )
        tl.store(ptr, (dz * inv_tau).to(logits_ptr.dtype.element_ty), mask=mask)


def _stats_triton(logits: Tensor, targets: Tensor, inv_tau: float, with_entropy: bool) -> tuple[Tensor, Tensor, Tensor]:
    """`_stats` in one read of the logits."""
    n, v = logits.shape
    assert logits.stride(1) == 1 and targets.is_contiguous(), "the kernel reads rows of contiguous columns"
    chosen = torch.empty(n, dtype=torch.float32, device=logits.device)
    lse, entropy = torch.empty_like(chosen), torch.zeros_like(chosen)
    if n:
        _stats_kernel[(n,)](
            logits, logits.stride(0), targets, chosen, lse, entropy, v, inv_tau, with_entropy, BLOCK=2048, num_warps=8
        )
    return chosen, lse, entropy


def _grad_logits_triton(
    logits: Tensor, targets: Tensor, lse: Tensor, entropy: Tensor, g_chosen: Tensor, g_entropy: Tensor, inv_tau: float
) -> Tensor:
    """`_grad_logits` in place: the chunk's logits are needed for nothing else."""
    n, v = logits.shape
    assert logits.stride(1) == 1 and all(t.is_contiguous() for t in (targets, lse, entropy, g_chosen, g_entropy))
    block = 4096
    if n:
        _grad_kernel[(n, triton.cdiv(v, block))](
            logits, logits.stride(0), targets, lse, entropy, g_chosen, g_entropy, v, inv_tau, BLOCK=block, num_warps=8
        )
    return logits


def _fused(device: torch.device) -> tuple:
    """(_stats, _grad_logits) as Triton kernels on CUDA (or anywhere under the Triton
    interpreter), where PyTorch's would spend most of the head's time in float32 passes over
    [n, V]; the PyTorch versions on CPU."""
    if triton is not None and (device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"):
        return _stats_triton, _grad_logits_triton
    return _stats, _grad_logits


class _ChunkedLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, hidden: Tensor, weight: Tensor, targets: Tensor, temperature: float, with_entropy: bool, chunk: int
    ) -> tuple[Tensor, Tensor]:
        stats, _ = _fused(hidden.device)
        inv_tau = 1.0 / temperature
        n = hidden.shape[0]
        chosen = torch.empty(n, dtype=torch.float32, device=hidden.device)
        lse, entropy = torch.empty_like(chosen), torch.zeros_like(chosen)
        for a in range(0, n, chunk):
            c, lse_c, e = stats(hidden[a : a + chunk] @ weight.t(), targets[a : a + chunk], inv_tau, with_entropy)
            chosen[a : a + chunk], lse[a : a + chunk] = c, lse_c
            if with_entropy:
                entropy[a : a + chunk] = e
        # the backward recomputes each chunk's logits but not their normalizer
        ctx.save_for_backward(hidden, weight, targets, lse, entropy)
        ctx.inv_tau, ctx.chunk = inv_tau, chunk
        ctx.set_materialize_grads(False)
        if not with_entropy:
            ctx.mark_non_differentiable(entropy)
        return chosen, entropy

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_chosen: Tensor | None, grad_entropy: Tensor | None) -> tuple[Tensor | None, ...]:
        hidden, weight, targets, lse, entropy = ctx.saved_tensors
        _, grad_logits = _fused(hidden.device)
        inv_tau, chunk = ctx.inv_tau, ctx.chunk
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        zeros = torch.zeros_like(lse)
        # contiguous: the Triton kernel reads one float per row, and autograd may hand over any
        # strides (the gradient of `lp.sum()` is one number expanded to stride 0)
        g_chosen = zeros if grad_chosen is None else grad_chosen.contiguous()
        g_entropy = zeros if grad_entropy is None else grad_entropy.contiguous()
        for a in range(0, hidden.shape[0], chunk):
            sl = slice(a, a + chunk)
            h = hidden[sl]
            dz = grad_logits(h @ weight.t(), targets[sl], lse[sl], entropy[sl], g_chosen[sl], g_entropy[sl], inv_tau)
            _backprop_chunk(dz, h, weight, sl, grad_h, grad_w)
        return grad_h, None if grad_w is None else grad_w.to(weight.dtype), None, None, None, None


def _backprop_chunk(
    dz: Tensor, h: Tensor, weight: Tensor, sl: slice, grad_h: Tensor | None, grad_w: Tensor | None
) -> None:
    """dh of a chunk's rows and its share of dW (float32, summed over chunks), from d loss / d logits."""
    if grad_h is not None:
        grad_h[sl] = dz @ weight
    if grad_w is not None:
        if weight.dtype == torch.float32:
            grad_w.addmm_(dz.t(), h)
        elif grad_w.is_cuda:  # the GEMM accumulates its bf16 product into float32 itself
            torch.addmm(grad_w, dz.t(), h, torch.float32, out=grad_w)
        else:  # low-precision product, float32 accumulation over chunks
            grad_w += (dz.t() @ h).float()


ChunkLoss = Callable[[Tensor, "Tensor | None", slice], Tensor]


class _ChunkedLoss(torch.autograd.Function):
    """Σ over row chunks of `loss_fn(log_probs, entropies, rows)`, its gradient taken in the forward."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden: Tensor,
        weight: Tensor,
        targets: Tensor,
        temperature: float,
        with_entropy: bool,
        chunk: int,
        loss_fn: ChunkLoss,
    ) -> Tensor:
        stats, grad_logits = _fused(hidden.device)
        inv_tau = 1.0 / temperature
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for a in range(0, hidden.shape[0], chunk):
            sl = slice(a, a + chunk)
            h = hidden[sl]
            logits = h @ weight.t()
            chosen, lse, entropy = stats(logits, targets[sl], inv_tau, with_entropy)
            with torch.enable_grad():  # a Function's forward runs without autograd
                leaves = [chosen.requires_grad_()] + ([entropy.requires_grad_()] if with_entropy else [])
                loss = loss_fn(chosen, entropy if with_entropy else None, sl)
                grads = torch.autograd.grad(loss, leaves, allow_unused=True, materialize_grads=True)
            total += loss.detach()
            g_chosen = grads[0].contiguous()
            g_entropy = grads[1].contiguous() if with_entropy else torch.zeros_like(g_chosen)
            dz = grad_logits(logits, targets[sl], lse, entropy.detach(), g_chosen, g_entropy, inv_tau)
            _backprop_chunk(dz, h, weight, sl, grad_h, grad_w)
        # the weight's gradient waits for the backward in the weight's dtype, as the backward of
        # `chunked_log_probs` would return it
        ctx.save_for_backward(grad_h, None if grad_w is None else grad_w.to(weight.dtype))
        return total

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_loss: Tensor) -> tuple[Tensor | None, ...]:
        grad_h, grad_w = ctx.saved_tensors
        scaled = [None if g is None else g * grad_loss for g in (grad_h, grad_w)]
        return scaled[0], scaled[1], None, None, None, None, None


def chunked_log_probs(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    temperature: float = 1.0,
    with_entropy: bool = False,
    chunk_size: int = DEFAULT_CHUNK,
) -> tuple[Tensor, Tensor | None]:
    """log softmax(h Wᵀ / τ)[y] for each row of `hidden` [R, H], and the entropy when asked.

    `weight` is the LM head's [V, H] (no bias, as in every model family supported). Results are
    float32 whatever the compute dtype, like the full-logit path they replace. `temperature`
    ≤ 0 means greedy sampling, scored at τ = 1.
    """
    tau = float(temperature) if temperature > 0 else 1.0
    chosen, entropy = _ChunkedLogProbs.apply(hidden, weight, targets, tau, with_entropy, max(1, int(chunk_size)))
    return chosen, entropy if with_entropy else None


def chunked_loss(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    loss_fn: ChunkLoss,
    temperature: float = 1.0,
    with_entropy: bool = False,
    chunk_size: int = DEFAULT_CHUNK,
) -> Tensor:
    """A loss of the rows' log-probs (and entropies), with the gradient `chunked_log_probs`
    followed by that loss would give, at three of its four GEMMs.

    `loss_fn(log_probs, entropies, rows)` gets the float32 log-probs (entropies: None unless
    asked) of the rows `rows` of `hidden` and returns their share of the loss, a scalar that
    depends on those rows only: the loss is the sum of the shares, each differentiated on its
    own while its chunk's logits exist. A loss that mixes rows (a mean over its own rows, a
    sequence-level quantity of the current log-probs) does not split this way; use
    `chunked_log_probs` for it. The backward only scales the gradient found in the forward, so
    the head's gradient is held from forward to backward: dh [R, H] (in place of the hidden
    states the other path keeps) and dW, the size of the head's weight. A factor on the loss
    (e.g. a world size) belongs inside `loss_fn`: there it scales d loss / d log p before the
    logits' gradient is rounded to their dtype, as autograd would after `chunked_log_probs`.
    """
    if not torch.is_grad_enabled():
        raise RuntimeError("chunked_loss computes a gradient: call it with autograd on, or use chunked_log_probs")
    tau = float(temperature) if temperature > 0 else 1.0
    return _ChunkedLoss.apply(hidden, weight, targets, tau, with_entropy, max(1, int(chunk_size)), loss_fn)
