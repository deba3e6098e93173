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


def add_shape_args(ap: argparse.ArgumentParser) -> None:
    """The trainer benches' --device, --tiny and --shape."""
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--tiny", action="store_true", help="a 2-layer model and short sequences (CPU smoke test)")
    ap.add_argument("--shape", choices=list(SHAPES), default="qwen3-0.6b", help="model shape (random weights)")
