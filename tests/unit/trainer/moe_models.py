"""Tiny random mixtures of experts for the MoE tests: Qwen3-MoE and Mixtral built from a
transformers config and written with save_pretrained, with the character tokenizer the tiny dense
model has (`vime.models.make_tiny_tokenizer`), so engines, trainer and checkpoints read them as
they read a real one."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from vime.models import make_tiny_tokenizer


def make_tiny_moe(
    out: Path, arch: str = "qwen3_moe", seed: int = 0, router_std: float | None = None, **overrides: Any
) -> Path:
    """A random 2-layer MoE of `arch` (qwen3_moe or mixtral): 4 experts of which 2 route each token;
    `overrides` change the config (e.g. Qwen3-MoE's `mlp_only_layers=[0]` for one dense layer).
    `router_std`: the routers' weights drawn at that scale, so that no two experts' probabilities
    tie within float32 rounding (near a tie, two correct implementations may pick different ones)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    tokenizer = make_tiny_tokenizer()
    shape = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.pad_token_id,
        rope_theta=10000.0,
        num_experts_per_tok=2,
    )
    if arch == "qwen3_moe":
        shape.update(num_experts=4, moe_intermediate_size=32, norm_topk_prob=True)
    elif arch == "mixtral":
        shape.update(num_local_experts=4, intermediate_size=32, sliding_window=None)
    else:
        raise ValueError(f"unknown tiny MoE arch {arch}: qwen3_moe or mixtral")
    shape.update(overrides)
    config = AutoConfig.for_model(arch, **shape)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if router_std is not None:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("mlp.gate.weight"):
                    p.normal_(0.0, router_std)
    model.generation_config.eos_token_id = [config.eos_token_id, tokenizer.eos_token_id]
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
