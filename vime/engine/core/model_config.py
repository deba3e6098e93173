"""What the engine reads of an HF checkpoint's config.json, and what it refuses.

Kept apart from the modules so that start-up can ask whether a checkpoint is runnable
(`unsupported`) before any engine starts, without building a model.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

SUPPORTED_ARCHS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


class UnsupportedModelError(ValueError):
    """A checkpoint this engine cannot run; the message names the field and what is supported."""


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

    @classmethod
    def from_hf_dir(cls, model_dir: str | Path) -> ModelConfig:
        """Read config.json (+ generation_config.json for extra eos ids); refuse what we cannot run."""
        model_dir = Path(model_dir)
        c = json.loads((model_dir / "config.json").read_text())
        mt = c.get("model_type")
        if mt not in SUPPORTED_ARCHS:
            raise UnsupportedModelError(
                f"model_type '{mt}' in {model_dir}/config.json is not supported by the vime engine (supported: {', '.join(SUPPORTED_ARCHS)})"
            )
        if c.get("hidden_act", "silu") != "silu":
            raise UnsupportedModelError(f"hidden_act '{c['hidden_act']}' is not supported (only silu)")
        if c.get("use_sliding_window") or any(t != "full_attention" for t in c.get("layer_types") or []):
            raise UnsupportedModelError("sliding-window attention layers are not supported by the vime engine")
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
            qk_norm=mt == "qwen3",
            eos_token_ids=tuple(eos),
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
