"""Decoder-only LMs in plain PyTorch, loading HF checkpoints: dense (Llama, Qwen2, Qwen3) and
mixture-of-experts (Qwen3-MoE, Mixtral: the sparse MLP is `moe.py`).

Module names mirror the HF ones, except that q/k/v and gate/up are fused into one projection
each (one matmul instead of three or two); `named_weights` maps every HF name onto the tensor
(or row slice) that holds it, so a checkpoint or a trainer's state dict loads by HF name. The
forward takes a flat, packed batch of tokens (many sequences, each contributing a different
number of new tokens) and reads/writes past keys and values through the paged KV cache. On
CUDA the elementwise chains run as fused Triton kernels (`kernels/fused.py`), on CPU as PyTorch ops.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from vime.engine.core import fp8, kernels
from vime.engine.core.attention import AttnMetadata, paged_attention
from vime.engine.core.model_config import ModelConfig
from vime.engine.core.moe import SparseMoE, hub_views
from vime.engine.core.safetensors_io import iter_safetensors
from vime.transport.checksums import checksums, non_finite, piece_checksums

COPY_BATCH_BYTES = 256 * 2**20  # same-device weights copied per _foreach_copy_


class Linear(nn.Linear):
    """nn.Linear whose CPU float32 forward runs oneDNN's GEMM instead of the default one.

    At decode batch sizes PyTorch's CPU float32 linear (MKL) ran 1.4-2.2x slower than oneDNN
    on the same weights (8-64 rows, SmolLM2 shapes, one thread; bench/RESULTS.md), and linears
    are three quarters of a CPU decode step. The weight stays a plain parameter (loads and
    pushes are unchanged); bfloat16 and GPU take the default path, which already is the fast one.
    With `--quantization fp8` a projection computes from `fp8`, its weight's fp8 copy and
    per-channel scales (`fp8.py`), which the engine keeps up to date with the weight.
    """

    fp8: tuple[torch.Tensor, torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fp8 is not None:
            return fp8.linear(x, *self.fp8, self.bias)
        if x.device.type == "cpu" and x.dtype == torch.float32 and _ONEDNN_LINEAR:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return super().forward(x)


_ONEDNN_LINEAR = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual), the residual stream's add fused into the norm.
        Without a residual: (norm(x), x)."""
        if kernels.enabled(x.device):
            return kernels.add_rmsnorm(x, residual, self.weight, self.eps)
        if residual is not None:
            x = residual + x
        return self.norm(x), x

    def norm(self, x: torch.Tensor) -> torch.Tensor:
        # Normalize in float32 and scale after casting back, exactly as HF does, so bf16 matches too.
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        # on the CPU even inside `load_model`'s meta-device build, where arange's kernel is a
        # Python reference that imports torch._dynamo (seconds of an engine's start; it compiles nothing)
        arange = torch.arange(0, head_dim, 2, dtype=torch.float, device="cpu")
        self.register_buffer("inv_freq", 1.0 / (theta ** (arange / head_dim)), persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [T, head_dim / 2] in float32 (HF duplicates them over both halves)."""
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        return freqs.cos(), freqs.sin()


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    cos = torch.cat((cos, cos), dim=-1)[:, None, :].to(x.dtype)  # [T, 1, head_dim], cast as HF does
    sin = torch.cat((sin, sin), dim=-1)[:, None, :].to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class Attention(nn.Module):
    """q, k and v come from one fused projection (one matmul); `CausalLM.named_weights` maps the
    HF names onto its row slices."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.qkv_proj = Linear(
            cfg.hidden_size, (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim, bias=cfg.qkv_bias
        )
        self.o_proj = Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm
        self.eps = cfg.rms_norm_eps

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        kv: tuple[torch.Tensor, torch.Tensor],
        meta: AttnMetadata,
    ) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        if kernels.enabled(x.device):
            qw, kw = (self.q_norm.weight, self.k_norm.weight) if self.qk_norm else (None, None)
            q = kernels.qkv_rope_store(
                qkv,
                *rope,
                qw,
                kw,
                self.eps,
                meta.slot_mapping,
                kv[0],
                kv[1],
                self.num_heads,
                self.num_kv_heads,
                self.head_dim,
            )
            out = paged_attention(q, None, None, kv[0], kv[1], meta, scale=self.head_dim**-0.5)
        else:
            q, k, v = qkv.split(
                [self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim, self.num_kv_heads * self.head_dim],
                dim=-1,
            )
            q = q.reshape(t, self.num_heads, self.head_dim)
            k = k.reshape(t, self.num_kv_heads, self.head_dim)
            v = v.reshape(t, self.num_kv_heads, self.head_dim)
            if self.qk_norm:
                q, k = self.q_norm.norm(q), self.k_norm.norm(k)
            q, k = _apply_rope(q, *rope), _apply_rope(k, *rope)
            out = paged_attention(q, k, v, kv[0], kv[1], meta, scale=self.head_dim**-0.5)
        return self.o_proj(out.reshape(t, -1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if kernels.enabled(gate_up.device):
            return self.down_proj(kernels.silu_and_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int):
        super().__init__()
        self.self_attn = Attention(cfg)
        moe = cfg.moe
        self.mlp = SparseMoE(cfg, moe.layers.index(index)) if moe is not None and index in moe.layers else MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self,
        h: torch.Tensor,
        residual: torch.Tensor | None,
        rope: tuple[torch.Tensor, torch.Tensor],
        kv: tuple[torch.Tensor, torch.Tensor],
        meta: AttnMetadata,
        routes: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (this layer's MLP output, the residual stream before adding it): the add is
        fused into the next norm. `routes`: where an MoE layer writes its experts (`SparseMoE`)."""
        x, residual = self.input_layernorm(h, residual)
        x, residual = self.post_attention_layernorm(self.self_attn(x, rope, kv, meta), residual)
        return (self.mlp(x, routes) if isinstance(self.mlp, SparseMoE) else self.mlp(x)), residual


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        # no random init: `load_model` fills it from the checkpoint, and on the meta device
        # normal_'s kernel is a Python reference that imports torch._dynamo (as arange's below)
        self.embed_tokens = nn.Embedding(
            cfg.vocab_size, cfg.hidden_size, _weight=torch.empty(cfg.vocab_size, cfg.hidden_size)
        )
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(cfg.head_dim, cfg.rope_theta)


# HF projections stored as row slices of one fused parameter: fused name → HF names, in order.
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


class CausalLM(nn.Module):
    """The whole model. `forward` returns logits (model dtype) only for the rows that get sampled."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = DecoderModel(cfg)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttnMetadata,
        logit_rows: torch.Tensor | None,
        routes: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """logit_rows: which tokens get logits (None: all, as in a decode step). routes: the
        routing pool beside the KV cache ([slots, MoE layers, top_k] int32), where each MoE layer
        writes every token's experts at its KV slot."""
        h = self.model.embed_tokens(input_ids)
        rope = self.model.rotary_emb(positions)
        record = None if routes is None else (routes, meta.slot_mapping.long())
        residual = None
        for layer, kv in zip(self.model.layers, kv_caches):
            h, residual = layer(h, residual, rope, kv, meta, record)
        if logit_rows is not None:
            h, residual = h[logit_rows], residual[logit_rows]
        h, _ = self.model.norm(h, residual)
        return self.lm_head(h)

    def named_weights(self) -> dict[str, torch.Tensor]:
        """HF name → the tensor holding it: a parameter, or a row slice of a fused projection;
        tied weights are listed under both names (a trainer may send either), stacked experts
        under their in-memory names and, slice by slice, under the checkpoint's (`moe.hub_views`)."""
        c = self.config
        rows = {
            "qkv_proj": [c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.num_kv_heads * c.head_dim],
            "gate_up_proj": [c.intermediate_size] * 2,
        }
        out: dict[str, torch.Tensor] = {}
        for name, p in self.named_parameters(remove_duplicate=False):
            *prefix, module, kind = name.split(".")
            if module in FUSED:
                for hf_module, piece in zip(FUSED[module], p.split(rows[module], dim=0)):
                    out[".".join([*prefix, hf_module, kind])] = piece
            else:
                out[name] = p
        for views in self.hub_aliases().values():
            out.update(views)
        return out

    def hub_aliases(self) -> dict[str, dict[str, torch.Tensor]]:
        """Expert and router parameters by name → the checkpoint's names for them (or their
        slices); empty for a dense model."""
        if self.config.moe is None:
            return {}
        mt = self.config.model_type
        found = {name: hub_views(name, p, mt) for name, p in self.named_parameters()}
        return {name: views for name, views in found.items() if views}

    def checksums(self, views: dict[str, torch.Tensor]) -> dict[str, list[int]]:
        """`transport.checksums` of `named_weights()` by name: stacked experts and their checkpoint
        names (slices in the order `hub_views` lists them) from one reduction per stacked tensor."""
        aliases = self.hub_aliases()
        stacked = set(aliases) | {a for group in aliases.values() for a in group}
        plain = [n for n in views if n not in stacked]
        out = dict(zip(plain, checksums([views[n] for n in plain])))
        pieces = piece_checksums((views[n], len(group)) for n, group in aliases.items())
        for (name, group), (whole, parts) in zip(aliases.items(), pieces):
            out[name] = whole
            out.update(zip(group, parts))
        return out

    def missing_weights(self, names: Iterable[str]) -> set[str]:
        """The HF names a set of weights leaves unfilled. With tied embeddings one tensor has two
        names and either one fills it; stacked experts are filled by their own name or by all of
        their checkpoint names."""
        names = set(names)
        expected = set(self.named_weights())
        for name, views in self.hub_aliases().items():
            expected -= set(views)
            if names.issuperset(views):
                names.add(name)
        if self.config.tie_word_embeddings:
            expected.discard("lm_head.weight")
            if "lm_head.weight" in names:
                names.add("model.embed_tokens.weight")
        return expected - names

    @torch.no_grad()
    def load_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], params: dict[str, torch.Tensor] | None = None
    ) -> set[str]:
        """Copy HF-named tensors into the existing parameters, in place.

        In place (never rebinding `.data`) so that anything holding the parameter storage, such
        as a captured CUDA graph, sees the new values. Returns the names loaded.
        """
        params = self.named_weights() if params is None else params
        loaded: set[str] = set()
        dst: list[torch.Tensor] = []
        src: list[torch.Tensor] = []
        pending = 0
        for name, tensor in weights:
            p = params.get(name)
            if p is None:
                raise KeyError(f"weight '{name}' does not exist in this {self.config.model_type} model")
            if tuple(p.shape) != tuple(tensor.shape):
                raise ValueError(f"weight '{name}' has shape {tuple(tensor.shape)}, the model expects {tuple(p.shape)}")
            loaded.add(name)
            if tensor.device != p.device or tensor.dtype != p.dtype:  # from disk or another dtype: one by one
                p.copy_(tensor)
                continue
            dst.append(p)
            src.append(tensor)
            pending += tensor.numel() * tensor.element_size()
            if pending >= COPY_BATCH_BYTES:
                torch._foreach_copy_(dst, src)
                dst, src, pending = [], [], 0
        if dst:
            # a few launches per bucket instead of one per tensor: at 0.6B the per-tensor
            # launches cost more than the bytes on a slow host
            torch._foreach_copy_(dst, src)
        # checked as copied (in the engine's dtype); the caller then marks the weights
        # incomplete, so nothing is sampled from them
        bad = non_finite([(n, params[n]) for n in sorted(loaded)])
        if bad is not None:
            raise ValueError(f"weight '{bad}' holds non-finite values (NaN or inf): push finite weights")
        return loaded


def load_model(
    model_dir: str | Path,
    device: torch.device,
    dtype: torch.dtype,
    materialize: Callable[[CausalLM], object] | None = None,
) -> CausalLM:
    """Build the model without initializing it (meta device) and fill it from the checkpoint.
    `materialize` gives the parameters their storage on `device` before the checkpoint is read
    into them (the engine packs them into one buffer); by default each gets its own tensor."""
    cfg = ModelConfig.from_hf_dir(model_dir)
    with torch.device("meta"):
        model = CausalLM(cfg).to(dtype)
    if materialize is None:
        model = model.to_empty(device=device)
    else:
        materialize(model)
    model.tie_weights()
    # Not in the checkpoint, and kept in float32 whatever the model dtype, as HF does.
    model.model.rotary_emb.inv_freq = RotaryEmbedding(cfg.head_dim, cfg.rope_theta).inv_freq.to(device)
    model.requires_grad_(False)
    model.eval()
    missing = model.missing_weights(model.load_weights(iter_safetensors(model_dir)))
    if missing:
        raise ValueError(f"checkpoint {model_dir} lacks {len(missing)} weights, e.g. {sorted(missing)[:3]}")
    return model
