"""The route plug-ins reach the engines by, served in the run's own process on the rollout loop:
vLLM's `/inference/v1/generate` (and `/v1/chat/completions/render`) for vllm-project/vime's
plug-ins, at `args.vllm_router_ip` / `args.vllm_router_port`, and SGLang's native `/generate`
(with `/abort_request`, `/health`, `/health_generate`, `/get_model_info`, `/flush_cache`) for
slime's, at `args.sglang_router_ip` / `args.sglang_router_port`: one server, one address. Each
request goes through the run's engines as vime's own generate does (`generate_on_engines`: any
backend, the engine picking and failover of runtime.py, the weight version of every token), so
a plug-in never needs an engine's address. The run starts it when a custom generate or rollout
function is given (`SlimeServices`).

A run with a key of its own (--api-key, or $VIME_API_KEY) keeps the router behind it as it keeps
its engines: every route but /health wants `Authorization: Bearer <key>`. The plug-ins' own
`post()` and `get()` (`slime.utils.http_utils`, `vime.utils.http_utils`) send it to the router by
themselves (`http_utils.ROUTER_KEYS`); a plug-in with an HTTP client of its own sends that header.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from vime.compat import sglang_api
from vime.compat.answer_log import AnswerLog
from vime.compat.utils.http_utils import ROUTER_KEYS
from vime.engine.http_common import auth_middleware, page_guard
from vime.rollout import async_loop
from vime.rollout.engine_requests import generate_on_engines
from vime.rollout.runtime import RolloutRuntime

log = logging.getLogger("vime")

GENERATE_ROUTE = "/inference/v1/generate"
RENDER_ROUTE = "/v1/chat/completions/render"
SGLANG_ROUTE = "/generate"
ABORT_TRIES = 20  # an abort is sent again every 0.1 s while its request has not reached an engine


# vLLM's sampling-params keys the router takes → vime's engine protocol key (None: accepted and
# not needed: log-probs always come back, tokens are ids so detokenizer switches change nothing)
_FROM_VLLM: dict[str, str | None] = {
    "max_tokens": "max_new_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "stop": "stop",
    "stop_token_ids": "stop_token_ids",
    "seed": "sampling_seed",
    "n": "n",
    "ignore_eos": "ignore_eos",
    "repetition_penalty": "repetition_penalty",
    "min_p": "min_p",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "logprobs": None,
    "skip_special_tokens": None,
    "include_stop_str_in_output": None,
    "spaces_between_special_tokens": None,
}


RequestError = sglang_api.RequestError  # a request the router cannot serve: answered 400 with its message


def _refused(status: int, message: str) -> web.Response:
    """An error answer, in the shape vLLM and SGLang both give (`{"error": {"message": ...}}`)."""
    return web.json_response({"error": {"message": message}}, status=status)


def engine_params(body: dict[str, Any], default_max_tokens: int) -> dict[str, Any]:
    """vime's sampling params of a `/inference/v1/generate` body. A key vime's engines cannot
    honour (min_tokens, say) is refused by name, never dropped: dropped, the request
    would sample from another distribution than the one asked for."""
    given = body.get("sampling_params") or {}
    if not isinstance(given, dict):
        raise RequestError("sampling_params must be an object")
    unknown = sorted(k for k in given if k not in _FROM_VLLM)
    if unknown:
        raise RequestError(
            f"sampling_params {', '.join(unknown)}: vime's engines do not take "
            f"{'it' if len(unknown) == 1 else 'them'} (they take {', '.join(k for k, v in _FROM_VLLM.items() if v)})"
        )
    params: dict[str, Any] = {"max_new_tokens": default_max_tokens}
    for key, value in given.items():
        if _FROM_VLLM[key] is not None and value is not None:
            params[_FROM_VLLM[key]] = value
    if int(params.get("n", 1)) != 1:
        raise RequestError("n must be 1 (send one request per sample)")
    return params


def vllm_answer(rid: str, input_len: int, out: dict[str, Any]) -> dict[str, Any]:
    """vime's engine answer as vLLM's `/inference/v1/generate` one; `weight_versions` (per token)
    is vime's addition, read by `Sample.append_response_tokens` when passed as meta_info."""
    meta = out["meta_info"]
    ids = list(out["output_ids"])
    versions = list(meta.get("output_weight_versions") or [])
    return {
        "id": rid,
        "choices": [
            {
                "index": 0,
                "token_ids": ids,
                "logprobs": {
                    "content": [
                        {"token_id": t, "logprob": lp} for t, lp in zip(ids, meta.get("output_token_logprobs") or [])
                    ]
                },
                "finish_reason": meta["finish_reason"]["type"],
                "weight_versions": versions,
            }
        ],
        "usage": {"prompt_tokens": input_len, "completion_tokens": len(ids)},
        "weight_version": versions[-1] if versions else meta.get("weight_version"),
    }


