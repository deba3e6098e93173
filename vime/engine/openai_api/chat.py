"""A chat request's messages and tools, checked and rendered through the model's chat template.

The template is the model's own contract: tools are shown in the form it was trained on, an
assistant's earlier `tool_calls` and the `tool` messages that answer them are written as it
writes them. What the API sends is made what templates read: text parts joined into one string,
and a call's `arguments` (a JSON string in the API) parsed into the object templates print with
`tojson`. A template that never shows the tools (one written without them) would leave the model
blind to them while the client believes otherwise, so that is refused.

`tool_choice` `required` or a named function is kept by writing the opening of a call at the end
of the prompt, as the template itself writes an assistant's call (found by rendering a made-up
call and cutting it where its name, or its arguments, begin): the model then writes the rest
(the tool's name and arguments, or the arguments), so its answer is a call. vLLM forces these by
constrained decoding; the engine has none, so the arguments are the model's own, not checked
against the tool's schema (a call that does not parse comes back as text).
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any

from vime.engine.http_common import BadRequest

# the roles of OpenAI's chat API that chat templates know
CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function", "ipython"})


def _text(content: Any, where: str) -> str | None:
    """A message's content as one string: text parts joined by newlines (as vLLM does)."""
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, list) or not all(isinstance(p, dict) for p in content):
        raise BadRequest(f"{where}: content must be a string or a list of content parts")
    kinds = sorted({str(p.get("type")) for p in content} - {"text"})
    if kinds:
        raise BadRequest(f"{where}: content parts of type {kinds} are not supported: the vime engine reads text only")
    if not all(isinstance(p.get("text"), str) for p in content):
        raise BadRequest(f"{where}: a text part needs its text")
    return "\n".join(p["text"] for p in content)


def _tool_calls(calls: Any, where: str) -> list[dict]:
    """An assistant's earlier calls with their arguments parsed (templates print them as JSON)."""
    if not isinstance(calls, list):
        raise BadRequest(f"{where}: tool_calls must be a list")
    out = []
    for call in calls:
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise BadRequest(f"{where}: each tool call needs function.name")
        arguments = fn.get("arguments", "{}")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments or "{}")
            except (json.JSONDecodeError, RecursionError):  # nested too deeply: a 500 and its traceback
                raise BadRequest(f"{where}: the arguments of call '{fn['name']}' are not JSON") from None
        out.append({**call, "function": {**fn, "arguments": arguments}})
    return out


def read_messages(messages: list) -> list[dict]:
    """The messages as a chat template reads them; a BadRequest naming the first wrong one."""
    if not messages:
        raise BadRequest("messages is empty")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise BadRequest(f"{where} must be an object with a role")
        if m["role"] not in CHAT_ROLES:  # a template renders an unknown role as it likes, or not at all
            raise BadRequest(f"{where}: unknown role '{m['role']}': use {', '.join(sorted(CHAT_ROLES))}")
        message = {**m, "content": _text(m.get("content"), where)}
        if m.get("tool_calls") is not None:
            message["tool_calls"] = _tool_calls(m["tool_calls"], where)
        elif message["content"] is None and m["role"] != "assistant":
            raise BadRequest(f"{where} ({m['role']}) has no content")
        out.append(message)
    return out


@dataclass(frozen=True)
class Tools:
    """The tools shown to the model, and which call it must make: `force` None (it decides,
    tool_choice auto), "" (some call, `required`) or a tool's name (that call)."""

    tools: list[dict]
    force: str | None = None


def _forced(tool_choice: str | dict | None, names: list[str]) -> str | None:
    """`tool_choice` as `Tools.force`; a BadRequest for a choice that names no tool given."""
    if tool_choice in (None, "auto"):
        return None
    if tool_choice == "required":
        return ""
    fn = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    if not isinstance(fn, dict) or tool_choice.get("type") != "function" or not isinstance(fn.get("name"), str):
        shown = tool_choice if isinstance(tool_choice, str) else json.dumps(tool_choice)
        raise BadRequest(
            f"tool_choice {shown} is not supported: give 'auto', 'none', 'required' or "
            "{'type': 'function', 'function': {'name': ...}}"
        )
    if fn["name"] not in names:
        raise BadRequest(f"tool_choice names the function '{fn['name']}', which is not in tools ({', '.join(names)})")
    return fn["name"]


