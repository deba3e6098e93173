"""Paged attention over the KV cache: decode (one query per sequence, the context split across
programs and combined when the batch is small: flash-decoding) and varlen prefill of packed chunks.
Both run one online-softmax helper, `_paged_attend`.

Checked under the Triton interpreter by `tests/unit/engine/test_gpu_path.py::attention_kernel_checks` (against
the PyTorch path, bfloat16, decode and chunks after a cached prefix).
"""

from __future__ import annotations

import torch

from vime.engine.core.kernels.common import AVAILABLE, _pow2, _precision

if AVAILABLE:
    import triton
    import triton.language as tl

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


# ---- wrappers --------------------------------------------------------------------------


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
