"""vllm-project/vime's plug-in helpers, by the names its plug-ins import from
`vime.rollout.vllm_rollout` (docs/plugin-compat.md lists every name).

vllm-project/vime (vLLM's vime, built on slime) has its custom generate functions talk to the
engines themselves: they read `GenerateState(args).tokenizer`, turn the rollout's sampling params
into vLLM's with `_build_inference_sampling_params`, POST token ids to the run's router
(`vime/compat/router.py`) and append what comes back with `Sample.append_response_tokens`.
"""

from __future__ import annotations

import copy
from typing import Any

from vime.rollout.engine_requests import sampling_params


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
