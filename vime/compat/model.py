"""Megatron's flags against the checkpoint, before anything starts: the shape flags must describe
the model vime trains (its config.json and weight names), and the training state that FSDP2
shards over the actor GPUs must fit them, whatever parallel sizes the script asked for.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from vime.compat.flags import FLAGS
from vime.models import parameter_count


def model_facts(config: dict[str, Any], weight_names: set[str]) -> dict[str, Any]:
    """What each shape flag would have to say for this checkpoint, keyed by the flag's dest."""
    heads = config.get("num_attention_heads")
    kv_heads = config.get("num_key_value_heads") or heads
    rope = config.get("rope_theta")
    if rope is None:  # transformers 5 nests it
        rope = (config.get("rope_parameters") or config.get("rope_scaling") or {}).get("rope_theta")
    act = config.get("hidden_act", "silu")

    def has(suffix: str) -> bool:
        return any(n.endswith(suffix) for n in weight_names)

    return {
        "num_layers": config.get("num_hidden_layers"),
        "hidden_size": config.get("hidden_size"),
        "ffn_hidden_size": config.get("intermediate_size"),
        "num_attention_heads": heads,
        "num_query_groups": kv_heads,
        "kv_channels": config.get("head_dim") or (config["hidden_size"] // heads if heads else None),
        "vocab_size": config.get("vocab_size"),
        "max_position_embeddings": config.get("max_position_embeddings"),
        "rotary_base": rope,
        "norm_epsilon": config.get("rms_norm_eps", config.get("layer_norm_eps")),
        "rotary_percent": config.get("partial_rotary_factor", 1.0),
        "normalization": "RMSNorm" if "rms_norm_eps" in config else "LayerNorm",
        "position_embedding_type": "rope" if rope is not None else None,
        # a mixture of experts' experts are gated too (Qwen3-MoE's gate_proj, Mixtral's w1)
        "swiglu": act in ("silu", "swish")
        and any(has(s) for s in ("mlp.gate_proj.weight", "0.gate_proj.weight", "0.w1.weight")),
        "group_query_attention": bool(heads and kv_heads < heads),
        "qk_layernorm": has("self_attn.q_norm.weight"),
        "add_qkv_bias": has("self_attn.q_proj.bias"),
        "disable_bias_linear": not (has("self_attn.o_proj.bias") or has("mlp.down_proj.bias")),
        "untie_embeddings_and_output_weights": not config.get("tie_word_embeddings", False),
        "use_rotary_position_embeddings": rope is not None,
        **_moe_facts(config),
    }


EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")  # as vime/trainer/moe.py reads config.json


def _moe_facts(config: dict[str, Any]) -> dict[str, Any]:
    """What Megatron's MoE flags would have to say: a dense model has 0 experts, and the other
    flags are not compared for it (its --num-experts contradiction says enough)."""
    experts = int(next((config[k] for k in EXPERT_KEYS if config.get(k)), 0))
    if not experts:
        return {"num_experts": 0}
    n = int(config.get("num_hidden_layers") or 0)
    dense = set(config.get("mlp_only_layers") or [])
    step, first = int(config.get("decoder_sparse_step") or 1), int(config.get("first_k_dense_replace") or 0)
    return {
        "num_experts": experts,
        "moe_ffn_hidden_size": config.get("moe_intermediate_size") or config.get("intermediate_size"),
        "moe_router_topk": config.get("num_experts_per_tok"),
        "moe_shared_expert_intermediate_size": config.get("shared_expert_intermediate_size") or 0,
        "moe_router_score_function": config.get("scoring_func", "softmax"),
        "moe_layer_freq": [int(i not in dense and (i + 1) % step == 0 and i >= first) for i in range(n)],
    }


def layer_pattern(value: Any, layers: int) -> list[int] | None:
    """Megatron's --moe-layer-freq as one 0/1 per layer: an int N (every Nth layer from the first,
    i % N == 0), or a list, literal or of sums and products of lists (`([0]*3+[1]*45)`, as slime's
    scripts write it); None when it is neither."""
    import ast

    def value_of(node: ast.AST) -> Any:
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.List):
            return [value_of(e) for e in node.elts]
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
            left, right = value_of(node.left), value_of(node.right)
            return left + right if isinstance(node.op, ast.Add) else left * right
        raise ValueError(node)

    try:
        parsed = value_of(ast.parse(str(value).strip(), mode="eval").body)
    except (SyntaxError, ValueError, TypeError):
        return None
    if isinstance(parsed, int):
        return [int(i % parsed == 0) for i in range(layers)] if parsed > 0 else None
    return [int(bool(v)) for v in parsed] if isinstance(parsed, list) else None


