"""The OpenAI routes' handlers: `GET /v1/models`, `POST /v1/completions` and
`POST /v1/chat/completions`, answered at once or streamed (and `POST /v1/responses` on the chat
path, vLLM's /tokenize, /detokenize and /version).

A request becomes one engine request per prompt (n samples each), queued through the server's
`generate` like any other; its log-probs are the engine's scoring of prompt and answer
(`scoring.score_top`, in the engine thread between two steps), the model's raw distribution as
vLLM returns by default. Tokenizing, the chat template and detokenizing run here, on the event
loop or in a thread, never in the engine thread.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from aiohttp import web

from vime.engine.http_common import BadRequest, body_field, read_body
from vime.engine.openai_api.chat import read_messages, render
from vime.engine.openai_api.choices import ChoiceText, Finished, Scored, chat_logprobs, completion_logprobs
from vime.engine.openai_api.request import Plan, Prompt, read_plan
from vime.engine.openai_api.responses import chat_body, response_json, send_events
from vime.engine.openai_api.stream import stream_answer
from vime.tool_calls import TOOL_CALL_FORMATS, tool_call_format

if TYPE_CHECKING:
    from vime.engine.core.requests import RequestOutput, SeqOutput
    from vime.engine.core.sampler import SamplingParams
    from vime.engine.streams import OnTokens

Generate = Callable[..., Awaitable["RequestOutput"]]  # EngineServer._generate(ids, params, rid, on_tokens)


# /tokenize's fields (vLLM's): a prompt, or a chat with the chat route's template fields
CHAT_TOKENIZE_FIELDS = frozenset({"tools", "chat_template_kwargs", "add_generation_prompt", "continue_final_message"})
TOKENIZE_FIELDS = CHAT_TOKENIZE_FIELDS | {"model", "prompt", "messages", "add_special_tokens", "return_token_strs"}


class ModelNotFound(RuntimeError):
    http_status = 404


@dataclass(frozen=True)
class ServedModel:
    path: str  # the model directory: its tokenizer and chat template
    names: tuple[str, ...]  # what a request's `model` may say; GET /v1/models lists the first
    max_seq_len: int  # prompt + answer, at most
    tool_call_parser: str  # a row of vime.tool_calls


def add_openai_flags(p: argparse.ArgumentParser) -> None:
    """The server's flags for these routes (vLLM's names)."""
    p.add_argument(
        "--served-model-name",
        nargs="+",
        default=[],
        help="the model's names in the OpenAI routes (GET /v1/models lists the first; --model-path is taken too)",
    )
    p.add_argument(
        "--tool-call-parser",
        default="hermes",
        choices=list(TOOL_CALL_FORMATS),
        help="how the chat route reads the model's tool calls: one row of vime.tool_calls, the same as a run's "
        "--tool-call-parser reads its multi-turn rollouts with",
    )


async def gather_or_cancel(coros: list[Coroutine]) -> list:
    """All results, or the first error with the others cancelled (each aborts its engine request):
    a prompt refused must not leave its siblings generating for nobody."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


