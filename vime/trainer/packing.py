"""Packed micro-batches: sequences laid end to end in one row, no padding (but see `pack(pad_to=)`).

A packed micro-batch is one row of `T = sum(len_i)` tokens. Position ids restart at 0 for each
sequence and attention never crosses a sequence boundary, so every sequence sees exactly what it
would see alone; `cu_seqlens` ([0, len_0, len_0 + len_1, ...]) tells the attention kernel where
the boundaries are. Compared with right-padding to the longest sequence, no FLOPs go to pad
tokens, and the micro-batch budget (`--max-tokens-per-gpu`) counts real tokens.

The attention function registered here as `vime_packed` runs a varlen FlashAttention kernel on
CUDA (bf16/fp16): FlashAttention-4 (`flash4.py`) where it is installed and passes its check,
else torch's FlashAttention-2 (`--attention-kernel` chooses otherwise). Elsewhere it runs one
causal SDPA call per sequence, which is exact in float32 and what the CPU tests check against
padded batches.
"""

from __future__ import annotations

import inspect
import itertools
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from vime.errors import ConfigError
from vime.models import ModelError
from vime.trainer import flash4

log = logging.getLogger("vime")

ATTN_IMPLEMENTATION = "vime_packed"


@dataclass
class PackedBatch:
    """One packed row plus where its scored (response) tokens are.

    Token t of a sequence is predicted by the hidden state at t - 1, so `select[k]` is the row
    position whose hidden state scores `targets[k]`, in sample order.
    """

    indices: list[int]  # positions of these samples in the caller's list
    input_ids: Tensor  # [1, T]
    position_ids: Tensor  # [1, T], restarting at 0 per sequence
    cu_seqlens: Tensor  # [N + 1] int32, sequence boundaries in the row
    max_seqlen: int  # pad segments included
    longest: int  # the longest real sequence
    select: Tensor  # [R] positions whose hidden states score the response tokens
    targets: Tensor  # [R] response token ids
    response_lengths: list[int]
    # a mixture of experts' engine routing, set by `MicroBatches.pack` where the samples carry it:
    # [T, MoE layers, top_k] expert ids per position, -1 where the engine sent none (vime/trainer/routing.py)
    routed_experts: Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[1])


