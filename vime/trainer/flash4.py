"""FlashAttention-4 (the `flash-attn-4` package: kernels written in CUTLASS's CuTe DSL) as the
packed trainer's attention on Hopper and sm100 Blackwell GPUs (`--attention-kernel fa4`; opt-in).

Why: at the Qwen3-0.6B shape the trainer spends ~30% of its step in torch's varlen
FlashAttention-2 (bench/RESULTS.md, issue 50), whose kernels use none of Hopper's own
instructions; FA4's Hopper kernels are FlashAttention-3's design (warp-specialized, `wgmma`,
TMA copies). Recent torch releases can route their SDPA through FA4 as well, but through a
registry they call a prototype; calling the package's two entry points from ops of our own keeps
the trainer independent of which torch it runs on.

Why custom ops: the decoder layers are compiled, and the DSL's host side (its heuristics, its JIT
cache) cannot be traced. An opaque op with a fake (shapes only) is what Dynamo needs, and its
autograd formula is FA4's own backward kernel.

The package is optional (`pip install 'vime[fa4]'`, or carried as wheels: bench/fa4_prep.sh).
"""

from __future__ import annotations

import functools
import importlib
import os
import tempfile
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

MODULE = "flash_attn.cute.interface"
NOT_INSTALLED = "flash-attn-4 is not installed"  # how `unusable` begins when the package is absent
# bf16 attention against float32: FlashAttention-2's worst output or gradient is 5.8e-3 of the
# largest value on a GRPO batch (bench/RESULTS.md); a kernel four times further off is refused
TOLERANCE = 2.5e-2


@functools.cache
def _fa4() -> ModuleType:
    # the DSL compiles each kernel on first use (~3 s each on a CPU here), at every start of a
    # run; FA4 keeps them on disk (its own cache, keyed by its sources and versions) only when
    # asked to: vime asks, unless the variables are set already, and in the user's cache folder
    # rather than FA4's default under /tmp/$USER (which fails where the user has no name)
    home = Path.home()  # "~" itself where neither $HOME nor the user database names one
    root = os.environ.get("XDG_CACHE_HOME") or (home / ".cache" if home.is_absolute() else tempfile.gettempdir())
    cache = Path(root) / "vime" / "flash_attention_cute_dsl"
    os.environ.setdefault("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", "1")
    os.environ.setdefault("FLASH_ATTENTION_CUTE_DSL_CACHE_DIR", str(cache))
    return importlib.import_module(MODULE)


@torch.library.custom_op("vime::fa4_varlen", mutates_args=())
def fa4_varlen(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_seqlen: int, scale: float
) -> tuple[Tensor, Tensor]:
    """Causal attention within each packed sequence: q [T, H, D], k and v [T, Hkv, D] (GQA in
    the kernel) → (output [T, H, D], log-sum-exp [H, T] in float32, which the backward reads)."""
    out, lse, *_ = _fa4()._flash_attn_fwd(
        q, k, v, softmax_scale=scale, causal=True, return_lse=True, **_rows(cu_seqlens, max_seqlen)
    )
    return out, lse


def _rows(cu_seqlens: Tensor, max_seqlen: int) -> dict[str, Any]:
    """The packed row's bounds as both entry points take them: self-attention, so queries and
    keys share them."""
    return dict(cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens, max_seqlen_q=max_seqlen, max_seqlen_k=max_seqlen)


@fa4_varlen.register_fake
def _(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_seqlen: int, scale: float) -> tuple[Tensor, Tensor]:
    return q.new_empty(q.shape[:2] + v.shape[2:]), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


