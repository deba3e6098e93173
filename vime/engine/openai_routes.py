"""The engine's OpenAI-compatible routes: `/v1/completions` and `/v1/chat/completions`.

Separate from the native protocol (`server.py`) because only these routes deal in text: they own
the tokenizer (loaded on first use) and map OpenAI's request and response fields onto one
engine request. Non-streaming only; stop strings are applied after generation.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from aiohttp import web

from vime.engine.http_common import BadRequest, body_field, read_body

if TYPE_CHECKING:
    from vime.engine.core.requests import RequestOutput
    from vime.engine.core.sampler import SamplingParams

# the roles of OpenAI's chat API that chat templates know
CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function", "ipython"})


class OpenAIRoutes:
    """Handlers for the OpenAI routes; `generate` queues one request on the engine and awaits
    its output (`EngineServer._generate`)."""

    def __init__(self, generate: Callable[[list[int], SamplingParams, str], Awaitable[RequestOutput]], model_path: str):
        self._generate = generate
        self.model_path = model_path
        self._tokenizer = None
        self._tokenizer_lock = asyncio.Lock()

    async def tokenizer(self):
        async with self._tokenizer_lock:
            if self._tokenizer is None:
                from vime.models import load_tokenizer

                self._tokenizer = await asyncio.to_thread(load_tokenizer, self.model_path)
        return self._tokenizer

    async def completions(self, request: web.Request) -> web.Response:
        body = await read_body(request)
        tok = await self.tokenizer()
        prompt = body_field(body, "prompt", (str, list))
        if isinstance(prompt, str):  # in a thread: a long text takes seconds, and /health must answer meanwhile
            ids = await asyncio.to_thread(tok.encode, prompt, add_special_tokens=False)
        elif all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids = prompt
        else:
            raise BadRequest("prompt must be a string or a list of token ids (one prompt per request)")
        return await self._openai(body, ids, chat=False)

    async def chat_completions(self, request: web.Request) -> web.Response:
        body = await read_body(request)
        tok = await self.tokenizer()
        messages = body_field(body, "messages", list)
        if not all(isinstance(m, dict) and "role" in m and "content" in m for m in messages):
            raise BadRequest("messages must be a list of {role, content} objects")
        roles = sorted(
            {str(m["role"]) for m in messages if not isinstance(m["role"], str) or m["role"] not in CHAT_ROLES}
        )
        if roles:  # a chat template renders an unknown role as it likes, or not at all
            raise BadRequest(f"unknown message role(s) {roles}: use {', '.join(sorted(CHAT_ROLES))}")
        text = await asyncio.to_thread(tok.apply_chat_template, messages, tokenize=False, add_generation_prompt=True)
        ids = await asyncio.to_thread(tok.encode, text, add_special_tokens=False)
        return await self._openai(body, ids, chat=True)

    async def _openai(self, body: dict, ids: list[int], chat: bool) -> web.Response:
        from vime.engine.core.sampler import SamplingParams

        if body.get("stream"):
            raise BadRequest("stream=true is not supported by the vime engine")
        stop = body.get("stop") or []
        stop = [stop] if isinstance(stop, str) else stop
        if not all(isinstance(s, str) for s in stop):
            raise BadRequest("stop must be a string or a list of strings")
        params = SamplingParams.from_dict(
            {
                "max_new_tokens": body.get("max_completion_tokens", body.get("max_tokens", 16)),
                "temperature": body.get("temperature", 1.0),
                "top_p": body.get("top_p", 1.0),
                "top_k": body.get("top_k", -1),
                "n": body.get("n", 1),
                "stop_token_ids": body.get("stop_token_ids") or [],
                "ignore_eos": body.get("ignore_eos", False),
            }
        )
        rid = uuid.uuid4().hex
        out = await self._generate(ids, params, rid)
        tok = await self.tokenizer()
        choices = []
        for i, o in enumerate(out.outputs):
            text = tok.decode(o.output_ids, skip_special_tokens=True)
            reason = o.finish_reason
            cut = min((p for p in (text.find(s) for s in stop) if p >= 0), default=-1)
            if cut >= 0:  # stop strings are applied after generation; the text ends before them
                text, reason = text[:cut], "stop"
            if chat:
                choices.append({"index": i, "message": {"role": "assistant", "content": text}, "finish_reason": reason})
            else:
                choices.append({"index": i, "text": text, "finish_reason": reason, "logprobs": None})
        completion = sum(len(o.output_ids) for o in out.outputs)
        return web.json_response(
            {
                "id": ("chatcmpl-" if chat else "cmpl-") + rid,
                "object": "chat.completion" if chat else "text_completion",
                "created": int(time.time()),
                "model": body.get("model") or self.model_path,
                "choices": choices,
                "usage": {
                    "prompt_tokens": len(ids),
                    "completion_tokens": completion,
                    "total_tokens": len(ids) + completion,
                },
            }
        )
