"""LoRA (Hu et al. 2021) on the trainer's linear layers, our own, not PEFT's.

Why our own: vime trains the HF model under FSDP2 with per-layer compile and a chunked LM head,
and pushes weights by their HF names. PEFT wraps every target in a module of its own, renaming
each weight (`base_layer.weight`) and hiding the model behind `base_model.model`, which every
one of those paths would have to unwrap. Here a target `nn.Linear` keeps its module and its
`weight` (frozen) and gains two parameters, `lora_A` [r, in] and `lora_B` [out, r] (B starts at
zero, so step 0 is the base model), and a forward hook that adds s · B A x (s = alpha / r) to its
output. Everything that names weights sees the base model's names; only `lora_A`/`lora_B` are
trainable, so the optimizer holds state for them alone.

What leaves the trainer is the merged weight W + s · B A under the HF name (`merged`): pushes
reach every engine and backend unchanged, and a checkpoint's safetensors load in transformers
and vLLM as a plain model. Beside it a checkpoint holds the adapter in PEFT's layout
(`adapter/adapter_model.safetensors`, `adapter/adapter_config.json`), which PEFT loads onto the
base model and which a resumed run reads back (the base is the run's --hf-checkpoint).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from vime.config import TrainerConfig

ALL_LINEAR = "all-linear"
ADAPTER_DIR = "adapter"
_PEFT_PREFIX = "base_model.model."


@dataclass(frozen=True)
class LoraSpec:
    """--lora-rank, --lora-alpha, --lora-dropout, --target-modules, --exclude-modules."""

    rank: int
    alpha: float
    dropout: float
    targets: tuple[str, ...]  # module names' last parts (q_proj, ...), or all-linear
    exclude: tuple[str, ...]  # module names' last parts, or whole dotted names, left out

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    @classmethod
    def of(cls, trainer: TrainerConfig) -> LoraSpec | None:
        """The adapters the trainer's settings ask for; None when --lora-rank is 0 (full fine-tuning)."""
        if not trainer.lora_rank:
            return None
        return cls(
            trainer.lora_rank,
            float(trainer.lora_alpha),
            float(trainer.lora_dropout),
            tuple(trainer.target_modules),
            tuple(trainer.exclude_modules),
        )

    def wants(self, name: str) -> bool:
        """Whether the linear layer at dotted `name` gets an adapter. The LM head never does: it
        is tied to the embedding in the models vime trains, and the chunked head reads its
        weight directly."""
        last = name.rsplit(".", 1)[-1]
        if last == "lm_head" or any(x in (last, name) for x in self.exclude):
            return False
        return ALL_LINEAR in self.targets or last in self.targets


def _hook(module: nn.Module, inputs: tuple[Tensor, ...], out: Tensor) -> Tensor:
    x = module.lora_dropout(inputs[0])
    a, b = module.lora_A.to(x.dtype), module.lora_B.to(x.dtype)
    return out + nn.functional.linear(nn.functional.linear(x, a), b) * module.lora_scaling


def lora_targets(model: nn.Module, spec: LoraSpec) -> list[tuple[str, nn.Linear]]:
    """The linear layers that get adapters, or a ValueError (one line) when none does or the rank
    exceeds what one of them allows. Preflight runs it on the model built on the meta device,
    so a bad flag fails before the run starts; `add_adapters` before it allocates anything."""
    targets = [(name, mod) for name, mod in model.named_modules() if isinstance(mod, nn.Linear) and spec.wants(name)]
    if not targets:
        raise ValueError(
            f"--target-modules {' '.join(spec.targets)} (minus --exclude-modules) matches no linear layer of the "
            "model: name the layers' last parts (q_proj, v_proj, ...) or all-linear"
        )
    # B A has rank at most min(in, out): a larger rank only costs memory and time (100000 on
    # 64-wide layers made a step 40 times as long)
    name, narrowest = min(targets, key=lambda t: min(t[1].in_features, t[1].out_features))
    most = min(narrowest.in_features, narrowest.out_features)
    if spec.rank > most:
        raise ValueError(
            f"--lora-rank {spec.rank} is larger than the layer {name} allows ({narrowest.in_features} in, "
            f"{narrowest.out_features} out features): give at most {most}, or leave that layer out with --exclude-modules"
        )
    return targets


def add_adapters(model: nn.Module, spec: LoraSpec, seed: int) -> list[str]:
    """Freeze `model` and give every wanted linear layer its adapter; returns their names.
    A is drawn as nn.Linear draws its weights (Kaiming uniform) from a generator seeded by
    `seed`, so every rank of a sharded trainer starts from the same adapters."""
    targets = lora_targets(model, spec)
    model.requires_grad_(False)
    gen = torch.Generator().manual_seed(seed)
    names = []
    for name, mod in targets:
        weight = mod.weight
        a = torch.empty(spec.rank, mod.in_features, dtype=weight.dtype)
        bound = 1 / math.sqrt(mod.in_features)  # kaiming_uniform_(a=√5) on a [r, in] matrix
        a.uniform_(-bound, bound, generator=gen)
        mod.lora_A = nn.Parameter(a.to(weight.device))
        mod.lora_B = nn.Parameter(torch.zeros(mod.out_features, spec.rank, dtype=weight.dtype, device=weight.device))
        mod.lora_scaling = spec.scaling
        mod.lora_dropout = nn.Dropout(spec.dropout) if spec.dropout > 0 else nn.Identity()
        mod.register_forward_hook(_hook)
        names.append(name)
    return names


def is_adapter(param_name: str) -> bool:
    return param_name.endswith((".lora_A", ".lora_B"))


def merged(weight: Tensor, a: Tensor, b: Tensor, scaling: float) -> Tensor:
    """W + s · B A, in the weight's dtype (computed in float32)."""
    return (weight.float() + scaling * (b.float() @ a.float())).to(weight.dtype)


def peft_name(param_name: str) -> str:
    """`model.layers.0.self_attn.q_proj.lora_A` → PEFT's `base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`."""
    return f"{_PEFT_PREFIX}{param_name}.weight"


def param_name(peft_key: str) -> str:
    if not (peft_key.startswith(_PEFT_PREFIX) and peft_key.endswith(".weight")):
        raise ValueError(f"{peft_key!r} is not a PEFT LoRA tensor name")
    return peft_key[len(_PEFT_PREFIX) : -len(".weight")]


def adapter_config(spec: LoraSpec, modules: list[str], base: str) -> dict[str, Any]:
    """PEFT's adapter_config.json for these adapters (the fields PEFT needs to load them)."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base,
        "r": spec.rank,
        "lora_alpha": int(spec.alpha) if float(spec.alpha).is_integer() else spec.alpha,
        "lora_dropout": spec.dropout,
        "target_modules": sorted({m.rsplit(".", 1)[-1] for m in modules}),
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
    }


def write_adapter(directory: Path, tensors: dict[str, Tensor], config: dict[str, Any]) -> None:
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    save_file({peft_name(n): t.contiguous() for n, t in tensors.items()}, str(directory / "adapter_model.safetensors"))
    (directory / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")


def read_adapter(directory: Path) -> dict[str, Tensor]:
    """Parameter name → tensor, from a directory `write_adapter` wrote."""
    from safetensors.torch import load_file

    return {param_name(k): v for k, v in load_file(str(directory / "adapter_model.safetensors")).items()}
