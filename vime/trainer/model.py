"""The trained model's pieces, built once by the actor: the HF model loaded in float32, its
activation checkpointing, the token scorer (the forward the losses read) and FSDP2's wrapping."""

from __future__ import annotations

import logging
import os
import types
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: FSDP2's own accumulation runs
    triton = None

from vime.errors import ConfigError
from vime.models import ModelError
from vime.trainer.logprobs import ChunkLoss, chunked_log_probs, chunked_loss
from vime.trainer.packing import PackedBatch, choose_kernel, mark_kernel, pack, register_packed_attention
from vime.trainer.routing import Routing

log = logging.getLogger("vime")


# config settings by which some transformers models change their logits after the head's matmul
# (Gemma 2's soft-capping, Cohere's scale, Granite's divisor); None or 1.0 leaves them alone
LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


class TokenScorer(nn.Module):
    """HF causal LM → log-probs (and entropies) of the response tokens of a packed batch.

    A module of its own so that, under FSDP2, it is the root unit: its forward unshards the
    embedding, final norm and LM head that the chunked head reads directly.
    """

    def __init__(self, hf: nn.Module, chunk_size: int, routing: Routing | None = None) -> None:
        super().__init__()
        self.hf = hf
        self.chunk_size = chunk_size
        self.routing = routing  # a mixture of experts' routers (the policy's): what they replay and measure
        for name in LOGIT_TRANSFORMS:
            value = getattr(hf.config, name, None)
            if value not in (None, 1.0):
                raise ModelError(
                    f"this model's LM head applies {name}={value} to its logits, which vime's chunked head (hidden "
                    "states times the head's weight) does not: train a model without it"
                )

    def forward(
        self, mb: PackedBatch, temperature: float, with_entropy: bool, loss_fn: ChunkLoss | None = None
    ) -> tuple[Tensor, Tensor | None] | Tensor:
        """(log-probs, entropies) of the scored tokens; given a `loss_fn`, that loss of them
        instead, its gradient taken in the forward (`chunked_loss`)."""
        length_limits(self.hf.config, mb.longest)  # every model scored; the policy's planner checked it first
        if self.routing is not None:
            self.routing.begin(mb.routed_experts, *scored_and_real(mb))
        hidden = decoder_states(self.hf, mb)
        head = self.hf.get_output_embeddings()
        if getattr(head, "bias", None) is not None:
            raise NotImplementedError("the chunked LM head assumes no bias (true of the Llama/Qwen families)")
        if loss_fn is not None:
            return chunked_loss(
                hidden[mb.select], head.weight, mb.targets, loss_fn, temperature, with_entropy, self.chunk_size
            )
        return chunked_log_probs(hidden[mb.select], head.weight, mb.targets, temperature, with_entropy, self.chunk_size)


def scored_and_real(mb: PackedBatch) -> tuple[Tensor, Tensor]:
    """[T] masks of a packed row: the positions that score response tokens, and its real tokens
    (its samples', not the padding after them)."""
    positions = torch.arange(mb.num_tokens, device=mb.input_ids.device)
    scored = torch.zeros(mb.num_tokens, dtype=torch.bool, device=mb.input_ids.device)
    scored[mb.select] = True
    return scored, positions < mb.cu_seqlens[len(mb.indices)]


def decoder_states(hf: nn.Module, mb: PackedBatch) -> Tensor:
    """The decoder's last hidden states of a packed row, [T, hidden]: the sequence boundaries
    go to the attention function as transformers' packed-sequence arguments."""
    return hf.get_decoder()(
        input_ids=mb.input_ids,
        position_ids=mb.position_ids,
        use_cache=False,
        cu_seq_lens_q=mb.cu_seqlens,
        max_length_q=mb.max_seqlen,
    ).last_hidden_state[0]


