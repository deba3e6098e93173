"""The seed system's plug-in API on vime's parts (docs/plugin-compat.md lists every name).

The seed system (vLLM's vime, built on slime) has its custom generate functions talk to the
engines themselves: they read `GenerateState(args).tokenizer`, turn the rollout's sampling
params into vLLM's with `_build_inference_sampling_params`, POST token ids to
`http://{args.vllm_router_ip}:{args.vllm_router_port}/inference/v1/generate`, and append what
comes back with `Sample.append_response_tokens`. Some return several samples (multi-agent: one
per agent call). Here:

* `PluginArgs`: the `args` every plug-in and rollout function is handed, read-only: each
  setting of the run's config, and the live objects slime's plug-ins reach through it
  (`args.runtime`, `args.vllm_router_ip` / `args.vllm_router_port`).
* `Router`: the `/inference/v1/generate` route, vLLM's request and answer shapes, served in the
  run's own process on the rollout loop. Each request goes through the run's engines as vime's
  own generate does (`generate_on_engines`: any backend, the engine picking and failover of
  runtime.py, the weight version of every token), so a plug-in never needs an engine's address
  or key. The run starts it when a custom generate or rollout function is given; plug-ins find
  it at `args.vllm_router_ip` / `args.vllm_router_port`.
* `GenerateState`, `_build_inference_sampling_params`, `_inference_generate_tokens_and_logprobs`:
  the seed's helpers of those names (re-exported by vllm_rollout.py, where plug-ins import them).

A generate that returns a list of samples is vime's own rule now (`vime.rollout.types.flatten`,
`vime.algorithms.credit.rollout_credit`): each returned sample is trained, in the group of its
prompt, which GRPO normalizes within. The seed normalizes over the whole batch once counts
differ; per prompt is the group GRPO means, and what the seed does where it tracks group sizes
(multi-LoRA).
"""

from __future__ import annotations

import copy
import logging
import uuid
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from vime.plugins import SettingsView, SettingWriteError
from vime.rollout import async_loop
from vime.rollout.answer_log import AnswerLog
from vime.rollout.engine_requests import generate_on_engines, sampling_params
from vime.rollout.runtime import RolloutRuntime
from vime.rollout.types import Sample

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


# ---------------------------------------------------------------- the seed's helpers


class GenerateState:
    """What the seed's plug-ins read from `GenerateState(args)`: `tokenizer` (the run's),
    `processor` (None: vime rolls out text), `sampling_params` (the rollout's, in vime's
    protocol keys) and `args`. One per model per process, as the seed's is a singleton: a
    plug-in calls it on every sample."""

    _made: dict[str, GenerateState] = {}

    def __new__(cls, args: Any) -> GenerateState:
        key = str(getattr(args, "model_dir", None) or args.hf_checkpoint)
        state = cls._made.get(key)
        if state is None:
            state = cls._made[key] = super().__new__(cls)
            state.tokenizer = _tokenizer(args)
            state.processor = None
        state.args = args
        return state

    def __init__(self, args: Any) -> None:

        self.sampling_params: dict[str, Any] = sampling_params(args)


def _tokenizer(args: Any) -> Any:
    runtime = getattr(args, "runtime", None)
    if runtime is not None:
        return runtime.tokenizer
    from vime.models import load_tokenizer

    return load_tokenizer(getattr(args, "model_dir", None) or args.hf_checkpoint)


def _build_inference_sampling_params(sampling_params: dict[str, Any]) -> dict[str, Any]:
    """The rollout's sampling params (vime's keys) as the body of vLLM's `/inference/v1/generate`,
    asking for each token's log-prob: the seed's helper of this name."""
    out: dict[str, Any] = {
        "max_tokens": sampling_params["max_new_tokens"],
        "temperature": sampling_params["temperature"],
        "top_p": sampling_params["top_p"],
        "logprobs": 1,
    }
    top_k = sampling_params.get("top_k")
    if top_k is not None and (top_k > 0 or top_k == -1):
        out["top_k"] = top_k
    if sampling_params.get("stop"):
        out["stop"] = list(sampling_params["stop"])
        if sampling_params.get("no_stop_trim"):
            out["include_stop_str_in_output"] = True
    if sampling_params.get("stop_token_ids"):
        out["stop_token_ids"] = list(sampling_params["stop_token_ids"])
    seed = sampling_params.get("seed", sampling_params.get("sampling_seed"))
    if seed is not None:
        out["seed"] = seed
    if sampling_params.get("skip_special_tokens") is not None:
        out["skip_special_tokens"] = bool(sampling_params["skip_special_tokens"])
    return out


def _inference_generate_tokens_and_logprobs(choice: dict[str, Any]) -> tuple[list[int], list[float]]:
    """(token ids, their log-probs) of one choice of a `/inference/v1/generate` answer."""
    ids = [int(t) for t in choice.get("token_ids") or []]
    content = (choice.get("logprobs") or {}).get("content") or []
    return ids, [float(c.get("logprob", 0.0)) if isinstance(c, dict) else 0.0 for c in content]


