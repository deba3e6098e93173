"""Expert parallelism (--expert-model-parallel-size N, Megatron's flag): each MoE layer's experts
split over the trainer's ranks, N of them (all of them: vime's EP group is the whole trainer),
everything else sharded by FSDP2 over the same ranks.

Each rank keeps experts [r·E/N, (r+1)·E/N) of every layer: the fused expert parameters become
DTensors sharded on the expert dimension over the ranks' mesh (so the gradient norm, the
optimizer, `full_tensor` for pushes and checkpoints treat them as FSDP2's own shards), and FSDP2
leaves them alone (`ignored_params`). A MoE block's experts then run `expert_parallel_forward`:
every rank's tokens (with their expert ids and gate weights) are all-gathered, each rank runs its
own experts on the tokens routed to them (transformers' grouped GEMM, other experts' pairs skipped),
and a reduce-scatter sums each token's expert outputs back on the rank it came from. Simpler than
Megatron's all-to-all (every rank sees every token, N times the activations of one), exact, and
what gloo on CPU runs too; an all-to-all dispatch is the step to take for speed.

The gradients: each rank's loss enters the backward times the world size (FSDP2 averages its
gradients over the ranks; `OptimizerStep.accumulate`), and an expert's gradient gathers every
rank's tokens with no average after it, so it is divided by N on its way (`_ScaleGrad`).
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch import Tensor, nn

from vime.trainer.moe import MoeShape

EXPERT_PARAMETERS = ("gate_up_proj", "down_proj")  # transformers 5's fused experts, [E, ...] each
# torch 2.13 renamed the flat collectives (the old names warn); older torches have only the old ones
_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def shard_experts(moe: MoeShape, model: nn.Module, mesh: object) -> set[nn.Parameter]:
    """Split every MoE block's experts over `mesh` (a 1-D device mesh of the trainer's ranks), in
    place: each fused parameter becomes a DTensor sharded on dim 0 holding this rank's experts,
    and the block's experts run `expert_parallel_forward`. Returns the expert parameters, which
    FSDP2 must leave alone."""
    from torch.distributed.tensor import DTensor, Shard

    n, rank = mesh.size(), mesh.get_local_rank()
    out: set[nn.Parameter] = set()
    for block in moe.blocks(model):
        experts = block.experts
        for name in EXPERT_PARAMETERS:
            full = getattr(experts, name).detach()
            mine = full.chunk(n, dim=0)[rank].clone()  # [E/N, ...]
            param = nn.Parameter(DTensor.from_local(mine, mesh, [Shard(0)], run_check=False))
            setattr(experts, name, param)
            out.add(param)
        experts.forward = functools.partial(expert_parallel_forward, experts, mesh.get_group())
    return out


@torch.compiler.disable  # collectives between the grouped GEMMs: run eagerly inside a compiled layer
def expert_parallel_forward(
    experts: nn.Module, group: dist.ProcessGroup, hidden: Tensor, top_k_index: Tensor, top_k_weights: Tensor
) -> Tensor:
    """The experts' forward over the ranks' tokens: hidden [T, H], expert ids and gate weights
    [T, K] of this rank's tokens → their outputs [T, H]."""
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    gate_up, down = (getattr(experts, p).to_local() for p in EXPERT_PARAMETERS)  # this rank's experts
    local = gate_up.shape[0]
    counts = torch.tensor([hidden.shape[0]], device=hidden.device)
    every = torch.empty(n, dtype=counts.dtype, device=hidden.device)
    _GATHER(every, counts, group=group)
    longest = int(every.max())  # the ranks' token counts differ: each pads to the longest
    pad = longest - hidden.shape[0]
    ids = torch.nn.functional.pad(top_k_index, (0, 0, 0, pad), value=-1)
    all_ids = torch.empty(n * longest, ids.shape[1], dtype=ids.dtype, device=ids.device)
    _GATHER(all_ids, ids.contiguous(), group=group)  # [N·T, K]
    all_hidden = _Gather.apply(torch.nn.functional.pad(hidden, (0, 0, 0, pad)), group)  # [N·T, H]
    all_weights = _Gather.apply(torch.nn.functional.pad(top_k_weights, (0, 0, 0, pad)), group)  # [N·T, K]
    mine = all_ids - rank * local
    mine = torch.where((mine >= 0) & (mine < local), mine, local)  # another rank's expert: skipped
    view = SimpleNamespace(
        num_experts=local,
        gate_up_proj=_ScaleGrad.apply(gate_up, 1.0 / n).to(hidden.dtype),
        down_proj=_ScaleGrad.apply(down, 1.0 / n).to(hidden.dtype),
        has_gate=True,
        has_bias=False,
        is_transposed=False,
        has_post_expert_norm=False,
        _is_expert_parallel=True,  # ids >= num_experts are transformers' "not mine" sentinels
        _apply_gate=experts._apply_gate,
    )
    from transformers.integrations.moe import grouped_mm_experts_forward

    partial = grouped_mm_experts_forward(view, all_hidden, mine, all_weights)  # [N·T, H]: this rank's experts' share
    return _ReduceScatter.apply(partial, group)[: hidden.shape[0]]


def _all_gather(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    out = x.new_empty(dist.get_world_size(group) * x.shape[0], *x.shape[1:])
    _GATHER(out, x.contiguous(), group=group)
    return out


def _reduce_scatter(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    mine = x.new_empty(x.shape[0] // dist.get_world_size(group), *x.shape[1:])
    _REDUCE_SCATTER(mine, x.contiguous(), group=group)
    return mine


class _Gather(torch.autograd.Function):
    """All-gather along dim 0; its backward sums the gradients and keeps this rank's rows."""

    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup) -> Tensor:  # noqa: ANN001
        ctx.group = group
        return _all_gather(x, group)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:  # noqa: ANN001
        return _reduce_scatter(grad, ctx.group), None


class _ReduceScatter(torch.autograd.Function):
    """Sum over the ranks along dim 0, each rank keeping its rows; its backward all-gathers."""

    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup) -> Tensor:  # noqa: ANN001
        ctx.group = group
        return _reduce_scatter(x, group)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:  # noqa: ANN001
        return _all_gather(grad, ctx.group), None


class _ScaleGrad(torch.autograd.Function):
    """Identity whose backward scales the gradient: an expert's gradient gathers every rank's
    tokens, each rank's loss already times the world size (see the module's docstring)."""

    @staticmethod
    def forward(ctx, x: Tensor, scale: float) -> Tensor:  # noqa: ANN001
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:  # noqa: ANN001
        return grad * ctx.scale, None
