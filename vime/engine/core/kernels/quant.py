"""FP8 row quantization: each row of a matrix scaled by its own amax / 448 and cast to
float8_e4m3fn, one program per row (amax, scale, cast; no host sync, so it is captured in the
decode graphs with the matmul it feeds).

The same rows serve both sides of an FP8 projection (`vime/engine/core/fp8.py`): an activation
row is one token (per-token dynamic scales, every step), a weight row one output channel
(per-channel scales, after every weight update). Divisions are IEEE-rounded (`div_rn`, not
Triton's approximate `/`), as the PyTorch path's are, so both give the same bytes.

Checked under the Triton interpreter by `tests/unit/engine/test_gpu_path.py::quant_kernel_checks` (bit for bit
against the PyTorch path, zero rows and rows longer than one block included).
"""

from __future__ import annotations

import torch

from vime.engine.core.kernels.common import AVAILABLE, _pow2

FP8_MAX = 448.0  # the largest finite float8_e4m3fn
# vLLM's floor on a scale (1 / (448 * 512)): a row of zeros gets it instead of 0 and stays zeros
# rather than NaN (0 / 0); a row smaller than that rounds more coarsely, as vLLM's does
MIN_SCALE = 1.0 / (FP8_MAX * 512)
MAX_BLOCK = 4096  # columns a program reads at once; longer rows take several passes

if AVAILABLE:
    import triton
    import triton.language as tl

    @triton.jit
    def _quantize_rows_kernel(
        x_ptr, q_ptr, s_ptr, n_cols, x_stride, FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr, BLOCK: tl.constexpr
    ):
        """One row: its scale max(amax / FP8_MAX, MIN_SCALE) → s_ptr[row]; x / scale, clamped
        to ±FP8_MAX and rounded to nearest even → q_ptr's row."""
        row = tl.program_id(0).to(tl.int64)
        x_row = x_ptr + row * x_stride
        q_row = q_ptr + row * n_cols
        fp8_max = tl.full([BLOCK], FP8_MAX, tl.float32)
        # max(|x|) / FP8_MAX as the max of |x| / FP8_MAX: rounding keeps the order, so it is the same number
        top = tl.zeros([BLOCK], tl.float32)
        for start in range(0, n_cols, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(x_row + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
            top = tl.maximum(top, tl.math.div_rn(tl.abs(x), fp8_max))
        scale = tl.maximum(tl.max(top, axis=0), MIN_SCALE)
        tl.store(s_ptr + row, scale)
        scales = tl.zeros([BLOCK], tl.float32) + scale
        for start in range(0, n_cols, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < n_cols
            x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
            q = tl.minimum(tl.maximum(tl.math.div_rn(x, scales), -FP8_MAX), FP8_MAX)
            tl.store(q_row + cols, q.to(q_ptr.dtype.element_ty), mask=mask)


def quantize_rows(x: torch.Tensor, out: torch.Tensor, scales: torch.Tensor) -> None:
    """x [M, K] (any float dtype, unit column stride) → out [M, K] float8_e4m3fn (contiguous)
    and scales [M] or [M, 1] float32 (contiguous), with x ≈ out * scales."""
    m, n = x.shape
    _quantize_rows_kernel[(m,)](
        x, out, scales, n, x.stride(0), FP8_MAX=FP8_MAX, MIN_SCALE=MIN_SCALE, BLOCK=min(MAX_BLOCK, _pow2(n))
    )
