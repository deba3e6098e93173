"""The elementwise chains of a decoder layer, each one kernel: residual add + RMSNorm, the fused
q/k/v split with per-head RMSNorm (Qwen3), RoPE and the KV cache write, and SiLU-mul.

Checked under the Triton interpreter by `tests/unit/engine/test_gpu_path.py::engine_kernel_checks` (the whole
engine on the kernel path against HF).
"""

from __future__ import annotations

import torch

from vime.engine.core.kernels.common import AVAILABLE, _pow2

if AVAILABLE:
    import triton
    import triton.language as tl

    @triton.jit
    def _add_rmsnorm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, n_cols, eps, HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0)
        if HAS_RES:  # residual stream += x, rounded to the model dtype as HF's `residual + h` is
            r = tl.load(res_ptr + row * n_cols + cols, mask=mask, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
            tl.store(res_ptr + row * n_cols + cols, x, mask=mask)
        h = x.to(tl.float32)
        var = tl.sum(h * h, axis=0) / n_cols
        hn = (h * tl.rsqrt(var + eps)).to(x.dtype)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0)
        tl.store(out_ptr + row * n_cols + cols, (w.to(tl.float32) * hn.to(tl.float32)).to(x.dtype), mask=mask)

    @triton.jit
    def _head_rmsnorm(x1, x2, w_ptr, eps, D: tl.constexpr):
        """RMSNorm over the head dimension, given as its two halves [heads, D/2]."""
        half = tl.arange(0, D // 2)
        a, b = x1.to(tl.float32), x2.to(tl.float32)
        var = (tl.sum(a * a, axis=1) + tl.sum(b * b, axis=1)) / D
        r = tl.rsqrt(var + eps)[:, None]
        a, b = (a * r).to(x1.dtype), (b * r).to(x1.dtype)
        w1 = tl.load(w_ptr + half).to(tl.float32)[None, :]
        w2 = tl.load(w_ptr + D // 2 + half).to(tl.float32)[None, :]
        return (w1 * a.to(tl.float32)).to(x1.dtype), (w2 * b.to(tl.float32)).to(x1.dtype)

    @triton.jit
    def _rope(x1, x2, cos, sin):
        """HF's `x * cos + rotate_half(x) * sin` with its roundings: each product and the sum
        are rounded to the model dtype (cos/sin are cast to it first)."""
        dt = x1.dtype
        c = cos.to(dt).to(tl.float32)[None, :]
        s = sin.to(dt).to(tl.float32)[None, :]
        a, b = x1.to(tl.float32), x2.to(tl.float32)
        o1 = (a * c).to(dt).to(tl.float32) + (-b * s).to(dt).to(tl.float32)
        o2 = (b * c).to(dt).to(tl.float32) + (a * s).to(dt).to(tl.float32)
        return o1.to(dt), o2.to(dt)

    @triton.jit
    def _qkv_rope_store_kernel(
        qkv_ptr,
        cos_ptr,
        sin_ptr,
        qw_ptr,
        kw_ptr,
        slot_ptr,
        q_out_ptr,
        k_cache_ptr,
        v_cache_ptr,
        eps,
        H: tl.constexpr,
        HKV: tl.constexpr,
        H_PAD: tl.constexpr,
        HKV_PAD: tl.constexpr,
        D: tl.constexpr,
        QK_NORM: tl.constexpr,
    ):
        t = tl.program_id(0).to(tl.int64)
        half = tl.arange(0, D // 2)
        cos = tl.load(cos_ptr + t * (D // 2) + half)
        sin = tl.load(sin_ptr + t * (D // 2) + half)
        row = qkv_ptr + t * ((H + 2 * HKV) * D)
        # queries → q_out [T, H, D]
        h = tl.arange(0, H_PAD)
        hm = (h < H)[:, None]
        off = h[:, None] * D + half[None, :]
        q1 = tl.load(row + off, mask=hm, other=0.0)
        q2 = tl.load(row + off + D // 2, mask=hm, other=0.0)
        if QK_NORM:
            q1, q2 = _head_rmsnorm(q1, q2, qw_ptr, eps, D)
        q1, q2 = _rope(q1, q2, cos, sin)
        tl.store(q_out_ptr + t * (H * D) + off, q1, mask=hm)
        tl.store(q_out_ptr + t * (H * D) + off + D // 2, q2, mask=hm)
        # keys and values → their cache slot
        slot = tl.load(slot_ptr + t).to(tl.int64)
        g = tl.arange(0, HKV_PAD)
        gm = (g < HKV)[:, None]
        off = g[:, None] * D + half[None, :]
        k1 = tl.load(row + H * D + off, mask=gm, other=0.0)
        k2 = tl.load(row + H * D + off + D // 2, mask=gm, other=0.0)
        if QK_NORM:
            k1, k2 = _head_rmsnorm(k1, k2, kw_ptr, eps, D)
        k1, k2 = _rope(k1, k2, cos, sin)
        dst = slot * (HKV * D) + off
        tl.store(k_cache_ptr + dst, k1, mask=gm)
        tl.store(k_cache_ptr + dst + D // 2, k2, mask=gm)
        v_off = (H + HKV) * D + off
        tl.store(v_cache_ptr + dst, tl.load(row + v_off, mask=gm, other=0.0), mask=gm)
        tl.store(v_cache_ptr + dst + D // 2, tl.load(row + v_off + D // 2, mask=gm, other=0.0), mask=gm)

    @triton.jit
    def _silu_mul_kernel(x_ptr, out_ptr, n_cols, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < n_cols
        g = tl.load(x_ptr + row * 2 * n_cols + cols, mask=mask, other=0.0)
        u = tl.load(x_ptr + row * 2 * n_cols + n_cols + cols, mask=mask, other=0.0)
        gf = g.to(tl.float32)
        act = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)  # silu, rounded as torch's is
        tl.store(out_ptr + row * n_cols + cols, (act.to(tl.float32) * u.to(tl.float32)).to(g.dtype), mask=mask)


# ---- wrappers --------------------------------------------------------------------------


def add_rmsnorm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rmsnorm(x + residual), x + residual); the residual is updated in place. Without a
    residual: (rmsnorm(x), x)."""
    x = x.contiguous()
    out = torch.empty_like(x)
    n = x.shape[-1]
    _add_rmsnorm_kernel[(x.shape[0],)](
        x, residual if residual is not None else x, weight, out, n, eps, HAS_RES=residual is not None, BLOCK=_pow2(n)
    )
    return out, residual if residual is not None else x


def qkv_rope_store(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_norm: torch.Tensor | None,
    k_norm: torch.Tensor | None,
    eps: float,
    slots: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
) -> torch.Tensor:
    """Split the fused q/k/v projection, apply per-head RMSNorm (Qwen3) and RoPE, write k and v
    into their cache slots and return q [T, H, D]. cos/sin: [T, D/2] float32."""
    t = qkv.shape[0]
    q = torch.empty(t, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    qk_norm = q_norm is not None
    _qkv_rope_store_kernel[(t,)](
        qkv,
        cos,
        sin,
        q_norm if qk_norm else qkv,
        k_norm if qk_norm else qkv,
        slots,
        q,
        k_cache,
        v_cache,
        eps,
        H=num_heads,
        HKV=num_kv_heads,
        H_PAD=_pow2(num_heads),
        HKV_PAD=_pow2(num_kv_heads),
        D=head_dim,
        QK_NORM=qk_norm,
    )
    return q


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(x[:, :I]) * x[:, I:] for the fused gate/up projection."""
    t, n = x.shape[0], x.shape[1] // 2
    out = torch.empty(t, n, dtype=x.dtype, device=x.device)
    block = min(1024, _pow2(n))
    _silu_mul_kernel[(t, triton.cdiv(n, block))](x, out, n, BLOCK=block)
    return out
