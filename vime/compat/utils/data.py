"""`from slime.utils.data import Dataset, filter_long_prompt`: slime's prompt data set, which a
rollout file copied from slime's builds for a second prompt file (its eval rollout builds one per
eval data set), read by vime's own row reader.

`Dataset(path, tokenizer, processor, max_length, *, prompt_key, label_key, metadata_key,
tool_key, seed, apply_chat_template, apply_chat_template_kwargs)` reads a JSONL or Parquet file
(or slime's `path@[a:b]` slice) into Samples of prompt, label and metadata (a row's tools in
`metadata["tools"]`, as slime keeps them), rendered by the tokenizer's chat template when asked,
those over `max_length` prompt tokens left out; `shuffle(epoch)` orders them as slime's does
(seeded by `seed + epoch`); it indexes and has a length. A row vime's reader refuses (no prompt
key, a metadata that is not an object) is one line naming the file and row. vime rolls out text:
a processor or `multimodal_keys` is a ValueError saying so, not a data set without its images.
"""

from __future__ import annotations

import logging
import random
from pathlib import Path
from typing import Any

from vime.rollout.data.rows import load_prompts
from vime.rollout.types import Sample

log = logging.getLogger(__name__)


def filter_long_prompt(samples: list[Sample], tokenizer: Any, processor: Any, max_length: int | None) -> list[Sample]:
    """The samples whose text prompt is at most `max_length` tokens (no special tokens added, as
    slime counts them); chat-message prompts are kept unmeasured, as slime keeps them."""
    if max_length is None or not samples or not isinstance(samples[0].prompt, str):
        return samples
    ids = tokenizer([s.prompt for s in samples], add_special_tokens=False)["input_ids"]
    kept = [s for s, i in zip(samples, ids, strict=True) if len(i) <= max_length]
    log.info("left out %d prompts longer than %d tokens", len(samples) - len(kept), max_length)
    return kept


class Dataset:
    """slime's prompt data set (see the module's docstring)."""

    def __init__(
        self,
        path: str | Path,
        tokenizer: Any,
        processor: Any,
        max_length: int | None,
        *,
        prompt_key: str = "text",
        multimodal_keys: dict[str, str] | None = None,
        label_key: str | None = None,
        tool_key: str | None = None,
        metadata_key: str = "metadata",
        seed: int = 42,
        apply_chat_template: bool = False,
        apply_chat_template_kwargs: dict[str, Any] | None = None,
    ) -> None:
        if processor is not None or multimodal_keys:
            raise ValueError(f"Dataset({path}): vime rolls out text prompts; it has no processor for multimodal data")
        samples = []
        for row in load_prompts(path, prompt_key, label_key, metadata_key, "text", tool_key):
            prompt = row["input"]
            if apply_chat_template:
                messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
                prompt = tokenizer.apply_chat_template(
                    messages,
                    tools=row.get("tools"),
                    tokenize=False,
                    add_generation_prompt=True,
                    **(apply_chat_template_kwargs or {}),
                )
            samples.append(Sample(prompt=prompt, label=row["label"], metadata=row["metadata"]))
        self.origin_samples = filter_long_prompt(samples, tokenizer, processor, max_length)
        self.samples = self.origin_samples
        self.seed = seed
        self.epoch_id = -1

    def shuffle(self, new_epoch_id: int) -> None:
        """The samples in epoch `new_epoch_id`'s order (the same order slime's gives)."""
        if new_epoch_id == self.epoch_id:
            return
        order = list(range(len(self.origin_samples)))
        random.Random(self.seed + new_epoch_id).shuffle(order)
        self.samples = [self.origin_samples[i] for i in order]
        self.epoch_id = new_epoch_id

    def __getitem__(self, idx: int) -> Sample:
        return self.samples[idx]

    def __len__(self) -> int:
        return len(self.samples)
