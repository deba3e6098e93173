"""Mixtures of experts in the trainer: the families vime trains (`MOE_FAMILIES`, one row each), where
a model's MoE blocks are (`MoeShape`), and its expert weights under the names checkpoints use.

transformers 5 holds a block's experts fused, as two 3-D parameters, `mlp.experts.gate_up_proj`
[E, 2·I, H] (each expert's gate rows, then its up rows) and `mlp.experts.down_proj` [E, H, I], so
that one grouped GEMM runs every expert (`grouped_mm`, its default experts implementation); it
converts the hub's per-expert tensors into them at load and back at `save_pretrained`. What leaves
the trainer (pushes, checkpoints) is the hub's per-expert layout (`hub_tensors`), which the
built-in engine, vLLM and every HF loader read; a checkpoint read back is fused again
(`fused_tensors`).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from vime.config import AlgorithmConfig, TrainerConfig
from vime.models import ModelError


@dataclass(frozen=True)
class MoeFamily:
    """How one family of mixture-of-experts models names and routes its experts."""

    hub_block: str  # the MoE block's name in hub checkpoints (transformers 5 calls it `mlp` in every family)
    projections: tuple[str, str, str]  # hub names of an expert's gate, up and down projections
    renormalise_key: str | None  # the config switch that renormalises the top-k weights; None: always
    float32_weights: bool  # the router hands the experts float32 weights, not weights in the logits' dtype


MOE_FAMILIES: dict[str, MoeFamily] = {
    "qwen3_moe": MoeFamily("mlp", ("gate_proj", "up_proj", "down_proj"), "norm_topk_prob", False),
    "mixtral": MoeFamily("block_sparse_moe", ("w1", "w3", "w2"), None, True),
}

EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")  # what makes a config.json an MoE's


def expert_count(config: dict) -> int:
    """Experts per MoE layer a config.json names, 0 for a dense model."""
    return int(next((config[k] for k in EXPERT_KEYS if config.get(k)), 0))


def moe_refusal(config: dict, model_dir: str, trainer: TrainerConfig, algorithm: AlgorithmConfig) -> str | None:
    """What the MoE settings cannot do with the model of `config` (its config.json), in one line:
    each asks for experts a dense model has not, a family without a row is not trained, and
    expert parallelism must split every layer's experts evenly."""
    asked = [
        flag
        for flag, on in (
            ("--use-rollout-routing-replay", algorithm.use_rollout_routing_replay),
            ("--record-routed-experts", algorithm.record_routed_experts),
            (f"--moe-aux-loss-coeff {trainer.moe_aux_loss_coeff:g}", trainer.moe_aux_loss_coeff > 0),
            (
                f"--expert-model-parallel-size {trainer.expert_model_parallel_size}",
                trainer.expert_model_parallel_size > 1,
            ),
        )
        if on
    ]
    experts, model_type = expert_count(config), config.get("model_type")
    if not experts:
        return f"{asked[0]}: {model_dir} is a dense model, it has no experts: drop it" if asked else None
    if model_type not in MOE_FAMILIES:
        return f"{model_dir} is a {model_type} mixture of experts, which vime does not train yet: {_trained()}"
    ep = trainer.expert_model_parallel_size
    if experts % ep:
        return f"--expert-model-parallel-size {ep} does not split {model_dir}'s {experts} experts per layer evenly"
    return None


def moe_layer(config: object, i: int) -> bool:
    """Whether decoder layer `i` of an MoE config routes (Qwen3-MoE's `mlp_only_layers` and
    `decoder_sparse_step` leave layers dense; Mixtral's every layer routes); for a model not built."""
    dense = getattr(config, "mlp_only_layers", None) or []
    return i not in dense and (i + 1) % (getattr(config, "decoder_sparse_step", None) or 1) == 0


def is_moe_block(module: nn.Module | None) -> bool:
    """transformers 5's sparse MoE block: a router (`gate`, with `top_k`) and fused `experts`."""
    return hasattr(module, "experts") and hasattr(getattr(module, "gate", None), "top_k")