def length_limits(config: Any, longest: int) -> int | None:
    """Refuse a batch whose longest sequence the model would score under other attention or
    RoPE than transformers gives it alone (sliding window, dynamic RoPE), in one line; returns
    LongRoPE's split for the planner. `MicroBatches.plan` calls it on the whole batch, which every rank
    holds, so under FSDP all ranks refuse together rather than one raising while the others wait
    in a collective."""
    window = sliding_window(config)
    # the last position scored (the one before the last token) attends to all but the last
    if window is not None and longest - 1 > window:
        raise ModelError(
            f"a sequence of {longest} tokens is scored with attention over {longest - 1} of them, more than the "
            f"model's sliding window of {window}, which vime's packed attention does not apply: keep prompt + "
            f"response within {window + 1} tokens (--rollout-max-context-len, or --rollout-max-response-len and "
            "--rollout-max-prompt-len)"
        )
    limit = dynamic_rope_limit(config)
    if limit is not None and longest > limit:
        raise ModelError(
            f"a sequence of {longest} tokens is longer than the {limit} past which this model's dynamic RoPE "
            f"rescales by the longest sequence seen, so its scores would depend on the batch: keep prompt + "
            f"response within {limit} tokens (--rollout-max-context-len)"
        )
    return rope_split(config)


def rope_split(config: Any) -> int | None:
    """LongRoPE's switch length (Phi-3/3.5/4-mini's `original_max_position_embeddings`), or None.
    transformers picks its long or short frequencies for a whole row by the row's longest
    position, where each sequence alone gets them by its own length: so a micro-batch must not
    hold sequences on both sides of it (`plan_packed_micro_batches(split_above=...)`)."""
    rope = getattr(config, "rope_parameters", None) or {}
    return rope.get("original_max_position_embeddings") if rope.get("rope_type") == "longrope" else None


def dynamic_rope_limit(config: Any) -> int | None:
    """Dynamic NTK RoPE's original length (`max_position_embeddings`), or None: past it
    transformers rescales the frequencies by the longest sequence it has seen (state kept across
    calls), so a longer sequence's scores would depend on its neighbours and on history;
    `length_limits` refuses one."""
    rope = getattr(config, "rope_parameters", None) or {}
    return config.max_position_embeddings if "dynamic" in str(rope.get("rope_type", "")) else None


def sliding_window(config: Any) -> int | None:
    """The window of the model's sliding-attention layers, or None where every layer attends to
    the whole sequence. vime's packed attention is full causal attention, which is the model's
    own for every position a sequence of up to window + 1 tokens is scored at (the last token is
    scored, not attended from); `length_limits` refuses a longer one rather than score it under
    other attention. (Qwen2/3 configs clear `sliding_window` unless `use_sliding_window`;
    Mistral's applies to every layer; Gemma's lists its layers' types.)"""
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    return window if window and (types is None or "sliding_attention" in types) else None


