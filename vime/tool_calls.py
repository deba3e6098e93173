"""Tool calls in a model's text: one parser per format, each a row of `TOOL_CALL_FORMATS`.

A model calls a tool by writing it in the form its chat template taught it. vime reads that text
in two places, with the same row: the multi-turn rollout (`vime.rollout.tools.multi_turn`,
`--tool-call-parser`), which runs the call and appends the answer, and the engine's OpenAI chat
route (`vime serve --tool-call-parser`), which answers `tool_calls` to a client. So a policy
trained with vime's tool rollouts is read the same way when it is served, and a format added here
is one row for both.

A format here is a pair of tags around a JSON object `{"name": ..., "arguments": {...}}`; the
text before the first opening tag is the message's content. A block that is not such an object
is kept as `Malformed` rather than dropped: the rollout tells the model its call was not one,
and the server answers the whole text as content (never a call it made up).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: Any  # the JSON value the model wrote: an object for a call a tool can take


@dataclass(frozen=True)
class Malformed:
    """A call block whose body is not a call (not JSON, or no name); `text` is the body."""

    text: str


def json_call(body: str) -> ToolCall | Malformed:
    """`{"name": ..., "arguments": ...}` as a call. Some templates write the arguments as a JSON
    string of an object: that string is read as the object it holds."""
    text = body.strip()
    try:
        call = json.loads(text)
    except json.JSONDecodeError:
        return Malformed(text)
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return Malformed(text)
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass
    return ToolCall(call["name"], arguments)


@dataclass(frozen=True)
class ToolCallFormat:
    """One way models write calls: `start` + body + `end`, the body read by `parse_body`."""

    name: str
    start: str  # opens a call: the server streams no content past it
    end: str  # closes one: the multi-turn rollout's stop string
    parse_body: Callable[[str], ToolCall | Malformed]
    models: str  # whose chat templates write it (the help of the setting)

    def split(self, text: str) -> tuple[str, list[ToolCall | Malformed]]:
        """(the text before the first call, every call block in order). A block the text ends
        inside (a response cut short, or stopped at `end`) is read up to the text's end."""
        first = text.find(self.start)
        if first < 0:
            return text, []
        blocks: list[ToolCall | Malformed] = []
        at = first
        while at >= 0:
            body_start = at + len(self.start)
            close = text.find(self.end, body_start)
            blocks.append(self.parse_body(text[body_start : close if close >= 0 else len(text)]))
            if close < 0:
                break
            at = text.find(self.start, close + len(self.end))
        return text[:first], blocks


HERMES = ToolCallFormat(
    "hermes",
    "<tool_call>",
    "</tool_call>",
    json_call,
    'Hermes 2 Pro and 3, Qwen2.5, QwQ and Qwen3: <tool_call>{"name": ..., "arguments": {...}}</tool_call>',
)

# vLLM's names for the same formats, so a server flag reads as it does there
TOOL_CALL_FORMATS: dict[str, ToolCallFormat] = {f.name: f for f in (HERMES,)}


def tool_call_format(name: str) -> ToolCallFormat:
    """The row named `name`; a ValueError naming the rows otherwise."""
    try:
        return TOOL_CALL_FORMATS[name]
    except KeyError:
        raise ValueError(f"tool-call parser '{name}': use one of {', '.join(TOOL_CALL_FORMATS)}") from None
