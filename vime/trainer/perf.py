"""Model FLOPs of a training step and MFU, the trainer's throughput yardsticks.

FLOPs count the work the step needs, not what an implementation happens to do: the decoder on
every token, the LM head on the scored (response) tokens only, causal attention within each
sequence (no cross-sequence or pad work). A padded full-logit trainer and a packed chunked one
running the same batch are thus credited the same FLOPs, and MFU compares them directly.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from vime.trainer.moe import expert_count, moe_layer

# Dense bf16 peak of one H100/H200 SXM (vendor datasheet, no sparsity). Measured cuBLAS bf16 on
# this workplace's H200s is ~790 TFLOP/s, so MFU against 989 tops out near 80%.
PEAK_BF16_FLOPS = 989e12


def _dims(config: Any) -> tuple[int, int, int, int, int, int, int]:
    hidden = config.hidden_size
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    return hidden, heads, head_dim, kv, config.intermediate_size, config.num_hidden_layers, config.vocab_size


def decoder_matmul_params(config: Any) -> int:
    """Weights that multiply every token in the decoder (projections and MLP; no embeddings). A
    mixture of experts' MoE layers count the router and the top-k experts a token runs through,
    not the experts it skips."""
    hidden, heads, head_dim, kv, inter, layers, _ = _dims(config)
    attn = hidden * heads * head_dim * 2 + hidden * kv * head_dim * 2  # q, o; k, v
    experts = expert_count(config.to_dict()) if hasattr(config, "to_dict") else 0
    sparse = sum(moe_layer(config, i) for i in range(layers)) if experts else 0
    expert_inter = getattr(config, "moe_intermediate_size", None) or inter
    moe_mlp = config.num_experts_per_tok * 3 * hidden * expert_inter + hidden * experts if experts else 0
    return layers * attn + (layers - sparse) * 3 * hidden * inter + sparse * moe_mlp


def train_flops(
    config: Any, seq_lens: Sequence[int], scored: Sequence[int], forwards: int = 1, frozen: bool = False
) -> float:
    """FLOPs of one forward+backward over the sequences plus `forwards` extra forward passes
    (the log-prob recompute, the reference model).

    Per token: 2 × matmul params forward, 6 × forward+backward. Attention per layer and
    sequence of s tokens: QKᵀ and AV are 2·s²·d each, halved by the causal mask → 2·s²·d
    forward (d = heads × head_dim). `frozen` (LoRA): the base weights get no gradient, so the
    matmuls' backward is the input gradient alone, 4 × in all; the adapters' own FLOPs (rank r
    against thousands of features) are left out.
    """
    hidden, heads, head_dim, _, _, layers, vocab = _dims(config)
    tokens, scored_tokens = sum(seq_lens), sum(scored)
    matmul_fwd = 2.0 * (decoder_matmul_params(config) * tokens + vocab * hidden * scored_tokens)
    attn_fwd = 2.0 * layers * heads * head_dim * sum(s * s for s in seq_lens)
    fwd = matmul_fwd + attn_fwd
    return (2.0 if frozen else 3.0) * matmul_fwd + 3.0 * attn_fwd + forwards * fwd


def mfu(flops: float, seconds: float, num_gpus: int = 1, peak: float = PEAK_BF16_FLOPS) -> float:
    """Model FLOPs utilization: achieved FLOP/s over the bf16 peak of all GPUs."""
    return flops / (seconds * peak * num_gpus)
