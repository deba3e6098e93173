"""`from slime.utils.mask_utils import MultiTurnLossMaskGenerator`: slime's conversation → (token
ids, loss mask) generator, which agent plug-ins (a tau-bench rollout that trains a whole dialogue,
an OPD reward that rebuilds the student's turns) import to build their samples' tokens and masks
as slime's SFT does.

vime already makes slime's masks for its SFT path (`vime.rollout.loss_masks.LossMasks`, one rule
per `--loss-mask-type`, checked against slime's generator there); this is that class under slime's
name, method names and return shapes, so a plug-in's samples and vime's SFT rows agree token for
token.
"""

from __future__ import annotations

from typing import Any

from vime.rollout.loss_masks import LossMasks

TYPES = ("qwen", "qwen3", "qwen3_5", "distill_qwen")


def get_response_lengths(loss_masks: list[list[int]]) -> list[int]:
    """How many tokens each mask trains (slime counts a sample's response by its trained tokens)."""
    return [mask.count(1) for mask in loss_masks]


class MultiTurnLossMaskGenerator:
    """slime's generator: `tokenizer_type` is a `--loss-mask-type` (`qwen`, `qwen3`, `qwen3_5`,
    `distill_qwen`; `qwen` with DeepSeek-R1-distill's tokenizer is `distill_qwen`, as in slime)."""

    def __init__(self, tokenizer: Any, tokenizer_type: str = "qwen") -> None:
        if tokenizer_type not in TYPES:
            raise ValueError(f"Unsupported tokenizer type: {tokenizer_type} (slime's types: {', '.join(TYPES)})")
        self.tokenizer = tokenizer
        self.tokenizer_type = tokenizer_type
        self._masks = LossMasks(tokenizer, tokenizer_type)

    @property
    def system_message_length(self) -> int:
        """The tokens the template puts before every message rendered alone (cut from all but the first)."""
        return self._masks.template.system

    @property
    def gen_token_length(self) -> int:
        """The generation prompt's tokens: an assistant turn's untrained header."""
        return self._masks.template.header

    def get_loss_mask(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> tuple[list[int], list[int]]:
        """The conversation's token ids and loss mask (1: trained), by this generator's rule."""
        return self._masks.encode(messages, tools)

    def get_response_lengths(self, loss_masks: list[list[int]]) -> list[int]:
        return get_response_lengths(loss_masks)

    def get_text_from_loss_mask(self, token_ids: list[int], loss_masks: list[int]) -> list[str]:
        """The decoded text of each run of trained tokens, in order."""
        texts, run = [], []
        for token, mask in zip(token_ids, loss_masks, strict=False):
            if mask == 1:
                run.append(token)
            elif run:
                texts.append(self.tokenizer.decode(run))
                run = []
        return texts + ([self.tokenizer.decode(run)] if run else [])
