"""SFT on RL's trainer: slime's `--rollout-function-path slime.rollout.sft_rollout.generate_rollout`
(or vime's own path to this module) with `--loss-type sft_loss`, so a warm start and the RL run
after it use the same scripts, trainer and checkpoints.

Nothing is generated: a sample is one row's conversation (`--input-key`, a list of messages), its
tokens and loss mask made by slime's rule for `--loss-mask-type` (vime/rollout/loss_masks.py: the
chat template applied message by message, every assistant turn trained after its header, through
the tokens that close it), with no --apply-chat-template needed, as in slime. A message with
`"step_loss_mask": 0` stays out of the loss. The sample's response is everything from the first
trained token on, as slime's `get_response_lengths` has it.

`ConversationSource` hands out the rows (epochs, shuffling, checkpointed position: the
`DataSource` machinery) and checks every one at start-up; `generate_rollout` encodes a batch.
A run with this rollout function starts no engine (`Config.validate` sets --debug-train-only).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from vime.rollout.data.rows import DataError, load_prompts
from vime.rollout.data.source import DataSource
from vime.rollout.loss_masks import LossMasks
from vime.rollout.types import RolloutOutput, Sample, Status

log = logging.getLogger("vime")


@dataclass(frozen=True)
class Encoded:
    """One conversation as the trainer takes it: all its tokens, and the loss mask of those from
    the first trained token on (the 'response', in `Sample`'s terms)."""

    tokens: list[int]
    response_length: int
    loss_mask: list[int]


class ChatMasks:
    """A conversation → tokens and the mask of its assistant turns, by slime's rule for the run's
    --loss-mask-type (`LossMasks`), each row checked first so a bad one is one line naming it."""

    def __init__(
        self, tokenizer: Any, template_kwargs: dict[str, Any], source: str, loss_mask_type: str = "qwen"
    ) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise DataError(
                f"SFT renders each conversation of {source} with the model's chat template, and its tokenizer has none: "
                "use a model with a chat template (an instruct model)"
            )
        if loss_mask_type == "qwen3_5" and not getattr(tokenizer, "is_fast", False):
            raise DataError(
                "--loss-mask-type qwen3_5 finds each assistant turn's tokens by their character offsets, which only a "
                "fast tokenizer gives: use the model's tokenizer.json"
            )
        self.masks = LossMasks(tokenizer, loss_mask_type, template_kwargs)

    def encode(self, messages: Any, where: str, tools: list[dict[str, Any]] | None = None) -> Encoded:
        """DataError naming `where` for a row that is not a conversation or has no assistant turn
        to learn (none, or none the rule trains a token of)."""
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            what = "text" if isinstance(messages, str) else "not a list of messages"
            raise DataError(
                f"{where}: the input is {what}, and SFT trains on conversations: give a list of messages "
                "[{role, content}, ...] with at least one assistant turn (--input-key names it)"
            )
        trained = [
            i for i, m in enumerate(messages) if m.get("role") == "assistant" and m.get("step_loss_mask", 1) == 1
        ]
        if not trained:
            raise DataError(
                f"{where}: the conversation has no assistant turn to learn from: add the answer as a message "
                "{role: assistant, content: ...}, or remove the row"
            )
        for i in trained:
            if not isinstance(messages[i].get("content"), str):
                raise DataError(
                    f"{where}: message {i} (assistant) has content of type {type(messages[i].get('content')).__name__}; "
                    "SFT reads an assistant's text: make it a string"
                )
        ids, mask = self.masks.encode(messages, tools)
        if 1 not in mask:
            raise DataError(
                f"{where}: --loss-mask-type {self.masks.loss_mask_type} trains no token of this conversation (its "
                "assistant turns render to no more than their headers): give them some text"
            )
        first = mask.index(1)
        return Encoded(ids, len(ids) - first, mask[first:])


class ConversationSource(DataSource):
    """The data source of an SFT run: rows are conversations (no label), each checked at
    start-up, handed out one per group with the conversation as the sample's prompt. A row
    longer than the model's context (or --rollout-max-context-len) is refused, or left out and
    counted with --skip-overlong-prompts."""

    def _load(self, tokenizer: Any, max_prompt_len: int | None) -> list[dict[str, Any]]:
        rollout = self.settings
        source = str(rollout.prompt_data)
        rows = load_prompts(
            rollout.prompt_data, rollout.input_key, None, rollout.metadata_key, rollout.label_format, rollout.tool_key
        )
        self.chat = ChatMasks(tokenizer, rollout.apply_chat_template_kwargs or {}, source, rollout.loss_mask_type)
        # max_prompt_len leaves room for one response token; a conversation holds its answers
        limits = [n for n in (max_prompt_len and max_prompt_len + 1, rollout.rollout_max_context_len) if n]
        most = min(limits) if limits else None
        kept = []
        for i, row in enumerate(rows):
            n = len(self.chat.encode(row["input"], f"{source} row {i}", row.get("tools")).tokens)
            if most is None or n <= most:
                kept.append(row)
                self.longest_row = max(self.longest_row or 0, n)
            elif not rollout.skip_overlong_prompts:
                raise DataError(
                    f"{source} row {i}: the conversation is {n} tokens, the model takes at most {most}: "
                    "shorten or remove it, or pass --skip-overlong-prompts"
                )
        if not kept:
            raise DataError(f"{source}: every conversation is longer than {most} tokens: shorten them")
        self.skipped_prompts = len(rows) - len(kept)
        if self.skipped_prompts:
            self.skipped_note = (
                f"--skip-overlong-prompts: left out {self.skipped_prompts} of {len(rows)} conversations of {source} "
                f"longer than {most} tokens (rollout/skipped_prompts)"
            )
        return kept

    def _new_group(self) -> list[Sample]:
        row_index = self._next_row()
        row = self.rows[row_index]
        sample = Sample(
            index=self.next_index,
            group_index=self.next_group,
            prompt=[dict(m) for m in row["input"]],
            metadata=dict(row["metadata"]),
        )
        self.next_index += 1
        self.next_group += 1
        return [sample]

    def encode(self, sample: Sample) -> Sample:
        """The sample's conversation as tokens and loss mask: a training sample, reward 0."""
        # every row was encoded once at start-up: this cannot fail on the data
        enc = self.chat.encode(
            sample.prompt, f"{self.settings.prompt_data} sample {sample.index}", sample.metadata.get("tools")
        )
        sample.tokens = enc.tokens
        sample.response_length = enc.response_length
        sample.loss_mask = enc.loss_mask
        sample.reward = 0.0
        sample.temperature = 1.0  # the data's likelihood, whatever --rollout-temperature a later RL run samples at
        sample.status = Status.COMPLETED
        return sample


def generate_rollout(
    args: Any, rollout_id: int, data_source: ConversationSource, evaluation: bool = False
) -> RolloutOutput:
    """The next --rollout-batch-size conversations, tokenized and masked (no engine)."""
    if evaluation:
        raise DataError("the SFT rollout function trains on the data's conversations: evaluate with `vime eval`")
    groups = data_source.get_samples(args.rollout.rollout_batch_size)
    samples = [data_source.encode(s) for g in groups for s in g]
    tokens = sum(s.effective_loss_mask().count(1) for s in samples)
    return RolloutOutput(
        groups,
        {
            "rollout/response_len_mean": sum(s.response_length for s in samples) / len(samples),
            "rollout/loss_tokens": float(tokens),
        },
    )