def load_model(
    model_path: str | Path, device: torch.device, attention_kernel: str = "auto", trained: bool = True
) -> nn.Module:
    """An HF causal LM in float32 master weights everywhere; on CUDA, FSDP2 computes in bf16
    (`wrap`), and its packed attention runs the kernel `--attention-kernel` settles here. A
    model not `trained` (a reference or teacher) only ever runs in eval mode, so its train-mode
    forward is not checked."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(model_path), dtype=torch.float32, attn_implementation=register_packed_attention()
    )
    model.config.use_cache = False  # training never decodes; a KV cache only costs memory
    c = model.config
    if getattr(c, "output_router_logits", False):  # transformers adds its loss only in a forward vime never calls
        raise ModelError(
            "this model's config sets output_router_logits, asking for transformers' MoE router loss "
            f"(router_aux_loss_coef {getattr(c, 'router_aux_loss_coef', None)}), which vime's trainer does not add: set "
            "it to false in config.json, and give vime's --moe-aux-loss-coeff for a load-balancing loss"
        )
    heads = c.num_attention_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
    if getattr(c, "qk_nope_head_dim", None) is not None:  # multi-head latent attention (DeepSeek-V2/V3)
        head_dim = c.qk_nope_head_dim + c.qk_rope_head_dim
    if (getattr(c, "v_head_dim", None) or head_dim) != head_dim:
        if attention_kernel in ("fa4", "fa2"):
            raise ConfigError(
                f"--attention-kernel {attention_kernel}: this model's values have {c.v_head_dim} dims against "
                f"{head_dim} for queries and keys, which vime runs through SDPA only: use auto or sdpa"
            )
        attention_kernel = "sdpa"
    kernel = choose_kernel(attention_kernel, device, heads, getattr(c, "num_key_value_heads", None) or heads, head_dim)
    mark_kernel(model, kernel)
    log.info("trainer attention on %s: %s", device, kernel)
    dropouts = [m for m in model.modules() if isinstance(m, nn.Dropout) and m.p > 0]
    for m in dropouts:  # the training forward must be the scoring forward (eval mode), or the ratio is noise
        m.p = 0.0
    if dropouts:
        log.info("the trainer runs without dropout: %d dropout layers of the model set to 0", len(dropouts))
    model.to(device)
    packed, train_gap = forward_gaps(model, device)
    if packed > PACKING_TOLERANCE:
        raise ModelError(
            f"{type(model).__name__} lets sequences packed into one row change each other's hidden states (by "
            f"{packed:.1e} of their largest, against each alone): vime's trainer packs sequences, so it cannot train "
            "this model (its layers ignore the packed-sequence boundaries transformers hands them)"
        )
    if trained and train_gap > PACKING_TOLERANCE:
        raise ModelError(
            f"{type(model).__name__}'s training forward differs from its scoring forward (by {train_gap:.1e} of the "
            "largest hidden value: router jitter, sampled routing or a dropout vime cannot turn off), so the policy "
            "ratio would be noise: turn it off in config.json (e.g. router_jitter_noise 0)"
        )
    return model


# float32 on one device: the same sequence packed or alone differs by summation order only
# (~1e-6 of the largest hidden value); leaking across sequences moves it by far more
PACKING_TOLERANCE = 1e-4


@torch.no_grad()
def forward_gaps(model: nn.Module, device: torch.device) -> tuple[float, float]:
    """Two short sequences' last hidden states, relative to their largest value: how far they
    move packed into one row against each alone, and in training mode against eval mode.

    vime scores packed rows by handing the sequence boundaries to the attention function, so a
    model whose layers drop them (some call their attention without the keyword arguments,
    some never call the attention interface, some mix tokens in recurrent or linear-attention
    layers) would let sequences see each other: silently wrong log-probs and gradients on every
    micro-batch of two or more. And the policy ratio compares the training forward with the
    scoring forward (eval mode): a training forward that differs (router jitter, sampled
    routing) makes it noise."""
    vocab = model.config.get_text_config().vocab_size
    seqs = [[(step * i + 3) % vocab for i in range(n)] for step, n in ((7, 5), (11, 7))]  # no shared prefix

    def hidden(rows: list[list[int]], training: bool) -> Tensor:
        model.train(training)
        return decoder_states(model, pack(rows, [1] * len(rows), list(range(len(rows))), device)).float()

    was_training = model.training
    try:
        packed = hidden(seqs, False)
        alone = torch.cat([hidden([s], False) for s in seqs])
        trained = hidden(seqs, True)
    finally:
        model.train(was_training)
    scale = alone.abs().max().clamp_min(1e-30)
    return float((packed - alone).abs().max() / scale), float((trained - packed).abs().max() / scale)


def checkpoint_layers(model: nn.Module, n: int | None) -> None:
    """Recompute the activations of the first `n` decoder layers in the backward (all of them
    when None): Megatron's `--recompute-method block --recompute-num-layers n`, which trades
    less recompute for the memory of the later layers' activations. transformers' decoder
    layers each carry their own `gradient_checkpointing` flag, which `*_checkpointing_enable`
    sets on all of them; the later ones are turned off again."""
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:  # transformers 5's name; the old one warns there
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if n is not None:
        for layer in model.get_decoder().layers[n:]:
            layer.gradient_checkpointing = False


def wrap(
    scorer: TokenScorer, device: torch.device, world: int, mesh: Any = None, experts: set[nn.Parameter] | None = None
) -> nn.Module:
    """FSDP2 the way torchtitan does it: one unit per decoder layer, the rest in the root; over
    `mesh` (default: all ranks). `experts`: parameters split by expert parallelism already
    (vime/trainer/expert_parallel.py), which FSDP2 leaves alone."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if device.type == "cuda"
        else MixedPrecisionPolicy()
    )
    layers = list(scorer.hf.get_decoder().layers)
    for i, layer in enumerate(layers):
        # the last layer's parameters are needed again at once by the backward: keep them; on
        # one rank resharding frees nothing (the shard is the whole tensor) and the backward's
        # re-gather would only cast every weight to bf16 again
        reshard = world > 1 and i < len(layers) - 1
        fully_shard(layer, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard, ignored_params=experts or None)
    fully_shard(scorer, mesh=mesh, mp_policy=mp, reshard_after_forward=False, ignored_params=experts or None)
    if device.type == "cuda" and triton is not None:
        vectorize_grad_accumulation(scorer)
    return scorer


