"""`vime convert`: a Megatron torch_dist checkpoint (what slime's `--save` writes) of a dense
Llama, Qwen2 or Qwen3 model → an HF directory, with torch's distributed-checkpoint reader (no
Megatron). The HF model it was trained from (`--hf-checkpoint`, slime's `--origin-hf-dir`) gives
the config, tokenizer and expected tensors.

What the checkpoint holds (Megatron-LM's megatron/core/dist_checkpointing and the GPT model's
sharded_state_dict; slime's tools/convert_torch_dist_to_hf.py reads the same):
* a `--save` directory: `latest_checkpointed_iteration.txt` (a step or `release`) and one
  `iter_0000010/` per save, each a torch.distributed.checkpoint directory (`.metadata`,
  `__R_N.distcp`, Megatron's `metadata.json`; older ones a `common.pt`);
* every tensor at its global shape, whatever the tensor- and pipeline-parallel sizes were, under
  its model key (`optimizer.*` and byte entries such as `*._extra_state/shard_0_1` are not the
  model's); a layer's index is in its key (`decoder.layers.3.mlp...`), or, with homogeneous layers,
  one key per kind holds every layer along a leading dimension (`decoder.layers.mlp...`: [L, ...]);
* `self_attention.linear_qkv.weight` is [groups × (q per group + 2) × head_dim, hidden]: per KV
  head, its query heads' rows, then its key's, then its value's (bias alike);
* `mlp.linear_fc1.weight` is gate then up (`weight_w` and `weight_v` with singleton local shards);
* norms: Transformer Engine's fused `linear_qkv.layer_norm_weight` / `linear_fc1.layer_norm_weight`
  (`input_layernorm.weight` / `pre_mlp_layernorm.weight` in the local layer spec); Qwen3's
  `q_layernorm` / `k_layernorm`;
* `embedding.word_embeddings.weight` and `output_layer.weight` (absent with tied embeddings) have
  their rows padded to a multiple of make-vocab-size-divisible-by × TP: cut to the config's vocab.
"""

from __future__ import annotations

import json
import pickle
import re
import shutil
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from vime.errors import ConfigError
from vime.models import read_config, resolve_model, torch_dist_checkpoint

FAMILIES = ("llama", "qwen2", "qwen3")
SHARD_BYTES = 5 * 1024**3  # per safetensors file, as slime's converter writes them
_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.+)")
_STACKED = re.compile(r"decoder\.layers\.(\D.*)")
_NOT_MODEL = ("optimizer.", "rng_state", "common_state", "rerun_state")  # training state: not converted


