"""What an engine's answers said of a sample's generation beyond its tokens: slime's
`Sample.SpecInfo` (speculative decoding's acceptance) and `Sample.PrefixCacheInfo` (the prompt
tokens its prefix cache served), summed over the sample's turns from each answer's `meta_info`.

slime's generate and metrics read and write them, and plug-ins copied from it do
(`sample.prefix_cache_info.add(output["meta_info"])`), so they exist on vime's Sample with
slime's fields. vime's engine drafts nothing and reports no per-request cache hits: its answers
leave the counts at 0 but for `total_prompt_tokens`, which they carry.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any


@dataclass
class SpecInfo:
    """Speculative decoding's counts over a sample's generations (SGLang's meta_info keys)."""

    spec_accept_token_num: int = 0
    spec_draft_token_num: int = 0
    spec_verify_ct: int = 0
    completion_token_num: int = 0

    @property
    def spec_accept_rate(self) -> float:
        return self.spec_accept_token_num / self.spec_draft_token_num if self.spec_draft_token_num else 0.0

    @property
    def spec_accept_length(self) -> float:
        return self.completion_token_num / self.spec_verify_ct if self.spec_verify_ct else 0.0

    def add(self, meta_info: dict[str, Any]) -> None:
        self.spec_accept_token_num += meta_info.get("spec_accept_token_num", 0)
        self.spec_draft_token_num += meta_info.get("spec_draft_token_num", 0)
        self.spec_verify_ct += meta_info.get("spec_verify_ct", 0)
        self.completion_token_num += meta_info.get("completion_tokens", 0)

    def to_dict(self) -> dict[str, int]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SpecInfo:
        return cls(**{f.name: data.get(f.name, 0) for f in fields(cls)})


@dataclass
class PrefixCacheInfo:
    """The prompt tokens a sample's generations sent and those the engine's prefix cache held."""

    cached_tokens: int = 0
    total_prompt_tokens: int = 0

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.cached_tokens / self.total_prompt_tokens if self.total_prompt_tokens else 0.0

    def add(self, meta_info: dict[str, Any]) -> None:
        self.cached_tokens += meta_info.get("cached_tokens", 0)
        self.total_prompt_tokens += meta_info.get("prompt_tokens", 0)

    def to_dict(self) -> dict[str, int]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PrefixCacheInfo:
        return cls(**{f.name: data.get(f.name, 0) for f in fields(cls)})