@torch.library.custom_op("vime::fa4_varlen_backward", mutates_args=())
def fa4_varlen_backward(
    grad: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    cu_seqlens: Tensor,
    max_seqlen: int,
    scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    dq, dk, dv = _fa4()._flash_attn_bwd(
        q, k, v, out, grad.contiguous(), lse, scale, True, **_rows(cu_seqlens, max_seqlen)
    )
    # FA4 shapes dq, dk and dv like q, k and v, strides too; the fake promises contiguous ones
    return dq.contiguous(), dk.contiguous(), dv.contiguous()


@fa4_varlen_backward.register_fake
def _(grad: Tensor, q: Tensor, k: Tensor, v: Tensor, *_: object) -> tuple[Tensor, Tensor, Tensor]:
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup(ctx: Any, inputs: tuple, output: tuple[Tensor, Tensor]) -> None:
    q, k, v, cu_seqlens, max_seqlen, scale = inputs
    ctx.save_for_backward(q, k, v, *output, cu_seqlens)
    ctx.max_seqlen, ctx.scale = max_seqlen, scale
    ctx.mark_non_differentiable(output[1])  # the backward takes no gradient of the log-sum-exp
    ctx.set_materialize_grads(False)  # nor a [T, H, D] of zeros for an output nothing used


def _backward(ctx: Any, grad: Tensor | None, _grad_lse: Tensor | None) -> tuple:
    q, k, v, out, lse, cu_seqlens = ctx.saved_tensors
    grad = torch.zeros_like(out) if grad is None else grad
    return (*fa4_varlen_backward(grad, q, k, v, out, lse, cu_seqlens, ctx.max_seqlen, ctx.scale), None, None, None)


fa4_varlen.register_autograd(_backward, setup_context=_setup)


def reference(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, scale: float | None = None) -> Tensor:
    """float32 causal attention, one SDPA call per packed sequence; [T, H, D] in and out, k and
    v with their own (fewer) heads. What the kernels are checked against."""
    groups = q.shape[1] // k.shape[1]
    bounds = cu_seqlens.tolist()
    parts = []
    for a, b in zip(bounds, bounds[1:]):
        qs, ks, vs = (x[a:b].float().transpose(0, 1) for x in (q, k, v))
        ks, vs = ks.repeat_interleave(groups, dim=0), vs.repeat_interleave(groups, dim=0)
        parts.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale).transpose(0, 1))
    return torch.cat(parts)


def relative_error(got: Tensor, want: Tensor) -> float:
    """Largest absolute difference over the largest absolute value of `want`."""
    return ((got.float() - want).abs().max() / want.abs().max()).item()


def _first_line(e: Exception) -> str:
    return (str(e).splitlines() or [""])[0][:200]


def unusable(device: torch.device, heads: int, kv_heads: int, head_dim: int) -> str | None:
    """Why FA4 cannot be the trainer's attention on `device`, or None: the package imports, the
    GPU is one vime runs it on, and a small packed row at the model's head shape gives float32
    attention's output and gradients within TOLERANCE. FA4 picks its kernels' tiles by the
    lengths too, so training may compile more of them (the DSL compiles each on first use),
    which the check does not try; its disk cache keeps them for the next run."""
    try:
        _fa4()
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] != "flash_attn":  # installed, but short of a module it needs
            return f"flash-attn-4 does not import here (it needs {e.name}: {_first_line(e)})"
        return f"{NOT_INSTALLED} ({_first_line(e)}): pip install 'vime[fa4]'"
    except Exception as e:  # its compiler libraries load at import, and can fail in many ways
        return f"flash-attn-4 does not import here ({type(e).__name__}: {_first_line(e)})"
    major = torch.cuda.get_device_capability(device)[0]
    if major not in (9, 10):
        return f"vime runs FlashAttention-4 on compute capability 9.x and 10.x only; this GPU is {major}.x"
    lengths = [37, 200, 19]
    cu = torch.tensor([0, 37, 237, 256], dtype=torch.int32, device=device)
    gen = torch.Generator(device=device).manual_seed(0)

    def rand(n: int) -> Tensor:
        x = torch.randn(sum(lengths), n, head_dim, device=device, generator=gen, dtype=torch.bfloat16)
        return x.requires_grad_()

    q, k, v = rand(heads), rand(kv_heads), rand(kv_heads)
    grad = torch.randn(q.shape, device=device, generator=gen, dtype=torch.bfloat16)
    try:
        with torch.enable_grad():
            out = fa4_varlen(q, k, v, cu, max(lengths), head_dim**-0.5)[0]
            got = (out, *torch.autograd.grad(out, (q, k, v), grad))
    except Exception as e:  # a DSL compile or launch failure has no one exception type
        return f"FlashAttention-4 failed on a test row ({type(e).__name__}: {_first_line(e)})"
    q32, k32, v32 = (x.detach().float().requires_grad_() for x in (q, k, v))
    with torch.enable_grad():
        ref = reference(q32, k32, v32, cu)
        want = (ref, *torch.autograd.grad(ref, (q32, k32, v32), grad.float()))
    error = max(relative_error(g, w) for g, w in zip(got, want))
    if error > TOLERANCE:
        return f"FlashAttention-4 is {error:.1e} off float32 attention on a test row (relative; more than {TOLERANCE})"
    return None