class OpenAIRoutes:
    """The OpenAI routes of one engine: `generate` queues a request on it, `call` runs a function
    in its engine thread (the scoring)."""

    def __init__(self, model: ServedModel, generate: Generate, call: Callable[[Callable], Awaitable], engine: Any):
        self.model = model
        self.parser = tool_call_format(model.tool_call_parser)
        self._generate, self._call, self._engine = generate, call, engine
        self.created = int(time.time())
        self._tokenizer = None
        self._tokenizer_lock = asyncio.Lock()

    def add_to(self, app: web.Application) -> None:
        """The routes, each also with a trailing slash (a base URL that ends in one: vLLM's server
        redirects those, which not every client follows), and vLLM's /tokenize, /detokenize and
        /version."""
        app.router.add_get("/v1/models/{name:.+}", self.model_card)
        for path, handler in {"/v1/models": self.models, "/version": self.version}.items():
            app.router.add_get(path, handler)
            app.router.add_get(path + "/", handler)
        for path, handler in {
            "/v1/completions": self.completions,
            "/v1/chat/completions": self.chat_completions,
            "/v1/responses": self.responses,
            "/tokenize": self.tokenize,
            "/detokenize": self.detokenize,
        }.items():
            app.router.add_post(path, handler)
            app.router.add_post(path + "/", handler)

    async def tokenizer(self):
        async with self._tokenizer_lock:
            if self._tokenizer is None:
                from vime.models import load_tokenizer

                self._tokenizer = await asyncio.to_thread(load_tokenizer, self.model.path)
        return self._tokenizer

    # ---- models ------------------------------------------------------------------------

    def _card(self, name: str) -> dict:
        return {
            "id": name,
            "object": "model",
            "created": self.created,
            "owned_by": "vime",
            "root": self.model.path,
            "parent": None,
            "max_model_len": self.model.max_seq_len,
        }

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [self._card(self.model.names[0])]})

    async def model_card(self, request: web.Request) -> web.Response:
        self._check_model(request.match_info["name"])
        return web.json_response(self._card(request.match_info["name"]))

    def _check_model(self, name: str | None) -> None:
        """A request for another model is refused (404, as OpenAI and vLLM do): answered by this
        one it would be a wrong answer that looks right. No `model` at all is taken."""
        if name is not None and name not in self.model.names:
            raise ModelNotFound(f"model '{name}' is not served here: this engine serves '{self.model.names[0]}'")

    async def version(self, request: web.Request) -> web.Response:
        from vime import __version__

        return web.json_response({"version": __version__})

    async def responses(self, request: web.Request) -> web.StreamResponse:
        """OpenAI's Responses API on the chat route's path (`responses.py` says what it takes)."""
        body = await read_body(request)
        chat = chat_body(body)
        plan = read_plan(chat, chat=True)
        self._check_model(plan.model)
        tok = await self.tokenizer()
        ids, opening = await render(
            tok, read_messages(chat["messages"]), plan.tools, plan.template_kwargs, self.parser.start
        )
        out = await self._generate(ids, self._params(plan, len(ids)), uuid.uuid4().hex)
        o = out.outputs[0]
        done = self._choice_text(plan, tok, opening).finish(o.output_ids, o.finish_reason)
        response = response_json(body, plan.model or self.model.names[0], done, len(ids), len(o.output_ids))
        return await send_events(request, response) if body.get("stream") else web.json_response(response)

    # ---- vLLM's tokenizer routes ---------------------------------------------------------

    async def tokenize(self, request: web.Request) -> web.Response:
        """vLLM's /tokenize: a `prompt` tokenized as /v1/completions does, or `messages` (and
        `tools`) rendered as /v1/chat/completions does, so `count` is the prompt's usage there."""
        body = await read_body(request)
        unknown = sorted(set(body) - TOKENIZE_FIELDS)
        if unknown:
            raise BadRequest(
                f"unsupported field(s) {unknown} for /tokenize: it takes {', '.join(sorted(TOKENIZE_FIELDS))}"
            )
        self._check_model(body_field(body, "model", str, required=False))
        tok = await self.tokenizer()
        if (body.get("prompt") is None) == (body.get("messages") is None):
            raise BadRequest("give 'prompt' (a text) or 'messages' (a chat), one of them")
        special = body_field(body, "add_special_tokens", bool, required=False, default=False)
        if body.get("prompt") is not None:
            prompt = body_field(body, "prompt", str)
            ids = await asyncio.to_thread(tok.encode, prompt, add_special_tokens=special)
        elif special:
            raise BadRequest("add_special_tokens is for a prompt: a chat's special tokens are its template's")
        else:
            plan = read_plan({k: body[k] for k in CHAT_TOKENIZE_FIELDS if k in body}, chat=True)
            messages = read_messages(body_field(body, "messages", list))
            ids, _ = await render(tok, messages, plan.tools, plan.template_kwargs, self.parser.start)
        with_strs = body_field(body, "return_token_strs", bool, required=False, default=False)
        strs = [tok.decode([t], skip_special_tokens=False) for t in ids] if with_strs else None
        return web.json_response(
            {"count": len(ids), "max_model_len": self.model.max_seq_len, "tokens": ids, "token_strs": strs}
        )

    async def detokenize(self, request: web.Request) -> web.Response:
        """vLLM's /detokenize: token ids to their text, special tokens kept."""
        body = await read_body(request)
        self._check_model(body_field(body, "model", str, required=False))
        ids = body_field(body, "tokens", list)
        tok = await self.tokenizer()
        if not all(map(_is_id, ids)) or any(t < 0 or t >= len(tok) for t in ids):
            raise BadRequest(f"tokens must be token ids in 0..{len(tok) - 1}")
        return web.json_response({"prompt": tok.decode(ids, skip_special_tokens=False)})

    # ---- the two routes ----------------------------------------------------------------

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await read_body(request)
        plan = read_plan(body, chat=False)
        self._check_model(plan.model)
        tok = await self.tokenizer()
        prompts = await asyncio.to_thread(_prompts, tok, body.get("prompt"))
        return await self._answer(request, plan, prompts)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        body = await read_body(request)
        plan = read_plan(body, chat=True)
        self._check_model(plan.model)
        messages = body.get("messages")
        if not isinstance(messages, list):
            raise BadRequest("missing field 'messages' (a list of {role, content} objects)")
        tok = await self.tokenizer()
        ids, opening = await render(tok, read_messages(messages), plan.tools, plan.template_kwargs, self.parser.start)
        return await self._answer(request, plan, [Prompt(ids, None)], opening)

    async def _answer(
        self, request: web.Request, plan: Plan, prompts: list[Prompt], opening: str = ""
    ) -> web.StreamResponse:
        """`opening`: the text each answer begins with, the prompt's end (a forced call's opening)."""
        tok = await self.tokenizer()
        params = [self._params(plan, len(p.ids)) for p in prompts]
        rid = uuid.uuid4().hex
        head = {
            "id": ("chatcmpl-" if plan.chat else "cmpl-") + rid,
            "created": int(time.time()),
            "model": plan.model or self.model.names[0],
        }

        def runner(i: int) -> Callable[[OnTokens | None], Awaitable[RequestOutput]]:
            return lambda on_tokens: self._generate(prompts[i].ids, params[i], f"{rid}-{i}", on_tokens)

        def text() -> ChoiceText:
            return self._choice_text(plan, tok, opening)

        if plan.stream:
            runs = [runner(i) for i in range(len(prompts))]

            async def score(i: int, o: SeqOutput) -> dict | None:
                return await self._logprobs(plan, tok, prompts[i].ids, o)

            return await stream_answer(
                request, plan, head, prompts, runs, text, score if plan.logprobs is not None else None
            )
        outs = await gather_or_cancel([runner(i)(None) for i in range(len(prompts))])
        choices = []
        for i, out in enumerate(outs):
            for o in out.outputs:
                done = text().finish(o.output_ids, o.finish_reason)
                choice = _choice(plan, len(choices), done, prompts[i].text if plan.echo else None)
                if plan.logprobs is not None:
                    choice["logprobs"] = await self._logprobs(plan, tok, prompts[i].ids, o)
                choices.append(choice)
        completion = sum(len(o.output_ids) for out in outs for o in out.outputs)
        prompt = sum(len(p.ids) for p in prompts)
        return web.json_response(
            {
                **head,
                "object": "chat.completion" if plan.chat else "text_completion",
                "choices": choices,
                "usage": {
                    "prompt_tokens": prompt,
                    "completion_tokens": completion,
                    "total_tokens": prompt + completion,
                },
            }
        )

    def _choice_text(self, plan: Plan, tok: Any, opening: str) -> ChoiceText:
        """A sample's text as the request reads it: its stop ids, its tool-call parser (with tools)."""
        eos = () if plan.params.ignore_eos else self._engine.model_config.eos_token_ids
        stop_ids = frozenset((*plan.params.stop_token_ids, *eos))
        parser = self.parser if plan.tools else None
        return ChoiceText(_decoder(tok, plan.skip_special_tokens), plan, parser, stop_ids, opening)

    def _params(self, plan: Plan, prompt_len: int) -> SamplingParams:
        if prompt_len == 0:
            raise BadRequest("a prompt is empty: give at least one token")
        if prompt_len >= self.model.max_seq_len:
            raise BadRequest(
                f"prompt of {prompt_len} tokens can never fit: the model's context is {self.model.max_seq_len} tokens"
            )
        return replace(plan.params, max_new_tokens=plan.max_new_tokens(prompt_len, self.model.max_seq_len))

    async def _logprobs(self, plan: Plan, tok: Any, prompt: list[int], out: SeqOutput) -> dict | None:
        """The choice's log-probs by the engine's scoring: of its tokens, and with `echo` of the
        prompt's too (the first one None: nothing predicts it)."""
        from vime.engine.core.scoring import score_top

        ids = prompt + out.output_ids
        start = 0 if plan.echo else len(prompt)
        if start >= len(ids):  # nothing to score: no tokens generated and no echo
            return chat_logprobs(_token_text(tok), Scored([], [], [])) if plan.chat else None
        k = plan.logprobs or 0
        lps, tops = await self._call(lambda: score_top(self._engine, ids, start, k))
        return (chat_logprobs if plan.chat else completion_logprobs)(_token_text(tok), Scored(ids[start:], lps, tops))


