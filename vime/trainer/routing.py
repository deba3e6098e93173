"""The routers of the policy's mixture of experts as the trainer runs them: the engine's expert
choice replayed (rollout routing replay, R3: --use-rollout-routing-replay), how often the trainer
would have chosen otherwise (`train/routing_mismatch`), and the load-balancing loss
(--moe-aux-loss-coeff, `train/moe_aux_loss`).

Each MoE block's router (transformers' top-k router: logits → softmax → top-k → weights) runs
`route` in place of its forward, reading the policy's one `Routing`. Replay takes the engine's
expert ids and the trainer's own gate weights: the softmax of the trainer's router logits gathered
at those ids and renormalised as the family does, so the router keeps its gradient (R3, Ma et al.
2025). Positions the engine sent no ids for (each sequence's last token, padding) route as the
trainer would. Without replay `route` computes what transformers' router does, bit for bit.

The engine's answer (`Sample.rollout_routed_experts`, SGLang's layout) has one row per position
it ran, the top-k ids of each layer; SGLang's rows hold every decoder layer (a dense layer's ids
are zeros), an engine that counts MoE layers only holds those: both are read (`sample_routing`).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from vime.models import ModelError
from vime.trainer.moe import MoeShape


@dataclass
class Routing:
    """What the policy's routers read and add to during a forward. `replay`: the run's
    --use-rollout-routing-replay; the rest is set per forward by the trainer."""

    moe: MoeShape
    replay: bool
    engine: Tensor | None = None  # [T, MoE layers, top_k] the engine's ids for the packed row, -1 where none
    scored: Tensor | None = None  # [T] bool: the positions that score response tokens
    real: Tensor | None = None  # [T] bool: the row's real tokens (not padding)
    measure: bool = False  # count the mismatch (in a forward that does not replay)
    # a training forward: the balance loss is logged, weighted by the micro-batch's share of the
    # step's tokens, and enters the backward times `balance_scale` (coefficient × share × world)
    balancing: bool = False
    balance_share: float = 0.0
    balance_scale: float = 0.0
    sums: dict[str, Tensor] = field(default_factory=dict)  # on the device: summed over forwards until `take`

    @classmethod
    def install(cls, moe: MoeShape, model: nn.Module, replay: bool) -> Routing:
        """The routing of `model`, its routers running `route`."""
        routing = cls(moe, replay)
        for slot, block in enumerate(moe.blocks(model)):
            block.gate.forward = functools.partial(route, block.gate, routing, slot)
        return routing

    def begin(self, engine: Tensor | None, scored: Tensor, real: Tensor) -> None:
        """A packed row's forward starts: its engine ids, scored and real positions."""
        self.engine, self.scored, self.real = engine, scored, real

    @contextlib.contextmanager
    def replaying(self, replay: bool) -> Iterator[None]:
        """Forwards inside replay as `replay` says, whatever the run's setting (the gap measured
        with and without replay)."""
        was, self.replay = self.replay, replay
        try:
            yield
        finally:
            self.replay = was

    @contextlib.contextmanager
    def measuring(self) -> Iterator[None]:
        """Forwards inside that do not replay count the routing mismatch."""
        self.measure = True
        try:
            yield
        finally:
            self.measure = False

    def balance(self, share: float, scale: float) -> None:
        """The next forward is a training forward holding `share` of its step's tokens (0, 0:
        forwards are not training ones any more): its balance loss is logged weighted by it and
        enters the backward times `scale`."""
        self.balancing, self.balance_share, self.balance_scale = share > 0, share, scale

    def add(self, name: str, value: Tensor) -> None:
        self.sums[name] = self.sums.get(name, 0) + value.detach().double()

    def take(self) -> dict[str, float]:
        """The sums since the last take, as floats (this rank's: every rank has the same keys, for
        `Ranks.sum`), and zero them."""
        out = {k: float(self.sums.get(k, 0.0)) for k in SUMS}
        self.sums = {}
        return out


SUMS = ("moe_aux_loss", "mismatch", "compared")  # what the routers add up: the balance loss, the mismatch


def routing_metrics(
    sums: dict[str, float], replay: bool, trained_gap: float | None, other_gap: float | None, steps: int
) -> dict[str, float]:
    """A step's routing metrics from the routers' sums over its ranks and optimizer steps:
    `train/moe_aux_loss` (each optimizer step's token-weighted balance loss, averaged over them),
    `train/routing_mismatch`, and the engine/trainer log-prob gap with and without replay: the
    training forward's (`trained_gap`, the loss's train_rollout_logprob_abs_diff) under the
    run's setting, the other from `Actor`'s extra scoring forward."""
    out = {"train/moe_aux_loss": sums["moe_aux_loss"] / max(steps, 1)}
    if sums["compared"]:
        out["train/routing_mismatch"] = sums["mismatch"] / sums["compared"]
    for replayed, gap in ((replay, trained_gap), (not replay, other_gap)):
        if gap is not None:
            out["train/logprob_gap_replay" if replayed else "train/logprob_gap_no_replay"] = gap
    return out


