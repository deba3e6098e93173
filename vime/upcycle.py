"""`vime upcycle`: a dense Llama-family checkpoint made into a Mixtral-format mixture of experts
(sparse upcycling, Komatsuzaki et al. 2022), a real small MoE to train from a real dense model (the
embedded SmolLM2-135M: `--hf-checkpoint smollm2`) where no MoE small enough for one GPU or a CPU
installs from the package index.

Each decoder layer's MLP is copied into every one of E experts and gets a fresh router (a normal
init of the config's initializer_range, seeded); the rest (attention, norms, embeddings) is kept.
Mixtral renormalises the top-k router weights to sum to 1 and the experts start equal, so the
upcycled model computes the dense model's function at step 0 (to float32's rounding of that sum);
training then pulls the experts apart. Written layer by layer, one safetensors shard per layer,
under the hub's per-expert names (`block_sparse_moe.experts.{e}.w1.weight`, ...), beside the
source's tokenizer and generation config.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
from pathlib import Path

import torch

from vime.models import ModelError, read_config, resolve_model

LLAMA_FAMILY = ("llama", "mistral")  # layers Mixtral's are: no attention or MLP biases, no q/k norms
# the dense config's fields a Mixtral config takes as they are
SHARED = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "hidden_act", "max_position_embeddings", "initializer_range",
    "rms_norm_eps", "pad_token_id", "bos_token_id", "eos_token_id", "tie_word_embeddings", "rope_parameters",
    "sliding_window",
)  # fmt: skip
_MLP = re.compile(r"^model\.layers\.(?P<layer>\d+)\.mlp\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")
_EXPERT = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}  # Mixtral's names of them


def mixtral_config(dense: dict, num_experts: int, top_k: int) -> object:
    """The Mixtral config of the upcycled model: the dense model's shape, E experts of its MLP's
    size, top-k routing, no router jitter (the trainer refuses a training forward that differs)."""
    from transformers import MixtralConfig

    why = _not_upcyclable(dense, num_experts, top_k)
    if why is not None:
        raise ModelError(why)
    kept = {k: dense[k] for k in SHARED if k in dense}
    if "rope_parameters" not in kept and "rope_theta" in dense:  # an older config.json's top-level base
        kept["rope_parameters"] = {"rope_type": "default", "rope_theta": dense["rope_theta"]}
    config = MixtralConfig(
        **kept, num_local_experts=num_experts, num_experts_per_tok=top_k, router_jitter_noise=0.0,
        output_router_logits=False,
    )  # fmt: skip
    config.architectures = ["MixtralForCausalLM"]
    return config


def _not_upcyclable(dense: dict, num_experts: int, top_k: int) -> str | None:
    model_type = dense.get("model_type")
    if model_type not in LLAMA_FAMILY:
        return (
            f"upcycle makes a Mixtral, whose layers are Llama's: a {model_type} model is not of the Llama family "
            f"({', '.join(LLAMA_FAMILY)})"
        )
    if dense.get("attention_bias") or dense.get("mlp_bias"):
        return "upcycle makes a Mixtral, whose layers have no biases: this model's attention or MLP has them"
    if dense.get("hidden_act", "silu") != "silu":
        return f"upcycle makes a Mixtral, whose experts run silu: this model's MLP runs {dense['hidden_act']}"
    if num_experts < 2:
        return f"--num-experts {num_experts}: a mixture needs at least 2 experts"
    if not 1 <= top_k <= num_experts:
        return f"--top-k {top_k}: each token goes to between 1 and --num-experts {num_experts} experts"
    return None


def _source_files(model_dir: Path) -> dict[str, Path]:
    """Tensor name → the safetensors file holding it (one file, or an index's shards)."""
    from safetensors import safe_open

    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        return {n: model_dir / f for n, f in json.loads(index.read_text())["weight_map"].items()}
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        return {n: model_dir / "model.safetensors" for n in f.keys()}  # noqa: SIM118 (safe_open is no mapping)


def upcycle(
    model_dir: Path, out: Path, num_experts: int, top_k: int, seed: int = 0, dtype: torch.dtype | None = None
) -> Path:
    """Write the upcycled model of the dense HF directory `model_dir` to `out` (which must not
    hold anything yet); `dtype`: its tensors' (default: the source's)."""
    from safetensors import safe_open
    from safetensors.torch import save_file
    from tqdm import tqdm

    config = mixtral_config(read_config(model_dir), num_experts, top_k)
    if out.exists() and not out.is_dir():  # iterdir's NotADirectoryError was a traceback
        raise ModelError(f"--out {out} is a file: give a new directory")
    if out.exists() and any(out.iterdir()):
        raise ModelError(f"--out {out} is not empty: give a new directory")
    files = _source_files(model_dir)
    layers = config.num_hidden_layers
    generator = torch.Generator().manual_seed(seed)
    out.mkdir(parents=True, exist_ok=True)
    weight_map, total = {}, 0
    groups = [f"model.layers.{i}." for i in range(layers)] + [""]  # each layer, then everything else
    for shard, prefix in enumerate(tqdm(groups, desc="upcycling", unit="layer", leave=False), start=1):
        names = [n for n in files if (n.startswith(prefix) if prefix else not n.startswith("model.layers."))]
        tensors: dict[str, torch.Tensor] = {}
        for name in names:
            with safe_open(str(files[name]), "pt") as f:
                tensor = f.get_tensor(name)
            tensors.update(_upcycled(name, tensor if dtype is None else tensor.to(dtype), num_experts))
        if prefix:
            router = torch.empty(num_experts, config.hidden_size).normal_(
                0.0, config.initializer_range, generator=generator
            )
            tensors[f"{prefix}block_sparse_moe.gate.weight"] = router.to(next(iter(tensors.values())).dtype)
        file = f"model-{shard:05d}-of-{len(groups):05d}.safetensors"
        save_file(tensors, str(out / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, file))
        total += sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    config.save_pretrained(out)
    for extra in model_dir.iterdir():  # the tokenizer, its chat template, the generation config
        if extra.is_file() and extra.name != "config.json" and not extra.name.startswith("model."):
            shutil.copy(extra, out / extra.name)
    return out


def _upcycled(name: str, tensor: torch.Tensor, num_experts: int) -> dict[str, torch.Tensor]:
    """A dense tensor under its upcycled name(s): an MLP projection once per expert (its own copy:
    safetensors writes no shared memory), anything else as it is."""
    m = _MLP.match(name)
    if m is None:
        return {name: tensor}
    block = f"model.layers.{m['layer']}.block_sparse_moe.experts"
    return {f"{block}.{e}.{_EXPERT[m['proj']]}.weight": tensor.clone() for e in range(num_experts)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="vime upcycle",
        description="Make a dense Llama-family model a Mixtral-format mixture of experts: each MLP copied into "
        "every expert, a fresh router; it computes the dense model's function until trained.",
    )
    p.add_argument("--hf-checkpoint", default="smollm2", help="the dense model: an HF directory or 'smollm2' (default)")
    p.add_argument("--num-experts", type=int, default=8, help="experts per layer (default 8)")
    p.add_argument("--top-k", type=int, default=2, help="experts each token is routed to (default 2)")
    p.add_argument("--seed", type=int, default=0, help="seed of the routers' init (default 0)")
    p.add_argument(
        "--dtype", choices=("float32", "bfloat16"), default=None, help="tensor dtype (default: the source's)"
    )
    p.add_argument("--out", required=True, help="a new directory for the upcycled model")
    a = p.parse_args(argv)
    dtype = getattr(torch, a.dtype) if a.dtype else None
    out = upcycle(resolve_model(a.hf_checkpoint), Path(a.out), a.num_experts, a.top_k, a.seed, dtype)
    print(f"{out}  Mixtral, {a.num_experts} experts per layer, top-{a.top_k}")
    return 0