def _status(e: BaseException) -> int:
    """400 for a request an engine refused as malformed (its `HTTP 4xx`, or the client's
    ValueError), which a retry would not mend; 503 for an engine gone or failing."""
    return 400 if isinstance(e, ValueError) or re.search(r"HTTP 4\d\d", str(e)) else 503


@dataclass
class Router:
    """The plug-ins' routes on 127.0.0.1, through the run's engines and tokenizer."""

    runtime: RolloutRuntime
    max_new_tokens: int  # what a vLLM request that names no max_tokens gets (--rollout-max-response-len)
    model_path: str = ""  # what /get_model_info names
    api_key: str | None = None  # the run's own key (--api-key): every route but /health wants it
    host: str = "127.0.0.1"
    port: int = 0
    _runner: web.AppRunner | None = None
    # what a custom generate may drop, restored when it returns (assemble gives one only to a run
    # with a custom generate, the one caller of `restore`; None: nothing is kept)
    answers: AnswerLog | None = None
    # the engines' request ids of the router's requests in flight (what /abort_request reaches)
    inflight: set[str] = field(default_factory=set)
    # requests answered with an error, and the last one's message: a generate that returns
    # nothing is told what it may have hidden behind its own try/except
    refused: int = 0
    last_refusal: str = ""

    def _refuse(self, status: int, message: str) -> web.Response:
        self.refused += 1
        self.last_refusal = f"HTTP {status}: {message}"
        return _refused(status, message)

    async def _run(self, ids: list[int], params: dict[str, Any], rid: str, **extra: int) -> Any:
        """One request through the run's engines (its answer, or a list of `n`), noted for `restore`."""
        if rid in self.inflight:
            raise RequestError(f"rid {rid} is already in flight: give each request its own")
        key = hash(tuple(ids[:64]))  # the same prompt to the same engine while it runs (its prefix cache)
        self.inflight.add(rid)
        try:
            out = await generate_on_engines(self.runtime, key, ids, params, rid=rid, **extra)
        finally:
            self.runtime.forget_group(key)
            self.inflight.discard(rid)
        if self.answers is not None:
            for o in out if isinstance(out, list) else [out]:
                meta = o["meta_info"]
                lps, versions = meta.get("output_token_logprobs") or [], meta.get("output_weight_versions") or []
                self.answers.record(ids, o["output_ids"], lps, versions)
        return out

    async def _generate(self, request: web.Request) -> web.Response:
        """vLLM's `/inference/v1/generate`."""
        try:
            body = await request.json()
            ids = body.get("token_ids") if isinstance(body, dict) else None
            if not isinstance(ids, list) or not ids or not all(isinstance(t, int) for t in ids):
                raise RequestError("token_ids must be a non-empty list of token ids (the prompt, tokenized)")
            params = engine_params(body, self.max_new_tokens)
        except (ValueError, TypeError) as e:  # malformed JSON too
            return self._refuse(400, str(e))
        rid = str(body.get("request_id") or uuid.uuid4().hex)
        try:
            out = await self._run(ids, params, rid)
        except Exception as e:  # the engine refused or is gone: the plug-in's post() raises with this
            return self._refuse(_status(e), f"{type(e).__name__}: {e}")
        return web.json_response(vllm_answer(rid, len(ids), out))

    async def _sglang_generate(self, request: web.Request) -> web.StreamResponse:
        """SGLang's native `/generate` (sglang_api.py): every prompt of a batch at once."""
        t0 = time.perf_counter()
        try:
            req = sglang_api.parse_generate(await request.json(), self.runtime.tokenizer)
        except (ValueError, TypeError) as e:  # malformed JSON too
            return self._refuse(400, str(e))

        async def one(item: sglang_api.Item) -> list[dict[str, Any]]:
            extra = {"logprob_start_len": item.logprob_start_len} if item.logprob_start_len >= 0 else {}
            out = await self._run(item.input_ids, item.params, item.rid, **extra)
            version, took = self.runtime.engine_version, time.perf_counter() - t0
            outs = out if isinstance(out, list) else [out]
            return [sglang_api.answer(item, o, self.runtime.tokenizer, version, took) for o in outs]

        try:
            answers = [a for outs in await asyncio.gather(*(one(it) for it in req.items)) for a in outs]
        except Exception as e:
            return self._refuse(_status(e), f"{type(e).__name__}: {e}")
        if req.stream:
            return await self._stream(request, answers, req.batch)
        return web.json_response(answers if req.batch else answers[0])

    async def _stream(self, request: web.Request, answers: list[dict[str, Any]], batch: bool) -> web.StreamResponse:
        """`stream: true`, SGLang's server-sent events: each answer whole in one event (SGLang's
        events carry the text so far; here the first is the last), then `[DONE]`."""
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i, a in enumerate(answers):
            await resp.write(f"data: {json.dumps({**a, 'index': i} if batch else a)}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def _abort(self, request: web.Request) -> web.Response:
        """SGLang's `/abort_request {rid | abort_all}`: the router's requests of that id (or whose
        id begins with it, as SGLang matches a batch's) end at once with `finish_reason` abort
        and the tokens they had; vime's own requests are never touched."""
        try:
            body = await request.json() if request.can_read_body else {}
            if not isinstance(body, dict):
                raise RequestError("the body must be a JSON object: {rid} or {abort_all: true}")
        except (ValueError, TypeError) as e:
            return self._refuse(400, str(e))
        rid = str(body.get("rid") or "")
        rids = [r for r in self.inflight if body.get("abort_all") or (rid and r.startswith(rid))]

        def abort(engine: Any, r: str) -> None:
            self.runtime.call(engine, lambda c: c.abort_request(rid=r))

        # the engine a request runs on is the runtime's choice: each is asked (they are few), and
        # again while one is still in flight (on its way to an engine when the first abort came)
        for _ in range(ABORT_TRIES):
            rids = [r for r in rids if r in self.inflight]
            if not rids:
                break
            engines = [e for e in self.runtime.engines if e.state == "up"]
            await asyncio.gather(
                *(asyncio.to_thread(abort, e, r) for r in rids for e in engines), return_exceptions=True
            )
            await asyncio.sleep(0.1)
        return web.Response(status=200)

    async def _health_generate(self, _: web.Request) -> web.Response:
        """SGLang's `/health_generate`: one token generated through the engines, or 503 why not."""
        try:
            await self._run([self.runtime.tokenizer.eos_token_id or 0], {"max_new_tokens": 1}, uuid.uuid4().hex)
        except Exception as e:
            return self._refuse(503, f"{type(e).__name__}: {e}")
        return web.Response(status=200)

    async def _model_info(self, _: web.Request) -> web.Response:
        """SGLang's `/get_model_info`, with the weight version the engines hold."""
        return web.json_response(
            {
                "model_path": self.model_path,
                "tokenizer_path": self.model_path,
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": str(self.runtime.engine_version),
            }
        )

    async def _flush_cache(self, _: web.Request) -> web.Response:
        """SGLang's `/flush_cache`: every engine's prefix cache."""
        try:
            await asyncio.to_thread(self.runtime.on_each, lambda c: c.flush_cache())
        except Exception as e:  # an engine that refused (requests in flight, say)
            return self._refuse(400, f"{type(e).__name__}: {e}")
        return web.Response(text="Cache flushed.\n")

    async def _render(self, request: web.Request) -> web.Response:
        """vLLM's `/v1/chat/completions/render`: a chat's messages through the run's chat template
        (with the assistant's generation prompt) as the token ids to generate from."""
        try:
            body = await request.json()
            messages = body.get("messages") if isinstance(body, dict) else None
            if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
                raise RequestError("messages must be a list of {role, content} objects")
            text = self.runtime.tokenizer.apply_chat_template(
                messages, tools=body.get("tools"), tokenize=False, add_generation_prompt=True
            )
        except (ValueError, TypeError) as e:  # malformed JSON, or a tokenizer without a chat template
            return self._refuse(400, f"{type(e).__name__}: {e}")
        ids = self.runtime.tokenizer.encode(text, add_special_tokens=False)
        return web.json_response({"token_ids": ids, "model": body.get("model")})

    async def _health(self, _: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def _start(self) -> None:
        app = web.Application(
            client_max_size=256 * 1024**2,
            middlewares=[
                page_guard(lambda path: False),  # a run's plug-ins call it, never a web page
                *([auth_middleware(self.api_key, "the run's --api-key or $VIME_API_KEY")] if self.api_key else []),
            ],
        )
        app.router.add_post(GENERATE_ROUTE, self._generate)
        app.router.add_post(RENDER_ROUTE, self._render)
        app.router.add_post(SGLANG_ROUTE, self._sglang_generate)
        app.router.add_post("/abort_request", self._abort)
        app.router.add_get("/health", self._health)
        app.router.add_get("/health_generate", self._health_generate)
        app.router.add_get("/get_model_info", self._model_info)
        app.router.add_route("*", "/flush_cache", self._flush_cache)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # the free port the OS gave
        if self.api_key:
            ROUTER_KEYS[f"{self.host}:{self.port}"] = self.api_key

    def start(self) -> Router:
        """Serve on the rollout loop (plug-ins find it on their `args`: `PluginArgs`)."""
        async_loop.run(self._start())
        log.info(
            "plug-ins reach the engines at http://%s:%d (%s, %s)", self.host, self.port, GENERATE_ROUTE, SGLANG_ROUTE
        )
        return self

    def stop(self) -> None:
        if self._runner is not None:
            ROUTER_KEYS.pop(f"{self.host}:{self.port}", None)
            async_loop.run(self._runner.cleanup())
            self._runner = None
