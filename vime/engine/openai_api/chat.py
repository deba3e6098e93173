"""A chat request's messages and tools, checked and rendered through the model's chat template.

The template is the model's own contract: tools are shown in the form it was trained on, an
assistant's earlier `tool_calls` and the `tool` messages that answer them are written as it
writes them. What the API sends is made what templates read: text parts joined into one string,
and a call's `arguments` (a JSON string in the API) parsed into the object templates print with
`tojson`. A template that never shows the tools (one written without them) would leave the model
blind to them while the client believes otherwise, so that is refused.
"""

from __future__ import annotations

import asyncio
import json
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


def read_tools(tools: list | None, tool_choice: str | dict | None) -> list[dict] | None:
    """The tools to show the model and read its calls for, or None: none given, or tool_choice
    'none' (the model is not told of them). 'required' and a named function need constrained
    decoding, which the engine lacks: refused rather than hoped for."""
    if tool_choice is not None and tool_choice not in ("auto", "none"):
        shown = tool_choice if isinstance(tool_choice, str) else json.dumps(tool_choice)
        raise BadRequest(
            f"tool_choice {shown} is not supported: the vime engine has no constrained decoding to force a call; "
            "use 'auto' (the model calls a tool or answers) or 'none'"
        )
    if not tools or tool_choice == "none":
        return None
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or tool.get("type") != "function" or not isinstance(fn.get("name"), str):
            raise BadRequest(
                f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., 'parameters': ...}}}}"
            )
    return tools


def _render(tokenizer: Any, messages: list[dict], tools: list[dict] | None, kwargs: dict) -> str:
    kwargs = {"add_generation_prompt": not kwargs.get("continue_final_message", False), **kwargs}
    return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, **kwargs)


async def render(tokenizer: Any, messages: list[dict], tools: list[dict] | None, kwargs: dict) -> list[int]:
    """The prompt's token ids: the messages (and tools) through the chat template, in a thread
    (a long chat takes a while, and /health must answer meanwhile)."""

    def work() -> list[int]:
        try:
            text = _render(tokenizer, messages, tools, kwargs)
            if tools and text == _render(tokenizer, messages, None, kwargs):
                raise BadRequest(
                    "this model's chat template does not show tools to the model: serve a model whose template "
                    "renders `tools` (Qwen's, Hermes'), or describe the tools in a message"
                )
        except BadRequest:
            raise
        except Exception as e:  # jinja's errors (a template's raise_exception) are the request's
            raise BadRequest(f"the chat template refused the messages: {type(e).__name__}: {e}") from None
        return tokenizer.encode(text, add_special_tokens=False)

    return await asyncio.to_thread(work)
