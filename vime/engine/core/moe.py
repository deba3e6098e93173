"""The sparse MLP of a mixture-of-experts model (Qwen3-MoE, Mixtral): a router picks each
token's top-k experts, and their outputs, scaled by the routing weights, are summed.

The experts of a layer are stored stacked, as transformers 5 holds them in memory:
`experts.gate_up_proj` [E, 2I, H] (each expert's gate rows, then its up rows) and
`experts.down_proj` [E, H, I], so the GPU path runs all experts in two grouped launches
(`kernels/moe.py`). A checkpoint names them one expert at a time (Qwen3-MoE:
`mlp.experts.{e}.gate_proj.weight`; Mixtral: `block_sparse_moe.experts.{e}.w1.weight`, with w3 the
up and w2 the down projection, and its router `block_sparse_moe.gate.weight`): `hub_views` gives
those names as slices of the stacked tensors, so loads, pushes and checksums take either naming.

Routing follows HF's modules: router logits in the model dtype, softmax in float32, top-k,
renormalised where the model says so (Mixtral always), then Qwen3-MoE rounds the weights to the
model dtype (Mixtral scales in float32). Each MoE layer also writes its choice, the top-k expert
ids of every token, into the routing pool beside the KV cache (`KVCache.routes`, one row per KV
slot), which is how a request gets them back (`routing.py`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vime.engine.core import kernels
from vime.engine.core.model_config import ModelConfig

# the pieces of an HF weight name that only expert and router weights have
EXPERT_NAME_PARTS = (".mlp.experts.", ".mlp.gate.weight", ".block_sparse_moe.")


class Router(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        assert cfg.moe is not None
        self.moe = cfg.moe
        self.weight = nn.Parameter(torch.empty(cfg.moe.num_experts, cfg.hidden_size))  # [E, H]

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] → (weights [T, K], expert ids [T, K] int64); weights in the model dtype where
        HF rounds them to it (Qwen3-MoE), else float32."""
        probs = torch.softmax(F.linear(x, self.weight), dim=-1, dtype=torch.float32)  # [T, E]
        weights, ids = probs.topk(self.moe.top_k, dim=-1)
        if self.moe.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return (weights.to(x.dtype) if self.moe.round_weights else weights), ids


class Experts(nn.Module):
    """The layer's experts, stacked; parameter names as transformers 5's (`gate_up_proj`, `down_proj`)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        assert cfg.moe is not None
        e, i, h = cfg.moe.num_experts, cfg.moe.intermediate_size, cfg.hidden_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h))
        self.down_proj = nn.Parameter(torch.empty(e, h, i))


class SparseMoE(nn.Module):
    """`index`: this layer's place among the model's MoE layers (its column of the routing pool)."""

    def __init__(self, cfg: ModelConfig, index: int):
        super().__init__()
        self.gate = Router(cfg)
        self.experts = Experts(cfg)
        self.index = index

    def forward(self, x: torch.Tensor, routes: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        """x [T, H] → [T, H]. `routes`: (the routing pool [slots, MoE layers, K] int32, each
        token's KV slot [T] int64), where this layer writes the experts it chose."""
        weights, ids = self.gate(x)
        if routes is not None:
            pool, slots = routes
            pool[slots, self.index] = ids.to(torch.int32)
        gate_up, down = self.experts.gate_up_proj, self.experts.down_proj
        if kernels.enabled(x.device):
            return kernels.fused_experts(x, gate_up, down, weights.float(), ids)
        return experts_torch(x, gate_up, down, weights, ids)


def experts_torch(
    x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """The PyTorch path (CPU): per expert, gather its tokens, two matmuls, scale, scatter-add;
    the experts in increasing id, as HF adds them. One host sync (the count per expert)."""
    k = ids.shape[1]
    flat = ids.reshape(-1)
    order = flat.argsort(stable=True)  # the (token, k) indices grouped by expert
    counts = torch.bincount(flat, minlength=gate_up.shape[0]).tolist()
    out = torch.zeros_like(x)
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        pick = order[start : start + n]
        start += n
        token = pick // k
        gate, up = F.linear(x[token], gate_up[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, down[e])
        out.index_add_(0, token, (y * weights.reshape(-1)[pick, None]).to(x.dtype))
    return out


def hub_views(name: str, p: torch.Tensor, model_type: str) -> dict[str, torch.Tensor]:
    """The checkpoint's names for a stacked expert parameter's slices, one per expert and
    projection, and Mixtral's router under its checkpoint name; {} for any other parameter."""
    for leaf in ("mlp.experts.gate_up_proj", "mlp.experts.down_proj", "mlp.gate.weight"):
        if name.endswith("." + leaf):
            layer = name.removesuffix("." + leaf)
            break
    else:
        return {}
    mixtral = model_type == "mixtral"
    experts = f"{layer}.block_sparse_moe.experts" if mixtral else f"{layer}.mlp.experts"
    if leaf == "mlp.gate.weight":
        return {f"{layer}.block_sparse_moe.gate.weight": p} if mixtral else {}
    if leaf == "mlp.experts.down_proj":
        return {f"{experts}.{e}.{'w2' if mixtral else 'down_proj'}.weight": p[e] for e in range(p.shape[0])}
    gate, up = ("w1", "w3") if mixtral else ("gate_proj", "up_proj")
    i = p.shape[1] // 2
    out: dict[str, torch.Tensor] = {}
    for e in range(p.shape[0]):
        out[f"{experts}.{e}.{gate}.weight"] = p[e, :i]
        out[f"{experts}.{e}.{up}.weight"] = p[e, i:]
    return out


def is_expert_weight(name: str) -> bool:
    """Whether an HF weight name is an expert's or a router's (either naming)."""
    return any(part in name for part in EXPERT_NAME_PARTS)