def plan_packed_micro_batches(
    lengths: Sequence[int], max_tokens: int, max_samples: int | None = None, split_above: int | None = None
) -> list[list[int]]:
    """Bin-pack sequence indices into micro-batches of at most `max_tokens` real tokens and, if
    given, at most `max_samples` sequences (`--micro-batch-size`); with `split_above`, no
    micro-batch holds sequences on both sides of that length (LongRoPE's, `model.rope_split`).

    First-fit decreasing: few bins (so few forward passes, each large enough to fill the
    device), deterministic (every rank can recompute every other rank's plan). A sequence longer
    than the budget gets a micro-batch of its own rather than an error.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    long = [split_above is not None and n > split_above for n in lengths]
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in order:
        for b, load in enumerate(loads):
            fits = load + lengths[i] <= max_tokens and long[bins[b][0]] == long[i]
            if fits and (max_samples is None or len(bins[b]) < max_samples):
                bins[b].append(i)
                loads[b] += lengths[i]
                break
        else:
            bins.append([i])
            loads.append(lengths[i])
    return [sorted(b) for b in bins]


def shard_by_tokens(lengths: Sequence[int], world_size: int) -> list[list[int]]:
    """Split sequence indices over ranks so each rank gets about the same number of tokens.

    Longest first onto the least loaded rank (LPT): the step ends when the slowest rank ends,
    and compute grows with tokens, not with sequences. Deterministic, so every rank derives the
    same split from the same batch without talking to the others.
    """
    shards: list[list[int]] = [[] for _ in range(world_size)]
    loads = [0] * world_size
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        r = min(range(world_size), key=lambda r: (loads[r], r))
        shards[r].append(i)
        loads[r] += lengths[i]
    return [sorted(s) for s in shards]


# what some transformers models hand their attention function besides q, k, v and the scale
UNSUPPORTED = {
    "softcap": "Gemma 2's logit soft-capping",
    "s_aux": "gpt-oss's attention sinks",
    "sinks": "attention sinks",
}

PAD_SEGMENT = 256  # longest sequence of pad tokens: their attention costs next to nothing
# compiled trainers round each micro-batch up to a multiple of budget / PAD_BUCKETS tokens: a few
# shapes, all compiled before step 1, wasting at most a sixteenth of the budget per micro-batch
# (with 8, the 2.5% of a GRPO batch's tokens that were padding cost 2.5% of a step: RESULTS.md)
PAD_BUCKETS = 16


def pack(
    token_lists: Sequence[Sequence[int]],
    response_lengths: Sequence[int],
    indices: list[int],
    device: torch.device,
    pad_to: int | None = None,
    pad_id: int = 0,
) -> PackedBatch:
    """Lay the sequences end to end; mark the positions that score each response token.

    `pad_to`: fill the row up to a multiple of this many tokens with short sequences of `pad_id`
    that nothing scores, so that micro-batches come in a few lengths (see `MicroBatches.pack`: a
    compiled layer sees only token counts its warm-up compiled)."""
    lengths = [len(t) for t in token_lists]
    real = sum(lengths)
    if pad_to:
        missing = -real % pad_to
        lengths += [PAD_SEGMENT] * (missing // PAD_SEGMENT) + [missing % PAD_SEGMENT] * bool(missing % PAD_SEGMENT)
    # tensor arithmetic, not Python lists: the host packs each micro-batch while the GPU runs the
    # previous one, and built from lists a 32k-token row took 5.6 ms on a fast host core (0.5 ms
    # now), long enough on the GPU machine's slow host for the GPU to idle (bench/RESULTS.md)
    n = torch.tensor(lengths, dtype=torch.long)
    cu = torch.cat([n.new_zeros(1), n.cumsum(0)])
    ids = torch.full((int(cu[-1]),), pad_id, dtype=torch.long)
    ids[:real] = torch.from_numpy(np.fromiter(itertools.chain.from_iterable(token_lists), np.int64, real))
    pos = torch.arange(len(ids)) - cu[:-1].repeat_interleave(n)
    resp = torch.tensor(list(response_lengths), dtype=torch.long)
    first = cu[1 : len(token_lists) + 1] - resp - 1  # the position scoring each sequence's first response token
    offset = torch.arange(int(resp.sum())) - (resp.cumsum(0) - resp).repeat_interleave(resp)
    select = first.repeat_interleave(resp) + offset
    return PackedBatch(
        indices=indices,
        input_ids=to_device(ids[None], device),
        position_ids=to_device(pos[None], device),
        cu_seqlens=to_device(cu.to(torch.int32), device),
        max_seqlen=max(lengths),
        longest=max(lengths[: len(token_lists)]),
        select=to_device(select, device),
        targets=to_device(ids[select + 1], device),
        response_lengths=list(response_lengths),
    )


def to_device(t: Tensor, device: torch.device) -> Tensor:
    """A host tensor on `device` without stalling the host: a copy from pageable memory to a GPU
    waits for every kernel queued before it, so each one would drain the GPU while the (slow)
    host builds the next micro-batch. From pinned memory the copy is queued like a kernel. A
    tensor already on a device (the old and reference log-probs the actor computed) only moves
    if it is on another one."""
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


# ---- attention ---------------------------------------------------------------------------


def _varlen_kwargs() -> dict[str, Any] | None:
    """How to ask torch's varlen FlashAttention for causal GQA, or None where it is missing.

    Its signature moved between torch releases (an `is_causal` flag, later a window of
    (-1, 0)); reading it once here keeps the call site version-free.
    """
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    kwargs: dict[str, Any] = {"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)}
    if "enable_gqa" in params:
        kwargs["enable_gqa"] = True
    return kwargs


# Read only where CUDA is: importing it loads torch's compiler stack, ~2 s of the start of every
# CPU process (each engine's, each test run's) for a kernel that only CUDA has.
_VARLEN = _varlen_kwargs() if torch.cuda.is_available() else None
_varlen_ok: dict[torch.device, bool] = {}


def _same(t: Tensor) -> Tensor:
    return t


def _varlen_usable(device: torch.device) -> bool:
    """Whether varlen FlashAttention runs forward *and* backward here, tried once per device on
    a tiny input, so a build without the kernel (or its backward) falls back before training.

    The trainer tries it at load (`choose_kernel`); elsewhere the first try happens inside the
    first layer's forward, which activation checkpointing may be recording: the try's own saved
    tensors go through identity hooks, not the checkpoint's, or the recomputation (which does
    not try again) would save fewer tensors and fail."""
    if device not in _varlen_ok:
        ok = _VARLEN is not None
        if ok:
            from torch.nn.attention.varlen import varlen_attn

            try:
                q = torch.randn(8, 2, 64, device=device, dtype=torch.bfloat16, requires_grad=True)
                k = torch.randn(8, 1 if "enable_gqa" in _VARLEN else 2, 64, device=device, dtype=torch.bfloat16)
                cu = torch.tensor([0, 3, 8], dtype=torch.int32, device=device)
                with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(_same, _same):
                    varlen_attn(q, k, k, cu, cu, 5, 5, **_VARLEN).sum().backward()
            except (RuntimeError, TypeError, ValueError, NotImplementedError) as e:
                log.warning(
                    "varlen FlashAttention unavailable (%s); packed attention runs one SDPA call per sequence", e
                )
                ok = False
        _varlen_ok[device] = ok
    return _varlen_ok[device]


def packed_attention(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    cu_seq_lens_q: Tensor | None = None,
    max_length_q: int | None = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """Causal attention within each packed sequence; transformers' attention-function contract.

    query [1, H, T, D], key/value [1, Hkv, T, D] → output [1, T, H, D]. Without
    `cu_seq_lens_q` the row is one sequence.
    """
    extras = [name for name in UNSUPPORTED if kwargs.get(name) is not None]
    if extras:  # attention of another form than softmax(QK^T)V: scoring it as that would be wrong
        raise ModelError(
            f"this model's attention takes {', '.join(extras)} ({UNSUPPORTED[extras[0]]}), which vime's packed "
            "attention does not apply: train a model without it"
        )
    t = query.shape[2]
    if cu_seq_lens_q is None:
        cu_seq_lens_q = torch.tensor([0, t], dtype=torch.int32, device=query.device)
        max_length_q = t
    groups = query.shape[1] // key.shape[1]
    kernel = packed_attention_backend(module, query.device, query.dtype)
    if kernel == "fa4":
        q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # [T, H, D]
        scale = query.shape[-1] ** -0.5 if scaling is None else scaling
        return flash4.fa4_varlen(q, k, v, cu_seq_lens_q, max_length_q, scale)[0].unsqueeze(0), None
    if kernel == "fa2":
        from torch.nn.attention.varlen import varlen_attn

        q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # [T, H, D]
        if groups > 1 and "enable_gqa" not in _VARLEN:
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        out = varlen_attn(q, k, v, cu_seq_lens_q, cu_seq_lens_q, max_length_q, max_length_q, scale=scaling, **_VARLEN)
        return out.unsqueeze(0), None
    if groups > 1:
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    # compiled, the loop over sequences runs as one opaque op: traced, its host-side bounds
    # would break the graph and guard the sequence count, compiling again for every other count
    attend = _sdpa_per_sequence if torch.compiler.is_compiling() else _sdpa_loop
    return attend(query, key, value, cu_seq_lens_q, scaling).transpose(1, 2), None


def _sdpa_loop(query: Tensor, key: Tensor, value: Tensor, cu_seqlens: Tensor, scale: float | None) -> Tensor:
    """Causal SDPA per packed sequence, [1, H, T, D] in and out."""
    bounds = cu_seqlens.tolist()
    parts = [
        F.scaled_dot_product_attention(query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], is_causal=True, scale=scale)
        for a, b in zip(bounds, bounds[1:])
    ]
    return torch.cat(parts, dim=2)


@torch.library.custom_op("vime::sdpa_per_sequence", mutates_args=())
def _sdpa_per_sequence(query: Tensor, key: Tensor, value: Tensor, cu_seqlens: Tensor, scale: float | None) -> Tensor:
    return _sdpa_loop(query, key, value, cu_seqlens, scale).contiguous()


@_sdpa_per_sequence.register_fake
def _(query: Tensor, key: Tensor, value: Tensor, cu_seqlens: Tensor, scale: float | None) -> Tensor:
    return query.new_empty((*query.shape[:-1], value.shape[-1]))  # values may be narrower (latent attention)


@torch.library.custom_op("vime::sdpa_per_sequence_backward", mutates_args=())
def _sdpa_per_sequence_backward(
    grad: Tensor, query: Tensor, key: Tensor, value: Tensor, cu_seqlens: Tensor, scale: float | None
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of causal attention per sequence, by formula (a custom op's body runs without
    autograd). With P = softmax(S), S = q kᵀ·scale masked: dV = Pᵀ dO, dS = P ⊙ (dO vᵀ − rowsum(dO ⊙ O)),
    dQ = dS k·scale, dK = dSᵀ q·scale. Attention is recomputed: only the CPU compiled path pays."""
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    gq, gk, gv = (t.new_zeros(t.shape) for t in (query, key, value))  # contiguous, as the fake says
    bounds = cu_seqlens.tolist()
    for a, b in zip(bounds, bounds[1:]):
        q, k, v, d_out = (t[:, :, a:b].float() for t in (query, key, value, grad))
        causal = torch.ones(b - a, b - a, dtype=torch.bool, device=q.device).tril()
        p = torch.softmax((q @ k.transpose(-1, -2) * scale).masked_fill(~causal, float("-inf")), dim=-1)
        out = p @ v
        d_s = p * (d_out @ v.transpose(-1, -2) - (d_out * out).sum(-1, keepdim=True))
        gq[:, :, a:b] = (d_s @ k * scale).to(gq.dtype)
        gk[:, :, a:b] = (d_s.transpose(-1, -2) @ q * scale).to(gk.dtype)
        gv[:, :, a:b] = (p.transpose(-1, -2) @ d_out).to(gv.dtype)
    return gq, gk, gv


