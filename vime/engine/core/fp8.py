"""FP8 rollouts (`--quantization fp8`): the four projections of every decoder layer run W8A8.

What is quantized: q/k/v, o, gate/up and down (`PROJECTIONS`), most of the weight bytes a
decode step reads in full (nine tenths at Qwen3-4B). Weights get one scale per output channel (a
row of [N, K]), activations one per token, computed every step (dynamic); both as vLLM's
`fp8_per_channel` does (amax / 448, floored, true division, float8_e4m3fn). The matmul is
`torch._scaled_mm`, accumulating in float32 and writing the model dtype. Embeddings, norms and
`lm_head` stay in the model dtype, as vLLM keeps them: the head's error would land on every
log-prob directly, for a tenth of the bytes at 4B.

When: the model-dtype weights stay resident and every push still lands in them (NCCL, CUDA IPC,
disk, shared memory, merged LoRA adapters), so nothing about transports or checksums changes.
After the load and after each *complete* update the engine calls `requantize`, which writes
the fp8 copies in place: the same addresses, so the captured decode graphs read the new
values. The price is the fp8 copies beside the weights (half their bytes once more).

A memory release unmaps the fp8 copies without saving them (they are derived data); the
resume maps them at the same addresses and requantizes from the restored weights, so an
update that arrived while released is picked up too.
"""

from __future__ import annotations

import torch
from torch import nn

from vime.engine.core import kernels, vmem
from vime.engine.core.kernels.quant import FP8_MAX, MIN_SCALE
from vime.engine.core.model_config import ModelConfig

QUANTIZATIONS = ("fp8",)
PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
FP8 = torch.float8_e4m3fn
MIN_CAPABILITY = (8, 9)  # Ada and Hopper have FP8 tensor cores; torch._scaled_mm refuses older GPUs


def check(quantization: str | None, device: torch.device, dtype: torch.dtype, model_path: str | None = None) -> None:
    """A one-line ValueError for a quantization this engine cannot run on `device` in `dtype`
    (or for the model of `model_path`), before any weight is read."""
    if quantization is None:
        return
    if quantization not in QUANTIZATIONS:
        raise ValueError(
            f"--quantization {quantization}: use {', '.join(QUANTIZATIONS)}, or leave it out to run in --dtype"
        )
    # the experts are most of such a model's bytes and run their own kernels (kernels/moe.py), which have no fp8 path
    mc = None if model_path is None else ModelConfig.from_hf_dir(model_path)
    if mc is not None and mc.moe is not None:
        raise ValueError(
            f"--quantization fp8 does not cover the experts of a mixture-of-experts model ({mc.model_type}): "
            "leave --quantization out for this model"
        )
    if device.type != "cuda":
        return
    # torch._scaled_mm's row-wise scales write bfloat16 on every GPU it supports (float32 only
    # with cuBLAS 12.9+ on Hopper, and never with a bias)
    if dtype != torch.bfloat16:
        raise ValueError(f"--quantization fp8 on a GPU runs with --dtype bfloat16, not {str(dtype)[6:]}")
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_CAPABILITY:
        raise ValueError(
            f"--quantization fp8 needs a GPU of compute capability {'.'.join(map(str, MIN_CAPABILITY))} or newer "
            f"(Ada, Hopper); {device} is {'.'.join(map(str, capability))}: leave --quantization out"
        )


def quantize_rows_torch(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] → (float8_e4m3fn [M, K], float32 scales [M, 1]), x ≈ q * scales: the Triton
    kernel's arithmetic in PyTorch (`kernels/quant.py`), byte for byte."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True)  # [M, 1]
    # over a tensor: a Python number would divide by multiplying with its reciprocal on CUDA
    scales = (amax / torch.full_like(amax, FP8_MAX)).clamp_min(MIN_SCALE)
    return (xf / scales).clamp(-FP8_MAX, FP8_MAX).to(FP8), scales