def _same(flag_value: Any, fact: Any) -> bool:
    if isinstance(fact, list):  # --moe-layer-freq against the checkpoint's MoE layers
        return layer_pattern(flag_value, len(fact)) == fact
    if isinstance(flag_value, float) and isinstance(fact, (int, float)):
        return math.isclose(
            flag_value, float(fact), rel_tol=1e-6
        )  # config.json may hold float32 roundings (9.99999975e-06)
    if isinstance(flag_value, str) and isinstance(fact, str):
        return flag_value.lower() == fact.lower()
    return flag_value == fact


def shape_contradictions(given: dict[str, Any], facts: dict[str, Any], source: str) -> str | None:
    """One line naming every shape flag that contradicts the checkpoint, or None.

    A value flag is compared when given. The switches are compared both ways once a model block
    is present (`--num-layers` or `--hidden-size` given): Megatron builds its model from the flags
    alone, so a switch left out (no --add-qkv-bias for a model with q/k/v biases) describes
    another model just as a wrong number does. Without --group-query-attention, Megatron ignores
    --num-query-groups (every head its own KV head)."""
    block = "num_layers" in given or "hidden_size" in given
    if str(given.get("position_embedding_type", "")).lower() == "rope":  # Megatron's newer spelling of the switch
        given = {**given, "use_rotary_position_embeddings": True}
    bad = []
    for name, fact in facts.items():
        f = FLAGS[name]
        if f.type is bool:
            if block and fact is not None and bool(given.get(name)) != fact:
                bad.append(
                    f"{f.flag} {'given' if given.get(name) else 'left out'} (checkpoint: {'yes' if fact else 'no'})"
                )
        elif name in given and fact is not None:
            if name == "num_query_groups" and block and not given.get("group_query_attention"):
                continue  # Megatron ignores it without --group-query-attention; the switch is compared above
            if not _same(given[name], fact):
                bad.append(f"{f.flag} {given[name]} (checkpoint: {fact})")
    if not bad:
        return None
    return (
        f"model flags contradict {source}: {'; '.join(bad)}. vime trains the checkpoint as it is: fix or drop "
        "these flags, or point --hf-checkpoint at the model they describe"
    )


def weight_names(model_dir: Path) -> set[str]:
    """Tensor names of an HF directory's safetensors, from the index or the files' headers."""
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        return set(json.loads(index.read_text())["weight_map"])
    from safetensors import safe_open

    names: set[str] = set()
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            names.update(f.keys())
    return names


# float32 master weights (4) + gradients (4) + AdamW's two moments (8); a frozen float32 reference adds 4
TRAIN_BYTES_PER_PARAM, REF_BYTES_PER_PARAM = 16, 4


def fsdp_bytes_per_gpu(params: int, gpus: int, with_ref: bool) -> float:
    """The sharded training state one GPU holds under FSDP2, activations aside: a lower bound."""
    return params * (TRAIN_BYTES_PER_PARAM + REF_BYTES_PER_PARAM * with_ref) / gpus