@_sdpa_per_sequence_backward.register_fake
def _(
    grad: Tensor, query: Tensor, key: Tensor, value: Tensor, cu_seqlens: Tensor, scale: float | None
) -> tuple[Tensor, Tensor, Tensor]:
    return query.new_empty(query.shape), key.new_empty(key.shape), value.new_empty(value.shape)


def _sdpa_setup(ctx: Any, inputs: tuple, output: Tensor) -> None:
    query, key, value, cu_seqlens, scale = inputs
    ctx.save_for_backward(query, key, value, cu_seqlens)
    ctx.scale = scale


def _sdpa_backward(ctx: Any, grad: Tensor) -> tuple:
    query, key, value, cu_seqlens = ctx.saved_tensors
    return (*_sdpa_per_sequence_backward(grad, query, key, value, cu_seqlens, ctx.scale), None, None)


_sdpa_per_sequence.register_autograd(_sdpa_backward, setup_context=_sdpa_setup)


# the attribute `mark_kernel` sets on each module of a model: the kernel `choose_kernel` settled
# for it, which `packed_attention` reads from the attention module that calls it
KERNEL_ATTR = "vime_attention_kernel"
# FA4's check per (device, heads, kv_heads, head_dim): a run loads its policy, reference and teacher
_fa4_checked: dict[tuple, str | None] = {}
KERNELS = ("auto", "fa4", "fa2", "sdpa")


