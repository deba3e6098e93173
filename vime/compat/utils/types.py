"""`from vime.utils.types import Sample` (and slime's `slime.utils.types`): vime's Sample
(vime/rollout/types.py), which has vllm-project/vime's `Sample.Status` and
`append_response_tokens` and slime's `Sample.SpecInfo`/`PrefixCacheInfo`, and slime's other
names of this module that its plug-ins and helpers import: `RolloutBatch` (the type of the
rollout data a Megatron loss reads), `ParamInfo` (a weight's record in slime's weight
transfer) and `MultimodalType`/`MultimodalTypes` (the placeholders of its multimodal prompts).
They are types and constants: vime's trainer neither reads nor needs them, a plug-in's
annotations and helper code do."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vime.rollout.types import RolloutOutput, Sample, Status

# slime's: a rollout's data by key, each a list over samples (tensors, numbers or text)
RolloutBatch = dict[str, list[Any]]


@dataclass
class ParamInfo:
    """One weight as slime's trainer describes it to its engines: name, dtype (a torch.dtype),
    shape, attributes, byte size and the rank that holds it."""

    name: str
    dtype: Any
    shape: Any
    attrs: dict
    size: int
    src_rank: int


@dataclass
class MultimodalType:
    """A kind of media in a prompt: its name in a message's content and its placeholder text."""

    name: str
    placeholder: str


class MultimodalTypes:
    """slime's kinds of media: image, video and audio, with their `<image>`-style placeholders."""

    IMAGE = MultimodalType(name="image", placeholder="<image>")
    VIDEO = MultimodalType(name="video", placeholder="<video>")
    AUDIO = MultimodalType(name="audio", placeholder="<audio>")

    @classmethod
    def all(cls) -> list[MultimodalType]:
        return [cls.IMAGE, cls.VIDEO, cls.AUDIO]

    @classmethod
    def get(cls, name: str) -> MultimodalType | None:
        return next((kind for kind in cls.all() if kind.name == name), None)


__all__ = [
    "MultimodalType",
    "MultimodalTypes",
    "ParamInfo",
    "RolloutBatch",
    "RolloutOutput",
    "Sample",
    "Status",
]
