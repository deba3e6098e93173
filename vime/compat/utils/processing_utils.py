"""`slime.utils.processing_utils`: the names slime's examples import (geo3k multi-turn's
`build_processor_kwargs` and `encode_image_for_rollout_engine`, `load_tokenizer`, and
`load_processor`, which a generate or eval copied from slime's sglang_rollout imports).

vime rolls out text: `GenerateState.processor` is None, so a slime rollout takes its tokenizer
path, and an image it would send (`image_data`) is refused here in one line rather than by the
router's 400 in the middle of a run.
"""

from __future__ import annotations

from typing import Any

from transformers import AutoTokenizer

from vime.errors import ConfigError


def load_tokenizer(name_or_path: str, **kwargs: Any) -> Any:
    """The model's tokenizer, as slime loads it (`AutoTokenizer.from_pretrained`)."""
    return AutoTokenizer.from_pretrained(name_or_path, **kwargs)


def load_processor(name_or_path: str, **kwargs: Any) -> None:
    """slime's multimodal processor of a model, None for a text model (slime's answer there too):
    vime rolls out text, so there is none to load."""
    return None


def build_processor_kwargs(multimodal_inputs: dict[str, Any] | None = None) -> dict[str, Any]:
    """The keyword arguments of a HF processor call, as slime builds them: the inputs as given,
    text returned as lists (`return_tensors=None`) and every modality as tensors."""
    out = dict(multimodal_inputs or {})
    out["text_kwargs"] = {**out.get("text_kwargs", {}), "return_tensors": None, "return_mm_token_type_ids": False}
    for key in ("audio_kwargs", "images_kwargs", "videos_kwargs"):
        out[key] = {**out.get(key, {}), "return_tensors": "pt"}
    return out


def encode_image_for_rollout_engine(image: Any) -> str:
    """slime's PNG data URI of an image for SGLang's `image_data`; vime's engines take no image."""
    raise ConfigError(
        "a sample carries an image (multimodal_inputs), and vime rolls out text only: "
        "give data without images, or run this example on slime"
    )