def _coerce_flat_int_token_ids(value: Any) -> list[int]:
    """Token ids as a flat list of ints: the seed's helper, for a render answer's `token_ids`
    (one prompt given as a list of one list is taken too). Anything else is a ValueError naming it."""
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], list):
        value = value[0]
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise ValueError(f"token ids must be a flat list of integers, got {type(value).__name__}")
    return [int(t) for t in value]


def _mm_render_response_to_generate_body(render_data: Any, model: str) -> dict[str, Any]:
    """A `/v1/chat/completions/render` answer as the body of a `/inference/v1/generate` request
    (without its sampling_params): the seed's helper. Takes both shapes vLLM answers, a dict
    with `token_ids` and `[conversation, engine_prompts]`."""
    if isinstance(render_data, dict) and "token_ids" in render_data:
        return {**copy.deepcopy(render_data), "model": render_data.get("model") or model}
    if isinstance(render_data, list) and len(render_data) >= 2 and isinstance(render_data[1], list) and render_data[1]:
        prompt = render_data[1][0]
        if isinstance(prompt, dict):
            ids = prompt.get("prompt_token_ids") or prompt.get("token_ids")
            return {"token_ids": _coerce_flat_int_token_ids(ids), "model": model}
    raise ValueError("a chat render answer must be {token_ids: [...]} or [conversation, [{prompt_token_ids: [...]}]]")


# ---------------------------------------------------------------- the args plug-ins get


class PluginArgs(SettingsView):
    """slime's `args`, as every plug-in and rollout function of a run is handed it: the read-only
    view of the run's settings every plug-in gets (`vime.plugins.SettingsView`: a write or `del`
    of a setting raises, a name that is no setting is the plug-in's own), and the live objects
    slime's plug-ins reach through it: `runtime` (the engines' clients, the tokenizer, the
    rewards: `runtime.runtime_of`) and `vllm_router_ip` / `vllm_router_port` (the `Router`, None
    when the run has none). A copy (`copy.copy(args)` / `copy.deepcopy(args)`) is a Config of its
    own to change, still holding the live objects. A custom generate gets `for_call()`'s view
    instead, which takes any write for that one call: the seed's multi-agent generate stores its
    tokenizer, sampling params and agent settings on `args` on every call before copying it."""

    __slots__ = ("_live", "_mine", "_router")

    def __init__(
        self,
        config: Any,
        runtime: RolloutRuntime | None,
        router: Router | None = None,
        *,
        live: dict[str, Any] | None = None,
        own: dict[str, Any] | None = None,
        mine: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(config, own)
        if live is None:
            live = {
                "runtime": runtime,
                "vllm_router_ip": router.host if router else None,
                "vllm_router_port": router.port if router else None,
            }
        object.__setattr__(self, "_live", live)
        object.__setattr__(self, "_mine", mine)
        object.__setattr__(self, "_router", router)

    def for_call(self) -> PluginArgs:
        """A view of the same settings, live objects and plug-in names whose writes land in a dict
        of its own, dropped when the call ends, so one call's values never reach another's or the
        run's."""
        return PluginArgs(self._config, None, self._router, live=self._live, own=self._own, mine={})

    def with_settings(self, **changes: Any) -> PluginArgs:
        """The same live objects and plug-in names over a copy of the settings with `changes` (an
        eval set's overrides), so eval's generate calls get their per-call views as training's do."""
        config = copy.copy(self._config)
        for name, value in changes.items():
            setattr(config, name, value)
        return PluginArgs(config, None, self._router, live=self._live, own=self._own)

    def restore_log_probs(self, samples: list[Sample]) -> None:
        """Samples a custom generate built from a router answer, without its log-probs, get them
        back (`AnswerLog`), so correction and staleness see them as they see vime's own."""
        if self._router is not None and self._router.answers is not None:
            for s in samples:
                self._router.answers.restore(s)

    def __getattr__(self, name: str) -> Any:
        mine = self._mine
        if mine is not None and name in mine:
            return mine[name]
        live = self._live
        if name in live:
            return live[name]
        return super().__getattr__(name)

    def __setattr__(self, name: str, value: Any) -> None:
        if self._mine is not None:
            self._mine[name] = value
        elif name in self._live:
            raise SettingWriteError(name)
        else:
            super().__setattr__(name, value)

    def __delattr__(self, name: str) -> None:
        if self._mine is not None and name in self._mine:
            del self._mine[name]
        elif name in self._live:
            raise SettingWriteError(name)
        else:
            super().__delattr__(name)

    def _names(self) -> dict[str, Any]:
        return {**super()._names(), **self._live, **(self._mine or {})}

    def __copy__(self) -> Any:
        return self._copied(copy.copy(self._config), {**self._live, **self._own, **(self._mine or {})})

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        plugins = copy.deepcopy({**self._own, **(self._mine or {})}, memo)
        return self._copied(copy.deepcopy(self._config, memo), {**self._live, **plugins})


# ---------------------------------------------------------------- the router


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


def needs_router(rollout: Any) -> bool:
    """A plug-in that may talk to the engines itself: a custom generate or rollout function
    (`rollout`: the rollout room's settings)."""
    from vime.modes import DEFAULT_ROLLOUT_FN, FULLY_ASYNC_FN

    return bool(rollout.custom_generate_function_path) or rollout.rollout_function_path not in (
        DEFAULT_ROLLOUT_FN,
        FULLY_ASYNC_FN,
    )
