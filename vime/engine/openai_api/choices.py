"""From a sample's token ids to an OpenAI choice: its text, its tool calls, its finish reason and
its log-probs, the same whether it is answered at once or streamed.

The engine ends a sample on the token that completes a stop string and keeps it (`stop.py`); the
API's text ends before the stop string (after it with vLLM's `include_stop_str_in_output`). With
tools, the server's tool-call parser (`vime.tool_calls`) splits the text: the content is what
comes before the first call, and calls that all parse come back as `tool_calls` with finish
reason `tool_calls`; a block that is not a call leaves the whole text as content.

A streamed choice shows only text that the final answer will begin with: a tail that may grow
into a stop string or a call's opening tag, and a character whose bytes are still arriving
(U+FFFD), wait for the next tokens. So the streamed pieces join to the text answered without
streaming (for tokenizers whose text of a longer output begins with that of a shorter one).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from vime.engine.openai_api.request import Plan
from vime.tool_calls import ToolCall, ToolCallFormat

PENDING_CHAR = "\ufffd"  # what a tokenizer shows for a character whose bytes are not all there yet


@dataclass(frozen=True)
class Finished:
    """A choice's end: its text (content), its calls in OpenAI's form, its finish reason."""

    text: str
    tool_calls: list[dict]
    finish_reason: str


def _first_stop(text: str, stop: tuple[str, ...], start: int) -> tuple[int, str] | None:
    """The first stop string in `text` from `start` on (before it is the prompt's, not the model's)."""
    hits = [(at, s) for s in stop if (at := text.find(s, start)) >= 0]
    return min(hits) if hits else None


def _held(text: str, marker: str) -> int:
    """Characters at the end of `text` that begin `marker` (0: none)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


def openai_calls(calls: list[ToolCall]) -> list[dict]:
    return [
        {
            "id": f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {"name": c.name, "arguments": json.dumps(c.arguments, ensure_ascii=False)},
        }
        for c in calls
    ]


@dataclass
class ChoiceText:
    """One sample's text, token by token: `shown` what may be streamed now, `finish` the answer."""

    decode: Callable[[list[int]], str]
    plan: Plan
    fmt: ToolCallFormat | None  # the tool-call parser, when the request has tools
    stop_ids: frozenset[int] = frozenset()  # ids that end a sample (eos, stop_token_ids): not text
    opening: str = ""  # the text the answer begins with, in the prompt: a forced call's opening
    ids: list[int] = field(default_factory=list)
    sent: int = 0  # characters of the text already streamed

    def _text(self) -> tuple[str, bool]:
        """The text cut at its first stop string; whether one was found. A stop token that ended
        the sample is not text (as in vLLM), unless include_stop_str_in_output."""
        ids = self.ids
        if ids and ids[-1] in self.stop_ids and not self.plan.include_stop:
            ids = ids[:-1]
        text = self.opening + self.decode(ids)
        hit = _first_stop(text, self.plan.stop, len(self.opening))
        if hit is None:
            return text, False
        at, s = hit
        return text[: at + (len(s) if self.plan.include_stop else 0)], True

    def advance(self, new_ids: list[int]) -> str:
        """Take newly generated tokens; returns the text that may be streamed now."""
        self.ids += new_ids
        text, stopped = self._text()
        end = len(text)
        if not stopped:
            end -= max((_held(text, s) for s in self.plan.stop), default=0)
        if self.fmt is not None:
            at = text.find(self.fmt.start)
            end = min(end, at) if at >= 0 else end - _held(text[:end], self.fmt.start)
        while end > self.sent and text[end - 1] == PENDING_CHAR:
            end -= 1
        if end <= self.sent:
            return ""
        piece, self.sent = text[self.sent : end], end
        return piece

    def finish(self, ids: list[int], reason: str) -> Finished:
        """The choice's answer from all its tokens and the engine's finish reason."""
        self.ids = list(ids)
        text, stopped = self._text()
        if stopped and reason == "length":  # the stop string came with the last token allowed
            reason = "stop"
        if self.fmt is not None:
            content, blocks = self.fmt.split(text)
            if blocks and all(isinstance(b, ToolCall) and isinstance(b.arguments, dict) for b in blocks):
                if not self.plan.parallel_tool_calls:
                    blocks = blocks[:1]
                return Finished(content, openai_calls(blocks), "tool_calls")  # type: ignore[arg-type]
        return Finished(text, [], reason)

    def rest(self, done: Finished) -> str:
        """What the stream has not shown of the answer's text."""
        piece = done.text[self.sent :]
        self.sent = len(done.text)
        return piece


# ---- log-probs ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Scored:
    """Tokens with their log-probs and likeliest alternatives (`scoring.score_top`): None for the
    first token of a prompt, which nothing predicts."""

    ids: list[int]
    logprobs: list[float | None]
    tops: list[list[tuple[int, float]] | None]


def chat_logprobs(token: Callable[[int], str], scored: Scored) -> dict[str, Any]:
    """OpenAI's chat form: per token its text, log-prob, UTF-8 bytes and top alternatives."""

    def entry(t: int, lp: float) -> dict[str, Any]:
        s = token(t)
        return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}

    content = [
        {**entry(t, lp), "top_logprobs": [entry(a, alp) for a, alp in top or []]}
        for t, lp, top in zip(scored.ids, scored.logprobs, scored.tops)
    ]
    return {"content": content, "refusal": None}


def completion_logprobs(token: Callable[[int], str], scored: Scored) -> dict[str, Any]:
    """The completions form: parallel lists of token texts, log-probs, top alternatives (a dict
    of text to log-prob) and each token's offset in the choice's text."""
    tokens = [token(t) for t in scored.ids]
    offsets, at = [], 0
    for s in tokens:
        offsets.append(at)
        at += len(s)
    return {
        "tokens": tokens,
        "token_logprobs": scored.logprobs,
        "top_logprobs": [None if top is None else {token(a): lp for a, lp in top} for top in scored.tops],
        "text_offset": offsets,
    }