@dataclass(frozen=True)
class Shape:
    """What the HF config says the attention looks like: enough to split the fused tensors."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    layers: int
    tied: bool

    @staticmethod
    def of(config: dict[str, Any]) -> Shape:
        heads = int(config["num_attention_heads"])
        return Shape(
            hidden=int(config["hidden_size"]),
            heads=heads,
            kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or config["hidden_size"] // heads),
            vocab=int(config["vocab_size"]),
            layers=int(config["num_hidden_layers"]),
            tied=bool(config.get("tie_word_embeddings", False)),
        )


Split = Callable[[torch.Tensor, Shape], list[tuple[str, torch.Tensor]]]


def _qkv(ending: str) -> Split:
    """linear_qkv's weight or bias, per KV head its query heads' rows, then its key's and value's."""

    def split(t: torch.Tensor, s: Shape) -> list[tuple[str, torch.Tensor]]:
        per_group, tail = s.heads // s.kv_heads, t.shape[1:]  # tail: (hidden,) for the weight, () for the bias
        grouped = t.reshape(s.kv_heads, per_group + 2, s.head_dim, *tail)  # [groups, q heads + k + v, head_dim, ...]
        q, k, v = grouped.split([per_group, 1, 1], dim=1)
        return [(f"self_attn.{p}_proj.{ending}", x.reshape(-1, *tail)) for p, x in zip("qkv", (q, k, v))]

    return split


def _gate_up(t: torch.Tensor, s: Shape) -> list[tuple[str, torch.Tensor]]:
    gate, up = t.chunk(2, dim=0)
    return [("mlp.gate_proj.weight", gate), ("mlp.up_proj.weight", up)]


def _renamed(name: str) -> Split:
    return lambda t, s: [(name, t)]


# a layer key (after `decoder.layers.N.`) -> its HF tensors (after `model.layers.N.`)
LAYER_KEYS: dict[str, Split] = {
    "self_attention.linear_qkv.weight": _qkv("weight"),
    "self_attention.linear_qkv.bias": _qkv("bias"),
    "self_attention.linear_proj.weight": _renamed("self_attn.o_proj.weight"),
    "self_attention.linear_qkv.layer_norm_weight": _renamed("input_layernorm.weight"),  # TE's fused norm
    "input_layernorm.weight": _renamed("input_layernorm.weight"),  # the local layer spec's
    "self_attention.q_layernorm.weight": _renamed("self_attn.q_norm.weight"),  # Qwen3
    "self_attention.k_layernorm.weight": _renamed("self_attn.k_norm.weight"),
    "mlp.linear_fc1.weight": _gate_up,
    "mlp.linear_fc1.weight_w": _renamed("mlp.gate_proj.weight"),  # singleton local shards
    "mlp.linear_fc1.weight_v": _renamed("mlp.up_proj.weight"),
    "mlp.linear_fc1.layer_norm_weight": _renamed("post_attention_layernorm.weight"),
    "pre_mlp_layernorm.weight": _renamed("post_attention_layernorm.weight"),
    "mlp.linear_fc2.weight": _renamed("mlp.down_proj.weight"),
}
TOP_KEYS = {
    "embedding.word_embeddings.weight": "model.embed_tokens.weight",
    "output_layer.weight": "lm_head.weight",
    "decoder.final_layernorm.weight": "model.norm.weight",
}


class _MegatronFreeUnpickler(pickle.Unpickler):
    """Reads a `.metadata` that names Megatron's classes (older Megatron kept its own metadata and
    save-plan classes in it) without Megatron: those become an empty object; the tensors' entries are torch's."""

    def find_class(self, module: str, name: str) -> Any:
        if module.split(".")[0] == "megatron":
            return type(name, (), {"__init__": lambda self, *a, **k: None, "__setstate__": lambda self, st: None})
        return super().find_class(module, name)


class _Reader(dcp.FileSystemReader):
    """torch's file-system reader, its metadata read once (every `dcp.load` asks) and without Megatron."""

    def __init__(self, path: Path) -> None:
        super().__init__(str(path))
        self._metadata: Metadata | None = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self._metadata is None:
            with (Path(self.path) / ".metadata").open("rb") as f:
                self._metadata = _MegatronFreeUnpickler(f).load()
            if getattr(self._metadata, "planner_data", None) is None:
                self._metadata.planner_data = {}
        return self._metadata


def model_entries(metadata: Metadata, source: Path) -> dict[str, TensorStorageMetadata]:
    """The model's tensors of a checkpoint: training state and byte entries left out; a
    mixture-of-experts model refused."""
    out = {}
    for key, entry in metadata.state_dict_metadata.items():
        if not isinstance(entry, TensorStorageMetadata) or key.startswith(_NOT_MODEL) or "_extra_state" in key:
            continue
        if ".mlp.experts." in key or ".mlp.router." in key:
            raise ConfigError(
                f"{source} is a mixture-of-experts checkpoint ({key}): vime convert handles dense Llama, Qwen2 and "
                "Qwen3 models, not MoE ones yet"
            )
        out[key] = entry
    if not out:
        raise ConfigError(f"{source} holds no model tensors (only training state): give a checkpoint of a model")
    return out


def hf_tensors(key: str, t: torch.Tensor, s: Shape, source: Path) -> list[tuple[str, torch.Tensor]]:
    """One Megatron key's tensor as HF tensors: a stacked key gives every layer's; the vocabulary's
    padding rows cut off."""
    if key in TOP_KEYS:
        if key != "decoder.final_layernorm.weight":
            if t.shape[0] < s.vocab:
                raise ConfigError(
                    f"{source}: {key} has {t.shape[0]} rows and the --hf-checkpoint's config a vocabulary of {s.vocab}: "
                    "give the HF model the checkpoint was trained from"
                )
            t = t[: s.vocab]
        return [(TOP_KEYS[key], t)]
    if layered := _LAYER.fullmatch(key):
        return _split_checked(key, int(layered[1]), layered[2], t, s, source)
    if stacked := _STACKED.fullmatch(key):  # [layers, ...]: every layer's tensor under one key
        return [out for i in range(t.shape[0]) for out in _split_checked(key, i, stacked[1], t[i], s, source)]
    raise ConfigError(f"{source}: {key} is no tensor of a dense Llama, Qwen2 or Qwen3 model that vime convert knows")


