"""The built-in multi-turn generate (`--tools`): the model calls tools across several turns.

A turn is generated until it ends, or until it closes a tool call (`</tool_call>`, a stop string
of the request). A call is the JSON object between the turn's last `<tool_call>` and that end,
`{"name": ..., "arguments": {...}}` (the format of Qwen's and Hermes' chat templates; without a
chat template the same tags are the documented format), read by the `--tool-call-parser` row of
`vime.tool_calls`, the parser `vime serve` answers `tool_calls` with. The tool runs
(`vime.rollout.tools.calls`) and its answer is appended as the conversation's next message: with
`--apply-chat-template` in the template's own form for a `tool` message (whatever closes the
assistant's turn, the answer, and whatever opens the next assistant turn), without one as
`<tool_response>...</tool_response>`.

Token in, token out: the trajectory is the engine's tokens as it generated them, with the tool's
answer tokenized and appended between turns; no generated text is ever re-tokenized. Appended
tokens carry loss mask 0 (no gradient), log-prob 0 and the policy version of the token before
them, so `--max-staleness` and the staleness metrics count only what the model generated.
The sample's state (turns, calls, errors, tool seconds, where its turn began) lives in
`sample.metadata["multi_turn"]`,
so a sample aborted by a weight update in the async modes resumes at the turn it was in, its
earlier turns kept. A custom reward sees the whole trajectory (`sample.response`) and that
state; built-in rewards and eval grade the last turn (`Sample.final_response`), so a number
in a tool's answer never stands in for the model's own.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from vime.models import context_length
from vime.rollout.generate import generate as generate_turn
from vime.rollout.runtime import runtime_of
from vime.rollout.tools.calls import Tool, call_tool, load_tools, log_sandbox
from vime.rollout.types import MULTI_TURN_STATE as STATE
from vime.rollout.types import Sample, Status
from vime.tool_calls import HERMES, Malformed, ToolCallFormat, tool_call_format

CALL_START, CALL_END = HERMES.start, HERMES.end  # the default format's tags (examples and plug-ins name them)
_SENTINEL = "\u2063vime-turn-end\u2063"  # marks where the assistant's text ends in a rendered template


@lru_cache(maxsize=8)
def _context_length(model_dir: str) -> int:
    return context_length(model_dir)


@lru_cache(maxsize=8)
def _tools(specs: tuple[str, ...], unsafe: bool) -> dict[str, Tool]:
    tools = load_tools(list(specs), unsafe)
    log_sandbox(tools)  # here, once, where the run's log is open (preflight's load_tools comes before it)
    return tools


def parse_call(turn: str, fmt: ToolCallFormat = HERMES) -> tuple[Any, Any] | None:
    """(name, arguments) of the call a turn ends with, None when it ends without one; read by
    `fmt`, the row the server's chat route reads calls with too (`vime.tool_calls`). A call
    that is not a JSON object with a name comes back as (None, the text), an error the model
    is told about."""
    if not turn.rstrip().endswith(fmt.end):
        return None
    _, blocks = fmt.split(turn.rstrip())
    if not blocks:  # a closing tag with no opening one
        return None, turn.rstrip()[: -len(fmt.end)]
    last = blocks[-1]
    return (None, last.text) if isinstance(last, Malformed) else (last.name, last.arguments)


def answer_text(tokenizer: Any, answer: str, chat: bool, template_kwargs: dict | None = None) -> str:
    """The text that follows a turn ending in a tool call: the tool's answer as the next message
    and the opening of the model's next turn."""
    if not chat:
        return f"\n<tool_response>\n{answer}\n</tool_response>\n"
    messages = [
        {"role": "user", "content": "."},
        {"role": "assistant", "content": _SENTINEL},
        {"role": "tool", "content": answer},
    ]
    text = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, **(template_kwargs or {})
    )
    return text[text.index(_SENTINEL) + len(_SENTINEL) :]


def plain(tokenizer: Any, answer: str) -> str:
    """The answer with a zero-width space after the first character of each special token's text
    in it: tokenized with the template around it, a tool's '<|im_end|>' was the token that ends a
    turn, and '<|im_start|>assistant' opened one the model never wrote. The model reads the same."""
    for token in tokenizer.all_special_tokens:
        if len(token) > 1 and token in answer:
            answer = answer.replace(token, f"{token[0]}\u200b{token[1:]}")
    return answer


def _append(sample: Sample, ids: list[int]) -> None:
    """Tokens the model did not generate: in the trajectory, out of the loss."""
    version = (sample.weight_versions or [0])[-1]
    sample.append_generated(ids, [0.0] * len(ids), [version] * len(ids), trainable=False)


async def generate(args, sample: Sample, params: dict) -> Sample:
    """Generate a sample's conversation: turns and tool calls until a turn ends without a call,
    `--max-turns` turns, or no room is left (TRUNCATED)."""
    runtime, rollout = runtime_of(args), args.rollout
    tokenizer = runtime.tokenizer
    tools = _tools(tuple(rollout.tools), rollout.unsafe_python_tool)
    state = sample.metadata.setdefault(
        STATE,
        {"turns": 0, "tool_calls": 0, "tool_errors": 0, "tool_seconds": 0.0, "turn_start": sample.response_length},
    )
    fmt = tool_call_format(rollout.tool_call_parser)
    params = dict(params, stop=[*(params.get("stop") or []), fmt.end])
    budget = params["max_new_tokens"]  # the whole response's, tool answers included
    if sample.loss_mask is None:
        sample.loss_mask = [1] * sample.response_length  # kept in step with every token appended
    while True:
        sample = await generate_turn(args, sample, params)
        # the whole turn, also when it was aborted part way and resumed
        turn_tokens = sample.response_tokens[state["turn_start"] :]
        state["last_turn"] = tokenizer.decode(turn_tokens, skip_special_tokens=True)  # what is graded
        if sample.status in (Status.COMPLETED, Status.TRUNCATED):
            state["turns"] += 1
        if sample.status != Status.COMPLETED:  # aborted (resumed later, in this turn), truncated or failed
            return sample
        call = parse_call(tokenizer.decode(turn_tokens, skip_special_tokens=False), fmt)
        if call is None or state["turns"] >= rollout.max_turns:
            return sample
        name, arguments = call
        if name is None:
            result_text, error, seconds = f"error: not a tool call: {str(arguments)[:200]!r}", True, 0.0
        else:
            result = await call_tool(tools, name, arguments, rollout.tool_timeout, rollout.tool_max_output_chars)
            result_text, error, seconds = result.text, result.error, result.seconds
        state["tool_calls"] += 1
        state["tool_errors"] += int(error)
        state["tool_seconds"] += seconds
        answer = plain(tokenizer, result_text)
        ids = list(
            tokenizer.encode(
                answer_text(tokenizer, answer, bool(rollout.apply_chat_template), rollout.apply_chat_template_kwargs),
                add_special_tokens=False,
            )
        )
        # the next turn's request holds the answer: it must fit the context (the flag's, else
        # the model's; an engine refuses a longer prompt), with room for one more token
        context = rollout.rollout_max_context_len or _context_length(rollout.model_dir)
        room = min(budget - sample.response_length, context - len(sample.tokens))
        if len(ids) >= room:  # the answer and at least one more token must fit
            sample.status = Status.TRUNCATED
            return sample
        _append(sample, ids)
        state["turn_start"] = sample.response_length
        sample.response = tokenizer.decode(sample.response_tokens, skip_special_tokens=True)
