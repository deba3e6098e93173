"""What the engine reads of an HF checkpoint's config.json, and what it refuses.

Kept apart from the modules so that start-up can ask whether a checkpoint is runnable
(`unsupported`) before any engine starts, without building a model.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

SUPPORTED_ARCHS = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
}
# config.json keys that count a model's routed experts, in the families transformers knows: a
# model_type outside SUPPORTED_ARCHS that has one is refused as a mixture-of-experts family
EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
# keys that give a model shared experts (every token through them), which no supported family has
SHARED_EXPERT_KEYS = ("shared_expert_intermediate_size", "n_shared_experts", "num_shared_experts")


class UnsupportedModelError(ValueError):
    """A checkpoint this engine cannot run; the message names the field and what is supported."""


@dataclass(frozen=True)
class MoEConfig:
    """The routed experts of a mixture-of-experts model (Qwen3-MoE, Mixtral): which layers have
    them and how a token picks its `top_k`. A router's auxiliary loss (`router_aux_loss_coef`) is
    the trainer's: generation never reads it."""

    num_experts: int
    top_k: int  # num_experts_per_tok
    intermediate_size: int  # each expert's (Qwen3-MoE: moe_intermediate_size; Mixtral: intermediate_size)
    norm_topk_prob: bool  # the top-k probabilities renormalised to sum to 1 (Mixtral: always)
    layers: tuple[int, ...]  # the decoder layers whose MLP is sparse; the rest stay dense (Qwen3-MoE)
    # HF's Qwen3-MoE rounds the routing weights to the model dtype before scaling an expert's
    # output by them; Mixtral scales in float32 and rounds the product (both identical in float32)
    round_weights: bool


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    eos_token_ids: tuple[int, ...]
    moe: MoEConfig | None = None  # None: a dense model

    @property
    def route_shape(self) -> tuple[int, int] | None:
        """(MoE layers, top_k): the expert ids of one token (`KVCache.routes`); None for a dense model."""
        return None if self.moe is None else (len(self.moe.layers), self.moe.top_k)

    @classmethod
    def from_hf_dir(cls, model_dir: str | Path) -> ModelConfig:
        """Read config.json (+ generation_config.json for extra eos ids); refuse what we cannot run."""
        model_dir = Path(model_dir)
        c = json.loads((model_dir / "config.json").read_text())
        mt = c.get("model_type")
        if mt not in SUPPORTED_ARCHS and any(c.get(k) for k in EXPERT_COUNT_KEYS):
            raise UnsupportedModelError(
                f"model_type '{mt}' in {model_dir}/config.json is a mixture-of-experts family the vime engine does not run "
                "(its experts: qwen3_moe and mixtral; dense: llama, qwen2, qwen3)"
            )
        if mt not in SUPPORTED_ARCHS:
            raise UnsupportedModelError(
                f"model_type '{mt}' in {model_dir}/config.json is not supported by the vime engine (supported: {', '.join(SUPPORTED_ARCHS)})"
            )
        if c.get("hidden_act", "silu") != "silu":
            raise UnsupportedModelError(f"hidden_act '{c['hidden_act']}' is not supported (only silu)")
        if c.get("use_sliding_window") or any(t != "full_attention" for t in c.get("layer_types") or []):
            raise UnsupportedModelError("sliding-window attention layers are not supported by the vime engine")
        if mt == "mixtral" and c.get("sliding_window") is not None:  # Mixtral's attention reads it as it is
            raise UnsupportedModelError(
                f"sliding_window {c['sliding_window']} in {model_dir}/config.json: sliding-window attention is not "
                "supported by the vime engine (Mixtral checkpoints that attend to everything set it to null)"
            )
        eos: list[int] = []
        gen_path = model_dir / "generation_config.json"
        for src in (c, json.loads(gen_path.read_text()) if gen_path.exists() else {}):
            ids = src.get("eos_token_id")
            for i in ids if isinstance(ids, list) else [ids] if ids is not None else []:
                if i not in eos:
                    eos.append(int(i))
        n_heads = c["num_attention_heads"]
        return cls(
            model_type=mt,
            vocab_size=c["vocab_size"],
            hidden_size=c["hidden_size"],
            intermediate_size=c["intermediate_size"],
            num_layers=c["num_hidden_layers"],
            num_heads=n_heads,
            num_kv_heads=c.get("num_key_value_heads") or n_heads,
            head_dim=c.get("head_dim") or c["hidden_size"] // n_heads,
            rms_norm_eps=c.get("rms_norm_eps", 1e-6),
            rope_theta=_rope_theta(c),
            max_position_embeddings=c.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
            # Qwen2 hard-codes q/k/v bias and no o bias; Llama and Qwen3 follow attention_bias.
            qkv_bias=True if mt == "qwen2" else bool(c.get("attention_bias", False)),
            o_bias=False if mt == "qwen2" else bool(c.get("attention_bias", False)),
            mlp_bias=bool(c.get("mlp_bias", False)),
            qk_norm=mt in ("qwen3", "qwen3_moe"),
            eos_token_ids=tuple(eos),
            moe=_moe(c, mt, model_dir),
        )