def _choice(plan: Plan, index: int, done: Finished, echo: str | None) -> dict:
    if not plan.chat:
        text = (echo or "") + done.text
        return {"index": index, "text": text, "logprobs": None, "finish_reason": done.finish_reason}
    message: dict[str, Any] = {"role": "assistant", "content": done.text or (None if done.tool_calls else "")}
    if done.tool_calls:
        message["tool_calls"] = done.tool_calls
    return {"index": index, "message": message, "logprobs": None, "finish_reason": done.finish_reason}


def _decoder(tok: Any, skip_special_tokens: bool) -> Callable[[list[int]], str]:
    from vime.engine.core.stop import decoder

    return decoder(tok) if skip_special_tokens else (lambda ids: tok.decode(ids, skip_special_tokens=False))


def _token_text(tok: Any) -> Callable[[int], str]:
    return lambda t: tok.decode([t], skip_special_tokens=False)


def _is_id(t: Any) -> bool:
    return isinstance(t, int) and not isinstance(t, bool)


def _prompts(tok: Any, prompt: Any) -> list[Prompt]:
    """/v1/completions' `prompt`: a text, a list of token ids, or a list of either, one engine
    request each (in a thread: a long text takes seconds to tokenize)."""
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(map(_is_id, prompt))):
        prompt = [prompt]  # one prompt
    if not isinstance(prompt, list) or not prompt:
        raise BadRequest("prompt must be a string, a list of token ids, or a non-empty list of either")
    out = []
    for p in prompt:
        if isinstance(p, str):
            out.append(Prompt(tok.encode(p, add_special_tokens=False), p))
        elif isinstance(p, list) and all(map(_is_id, p)):
            out.append(Prompt(list(p), tok.decode(p, skip_special_tokens=False)))
        else:
            raise BadRequest("prompt must be a string, a list of token ids, or a non-empty list of either")
    return out