def read_tools(tools: list | None, tool_choice: str | dict | None) -> Tools | None:
    """The tools to show the model and read its calls for, or None: none given, or tool_choice
    'none' (the model is not told of them)."""
    if tool_choice == "none":
        return None
    if not tools:
        if tool_choice not in (None, "auto"):
            raise BadRequest("tool_choice other than 'auto' or 'none' needs tools")
        return None
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or tool.get("type") != "function" or not isinstance(fn.get("name"), str):
            raise BadRequest(
                f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., 'parameters': ...}}}}"
            )
    return Tools(tools, _forced(tool_choice, [t["function"]["name"] for t in tools]))


def _render(tokenizer: Any, messages: list[dict], tools: list[dict] | None, kwargs: dict) -> str:
    kwargs = {"add_generation_prompt": not kwargs.get("continue_final_message", False), **kwargs}
    return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, **kwargs)


NAME_MARK = "vime_tool_name_0"  # a made-up call's name and argument, found again in its rendering
ARGUMENTS_MARK = "vime_argument_0"


def _call_opening(tokenizer: Any, messages: list[dict], tools: Tools, prompt: str, start: str, kwargs: dict) -> str:
    """The text after `prompt` that opens the forced call as the template writes calls: up to
    the arguments of `tools.force`'s call, or up to the name for any call. It must hold the
    parser's `start` tag (or the parser would not read the call); the answer begins there."""
    name = tools.force or NAME_MARK
    call = {"id": "call_0", "type": "function", "function": {"name": name, "arguments": {ARGUMENTS_MARK: 0}}}
    kwargs = {**kwargs, "add_generation_prompt": False, "continue_final_message": False}
    whole = _render(
        tokenizer, [*messages, {"role": "assistant", "content": "", "tool_calls": [call]}], tools.tools, kwargs
    )
    turn = whole[len(prompt) :] if whole.startswith(prompt) else ""
    if tools.force:
        cut = turn.find(f'"{ARGUMENTS_MARK}"')
        opening = turn[:cut].rstrip() if cut >= 0 else ""
        opening = opening[:-1] if opening.endswith("{") else ""  # the arguments' own brace: the model's to write
    else:
        cut = turn.find(NAME_MARK)
        opening = turn[:cut] if cut >= 0 else ""
    if start not in opening:
        raise BadRequest(
            f"tool_choice {tools.force or 'required'} is not supported with this model: its chat template does not "
            f"write an assistant's call as --tool-call-parser reads them ({start}...), so the engine cannot open one; "
            "use 'auto'"
        )
    return opening


async def render(
    tokenizer: Any, messages: list[dict], tools: Tools | None, kwargs: dict, start: str
) -> tuple[list[int], str]:
    """The prompt's token ids: the messages (and tools) through the chat template, in a thread
    (a long chat takes a while, and /health must answer meanwhile); and the text the answer
    begins with: the opening of a forced call from the parser's `start` tag, or "".

    The prompt ends with the whole opening (an empty thinking block a template writes before a
    call included), the answer's text only from `start` on."""

    def work() -> tuple[list[int], str]:
        shown = tools.tools if tools else None
        try:
            text = _render(tokenizer, messages, shown, kwargs)
            if shown and text == _render(tokenizer, messages, None, kwargs):
                raise BadRequest(
                    "this model's chat template does not show tools to the model: serve a model whose template "
                    "renders `tools` (Qwen's, Hermes'), or describe the tools in a message"
                )
            opening = ""
            if tools is not None and tools.force is not None:
                opening = _call_opening(tokenizer, messages, tools, text, start, kwargs)
        except BadRequest:
            raise
        except Exception as e:  # jinja's errors (a template's raise_exception) are the request's
            raise BadRequest(f"the chat template refused the messages: {type(e).__name__}: {e}") from None
        answer_start = opening[opening.find(start) :] if opening else ""
        return tokenizer.encode(text + opening, add_special_tokens=False), answer_start

    return await asyncio.to_thread(work)
