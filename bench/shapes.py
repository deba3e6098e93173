"""Model shapes the benches share (HF Qwen3 config keys, random weights): one definition, so the
engine, trainer and A/B rows of a shape are the same model."""

from __future__ import annotations

import argparse

QWEN3_0_6B = dict(
    vocab_size=151936,
    hidden_size=1024,
    intermediate_size=3072,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=40960,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
)
# Qwen3-4B's config (issue 30): the founding experiment's model
QWEN3_4B = dict(QWEN3_0_6B, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32)
SHAPES = {"qwen3-0.6b": QWEN3_0_6B, "qwen3-4b": QWEN3_4B}
# SmolLM2-135M-Instruct's config.json (a Llama): bench/profile_startup.py compiles the demo's shapes
# without the GGUF, which takes two calls to bring to a lent GPU (bench/device_prep.sh)
SMOLLM2_135M = dict(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    max_position_embeddings=8192,
    rms_norm_eps=1e-5,
    rope_theta=100000.0,
    tie_word_embeddings=True,
)

# CPU smoke tests
TINY = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=4096,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
)

# Qwen3-30B-A3B's config.json with 4 of its 48 layers (issue 70): its experts (128, top-8, each
# 768 wide), heads and vocabulary, at ~3.1B parameters, so the engine, HF and the trainer (float32
# master weights and Adam: ~50 GB) fit one GPU. Only bench_engine.py and bench_trainer.py build
# mixtures of experts, so they alone offer these shapes.
QWEN3_30B_A3B_4L = dict(
    model_type="qwen3_moe",
    vocab_size=151936,
    hidden_size=2048,
    intermediate_size=6144,
    moe_intermediate_size=768,
    num_experts=128,
    num_experts_per_tok=8,
    norm_topk_prob=True,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    num_hidden_layers=4,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=128,
    max_position_embeddings=40960,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)
MOE_SHAPES = {"qwen3-30b-a3b-4l": QWEN3_30B_A3B_4L}
# --tiny with a mixture of experts' --shape: the CPU smoke test keeps the family
TINY_MOE = dict(
    TINY,
    model_type="qwen3_moe",
    moe_intermediate_size=32,
    num_experts=8,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    decoder_sparse_step=1,
    mlp_only_layers=[],
)


def pick(name: str, tiny: bool) -> dict:
    """--shape's config, or with --tiny the 2-layer stand-in of its family."""
    shape = {**SHAPES, **MOE_SHAPES}[name]
    return dict((TINY_MOE if "num_experts" in shape else TINY) if tiny else shape)


def hf_config(shape: dict, **extra: object):  # noqa: ANN201 (transformers' config class)
    """The shape as a transformers config of its family (Qwen3 unless it says otherwise)."""
    from transformers import AutoConfig

    fields = {k: v for k, v in shape.items() if k != "model_type"}
    return AutoConfig.for_model(shape.get("model_type", "qwen3"), **fields, **extra)


def tiny_model_kwargs(shape: dict) -> dict:
    """A shape as `vime.models.make_tiny_model`'s keyword arguments (its own names; the
    character-level tokenizer it writes fits any vocabulary)."""
    return dict(
        hidden_size=shape["hidden_size"],
        num_layers=shape["num_hidden_layers"],
        num_heads=shape["num_attention_heads"],
        num_kv_heads=shape["num_key_value_heads"],
        head_dim=shape["head_dim"],
        intermediate_size=shape["intermediate_size"],
        vocab_size=shape["vocab_size"],
        tie_word_embeddings=shape["tie_word_embeddings"],
        max_position_embeddings=4096,
    )


def add_shape_args(ap: argparse.ArgumentParser, moe: bool = False) -> None:
    """The trainer benches' --device, --tiny and --shape (`moe`: the mixtures of experts too)."""
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--tiny", action="store_true", help="a 2-layer model and short sequences (CPU smoke test)")
    ap.add_argument(
        "--shape",
        choices=[*SHAPES, *(MOE_SHAPES if moe else {})],
        default="qwen3-0.6b",
        help="model shape (random weights)",
    )
