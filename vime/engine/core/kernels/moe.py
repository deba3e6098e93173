"""Mixture-of-experts on the GPU path: every token's top-k experts as two grouped matmuls.

The (token, k) pairs of a step are sorted by expert (`align_by_expert`) into blocks of BLOCK_M
rows, each block of one expert, padded with rows that point past the end. One launch of
`_expert_matmul_kernel` then runs every expert's gate and up projections with SiLU-mul folded in,
one more the down projection scaled by the routing weight; a program whose block belongs to no
expert returns at once. The sort is PyTorch ops that never wait for the host and have shapes
fixed by the token count, so a decode step with experts is captured in a CUDA graph like any
other. The k outputs of a token are then added in increasing expert id (`combine`), rounding
after each add, which is the order and the rounding of HF's loop over experts (`index_add_`).

Checked under the Triton interpreter by `tests/unit/engine/test_moe.py` (against the PyTorch path of
`vime/engine/core/moe.py`, and the whole engine against HF).
"""

from __future__ import annotations

import torch

from vime.engine.core.kernels.common import AVAILABLE, _precision

BLOCK_N = 64
BLOCK_K = 64

if AVAILABLE:
    import triton
    import triton.language as tl

    @triton.jit
    def _expert_matmul_kernel(
        a_ptr,
        w_ptr,
        out_ptr,
        rows_ptr,
        experts_ptr,
        scales_ptr,
        n_rows,
        N,
        K,
        stride_a,
        stride_we,
        stride_wn,
        stride_out,
        A_ROW_DIV: tl.constexpr,
        GATED: tl.constexpr,
        SCALED: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        PREC: tl.constexpr,
    ):
        """out[row, cols] for the rows of one block, all routed to `expert`: a[row // A_ROW_DIV] @
        w[expert, cols].T; GATED: silu(that) * the same with w's rows N.. 2N (the up projection);
        SCALED: times the row's routing weight. Rows >= n_rows are padding."""
        block = tl.program_id(0)
        expert = tl.load(experts_ptr + block).to(tl.int64)
        if expert < 0:  # a block past the last expert's rows
            return
        rows = tl.load(rows_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        valid = rows < n_rows
        a_rows = rows // A_ROW_DIV
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < N
        w_base = w_ptr + expert * stride_we
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < K
            a = tl.load(
                a_ptr + a_rows[:, None] * stride_a + ks[None, :], mask=valid[:, None] & k_ok[None, :], other=0.0
            )
            w_mask = col_ok[None, :] & k_ok[:, None]
            w = tl.load(w_base + cols[None, :] * stride_wn + ks[:, None], mask=w_mask, other=0.0)  # [BLOCK_K, BLOCK_N]
            acc = tl.dot(a, w, acc, input_precision=PREC)
            if GATED:
                u = tl.load(w_base + (cols[None, :] + N) * stride_wn + ks[:, None], mask=w_mask, other=0.0)
                acc_up = tl.dot(a, u, acc_up, input_precision=PREC)
        dt = out_ptr.dtype.element_ty
        if GATED:  # HF's roundings: each projection, the activation, the product
            g = acc.to(dt).to(tl.float32)
            act = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
            y = (act * acc_up.to(dt).to(tl.float32)).to(dt)
        else:
            y = acc.to(dt)
            if SCALED:  # the projection rounded, then scaled by the (float32) weight and rounded again
                s = tl.load(scales_ptr + rows, mask=valid, other=0.0)
                y = (y.to(tl.float32) * s[:, None]).to(dt)
        tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :], y, mask=valid[:, None] & col_ok[None, :])


def block_m_for(num_rows: int, num_experts: int) -> int:
    """Rows per block: 16 (tl.dot's least) while experts get few rows each, as in decode;
    more when a prefill gives each expert many."""
    per_expert = num_rows / num_experts
    return 16 if per_expert <= 16 else 32 if per_expert <= 64 else 64


def align_by_expert(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [T, K] → (rows [B * block_m] int32, experts [B] int32): the flat (token, k) indices
    sorted by expert, each expert's run padded to whole blocks with T * K (a row past the end),
    and each block's expert (-1 for the blocks left over). B is fixed by T, K and the number of
    experts: the largest number of blocks any routing can fill."""
    flat = ids.reshape(-1)
    n, dev = flat.numel(), flat.device
    counts = torch.zeros(num_experts, dtype=torch.long, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    pad_end = padded.cumsum(0)
    order = flat.argsort(stable=True)  # the (token, k) indices grouped by expert
    expert_of = flat[order]
    rank = torch.arange(n, device=dev) - (counts.cumsum(0) - counts)[expert_of]  # place within its expert's run
    blocks = -(-n // block_m) + min(num_experts, n)
    rows = torch.full((blocks * block_m,), n, dtype=torch.int32, device=dev)
    rows[(pad_end - padded)[expert_of] + rank] = order.to(torch.int32)
    experts = torch.searchsorted(pad_end, torch.arange(blocks, device=dev) * block_m, right=True)
    return rows, torch.where(experts < num_experts, experts, -1).to(torch.int32)


def fused_experts(
    x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """x [T, H] through experts gate_up [E, 2I, H] and down [E, H, I] → [T, H]: for each token the
    sum over its k experts `ids` [T, K] of down(silu(gate x) * up x) times `weights` [T, K]
    (float32)."""
    t, k = ids.shape
    e, two_i, h = gate_up.shape
    rows, experts = align_by_expert(ids, e, block_m_for(t * k, e))
    scales = weights.reshape(-1).float().contiguous()  # [T * K]
    act = torch.empty(t * k, two_i // 2, dtype=x.dtype, device=x.device)  # [T * K, I]
    _expert_matmul(x.contiguous(), gate_up, act, rows, experts, scales, a_row_div=k, gated=True)
    y = torch.empty(t * k, h, dtype=x.dtype, device=x.device)  # [T * K, H]
    _expert_matmul(act, down, y, rows, experts, scales, a_row_div=1, gated=False)
    return combine(y.view(t, k, h), ids)


def _expert_matmul(
    a: torch.Tensor,
    w: torch.Tensor,
    out: torch.Tensor,
    rows: torch.Tensor,
    experts: torch.Tensor,
    scales: torch.Tensor,
    a_row_div: int,
    gated: bool,
) -> None:
    """One grouped launch over every expert's blocks (`_expert_matmul_kernel`): out [T * K, N]
    from a's rows (a token's for the gate/up projection, a row's own for the down one) and w
    [E, N (x2 if gated), a's columns]; the down projection is scaled by `scales`."""
    num_rows, n = out.shape
    _expert_matmul_kernel[(experts.shape[0], triton.cdiv(n, BLOCK_N))](
        a,
        w,
        out,
        rows,
        experts,
        scales,
        num_rows,
        n,
        a.shape[1],
        a.stride(0),
        w.stride(0),
        w.stride(1),
        out.stride(0),
        A_ROW_DIV=a_row_div,
        GATED=gated,
        SCALED=not gated,
        BLOCK_M=rows.shape[0] // experts.shape[0],
        BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK_K,
        PREC=_precision(a.dtype),
    )


def combine(y: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """y [T, K, H] → [T, H]: each token's k rows added in increasing expert id, rounded after
    each add, as HF adds them (one `index_add_` per expert, in expert order)."""
    order = ids.argsort(dim=1)
    y = y.gather(1, order[:, :, None].expand_as(y))
    out = y[:, 0]
    for j in range(1, y.shape[1]):
        out = out + y[:, j]
    return out
