"""Triton kernels for the engine's GPU path, one module per concern: `fused.py` (fused norms and
activations, RoPE + KV write), `attention.py` (paged attention, decode and varlen prefill),
`sampling.py` (a one-pass sampler), `quant.py` (FP8 rows, for `--quantization fp8`) and `moe.py`
(a mixture-of-experts layer's experts as two grouped matmuls);
`common.py` holds what they share.

Why these and no others: a decode step of a small model is a few hundred tiny kernels, so every
elementwise chain PyTorch would run as 5-30 launches becomes one kernel here, and the step is
then captured in a CUDA graph. Matmuls stay with cuBLAS (FP8 ones with `torch._scaled_mm`): at
decode sizes Triton matmuls with the norm or SiLU-mul folded in were slower, and split-K won only
on `o_proj`, ~1% of a step (`bench/bench_decode_matmul.py`). The experts' matmuls are the
exception: one grouped launch over all experts beats one cuBLAS call per expert, and needs no host
sync to size them (a CUDA graph could not capture one that did).
Each kernel rounds to the model dtype exactly where the HF modules do (e.g. RMSNorm scales after
casting back), so bf16 outputs track HF's token for token for as long as near-ties allow.

The modules import only where Triton does; `AVAILABLE` says whether it did. The kernels also run
under `TRITON_INTERPRET=1` on CPU tensors, which is how the CPU tests check them, one check per
module (`tests/unit/engine/test_gpu_path.py::interpreted_checks`).
"""

from vime.engine.core.kernels.attention import (
    INTERPRETER_SMS,
    MAX_DECODE_SPLITS,
    decode_attention,
    decode_splits,
    prefill_attention,
)
from vime.engine.core.kernels.common import AVAILABLE, INTERPRET, enabled
from vime.engine.core.kernels.fused import add_rmsnorm, qkv_rope_store, silu_and_mul
from vime.engine.core.kernels.moe import fused_experts
from vime.engine.core.kernels.quant import quantize_rows
from vime.engine.core.kernels.sampling import SAMPLE_CHUNK_BLOCKS, sample

__all__ = [
    "AVAILABLE",
    "INTERPRET",
    "INTERPRETER_SMS",
    "MAX_DECODE_SPLITS",
    "SAMPLE_CHUNK_BLOCKS",
    "add_rmsnorm",
    "decode_attention",
    "decode_splits",
    "enabled",
    "fused_experts",
    "prefill_attention",
    "qkv_rope_store",
    "quantize_rows",
    "sample",
    "silu_and_mul",
]
