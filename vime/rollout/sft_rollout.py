"""SFT on RL's trainer: slime's `--rollout-function-path ...sft_rollout.generate_rollout` with
`--loss-type sft_loss`, so a warm start and the RL run after it use the same scripts, trainer and
checkpoints.

Nothing is generated: a sample is one row's conversation (`--input-key`, a list of messages),
its tokens the model's chat template's rendering of the whole conversation, and its loss mask
every assistant turn: the turn's text and the tokens that close it (`<|im_end|>` in ChatML), not
the header that opens it, nor any system, user or tool message. `--loss-mask-type` names slime's
per-family mask builders; vime reads every mask from the template itself (`ChatMasks`), so the
families it accepts all mean this. A message with `"step_loss_mask": 0` stays out of the loss,
as in slime.

How a turn's tokens are found in the rendering: each assistant text is rendered once more
between two private-use marker characters; where they land in the text, markers removed, is
where the turn lies, and the tokenizer's offsets give its tokens. A template that rewrites an
assistant's text (drops a `<think>` part, say) loses a marker: that row is refused in one line,
never trained with a wrong mask.

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
from vime.rollout.types import RolloutOutput, Sample, Status

log = logging.getLogger("vime")

_OPEN, _CLOSE = "\ue000", "\ue001"  # private-use characters: where an assistant turn's text starts and ends


@dataclass(frozen=True)
class Encoded:
    """One conversation as the trainer takes it: all its tokens, and the loss mask of those from
    the first trained token on (the 'response', in `Sample`'s terms)."""

    tokens: list[int]
    response_length: int
    loss_mask: list[int]


class ChatMasks:
    """A conversation → tokens and the mask of its assistant turns, from the tokenizer's chat
    template (see the module's docstring)."""

    def __init__(self, tokenizer: Any, template_kwargs: dict[str, Any], source: str) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise DataError(
                f"SFT renders each conversation of {source} with the model's chat template, and its tokenizer has none: "
                "use a model with a chat template (an instruct model)"
            )
        if not getattr(tokenizer, "is_fast", False):
            raise DataError(
                "SFT finds each assistant turn's tokens by their character offsets, which only a fast tokenizer gives: "
                "use the model's tokenizer.json"
            )
        self.tokenizer = tokenizer
        self.template_kwargs = dict(template_kwargs)
        # what the template writes after an assistant's text to close its turn: trained, so the
        # model learns to end its turn
        probe = self._render([{"role": "user", "content": "."}, {"role": "assistant", "content": _OPEN}], None)
        self.closing = probe[probe.index(_OPEN) + 1 :] if _OPEN in probe else ""

    def _render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str:
        kwargs = dict(self.template_kwargs, tools=tools) if tools is not None else self.template_kwargs
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False, **kwargs)

    def encode(self, messages: Any, where: str, tools: list[dict[str, Any]] | None = None) -> Encoded:
        """DataError naming `where` for a row that is not a conversation, has no assistant turn
        to learn, or whose assistant text the template rewrites."""
        if not isinstance(messages, list):
            raise DataError(
                f"{where}: the input is text, and SFT trains on conversations: give a list of messages "
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
            if not isinstance(messages[i]["content"], str):
                raise DataError(
                    f"{where}: message {i} (assistant) has content of type {type(messages[i]['content']).__name__}; "
                    "SFT reads an assistant's text: make it a string"
                )
        plain = self._render(messages, tools)
        marked = self._render(
            [{**m, "content": f"{_OPEN}{m['content']}{_CLOSE}"} if i in trained else m for i, m in enumerate(messages)],
            tools,
        )
        spans = self._spans(marked, plain)
        if spans is None or len(spans) != len(trained):
            raise DataError(
                f"{where}: the chat template rewrites an assistant turn's text as it renders it (e.g. drops a <think> part), "
                "so its tokens cannot be found: give that text in the form the template renders"
            )
        enc = self.tokenizer(plain, add_special_tokens=False, return_offsets_mapping=True)
        ids, offsets = list(enc["input_ids"]), enc["offset_mapping"]
        # a token holding any of an assistant turn's characters is trained
        mask = [int(any(s < b and e > a for a, b in spans)) for s, e in offsets]
        first = mask.index(1) if 1 in mask else len(mask)
        last = len(mask) - mask[::-1].index(1) if 1 in mask else 0
        if first >= last:
            raise DataError(f"{where}: the assistant turns render to no tokens: give them some text")
        # what follows the last trained token teaches nothing: left out
        return Encoded(ids[:last], last - first, mask[first:last])

    def _spans(self, marked: str, plain: str) -> list[tuple[int, int]] | None:
        """Character spans in `plain` of each marked assistant turn, its closing included; None
        when the markers do not pair up or the marked rendering is not `plain` plus markers."""
        spans: list[tuple[int, int]] = []
        text: list[str] = []
        start = None
        for ch in marked:
            if ch == _OPEN:
                if start is not None:
                    return None
                start = len(text)
            elif ch == _CLOSE:
                if start is None:
                    return None
                spans.append((start, len(text)))
                start = None
            else:
                text.append(ch)
        if start is not None or "".join(text) != plain:
            return None
        # each turn's closing (its common prefix with the template's closing) is trained too
        out = []
        for a, b in spans:
            n = 0
            while n < len(self.closing) and b + n < len(plain) and plain[b + n] == self.closing[n]:
                n += 1
            out.append((a, b + n))
        return out


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
        self.chat = ChatMasks(tokenizer, rollout.apply_chat_template_kwargs or {}, source)
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