def unsupported(model_dir: str | Path) -> str | None:
    """Why this engine cannot run the model of `model_dir`, or None: what start-up asks before any
    engine starts (an engine that refused it at its own start showed its traceback)."""
    try:
        ModelConfig.from_hf_dir(model_dir)
    except UnsupportedModelError as e:
        return str(e)
    except (KeyError, TypeError, ValueError) as e:  # a config.json without a field the engine reads
        return f"{Path(model_dir) / 'config.json'} lacks what the vime engine reads ({type(e).__name__}: {e})"
    return None


def _moe(c: dict, model_type: str, model_dir: Path) -> MoEConfig | None:
    """The experts of a qwen3_moe or mixtral config.json (None for the dense families, and for a
    Qwen3-MoE without experts); shared experts are refused."""
    if model_type not in ("qwen3_moe", "mixtral"):
        return None
    shared = next((k for k in SHARED_EXPERT_KEYS if c.get(k)), None)
    if shared is not None:
        raise UnsupportedModelError(
            f"{shared} {c[shared]} in {model_dir}/config.json: shared experts are not supported by the vime engine "
            "(qwen3_moe and mixtral route every token to its top-k experts only)"
        )
    # transformers 5 writes Qwen3-MoE's expert count as num_local_experts, the hub's files as num_experts
    num_experts = int(c.get("num_experts") or c.get("num_local_experts") or 0)
    if model_type == "mixtral":
        layers = tuple(range(c["num_hidden_layers"]))
        size, norm, round_weights = c["intermediate_size"], True, False
    else:
        dense, step = set(c.get("mlp_only_layers") or []), int(c.get("decoder_sparse_step", 1))
        layers = tuple(i for i in range(c["num_hidden_layers"]) if i not in dense and (i + 1) % step == 0)
        size, norm, round_weights = c["moe_intermediate_size"], bool(c.get("norm_topk_prob", False)), True
    if num_experts <= 0 or not layers:
        return None
    top_k = int(c["num_experts_per_tok"])
    if not 0 < top_k <= num_experts:
        raise UnsupportedModelError(
            f"num_experts_per_tok {top_k} in {model_dir}/config.json: give 1 to the number of experts ({num_experts})"
        )
    return MoEConfig(num_experts, top_k, int(size), norm, layers, round_weights)


def _rope_theta(c: dict) -> float:
    """rope_theta from either the transformers-5 `rope_parameters` dict or the older top-level
    `rope_theta` + `rope_scaling`; only plain (default) RoPE is implemented."""
    params = c.get("rope_parameters") or c.get("rope_scaling") or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise UnsupportedModelError(
            f"rope type '{rope_type}' is not supported by the vime engine yet (only default RoPE)"
        )
    return float(params.get("rope_theta", c.get("rope_theta", 10000.0)))