def memory_refusal(params: int, gpus: int, with_ref: bool, gpu_bytes: int, sizes: str) -> str | None:
    """Megatron's sizes asked for a model split; FSDP2 over `gpus` GPUs holds 1/gpus of the
    state each. If even that does not fit one GPU, the script cannot be honoured here."""
    need = fsdp_bytes_per_gpu(params, gpus, with_ref)
    if need <= gpu_bytes:
        return None
    return (
        f"the model's training state takes {need / 2**30:.1f} GiB per GPU sharded by FSDP2 over {gpus} actor GPU(s) "
        f"({sizes or 'no model-parallel sizes'} asked for a split), more than the {gpu_bytes / 2**30:.1f} GiB a GPU has: "
        "add actor GPUs (--actor-num-gpus-per-node, --actor-num-nodes)"
    )


ENGINE_BYTES_PER_PARAM = 2  # the built-in engine's bf16 weights
ENGINE_WEIGHT_SHARE = 0.8  # of a GPU, at most: the rest is KV cache, activations and CUDA graphs


def engine_memory_refusal(params: int, per_engine: int, gpu_bytes: int) -> str | None:
    """A slime script asked for engines of `per_engine` GPUs, which the built-in engine runs as one
    engine per GPU: refused when the whole model's weights leave too little of one GPU."""
    need = params * ENGINE_BYTES_PER_PARAM
    if need <= ENGINE_WEIGHT_SHARE * gpu_bytes:
        return None
    return (
        f"--rollout-num-gpus-per-engine {per_engine}: the built-in engine has no tensor parallelism and holds the "
        f"whole model on each GPU, {need / 2**30:.1f} GiB of bf16 weights of the {gpu_bytes / 2**30:.1f} GiB a GPU "
        f"has, too little room left for its KV cache: use --rollout-backend vllm (tensor-parallel engines)"
    )


def check_model(cfg: Any, model_dir: Path, read_config: Callable[[Path], dict], gpu_bytes: int | None) -> list[str]:
    """Refusals about the checkpoint: shape contradictions, experts asked of a dense model, and a
    model whose sharded training state cannot fit the actor GPUs. `gpu_bytes`: one GPU's memory
    when the trainer runs on CUDA, else None."""
    g = cfg.slime_flags
    config = read_config(model_dir)
    out = []
    shapes = {n: v for n, v in g.items() if n in FLAGS and FLAGS[n].kind == "shape"}  # not the --sglang-* family
    if shapes:
        line = shape_contradictions(
            shapes,
            model_facts(config, weight_names(model_dir)),
            str(model_dir / "config.json"),
        )
        if line:
            out.append(line)
    experts = any(config.get(k) for k in EXPERT_KEYS)
    # Megatron's expert sizes (--expert-model-parallel-size is vime's setting too, under its name)
    expert_sizes = {
        "--expert-model-parallel-size": cfg.expert_model_parallel_size,
        "--expert-tensor-parallel-size": g.get("expert_tensor_parallel_size", 1),
    }
    for flag, size in expert_sizes.items():
        if size > 1 and not experts:
            out.append(f"{flag} {size}: {model_dir} is a dense model, it has no experts to split; use 1")
    sizes = {n: g[n] for n in FLAGS if FLAGS[n].kind == "parallel" and g.get(n, 1) > 1}
    if gpu_bytes is not None and g.get("_engine_tensor_parallel"):
        refusal = engine_memory_refusal(parameter_count(model_dir), g["_engine_tensor_parallel"], gpu_bytes)
        if refusal:
            out.append(refusal)
    if gpu_bytes is not None:
        refusal = memory_refusal(
            parameter_count(model_dir),
            cfg.actor_num_nodes * cfg.actor_num_gpus_per_node,
            cfg.kl_loss_coef > 0,
            gpu_bytes,
            " ".join(f"{FLAGS[n].flag} {v}" for n, v in sizes.items()),
        )
        if refusal:
            out.append(refusal)
    return out