def _indexed(device: torch.device) -> torch.device:
    """`cuda` as `cuda:N`: the key a tensor's device will look up."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def choose_kernel(choice: str, device: torch.device, heads: int, kv_heads: int, head_dim: int) -> str:
    """Settle `--attention-kernel` for one model's half-precision attention on this device before
    any forward (`mark_kernel` keeps the answer on the model), so that FA4's check (which runs its kernels on a test row at the model's head shape) runs
    outside the compiled and checkpointed code; returns the kernel: fa4, fa2 or sdpa. `auto` is
    FA4 where it is installed and passes its check (the trainer's step is 9-14% faster with it
    at the Qwen3-0.6B shape, 7-8% at 4B: bench/RESULTS.md), else FA2 where it runs, else SDPA.
    float32 attention (a trainer without FSDP2's bf16 compute) is always SDPA: neither kernel
    takes float32. Each model a run loads passes through here with the run's one choice, and
    gets the kernel its own head shape allows; fa4 must pass its check at every one."""
    if choice not in KERNELS:
        raise ConfigError(f"--attention-kernel {choice!r} is not one of {', '.join(KERNELS)}")
    device = _indexed(device)
    if device.type != "cuda":
        if choice in ("fa4", "fa2"):
            raise ConfigError(
                f"--attention-kernel {choice} runs on CUDA only, and this trainer is on {device}: use auto or sdpa"
            )
        return "sdpa"
    kernel = "sdpa"
    if choice in ("fa4", "auto"):
        why = _fa4_problem(device, heads, kv_heads, head_dim)
        if why is None:
            kernel = "fa4"
        elif choice == "fa4":
            raise ConfigError(f"--attention-kernel fa4: {why}; or use --attention-kernel fa2")
        elif not why.startswith(flash4.NOT_INSTALLED):  # installed but failing: say so; absent is the norm
            log.warning("--attention-kernel auto passes FlashAttention-4 over: %s", why)
    if kernel == "sdpa" and choice != "sdpa":
        if _varlen_usable(device):
            kernel = "fa2"
        elif choice == "fa2":
            raise ConfigError(
                "--attention-kernel fa2: torch's varlen FlashAttention does not run here (the warning above "
                "says why); use --attention-kernel sdpa"
            )
    return kernel


def mark_kernel(model: torch.nn.Module, kernel: str) -> None:
    """Settle `choose_kernel`'s answer on the model itself, not on its device: a run's policy,
    reference and teacher share a GPU and may differ in head shape, so in what FA4's check
    allows; each model's attention must run the kernel checked at its own shape."""
    for m in model.modules():
        setattr(m, KERNEL_ATTR, kernel)


def _fa4_problem(device: torch.device, heads: int, kv_heads: int, head_dim: int) -> str | None:
    """`flash4.unusable` once per device and head shape (it compiles and runs FA4's kernels)."""
    key = (device, heads, kv_heads, head_dim)
    if key not in _fa4_checked:
        _fa4_checked[key] = flash4.unusable(device, heads, kv_heads, head_dim)
    return _fa4_checked[key]


def packed_attention_backend(module: torch.nn.Module | None, device: torch.device, dtype: torch.dtype) -> str:
    """Which kernel `packed_attention` uses for this attention module on this device and dtype:
    fa4, fa2 or sdpa (one SDPA call per sequence). The one `mark_kernel` settled for its model;
    for a module of a model not loaded by `load_model`, fa2 if it runs."""
    if device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16):
        return "sdpa"
    kernel = getattr(module, KERNEL_ATTR, None)
    return kernel or ("fa2" if _varlen_usable(_indexed(device)) else "sdpa")


def register_packed_attention() -> str:
    """Make `vime_packed` a transformers attention implementation; returns its name.

    transformers builds no mask for an implementation it has no mask function for, so the
    packed row costs no T × T mask either.
    """
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, packed_attention)
    return ATTN_IMPLEMENTATION
