"""Reading safetensors weight files: a checkpoint directory's files, their headers alone (to check
an update before any tensor is read) and their tensors through mmap."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import torch


def iter_safetensors(model_dir: str | Path) -> Iterable[tuple[str, torch.Tensor]]:
    """(name, tensor) from model.safetensors or the shards named by model.safetensors.index.json."""
    return iter_safetensors_files(safetensors_files(model_dir))


def iter_safetensors_files(files: Iterable[str | Path]) -> Iterable[tuple[str, torch.Tensor]]:
    """(name, tensor) of each file in turn, read through mmap (a /dev/shm file is never copied whole)."""
    from safetensors import safe_open

    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
                yield name, st.get_tensor(name)


# safetensors header dtype → torch dtype, for checking an update before any tensor is read
SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def safetensors_files(model_dir: str | Path) -> list[Path]:
    """The weight files of an HF directory: model.safetensors, or the shards its index names."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError):
            raise ValueError(f"{index} is not a valid safetensors index (no weight_map)") from None
        return [model_dir / n for n in names]
    if (model_dir / "model.safetensors").exists():
        return [model_dir / "model.safetensors"]
    raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {model_dir}")


def safetensors_layout(files: Iterable[str | Path]) -> list[tuple[str, tuple[int, ...], torch.dtype | str]]:
    """(name, shape, dtype) of every tensor in the files, from their headers alone (no tensor
    data is read); a damaged or truncated file raises ValueError naming it."""
    from safetensors import safe_open

    out: list[tuple[str, tuple[int, ...], torch.dtype | str]] = []
    for f in files:
        if not Path(f).is_file():
            raise FileNotFoundError(f"weights file {f} does not exist")
        try:
            with safe_open(str(f), framework="pt") as st:
                for name in st.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
                    sl = st.get_slice(name)
                    dtype = sl.get_dtype()
                    out.append((name, tuple(sl.get_shape()), SAFETENSORS_DTYPES.get(dtype, dtype)))
        except Exception as e:  # safetensors raises its own error types for a bad header
            raise ValueError(
                f"weights file {f} cannot be read ({type(e).__name__}: {' '.join(str(e).split())[:200]})"
            ) from None
    return out
