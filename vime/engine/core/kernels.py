"""Triton kernels for the engine's GPU path: fused norms and activations, RoPE + KV write, paged
attention (decode and varlen prefill) and a one-pass sampler.

Why these and no others: a decode step of a small model is a few hundred tiny kernels, so every
elementwise chain PyTorch would run as 5-30 launches becomes one kernel here, and the step is
then captured in a CUDA graph. Matmuls stay with cuBLAS. Each kernel rounds to the model dtype
exactly where the HF modules do (e.g. RMSNorm scales after casting back), so bf16 outputs track
HF's token for token for as long as near-ties allow.

The module imports only where Triton does; `AVAILABLE` says whether it did. The kernels also run
under `TRITON_INTERPRET=1` on CPU tensors, which is how the CPU tests check them.
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl

    AVAILABLE = True
except ImportError:  # CPU-only installs: the engine uses its PyTorch path
    AVAILABLE = False


INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def enabled(device: torch.device) -> bool:
    """Whether the Triton path runs on this device: CUDA with Triton installed, or any device
    under the Triton interpreter (how the CPU tests exercise the GPU code path)."""
    return AVAILABLE and (device.type == "cuda" or INTERPRET)


def _pow2(n: int) -> int:
    return 1 << (max(n, 1) - 1).bit_length()


def _precision(dtype: torch.dtype) -> str:
    """float32 models ask for exact float32 dots (tf32 would cost ~1e-3 in log-probs)."""
    return "ieee" if dtype == torch.float32 else "tf32"


if AVAILABLE:

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

    @triton.jit
    def _paged_attend(
        q,
        q_pos,
        k_cache_ptr,
        v_cache_ptr,
        bt_row_ptr,
        kvh,
        lo,
        ctx,
        end,
        scale,
        HKV: tl.constexpr,
        D: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        ROWS: tl.constexpr,
        BLOCK_N: tl.constexpr,
        PREC: tl.constexpr,
        CAUSAL: tl.constexpr,
    ):
        """Attention of ROWS query rows (all on KV head kvh) over keys [lo, end) of one sequence
        (keys from ctx on are masked; lo a multiple of BLOCK_N), gathered BLOCK_N at a time
        through its block table (rows of D contiguous values, loaded 16 bytes wide and pipelined
        by the compiler), with the online softmax. CAUSAL: row r sees keys up to q_pos[r]
        (decode needs no mask: its one query is the last position). Returns the unnormalized
        (acc, running max, running sum): a split's part, to be combined (`_combine_splits_kernel`),
        or acc / sum for all keys. An empty range gives (0, -inf, 0)."""
        d = tl.arange(0, D)
        m_i = tl.full([ROWS], float("-inf"), tl.float32)
        l_i = tl.zeros([ROWS], tl.float32)
        acc = tl.zeros([ROWS, D], tl.float32)
        for start in range(lo, end, BLOCK_N):
            n = start + tl.arange(0, BLOCK_N)
            valid = n < ctx
            blk = tl.load(bt_row_ptr + n // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
            kv_off = ((blk * BLOCK_SIZE + n % BLOCK_SIZE) * HKV + kvh) * D
            k = tl.load(k_cache_ptr + kv_off[:, None] + d[None, :], mask=valid[:, None], other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=PREC) * scale
            keep = valid[None, :]
            if CAUSAL:
                keep = keep & (n[None, :] <= q_pos[:, None])
            s = tl.where(keep, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))  # key lo < ctx is in the first block: never -inf after it
            p = tl.exp(s - m_new[:, None])
            alpha = tl.exp(m_i - m_new)
            v = tl.load(v_cache_ptr + kv_off[:, None] + d[None, :], mask=valid[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            m_i = m_new
        return acc, m_i, l_i

    # bt_stride (the block-table width) changes from step to step on the eager path: specializing
    # on its value (== 1, divisible by 16) would mean a JIT compile in the middle of serving.
    @triton.jit(do_not_specialize=["bt_stride"])
    def _decode_attn_kernel(
        q_ptr,
        k_cache_ptr,
        v_cache_ptr,
        bt_ptr,
        ctx_ptr,
        out_ptr,
        part_ptr,
        ml_ptr,
        scale,
        bt_stride,
        H: tl.constexpr,
        HKV: tl.constexpr,
        D: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        G_PAD: tl.constexpr,
        BLOCK_N: tl.constexpr,
        PREC: tl.constexpr,
        SPLIT: tl.constexpr,
    ):
        """One program per (sequence, KV head, split of the context): its G query heads share
        each K/V load. With one split the output is final; with more, each split writes its
        unnormalized part (float32 acc, max, sum) for `_combine_splits_kernel`."""
        b = tl.program_id(0).to(tl.int64)
        kvh = tl.program_id(1)
        split = tl.program_id(2)
        n_splits = tl.num_programs(2)
        G = H // HKV
        ctx = tl.load(ctx_ptr + b)
        g = tl.arange(0, G_PAD)
        d = tl.arange(0, D)
        gm = (g < G)[:, None]
        q = tl.load(q_ptr + b * (H * D) + (kvh * G + g)[:, None] * D + d[None, :], mask=gm, other=0.0)
        chunk = tl.cdiv(tl.cdiv(ctx, n_splits), BLOCK_N) * BLOCK_N
        lo = split * chunk
        hi = tl.minimum(lo + chunk, ctx)
        acc, m, denom = _paged_attend(
            q,
            g,
            k_cache_ptr,
            v_cache_ptr,
            bt_ptr + b * bt_stride,
            kvh,
            lo,
            hi,
            hi,
            scale,
            HKV,
            D,
            BLOCK_SIZE,
            G_PAD,
            BLOCK_N,
            PREC,
            False,
        )
        heads = kvh * G + g
        if SPLIT:
            part = (b * n_splits + split) * H + heads  # [G_PAD] rows of the split workspace
            tl.store(part_ptr + part[:, None] * D + d[None, :], acc, mask=gm)
            tl.store(ml_ptr + part * 2, m, mask=g < G)
            tl.store(ml_ptr + part * 2 + 1, denom, mask=g < G)
        else:
            out = acc / denom[:, None]
            tl.store(out_ptr + b * (H * D) + heads[:, None] * D + d[None, :], out.to(out_ptr.dtype.element_ty), mask=gm)

    @triton.jit
    def _combine_splits_kernel(
        part_ptr, ml_ptr, out_ptr, n_splits, H: tl.constexpr, D: tl.constexpr, S_PAD: tl.constexpr
    ):
        """One program per (sequence, head): the splits' parts rescaled to their common max and
        summed, then divided by the summed weights (the online softmax, across programs)."""
        b = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        s = tl.arange(0, S_PAD)
        d = tl.arange(0, D)
        sm = s < n_splits
        row = (b * n_splits + s) * H + h
        m = tl.load(ml_ptr + row * 2, mask=sm, other=float("-inf"))
        denom = tl.load(ml_ptr + row * 2 + 1, mask=sm, other=0.0)
        top = tl.max(m, axis=0)  # split 0 holds key 0: finite
        w = tl.where(m > float("-inf"), tl.exp(m - top), 0.0)
        acc = tl.load(part_ptr + row[:, None] * D + d[None, :], mask=sm[:, None], other=0.0)
        out = tl.sum(acc * w[:, None], axis=0) / tl.sum(denom * w, axis=0)
        tl.store(out_ptr + (b * H + h) * D + d, out.to(out_ptr.dtype.element_ty))

    @triton.jit(do_not_specialize=["bt_stride"])
    def _prefill_attn_kernel(
        q_ptr,
        k_cache_ptr,
        v_cache_ptr,
        bt_ptr,
        ctx_ptr,
        cu_q_ptr,
        out_ptr,
        scale,
        bt_stride,
        H: tl.constexpr,
        HKV: tl.constexpr,
        D: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        PREC: tl.constexpr,
    ):
        """One program per (sequence, head, tile of BLOCK_M new tokens); causal over the whole
        context (cached prefix + this chunk), read through the block table as in decode."""
        b = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        tile = tl.program_id(2)
        q_start = tl.load(cu_q_ptr + b)
        q_len = tl.load(cu_q_ptr + b + 1) - q_start
        if tile * BLOCK_M >= q_len:
            return
        ctx = tl.load(ctx_ptr + b)
        m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        mm = m < q_len
        d = tl.arange(0, D)
        tok = (q_start + m).to(tl.int64)
        q = tl.load(q_ptr + tok[:, None] * (H * D) + h * D + d[None, :], mask=mm[:, None], other=0.0)
        end = tl.minimum(ctx, ctx - q_len + (tile + 1) * BLOCK_M)  # keys past the tile's last query are never seen
        acc, _, denom = _paged_attend(
            q,
            ctx - q_len + m,
            k_cache_ptr,
            v_cache_ptr,
            bt_ptr + b * bt_stride,
            h // (H // HKV),
            0,
            ctx,
            end,
            scale,
            HKV,
            D,
            BLOCK_SIZE,
            BLOCK_M,
            BLOCK_N,
            PREC,
            True,
        )
        out = acc / denom[:, None]
        tl.store(
            out_ptr + tok[:, None] * (H * D) + h * D + d[None, :], out.to(out_ptr.dtype.element_ty), mask=mm[:, None]
        )

    @triton.jit
    def _mix32(x):
        """`sampler.mix32` on int64 lanes holding 32-bit values (same constants, same result)."""
        x = x ^ (x >> 16)
        x = (x * 0x7FEB352D) & 0xFFFFFFFF
        x = x ^ (x >> 15)
        x = (x * 0x2C1B3C6D) & 0xFFFFFFFF
        return x ^ (x >> 16)

    @triton.jit
    def _sample_part_kernel(logits_ptr, temp_ptr, seed_ptr, part_ptr, idx_ptr, V, CHUNK, BLOCK: tl.constexpr):
        """One program per (row, chunk of CHUNK columns), one pass over the chunk: the max and
        sum of exponentials of logits/T (for the log-sum-exp) and the Gumbel-max winner (argmax
        of logits/T + Gumbel noise samples softmax(logits/T) exactly; T == 0 takes the argmax).
        The noise is `sampler.uniform_noise` of the row's seed, so the PyTorch path agrees.
        Chunks rather than one program a row: at small batches one SM would walk 151,936 logits."""
        row = tl.program_id(0)
        c = tl.program_id(1)
        t = tl.load(temp_ptr + row)
        seed = tl.load(seed_ptr + row).to(tl.int64) & 0xFFFFFFFF
        greedy = t == 0.0
        inv_t = 1.0 / tl.where(greedy, 1.0, t)
        base = logits_ptr + row.to(tl.int64) * V
        m_i = tl.full([BLOCK], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK], tl.float32)
        best = tl.full([BLOCK], float("-inf"), tl.float32)
        best_idx = tl.zeros([BLOCK], tl.int32)
        for start in range(c * CHUNK, c * CHUNK + CHUNK, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < V
            x = tl.load(base + cols, mask=mask, other=float("-inf")).to(tl.float32) * inv_t
            m_new = tl.maximum(m_i, x)
            l_i = l_i * tl.exp(m_i - m_new) + tl.where(mask, tl.exp(x - m_new), 0.0)
            m_i = m_new
            h = _mix32((seed + cols.to(tl.int64) * 0x61C88647) & 0xFFFFFFFF)
            u = ((h >> 9).to(tl.float32) + 0.5) * 1.1920928955078125e-07  # 2^-23: below 1, see sampler.unit_interval
            score = tl.where(greedy, x, x - tl.log(-tl.log(u)))
            take = score > best  # strict: the earliest index wins ties, as torch.argmax
            best = tl.where(take, score, best)
            best_idx = tl.where(take, cols, best_idx)
        m = tl.max(m_i, axis=0)
        top = tl.max(best, axis=0)
        k = row.to(tl.int64) * tl.num_programs(1) + c
        tl.store(part_ptr + k * 3, m)
        tl.store(part_ptr + k * 3 + 1, tl.sum(tl.where(m_i > float("-inf"), l_i * tl.exp(m_i - m), 0.0), axis=0))
        tl.store(part_ptr + k * 3 + 2, top)
        tl.store(idx_ptr + k, tl.min(tl.where(best == top, best_idx, V), axis=0))

    @triton.jit
    def _sample_combine_kernel(
        logits_ptr, temp_ptr, part_ptr, idx_ptr, tok_ptr, lp_ptr, V, n_chunks, C_PAD: tl.constexpr
    ):
        """One program per row: the chunks' parts into the row's token (the best score, the
        earliest column on a tie) and its log-prob under softmax(logits / T)."""
        row = tl.program_id(0)
        c = tl.arange(0, C_PAD)
        cm = c < n_chunks
        k = row.to(tl.int64) * n_chunks + c
        m = tl.load(part_ptr + k * 3, mask=cm, other=float("-inf"))
        sums = tl.load(part_ptr + k * 3 + 1, mask=cm, other=0.0)
        top = tl.load(part_ptr + k * 3 + 2, mask=cm, other=float("-inf"))
        idx = tl.load(idx_ptr + k, mask=cm, other=V)
        mx = tl.max(m, axis=0)
        lse = mx + tl.log(tl.sum(tl.where(m > float("-inf"), sums * tl.exp(m - mx), 0.0), axis=0))
        best = tl.max(top, axis=0)
        tok = tl.min(tl.where(top == best, idx, V), axis=0)
        t = tl.load(temp_ptr + row)
        x = tl.load(logits_ptr + row.to(tl.int64) * V + tok).to(tl.float32) * (
            1.0 / tl.where(t == 0.0, 1.0, t)
        )  # as the part kernel scales
        tl.store(tok_ptr + row, tok.to(tl.int64))
        tl.store(lp_ptr + row, x - lse)


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


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One new token per sequence: q [B, H, D] → [B, H, D], over caches [blocks, block_size, Hkv, D].

    With few sequences, one program per (sequence, KV head) would leave most SMs idle while
    each walks its whole context: the context is then split across `decode_splits` programs
    and their parts combined by a second kernel (flash-decoding). The split count depends on the
    batch size alone, so a captured graph keeps its own."""
    b, h, d = q.shape
    hkv, bs = k_cache.shape[2], k_cache.shape[1]
    out = torch.empty_like(q)
    splits = decode_splits(b, hkv, q.device)
    part = torch.empty(b * splits * h * d if splits > 1 else 0, dtype=torch.float32, device=q.device)
    ml = torch.empty(b * splits * h * 2 if splits > 1 else 0, dtype=torch.float32, device=q.device)
    _decode_attn_kernel[(b, hkv, splits)](
        q,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        out,
        part,
        ml,
        scale,
        block_tables.stride(0),
        H=h,
        HKV=hkv,
        D=d,
        BLOCK_SIZE=bs,
        G_PAD=max(16, _pow2(h // hkv)),
        BLOCK_N=64 if q.dtype != torch.float32 else 32,
        PREC=_precision(q.dtype),
        SPLIT=splits > 1,
    )
    if splits > 1:
        _combine_splits_kernel[(b, h)](part, ml, out, splits, H=h, D=d, S_PAD=_pow2(splits))
    return out


MAX_DECODE_SPLITS = 16
INTERPRETER_SMS = 8  # under the Triton interpreter (CPU tests): small, so that their batches split too


def decode_splits(batch: int, kv_heads: int, device: torch.device) -> int:
    """Context splits per (sequence, KV head) so that a decode launches about two programs per
    SM; 1 (no combine) once the batch alone does."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else INTERPRETER_SMS
    return max(1, min(MAX_DECODE_SPLITS, -(-2 * sms // (batch * kv_heads))))


def prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    cu_q: torch.Tensor,
    max_q_len: int,
    scale: float,
) -> torch.Tensor:
    """Packed chunks of new tokens (sequence i owns q[cu_q[i]:cu_q[i+1]], the last tokens of its
    context_lens[i]); q [T, H, D] → [T, H, D]."""
    t, h, d = q.shape
    hkv, bs = k_cache.shape[2], k_cache.shape[1]
    out = torch.empty_like(q)
    block_m = 64 if q.dtype != torch.float32 else 32  # float32 tiles take twice the shared memory
    grid = (context_lens.shape[0], h, triton.cdiv(max_q_len, block_m))
    _prefill_attn_kernel[grid](
        q,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        cu_q,
        out,
        scale,
        block_tables.stride(0),
        H=h,
        HKV=hkv,
        D=d,
        BLOCK_SIZE=bs,
        BLOCK_M=block_m,
        BLOCK_N=32,
        PREC=_precision(q.dtype),
    )
    return out


def sample(logits: torch.Tensor, temperatures: torch.Tensor, seeds: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids (int64) and their log-probs under softmax(logits / T) for each row (T == 0:
    greedy, log-prob of the raw softmax), drawn with each row's seed (int32 bits); no host sync."""
    b, v = logits.shape
    logits = logits.contiguous()
    tokens = torch.empty(b, dtype=torch.int64, device=logits.device)
    logprobs = torch.empty(b, dtype=torch.float32, device=logits.device)
    block = min(1024, _pow2(v))
    chunk = block * SAMPLE_CHUNK_BLOCKS
    n_chunks = triton.cdiv(v, chunk)
    part = torch.empty(b * n_chunks * 3, dtype=torch.float32, device=logits.device)
    idx = torch.empty(b * n_chunks, dtype=torch.int32, device=logits.device)
    _sample_part_kernel[(b, n_chunks)](logits, temperatures, seeds, part, idx, v, chunk, BLOCK=block)
    _sample_combine_kernel[(b,)](logits, temperatures, part, idx, tokens, logprobs, v, n_chunks, C_PAD=_pow2(n_chunks))
    return tokens, logprobs


SAMPLE_CHUNK_BLOCKS = 4  # columns per sampler program, in blocks of 1024: 38 programs a row at 151,936
