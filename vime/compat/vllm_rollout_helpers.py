"""vllm-project/vime's plug-in helpers, by the names its plug-ins import from
`vime.rollout.vllm_rollout` (docs/plugin-compat.md lists every name).

vllm-project/vime (vLLM's vime, built on slime) has its custom generate functions talk to the
engines themselves: they read `GenerateState(args).tokenizer`, turn the rollout's sampling params
into vLLM's with `_build_inference_sampling_params`, POST token ids to the run's router
(`vime/compat/router.py`) and append what comes back with `Sample.append_response_tokens`. Its
rollout functions of their own (examples/fully_async) generate and score whole groups with
`generate_and_rm_group`, on an event loop of their own.
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Coroutine
from typing import Any, TypeVar

from vime.rollout import async_loop
from vime.rollout.engine_requests import sampling_params
from vime.rollout.generate import generate_fn, generate_samples, score_group
from vime.rollout.rewards import score_samples
from vime.rollout.runtime import runtime_of
from vime.rollout.types import Sample, Status

T = TypeVar("T")


class GenerateState:
    """What vllm-project/vime's plug-ins read from `GenerateState(args)`: `tokenizer` (the run's),
    `processor` (None: vime rolls out text), `sampling_params` (the rollout's, in vime's
    protocol keys) and `args`. One per model per process, as vllm-project/vime's is a singleton: a
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
    asking for each token's log-prob: vllm-project/vime's helper of this name."""
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
    """Token ids as a flat list of ints: vllm-project/vime's helper, for a render answer's `token_ids`
    (one prompt given as a list of one list is taken too). Anything else is a ValueError naming it."""
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], list):
        value = value[0]
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise ValueError(f"token ids must be a flat list of integers, got {type(value).__name__}")
    return [int(t) for t in value]


def _mm_render_response_to_generate_body(render_data: Any, model: str) -> dict[str, Any]:
    """A `/v1/chat/completions/render` answer as the body of a `/inference/v1/generate` request
    (without its sampling_params): vllm-project/vime's helper. Takes both shapes vLLM answers, a dict
    with `token_ids` and `[conversation, engine_prompts]`."""
    if isinstance(render_data, dict) and "token_ids" in render_data:
        return {**copy.deepcopy(render_data), "model": render_data.get("model") or model}
    if isinstance(render_data, list) and len(render_data) >= 2 and isinstance(render_data[1], list) and render_data[1]:
        prompt = render_data[1][0]
        if isinstance(prompt, dict):
            ids = prompt.get("prompt_token_ids") or prompt.get("token_ids")
            return {"token_ids": _coerce_flat_int_token_ids(ids), "model": model}
    raise ValueError("a chat render answer must be {token_ids: [...]} or [conversation, [{prompt_token_ids: [...]}]]")


def get_model_url(args: Any, model_name: str, endpoint: str = "/inference/v1/generate") -> str:
    """The router's URL of `endpoint` for a named model. vime serves one model, so every name is
    the run's router (vllm-project/vime falls back to it too for a name it does not know)."""
    return f"http://{args.vllm_router_ip}:{args.vllm_router_port}{endpoint}"


def _prepare_prompt_ids(sample: Sample, tokenizer: Any, processor: Any = None) -> list[int]:
    """The ids a sample's generation starts from: its tokens when it has them, else its prompt
    tokenized (a chat prompt through the tokenizer's template). `processor` is for images, which
    vime does not roll out."""
    if sample.tokens:
        return list(sample.tokens)
    prompt = sample.prompt
    if not isinstance(prompt, str):
        prompt = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    return list(tokenizer.encode(prompt, add_special_tokens=False))


async def generate_and_rm(
    args: Any, sample: Sample, sampling_params: dict[str, Any], evaluation: bool = False
) -> Sample | list[Sample]:
    """One sample generated by the run's generate (--custom-generate-function-path's, when given)
    and scored by the run's reward, unless its generate set one; several samples when the
    generate returns several."""

    async def one() -> Sample | list[Sample]:
        out = await generate_samples(args, [sample], sampling_params, generate_fn(args, evaluation))
        await score_samples(args, [s for s in out if s.reward is None])
        return out[0] if len(out) == 1 else out

    return await on_rollout_loop(one())


async def generate_and_rm_group(
    args: Any, group: list[Sample], sampling_params: dict[str, Any], evaluation: bool = False
) -> list[Sample]:
    """A group generated and scored as vime's rollout does it (`generate_samples`, then
    `score_group`: --group-rm scores it whole). Awaitable from any event loop: the work runs on
    vime's rollout loop, where the engines' clients live (vllm-project/vime's fully-async worker
    awaits it from a loop of its own thread). Once the run is over the group comes back aborted,
    as vllm-project/vime's does after its abort: a worker of the plug-in's own that outlives the
    run gets its groups back instead of errors from engines that are gone."""
    runtime = runtime_of(args)

    async def whole() -> list[Sample]:
        out = await generate_samples(args, group, sampling_params, generate_fn(args, evaluation))
        await score_group(args, out)
        return out

    if not runtime.closed:
        try:
            return await on_rollout_loop(whole())
        except (asyncio.CancelledError, Exception):
            if not runtime.closed:
                raise
    for s in group:
        s.status = Status.ABORTED
    return group


async def on_rollout_loop(coro: Coroutine[Any, Any, T]) -> T:
    """`coro` awaited on vime's rollout loop: here when this is that loop, else submitted to it."""
    if asyncio.get_running_loop() is async_loop.get_loop():
        return await coro
    return await asyncio.wrap_future(async_loop.submit(coro))