def quantize_rows(
    x: torch.Tensor, out: torch.Tensor | None = None, scales: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_rows_torch`, by the Triton kernel where it runs; into `out` [M, K] and
    `scales` ([M, 1] or [M]) when given (the fp8 weights, written in place)."""
    if out is None:
        out = torch.empty(x.shape, dtype=FP8, device=x.device)
    if scales is None:
        scales = torch.empty(x.shape[0], 1, dtype=torch.float32, device=x.device)
    if kernels.enabled(x.device):
        kernels.quantize_rows(x, out, scales)
    else:
        q, s = quantize_rows_torch(x)
        out.copy_(q)
        scales.copy_(s.view(scales.shape))
    return out, scales


def linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [T, K] (model dtype) through an fp8 weight [N, K] with per-channel scales [1, N] →
    [T, N] in x's dtype: x quantized per token, one scaled matmul (float32 accumulation)."""
    xq, xs = quantize_rows(x)  # [T, K] fp8, [T, 1] float32
    # weight.t(): the column-major [K, N] operand _scaled_mm takes, without a copy
    return torch._scaled_mm(xq, weight.t(), scale_a=xs, scale_b=scale, bias=bias, out_dtype=x.dtype)


class Fp8Weights:
    """The fp8 copies of a model's projections, in one buffer, and their per-channel scales.

    Each projection module gets `fp8 = (weight [N, K] float8_e4m3fn, scales [1, N] float32)`,
    which its forward takes instead of its weight (`model.Linear`). With `virtual` (CUDA VMM,
    as the engine's weights) the buffer keeps its addresses through `release` / `restore`;
    otherwise a release frees it and a restore allocates it anew (the engine captures its
    graphs again on that path anyway).
    """

    def __init__(self, model: nn.Module, device: torch.device, virtual: bool):
        self.device, self.virtual = device, virtual
        named = [(name, m) for name, m in model.named_modules() if name.rsplit(".", 1)[-1] in PROJECTIONS]
        for name, m in named:
            if device.type == "cuda" and any(d % 16 for d in m.weight.shape):  # _scaled_mm's CUDA kernels tile by 16
                raise ValueError(
                    f"--quantization fp8: {name} has shape {list(m.weight.shape)}, and FP8 matmuls on a GPU need "
                    "both sizes to be multiples of 16: leave --quantization out for this model"
                )
        self.layers = [m for _, m in named]
        self.offsets: list[tuple[int, int]] = []  # (weight, scales) byte offsets of each layer
        end = 0
        for m in self.layers:
            n, k = m.weight.shape
            self.offsets.append((end, end + _aligned(n * k)))
            end += _aligned(n * k) + _aligned(4 * n)
        self.nbytes = end
        self.buffer = vmem.VirtualBuffer(end, device) if virtual else None
        self.tensors = self._views(self._flat())
        for m, pair in zip(self.layers, self.tensors):
            m.fp8 = pair
        self.released = False
        self.requantize()

    def _flat(self) -> torch.Tensor:
        if self.buffer is not None:
            return self.buffer.tensor()
        return torch.empty(self.nbytes, dtype=torch.uint8, device=self.device)

    def _views(self, flat: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        out = []
        for m, (w, s) in zip(self.layers, self.offsets):
            n, k = m.weight.shape
            out.append((flat[w : w + n * k].view(FP8).view(n, k), flat[s : s + 4 * n].view(torch.float32).view(1, n)))
        return out

    @torch.no_grad()
    def requantize(self) -> None:
        """The fp8 copies from the weights as they are now, in place (a no-op while released:
        `restore` does it)."""
        if self.released:
            return
        for m, (w, s) in zip(self.layers, self.tensors):
            quantize_rows(m.weight, w, s.view(-1))

    def release(self) -> int:
        """Give the buffer's device memory back (a GPU engine's release; on CPU nothing moves);
        returns the bytes given back, so that a colocated run's count includes the fp8 copies."""
        if self.released or self.device.type != "cuda":
            return 0
        freed = sum(w.nbytes + s.nbytes for w, s in self.tensors)
        if self.buffer is not None:
            self.buffer.unmap()
        else:
            for w, s in self.tensors:  # no tensor holds the storage any more: it is freed
                w.data, s.data = torch.empty(0, dtype=FP8), torch.empty(0)
        self.released = True
        return freed

    def restore(self) -> None:
        """Memory back (at the same addresses with VMM) and the copies made again from the
        weights, which must be on the device already."""
        if not self.released:
            return
        if self.buffer is not None:
            self.buffer.map()
        else:
            for (w, s), (w_new, s_new) in zip(self.tensors, self._views(self._flat())):
                w.data, s.data = w_new, s_new
        self.released = False
        self.requantize()


def _aligned(nbytes: int) -> int:
    return -(-nbytes // vmem.PARAM_ALIGNMENT) * vmem.PARAM_ALIGNMENT
