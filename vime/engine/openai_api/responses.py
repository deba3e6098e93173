"""OpenAI's Responses API (`POST /v1/responses`), the part a stateless text server can keep: a
request is read into the chat route's body (its `input` items as messages, `instructions` as a
system message, its flat function tools as chat tools) and answered by the chat route's engine
path, its answer written as a response's output items (a message, function calls).

The OpenAI Agents SDK and LangChain's `use_responses_api` call it. What needs state or kinds of
output the engine lacks is a 400 that names the field: `previous_response_id` and
`conversation` (nothing is stored: send the whole conversation in `input`), tools other than
functions, images and files, `text.format` other than text, `reasoning`, log-probs. `stream`
sends the events of a response once its answer is done (the chat route streams token by token).
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from aiohttp import web

from vime.engine.http_common import BadRequest
from vime.engine.openai_api.choices import Finished

# fields taken: sampling, the tools, what is echoed back; the platform's are accepted and ignored
TAKEN = frozenset(
    {"model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "tools", "tool_choice"}
    | {"parallel_tool_calls", "stream", "text", "truncation", "reasoning", "include", "stream_options", "background"}
)
IGNORED = frozenset({"store", "metadata", "user", "service_tier", "prompt_cache_key", "safety_identifier"})
STATEFUL = "the vime engine stores no responses: send the whole conversation in input"
TEXT_PARTS = frozenset({"input_text", "output_text", "text"})


def _text(content: Any, where: str) -> str:
    """An item's content as one string: a string, or text parts joined by newlines."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list) or not all(isinstance(p, dict) for p in content):
        raise BadRequest(f"{where}: content must be a string or a list of content parts")
    kinds = sorted({str(p.get("type")) for p in content} - TEXT_PARTS)
    if kinds:
        raise BadRequest(f"{where}: content parts of type {kinds} are not supported: the vime engine reads text only")
    return "\n".join(str(p.get("text", "")) for p in content)


def _messages(items: Any, instructions: str | None) -> list[dict]:
    """`input` as chat messages: a function call joins the assistant turn before it (or opens
    one), its output becomes a `tool` message."""
    messages: list[dict] = [{"role": "system", "content": instructions}] if instructions else []
    if isinstance(items, str):
        return [*messages, {"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise BadRequest("input must be a string or a non-empty list of items")
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message":
            if not isinstance(item.get("role"), str):
                raise BadRequest(f"{where}: a message needs its role")
            messages.append({"role": item["role"], "content": _text(item.get("content"), where)})
        elif kind == "function_call":
            call = {
                "id": item.get("call_id"),
                "type": "function",
                "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")},
            }
            last = messages[-1] if messages else None
            if last is None or last["role"] != "assistant":
                last = {"role": "assistant", "content": None}
                messages.append(last)
            last["tool_calls"] = [*last.get("tool_calls", []), call]
        elif kind == "function_call_output":
            messages.append(
                {"role": "tool", "tool_call_id": item.get("call_id"), "content": _text(item.get("output"), where)}
            )
        else:
            raise BadRequest(
                f"{where}: an item of type {kind!r} is not supported: give messages, function_call and "
                "function_call_output items"
            )
    return messages


def _tools(tools: Any) -> list[dict] | None:
    """Flat function tools ({type, name, parameters}) as the chat route's ({type, function})."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise BadRequest("tools must be a list")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise BadRequest(f"tools[{i}] of type {kind!r} is not supported: the vime engine calls functions only")
        fn = {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict) and choice.get("type") == "function" and "function" not in choice:
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def chat_body(body: dict) -> dict:
    """The chat route's body for a Responses request; a BadRequest naming what it cannot take."""
    given = {k: v for k, v in body.items() if v is not None and k not in IGNORED}
    for name in ("previous_response_id", "conversation"):
        if name in given:
            raise BadRequest(f"field '{name}' is not supported: {STATEFUL}")
    unknown = sorted(set(given) - TAKEN)
    if unknown:
        raise BadRequest(f"unsupported field(s) {unknown} for /v1/responses: the vime engine would not honour them")
    kind = (given.get("text") or {}).get("format", {}).get("type", "text")
    if kind != "text":
        raise BadRequest(f"text.format {kind!r} is not supported: the vime engine has no constrained decoding")
    if given.get("reasoning") or given.get("include") or given.get("background"):
        name = next(k for k in ("reasoning", "include", "background") if given.get(k))
        raise BadRequest(f"{name} {given[name]!r} is not supported: the vime engine answers text and calls only")
    if given.get("truncation", "disabled") != "disabled":
        raise BadRequest(f"truncation {given['truncation']!r} is not supported: a prompt too long is refused")
    if "input" not in given:
        raise BadRequest("missing field 'input' (a string or a list of items)")
    out = {
        "messages": _messages(given["input"], given.get("instructions")),
        "max_tokens": given.get("max_output_tokens"),
        "tools": _tools(given.get("tools")),
        "tool_choice": _tool_choice(given.get("tool_choice")),
    }
    out.update({k: given[k] for k in ("model", "temperature", "top_p", "parallel_tool_calls") if k in given})
    return {k: v for k, v in out.items() if v is not None}