if triton is not None:

    @triton.jit
    def _accumulate_kernel(acc_ptr, grad_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        acc = tl.load(acc_ptr + offs, mask=mask)
        tl.store(acc_ptr + offs, acc + tl.load(grad_ptr + offs, mask=mask).to(tl.float32), mask=mask)


def accumulate(acc: Tensor, grad: Tensor) -> None:
    """`acc += grad` for a float32 accumulator and a bfloat16 gradient, as one vectorized Triton
    kernel: PyTorch's mixed-dtype add runs unvectorized, at about half the bandwidth. The same
    single rounding of each sum, so bit for bit PyTorch's result. Other dtypes and layouts, and
    CPU tensors outside the Triton interpreter, take PyTorch's add."""
    usable = acc.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"
    if (
        triton is not None
        and usable
        and acc.dtype == torch.float32
        and grad.dtype == torch.bfloat16
        and acc.shape == grad.shape
        and acc.is_contiguous()
        and grad.is_contiguous()
    ):
        _accumulate_kernel[(triton.cdiv(acc.numel(), 8192),)](acc, grad, acc.numel(), BLOCK=8192, num_warps=8)
    else:
        acc += grad


def _accumulate_unsharded(self: Any) -> None:
    """FSDPParam.accumulate_unsharded_grad_if_needed with `accumulate` for its add."""
    if self.unsharded_accumulated_grad is not None and self.unsharded_param.grad is not None:
        accumulate(self.unsharded_accumulated_grad, self.unsharded_param.grad)
        self.unsharded_param.grad = None


def vectorize_grad_accumulation(module: nn.Module) -> None:
    """Give every FSDP2 parameter of `module` `_accumulate_unsharded` for its gradient
    accumulation. With the reduction deferred to the last micro-batch (`OptimizerStep.defer_grad_sync`),
    FSDP2 adds each later micro-batch's bfloat16 gradient into a float32 one of every parameter:
    at 4B that add, PyTorch's unvectorized mixed-dtype kernel, was 175 ms of a 4.4 s profiled
    step, and this kernel took the realistic step from 4,687-4,703 to 4,649 ms (bench/RESULTS.md).
    Set per parameter object, not on FSDP2's class, so nothing else in the process changes. These
    are FSDP2's private names: a torch that renames them keeps its own add (`tests/gpu/test_trainer.py`
    checks that this one is set)."""
    for param in fsdp_params(module):
        if hasattr(param, "accumulate_unsharded_grad_if_needed"):
            param.accumulate_unsharded_grad_if_needed = types.MethodType(_accumulate_unsharded, param)


def fsdp_params(module: nn.Module) -> list[Any]:
    """FSDP2's per-parameter objects (`FSDPParam`) of every unit in `module`, by FSDP2's private
    names; none where a torch has renamed them."""
    out = []
    for sub in module.modules():
        state = getattr(sub, "_get_fsdp_state", None)
        group = getattr(state(), "_fsdp_param_group", None) if state is not None else None
        out.extend(getattr(group, "fsdp_params", ()))
    return out


def full_tensor(tensor: Tensor) -> Tensor:
    """The whole tensor of a (possibly FSDP2-sharded) parameter; every rank calls. One rank
    holds the whole tensor already: a gather would cost a collective and a copy."""
    if hasattr(tensor, "full_tensor"):
        return tensor.to_local() if tensor.device_mesh.size() == 1 else tensor.full_tensor()
    return tensor