def is_openai_path(path: str) -> bool:
    """The /v1/ routes and vLLM's tokenizer and version routes: OpenAI's errors, browsers' CORS."""
    return path.startswith("/v1/") or path.rstrip("/") in ("/tokenize", "/detokenize", "/version")


@web.middleware
async def cors_preflight(request: web.Request, handler: Callable) -> web.StreamResponse:
    """A browser's preflight (OPTIONS with Access-Control-Request-Method) of an OpenAI route,
    answered here, before the key check (a browser sends no key with it): any origin, as vLLM's
    server allows by default (`--allowed-origins '*'`), so a web page can call the server. The
    engine's own routes (weights, pause) get no preflight answer, so a page cannot call those."""
    if (
        request.method == "OPTIONS"
        and is_openai_path(request.path)
        and "Origin" in request.headers
        and "Access-Control-Request-Method" in request.headers
    ):
        allowed = {
            "Access-Control-Allow-Methods": "GET, POST, OPTIONS",
            "Access-Control-Allow-Headers": request.headers.get("Access-Control-Request-Headers", "*"),
            "Access-Control-Max-Age": "600",
        }
        return web.Response(headers=allowed)
    return await handler(request)


async def cors_origin(request: web.Request, response: web.StreamResponse) -> None:
    """`on_response_prepare`: an OpenAI route's answer to a browser may be read by its page (set
    as the headers go out, so a stream's too)."""
    if is_openai_path(request.path) and "Origin" in request.headers:
        response.headers["Access-Control-Allow-Origin"] = "*"


@web.middleware
async def openai_errors(request: web.Request, handler: Callable) -> web.StreamResponse:
    """The OpenAI routes' errors in OpenAI's shape, `{"error": {"message", "type", "param",
    "code"}}`, which OpenAI's clients read, whichever middleware or handler answered (the key
    check's 401, a body over the limit, an unknown route); other routes keep the protocol's."""
    if not is_openai_path(request.path):
        return await handler(request)
    try:
        response = await handler(request)
    except web.HTTPException as e:  # aiohttp's own answers: an unknown route, a wrong method
        if e.status < 400:
            raise
        message = f"{request.method} {request.path}: {e.reason}"
        if e.status == 404:
            message += (
                " (this engine serves GET /v1/models, POST /v1/completions, /v1/chat/completions and /v1/responses)"
            )
        return openai_error(e.status, message)
    if response.status >= 400 and isinstance(response, web.Response) and response.content_type == "application/json":
        error = json.loads(response.body).get("error")
        if isinstance(error, str):
            return openai_error(response.status, error)
    return response


def openai_error(status: int, message: str) -> web.Response:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return web.json_response(
        {"error": {"message": message, "type": kind, "param": None, "code": status}}, status=status
    )