def response_json(body: dict, model: str, done: Finished, prompt_tokens: int, completion_tokens: int) -> dict:
    """The response object: a message item with the text (when there is text, or no call) and a
    function_call item per call; `incomplete` when the answer hit max_output_tokens."""
    output: list[dict] = []
    if done.text or not done.tool_calls:
        part = {"type": "output_text", "text": done.text, "annotations": [], "logprobs": []}
        output.append(
            {
                "type": "message",
                "id": f"msg_{uuid.uuid4().hex}",
                "status": "completed",
                "role": "assistant",
                "content": [part],
            }
        )
    for call in done.tool_calls:
        fn = call["function"]
        output.append(
            {"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": call["id"], "name": fn["name"]}
            | {"arguments": fn["arguments"], "status": "completed"}
        )
    incomplete = done.finish_reason == "length"
    return {
        "id": f"resp_{uuid.uuid4().hex}",
        "object": "response",
        "created_at": int(time.time()),
        "status": "incomplete" if incomplete else "completed",
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "error": None,
        "model": model,
        "output": output,
        "instructions": body.get("instructions"),
        "max_output_tokens": body.get("max_output_tokens"),
        "temperature": body.get("temperature"),
        "top_p": body.get("top_p"),
        "tools": body.get("tools") or [],
        "tool_choice": body.get("tool_choice") or "auto",
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "text": {"format": {"type": "text"}},
        "truncation": "disabled",
        "previous_response_id": None,
        "reasoning": None,
        "store": False,
        "metadata": body.get("metadata") or {},
        "usage": {
            "input_tokens": prompt_tokens,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt_tokens + completion_tokens,
        },
    }


def _events(response: dict) -> list[dict]:
    """The stream's events for a finished response, in the order OpenAI sends them."""
    opened = {**response, "status": "in_progress", "incomplete_details": None, "output": [], "usage": None}
    events: list[dict] = [
        {"type": "response.created", "response": opened},
        {"type": "response.in_progress", "response": opened},
    ]
    for at, item in enumerate(response["output"]):
        where = {"item_id": item["id"], "output_index": at}
        if item["type"] == "message":
            part = item["content"][0]
            events += [
                {
                    "type": "response.output_item.added",
                    "output_index": at,
                    "item": {**item, "status": "in_progress", "content": []},
                },
                {"type": "response.content_part.added", **where, "content_index": 0, "part": {**part, "text": ""}},
                {
                    "type": "response.output_text.delta",
                    **where,
                    "content_index": 0,
                    "delta": part["text"],
                    "logprobs": [],
                },
                {
                    "type": "response.output_text.done",
                    **where,
                    "content_index": 0,
                    "text": part["text"],
                    "logprobs": [],
                },
                {"type": "response.content_part.done", **where, "content_index": 0, "part": part},
            ]
        else:
            events += [
                {
                    "type": "response.output_item.added",
                    "output_index": at,
                    "item": {**item, "status": "in_progress", "arguments": ""},
                },
                {"type": "response.function_call_arguments.delta", **where, "delta": item["arguments"]},
                {"type": "response.function_call_arguments.done", **where, "arguments": item["arguments"]},
            ]
        events.append({"type": "response.output_item.done", "output_index": at, "item": item})
    events.append({"type": f"response.{response['status']}", "response": response})
    return [{**e, "sequence_number": n} for n, e in enumerate(events)]


async def send_events(request: web.Request, response: dict) -> web.StreamResponse:
    """`stream: true`: the response's events as server-sent events, each named by its type."""
    stream = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await stream.prepare(request)
    for event in _events(response):
        data = json.dumps(event, ensure_ascii=False)
        await stream.write(f"event: {event['type']}\ndata: {data}\n\n".encode())
    await stream.write_eof()
    return stream