def _split_checked(
    key: str, layer: int, rest: str, t: torch.Tensor, s: Shape, source: Path
) -> list[tuple[str, torch.Tensor]]:
    split = LAYER_KEYS.get(rest)
    if split is None:
        raise ConfigError(
            f"{source}: {key} is no tensor of a dense Llama, Qwen2 or Qwen3 model that vime convert knows"
        )
    try:
        return [(f"model.layers.{layer}.{name}", part) for name, part in split(t, s)]
    except RuntimeError as e:  # a fused tensor that does not split into this config's heads
        raise ConfigError(
            f"{source}: {key} {list(t.shape)} does not split into the --hf-checkpoint's attention ({s.heads} heads, "
            f"{s.kv_heads} KV heads of {s.head_dim}, hidden {s.hidden}): give the HF model the checkpoint was trained "
            f"from ({e.__class__.__name__})"
        ) from None


def expected_tensors(base: Path, s: Shape) -> dict[str, tuple[int, ...]]:
    """The HF model's tensors and shapes, from its config (the model built on the meta device: no
    memory, no weights read); with tied embeddings there is no lm_head to write."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(base)))
    out = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    if s.tied:
        out.pop("lm_head.weight", None)
    return out


class _Shards:
    """safetensors files of at most SHARD_BYTES, written as tensors come, named and indexed as
    transformers names them once their number is known (`close`)."""

    def __init__(self, out: Path) -> None:
        self.out, self.buffer, self.size = out, {}, 0
        self.files: list[tuple[Path, list[str]]] = []
        self.total = 0

    def add(self, name: str, t: torch.Tensor) -> None:
        n = t.numel() * t.element_size()
        if self.buffer and self.size + n > SHARD_BYTES:
            self._flush()
        self.buffer[name] = t.clone()  # its own memory: a split of a fused tensor shares its parent's
        self.size += n
        self.total += n

    def _flush(self) -> None:
        from safetensors.torch import save_file

        path = self.out / f"part-{len(self.files):05d}.safetensors"
        save_file(self.buffer, str(path), metadata={"format": "pt"})
        self.files.append((path, list(self.buffer)))
        self.buffer, self.size = {}, 0

    def close(self) -> None:
        if self.buffer:
            self._flush()
        if len(self.files) == 1:
            self.files[0][0].rename(self.out / "model.safetensors")
            return
        weight_map = {}
        for i, (path, names) in enumerate(self.files):
            final = f"model-{i + 1:05d}-of-{len(self.files):05d}.safetensors"
            path.rename(self.out / final)
            weight_map.update(dict.fromkeys(names, final))
        index = {"metadata": {"total_size": self.total}, "weight_map": weight_map}
        (self.out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def _units(entries: dict[str, TensorStorageMetadata]) -> list[list[str]]:
    """The keys loaded together, in the HF model's order: the embedding, each layer's keys (a
    stacked key alone), the final norm, the output layer."""
    layers: dict[int, list[str]] = {}
    first, stacked, last = [], [], []
    for key in entries:
        if m := _LAYER.fullmatch(key):
            layers.setdefault(int(m[1]), []).append(key)
        elif key.startswith("embedding."):
            first.append(key)
        elif _STACKED.fullmatch(key):
            stacked.append(key)
        else:
            last.append(key)
    units = [first, *(layers[i] for i in sorted(layers)), *([k] for k in stacked), sorted(last)]
    return [u for u in units if u]


def convert(source: Path, base: Path, output: Path, force: bool = False) -> Path:
    """`source` (a torch_dist checkpoint, or slime's --save directory: its latest iteration) as an
    HF directory at `output`: the weights converted, every other file of `base` (config,
    tokenizer, chat template) copied. Written beside `output` and moved there when whole."""
    ckpt = torch_dist_checkpoint(source)
    if ckpt is None:
        raise ConfigError(
            f"{source} is not a Megatron torch_dist checkpoint (no .metadata with *.distcp files, no "
            "latest_checkpointed_iteration.txt, no iter_*/ holding one): give slime's --save directory or one iter_XXXXXXX/ of it"
        )
    config = read_config(base)
    if config["model_type"] not in FAMILIES:
        raise ConfigError(
            f"--hf-checkpoint {base} is a {config['model_type']} model: vime convert handles {', '.join(FAMILIES)}"
        )
    if output.exists() and not force:
        raise ConfigError(f"--output {output} exists: give a new directory, or --force to replace it")
    shape = Shape.of(config)
    partial = output.with_name(output.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    try:
        _write_weights(ckpt, shape, expected_tensors(base, shape), partial)
        for f in sorted(base.iterdir()):
            if f.is_file() and not f.name.endswith(
                (".safetensors", ".safetensors.index.json", ".bin", ".bin.index.json")
            ):
                shutil.copy2(f, partial / f.name)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    if output.exists():
        shutil.rmtree(output)
    partial.rename(output)
    return ckpt


def _write_weights(ckpt: Path, s: Shape, expected: dict[str, tuple[int, ...]], out: Path) -> None:
    """Every model tensor of `ckpt` read (one layer at a time), converted, checked against the HF
    model's names and shapes, and written; a tensor the HF model has that none gave is one line."""
    from tqdm import tqdm

    reader = _Reader(ckpt)
    entries = model_entries(reader.read_metadata(), ckpt)
    shards, seen = _Shards(out), set()
    nbytes = {k: e.size.numel() * e.properties.dtype.itemsize for k, e in entries.items()}
    with tqdm(total=sum(nbytes.values()), unit="B", unit_scale=True, desc=f"converting {ckpt.name}") as bar:
        for unit in _units(entries):
            tensors = {k: torch.empty(entries[k].size, dtype=entries[k].properties.dtype) for k in unit}
            with warnings.catch_warnings():  # "torch.distributed is disabled ...": one process reads it, as meant
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                dcp.load(tensors, storage_reader=reader, no_dist=True)
            for key, t in tensors.items():
                for name, part in hf_tensors(key, t, s, ckpt):
                    if name == "lm_head.weight" and s.tied:
                        continue  # tied: the embedding is the output layer
                    _check(ckpt, key, name, tuple(part.shape), expected, s)
                    shards.add(name, part)
                    seen.add(name)
                bar.update(nbytes[key])
    missing = [n for n in expected if n not in seen]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ConfigError(
            f"{ckpt} has no tensor for {missing[0]}{more} of the --hf-checkpoint's model ({s.layers} layers"
            f"{', untied output layer' if not s.tied else ''}): give the HF model the checkpoint was trained from"
        )
    shards.close()


def _check(
    ckpt: Path, key: str, name: str, shape: tuple[int, ...], expected: dict[str, tuple[int, ...]], s: Shape
) -> None:
    want = expected.get(name)
    if want is None:
        raise ConfigError(
            f"{ckpt}: {key} gives {name}, which the --hf-checkpoint's model ({s.layers} layers) has not: give the HF "
            "model the checkpoint was trained from"
        )
    if shape != want:
        raise ConfigError(
            f"{ckpt}: {key} gives {name} of shape {list(shape)}, and the --hf-checkpoint's config makes it {list(want)}: "
            "give the HF model the checkpoint was trained from"
        )


def main(argv: list[str]) -> int:
    """`vime convert SRC --hf-checkpoint BASE --output OUT`; slime's converter's spellings work
    too (`--input-dir`, `--origin-hf-dir`, `--output-dir`, `-f`, `--vocab-size`)."""
    import argparse

    p = argparse.ArgumentParser(
        prog="vime convert",
        description="A Megatron torch_dist checkpoint (slime's --save) of a dense Llama/Qwen2/Qwen3 model -> an HF directory.",
    )
    p.add_argument("source", nargs="?", help="slime's --save directory (its latest iteration), or one iter_XXXXXXX/")
    p.add_argument("--input-dir", dest="input_dir", help="the same as SOURCE (slime's spelling)")
    p.add_argument("--hf-checkpoint", "--origin-hf-dir", dest="base", required=True,
                   help="the HF model the checkpoint was trained from: its config, tokenizer and tensor names")  # fmt: skip
    p.add_argument("--output", "--output-dir", dest="output", required=True, help="the HF directory to write")
    p.add_argument("-f", "--force", action="store_true", help="replace --output if it exists")
    p.add_argument(
        "--vocab-size", type=int, help="slime's: the embedding rows kept; vime keeps the config's vocab_size"
    )
    a = p.parse_args(argv)
    source = a.source or a.input_dir
    if source is None or (a.source and a.input_dir):
        p.error("give the checkpoint once: SOURCE or --input-dir")
    base = resolve_model(a.base)  # an HF directory, or vime's names for one (smollm2)
    vocab = read_config(base)["vocab_size"]
    if a.vocab_size is not None and a.vocab_size != vocab:  # the HF model's tables have the config's rows
        raise ConfigError(f"--vocab-size {a.vocab_size}: the --hf-checkpoint's config has {vocab}: drop --vocab-size")
    ckpt = convert(Path(source).expanduser(), base, Path(a.output).expanduser(), a.force)
    print(f"converted {ckpt} to {a.output}")
    return 0