@dataclass(frozen=True)
class MoeShape:
    """A model's mixture of experts: its family's row, which decoder layers route (Qwen3-MoE's
    `mlp_only_layers` and `decoder_sparse_step` may leave some dense), experts per layer, top-k."""

    model_type: str
    family: MoeFamily
    layers: tuple[int, ...]  # indices of the decoder layers whose MLP is a mixture of experts
    num_experts: int
    top_k: int
    num_hidden_layers: int

    @classmethod
    def of(cls, model: nn.Module) -> MoeShape | None:
        """The MoE of an HF causal LM (built on any device, meta included), None for a dense one
        (one whose config names experts that no layer has, too); a mixture of experts of a family
        without a row is refused in one line."""
        decoder_layers = list(model.get_decoder().layers)
        layers = tuple(i for i, layer in enumerate(decoder_layers) if is_moe_block(getattr(layer, "mlp", None)))
        model_type = model.config.model_type
        if not layers:
            return None
        family = MOE_FAMILIES.get(model_type)
        if family is None:
            raise ModelError(f"{model_type} is a mixture of experts vime does not train yet: {_trained()}")
        block = decoder_layers[layers[0]].mlp
        return cls(model_type, family, layers, block.experts.num_experts, block.gate.top_k, len(decoder_layers))

    def blocks(self, model: nn.Module) -> list[nn.Module]:
        """The MoE blocks of `model`, in layer order."""
        decoder_layers = model.get_decoder().layers
        return [decoder_layers[i].mlp for i in self.layers]


def _trained() -> str:
    return f"it trains dense models and the MoE families {', '.join(MOE_FAMILIES)}"


_FUSED = re.compile(r"^(?P<layer>.+)\.mlp\.(?P<part>experts\.gate_up_proj|experts\.down_proj|gate\.weight)$")
_HUB = re.compile(r"^(?P<layer>.+)\.(?P<block>\w+)\.(?:experts\.(?P<expert>\d+)\.(?P<proj>\w+)|gate)\.weight$")


def hub_tensors(moe: MoeShape | None, name: str, tensor: Tensor) -> Iterator[tuple[str, Tensor]]:
    """One parameter as hub checkpoints hold it: a fused expert tensor as one tensor per expert and
    projection (`model.layers.3.mlp.experts.gate_up_proj` [E, 2I, H] → `...experts.{e}.gate_proj.weight`
    [I, H] and `...up_proj.weight`; Mixtral's `block_sparse_moe.experts.{e}.w1/w3/w2.weight`), the
    router under its hub name; anything else as it is. The expert tensors are copies, not views:
    safetensors refuses tensors that share memory, and a view would keep the whole fused tensor alive."""
    m = _FUSED.match(name) if moe is not None else None
    if m is None:
        yield name, tensor
        return
    assert moe is not None
    block = f"{m['layer']}.{moe.family.hub_block}"
    gate, up, down = moe.family.projections
    if m["part"] == "gate.weight":
        yield f"{block}.gate.weight", tensor
    elif m["part"] == "experts.gate_up_proj":
        half = tensor.shape[1] // 2  # [E, 2I, H]: gate rows first
        for e in range(tensor.shape[0]):
            yield f"{block}.experts.{e}.{gate}.weight", tensor[e, :half].clone()
            yield f"{block}.experts.{e}.{up}.weight", tensor[e, half:].clone()
    else:
        for e in range(tensor.shape[0]):  # [E, H, I]
            yield f"{block}.experts.{e}.{down}.weight", tensor[e].clone()


def fused_tensors(moe: MoeShape | None, tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    """A checkpoint's tensors under the model's own parameter names: `hub_tensors` undone (the
    experts of each layer stacked into its fused tensors, the router renamed back)."""
    if moe is None:
        return tensors
    gate, up, down = moe.family.projections
    out: dict[str, Tensor] = {}
    experts: dict[str, dict[str, dict[int, Tensor]]] = {}  # layer prefix → projection → expert → tensor
    for name, t in tensors.items():
        m = _HUB.match(name)
        if m is None or m["block"] != moe.family.hub_block:
            out[name] = t
        elif m["expert"] is None:
            out[f"{m['layer']}.mlp.gate.weight"] = t
        else:
            experts.setdefault(m["layer"], {}).setdefault(m["proj"], {})[int(m["expert"])] = t
    for layer, by_proj in experts.items():
        have = {p: sorted(by_proj.get(p, {})) for p in (gate, up, down)}
        if any(ids != list(range(moe.num_experts)) for ids in have.values()):
            lacking = next(p for p, ids in have.items() if ids != list(range(moe.num_experts)))
            raise ModelError(
                f"{layer}.{moe.family.hub_block}: the checkpoint holds {len(have[lacking])} of {moe.num_experts} "
                f"experts' {lacking} weights"
            )
        out[f"{layer}.mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([by_proj[gate][e], by_proj[up][e]]) for e in range(moe.num_experts)]
        )
        out[f"{layer}.mlp.experts.down_proj"] = torch.stack([by_proj[down][e] for e in range(moe.num_experts)])
    return out
