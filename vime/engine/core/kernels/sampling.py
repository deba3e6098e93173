"""The one-pass sampler: a token and its log-prob under softmax(logits / T) per row, drawn with the
row's seed by Gumbel-max over chunks of the vocabulary, the chunks' parts combined by a second
kernel; no host sync.

Checked under the Triton interpreter by `tests/unit/engine/test_gpu_path.py::sampler_kernel_checks` (its draws
against the distribution, and against the PyTorch sampler's).
"""

from __future__ import annotations

import torch

from vime.engine.core.kernels.common import AVAILABLE, _pow2

if AVAILABLE:
    import triton
    import triton.language as tl

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