@torch.compiler.disable  # eager inside a compiled layer: its flags would recompile the layer as they change
def route(router: nn.Module, routing: Routing, slot: int, hidden: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """A transformers top-k router's forward: (logits [T, E], top-k weights [T, K], expert ids
    [T, K]), with the engine's ids in place of its own top-k where `routing` replays."""
    family = routing.moe.family
    hidden = hidden.reshape(-1, router.hidden_dim)
    logits = F.linear(hidden, router.weight)  # [T, E]
    probs = torch.softmax(logits.float(), dim=-1)  # every family's softmax runs in float32
    own = torch.topk(probs, router.top_k, dim=-1).indices  # [T, K]: the trainer's choice
    engine = routing.engine[:, slot] if routing.engine is not None else None  # [T, K], -1 where none
    chosen = own if engine is None or not routing.replay else torch.where(engine >= 0, engine, own)
    weights = probs.gather(-1, chosen)
    if family.renormalise_key is None or getattr(router, family.renormalise_key):
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if not family.float32_weights:
        weights = weights.to(logits.dtype)
    if routing.measure and engine is not None and not routing.replay:
        _count_mismatch(routing, own, engine)
    if routing.balancing:
        weights = _balance(routing, probs, chosen, weights)
    return logits, weights, chosen


def _count_mismatch(routing: Routing, own: Tensor, engine: Tensor) -> None:
    """Scored positions with engine ids whose top-k set the trainer would have chosen otherwise."""
    assert routing.scored is not None
    counted = routing.scored & (engine[:, 0] >= 0)
    differs = (own.sort(dim=-1).values != engine.sort(dim=-1).values).any(dim=-1)
    routing.add("mismatch", (differs & counted).sum())
    routing.add("compared", counted.sum())


def _balance(routing: Routing, probs: Tensor, chosen: Tensor, weights: Tensor) -> Tensor:
    """The layer's load-balancing loss (Switch Transformer's, Megatron's `--moe-aux-loss-coeff`):
    E · Σ_e f_e · P_e over the row's real tokens, f_e the share of the top-k assignments expert e
    got, P_e its mean router probability; 1 when balanced. Logged, and with a coefficient added to
    the backward through the weights (the gradient reaches the router through P_e)."""
    assert routing.real is not None
    real = routing.real[: probs.shape[0]]
    experts = probs.shape[-1]
    p = probs[real]  # [Tr, E]
    counts = torch.zeros(experts, device=p.device).index_add_(
        0, chosen[real].reshape(-1), torch.ones(chosen[real].numel(), device=p.device)
    )
    loss = experts * (counts / counts.sum().clamp_min(1) * p.mean(dim=0)).sum()
    routing.add("moe_aux_loss", loss * routing.balance_share)
    if routing.balance_scale and torch.is_grad_enabled():
        return _BalanceLoss.apply(weights, loss, routing.balance_scale)
    return weights


class _BalanceLoss(torch.autograd.Function):
    """Identity on the router's weights whose backward also sends `scale` into the balance loss:
    the loss's gradient enters while the layer's backward runs (its weights gathered there under
    FSDP), as Megatron's MoEAuxLossAutoScaler does, not from outside the model."""

    @staticmethod
    def forward(ctx, weights: Tensor, loss: Tensor, scale: float) -> Tensor:  # noqa: ANN001
        ctx.scale = scale
        ctx.save_for_backward(loss)
        return weights.view_as(weights)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, Tensor, None]:  # noqa: ANN001
        (loss,) = ctx.saved_tensors
        return grad, torch.full_like(loss, ctx.scale), None


def sample_routing(routed: Tensor | None, n_tokens: int, moe: MoeShape) -> Tensor:
    """One sample's engine ids as the trainer replays them: [n_tokens, MoE layers, top_k] int64,
    -1 where the engine sent none. `routed`: `Sample.rollout_routed_experts`, [positions,
    layers × top_k], its layers every decoder layer (SGLang's) or the MoE layers only."""
    out = torch.full((n_tokens, len(moe.layers), moe.top_k), -1, dtype=torch.long)
    if routed is None:
        return out
    width = routed.shape[-1] if routed.dim() == 2 else 0
    if width % moe.top_k or width // moe.top_k not in (len(moe.layers), moe.num_hidden_layers):
        raise ModelError(
            f"a sample's routed experts have {width} ids per position, where this model routes "
            f"{len(moe.layers)} MoE layers (of {moe.num_hidden_layers}) to {moe.top_k} experts each: "
            "they come from an engine running another model"
        )
    rows = routed.reshape(routed.shape[0], -1, moe.top_k)
    if rows.shape[1] != len(moe.layers):
        rows = rows[:, list(moe.layers)]  # every decoder layer's row: the MoE layers' kept
    n = min(rows.shape[0], n_tokens)
    out[:n] = rows[:n]
    if out.numel() and (int(out.max()) >= moe.num_experts or int(out.min()) < -1):
        raise ModelError(f"a sample's routed experts name an expert outside the model's {moe.num_experts}")
    return out


def packed_routing(routed: Sequence[Tensor | None], lengths: Sequence[int], total: int, moe: MoeShape) -> Tensor:
    """The engine ids of a packed row of sequences of `lengths` (then padding up to `total`
    tokens): [total, MoE layers, top_k], -1 where none."""
    parts = [sample_routing(r, n, moe) for r, n in zip(routed, lengths)]
    pad = total - sum(lengths)
    if pad:
        parts.append(torch.full((pad, len(moe.layers), moe.top_k), -1, dtype=torch.long))
    return torch.cat(parts)
