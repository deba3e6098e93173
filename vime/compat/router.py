"""The route vllm-project/vime's plug-ins reach the engines by: vLLM's `/inference/v1/generate`
request and answer shapes (and `/v1/chat/completions/render`), served in the run's own process on
the rollout loop. Each request goes through the run's engines as vime's own generate does
(`generate_on_engines`: any backend, the engine picking and failover of runtime.py, the weight
version of every token), so a plug-in never needs an engine's address or key. The run starts it
when a custom generate or rollout function is given (`SlimeServices`); plug-ins find it at
`args.vllm_router_ip` / `args.vllm_router_port`.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from vime.compat.answer_log import AnswerLog
from vime.rollout import async_loop
from vime.rollout.engine_requests import generate_on_engines
from vime.rollout.runtime import RolloutRuntime

log = logging.getLogger("vime")

GENERATE_ROUTE = "/inference/v1/generate"
RENDER_ROUTE = "/v1/chat/completions/render"

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
    "logprobs": None,
    "skip_special_tokens": None,
    "include_stop_str_in_output": None,
    "spaces_between_special_tokens": None,
}


class RequestError(ValueError):
    """A request the router cannot serve; answered 400 with this message."""


def engine_params(body: dict[str, Any], default_max_tokens: int) -> dict[str, Any]:
    """vime's sampling params of a `/inference/v1/generate` body. A key vime's engines cannot
    honour (repetition_penalty, say) is refused by name, never dropped: dropped, the request
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


@dataclass
class Router:
    """`/inference/v1/generate`, `/v1/chat/completions/render` (and `/health`) on 127.0.0.1,
    through the run's engines and tokenizer."""

    runtime: RolloutRuntime
    max_new_tokens: int  # what a request that names no max_tokens gets (--rollout-max-response-len)
    host: str = "127.0.0.1"
    port: int = 0
    _runner: web.AppRunner | None = None
    # what a custom generate may drop, restored when it returns (assemble gives one only to a run
    # with a custom generate, the one caller of `restore`; None: nothing is kept)
    answers: AnswerLog | None = None

    async def _generate(self, request: web.Request) -> web.Response:

        try:
            body = await request.json()
            ids = body.get("token_ids") if isinstance(body, dict) else None
            if not isinstance(ids, list) or not ids or not all(isinstance(t, int) for t in ids):
                raise RequestError("token_ids must be a non-empty list of token ids (the prompt, tokenized)")
            params = engine_params(body, self.max_new_tokens)
        except (ValueError, TypeError) as e:  # malformed JSON too
            return web.json_response({"error": {"message": str(e)}}, status=400)
        rid = str(body.get("request_id") or uuid.uuid4().hex)
        runtime = self.runtime
        key = hash(tuple(ids[:64]))  # the same prompt to the same engine while it runs (its prefix cache)
        try:
            out = await generate_on_engines(runtime, key, ids, params)
        except Exception as e:  # the engine refused or is gone: the plug-in's post() raises with this
            return web.json_response({"error": {"message": f"{type(e).__name__}: {e}"}}, status=503)
        finally:
            runtime.forget_group(key)
        meta = out["meta_info"]
        if self.answers is not None:
            self.answers.record(
                ids,
                out["output_ids"],
                meta.get("output_token_logprobs") or [],
                meta.get("output_weight_versions") or [],
            )
        return web.json_response(vllm_answer(rid, len(ids), out))

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
            return web.json_response({"error": {"message": f"{type(e).__name__}: {e}"}}, status=400)
        ids = self.runtime.tokenizer.encode(text, add_special_tokens=False)
        return web.json_response({"token_ids": ids, "model": body.get("model")})

    async def _health(self, _: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def _start(self) -> None:
        app = web.Application(client_max_size=256 * 1024**2)
        app.router.add_post(GENERATE_ROUTE, self._generate)
        app.router.add_post(RENDER_ROUTE, self._render)
        app.router.add_get("/health", self._health)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # the free port the OS gave

    def start(self) -> Router:
        """Serve on the rollout loop (plug-ins find it at `args.vllm_router_ip/port`: `PluginArgs`)."""
        async_loop.run(self._start())
        log.info("plug-ins reach the engines at http://%s:%d%s", self.host, self.port, GENERATE_ROUTE)
        return self

    def stop(self) -> None:
        if self._runner is not None:
            async_loop.run(self._runner.cleanup())
            self._runner = None
