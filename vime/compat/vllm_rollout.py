"""`vime.rollout.vllm_rollout`: the module vllm-project/vime's scripts name as their rollout function
(`--rollout-function-path vime.rollout.vllm_rollout.generate_rollout`) and its plug-ins import their
helpers from. vime's default rollout is `vime.rollout.generate`; this module hands on its names
and vllm-project/vime's helpers (`vllm_rollout_helpers.py`), so `from vime.rollout.vllm_rollout
import GenerateState, generate` works in a plug-in (docs/plugin-compat.md lists every name)."""

from vime.compat.vllm_rollout_helpers import (
    GenerateState,
    _build_inference_sampling_params,
    _coerce_flat_int_token_ids,
    _inference_generate_tokens_and_logprobs,
    _mm_render_response_to_generate_body,
)
from vime.plugin_args import PluginArgs
from vime.rollout.engine_requests import sampling_params
from vime.rollout.generate import (
    generate,
    generate_fn,
    generate_group,
    generate_rollout,
    generate_samples,
    rollout_metrics,
    score_group,
)
from vime.rollout.types import flatten

__all__ = [
    "GenerateState",
    "PluginArgs",
    "_build_inference_sampling_params",
    "_coerce_flat_int_token_ids",
    "_inference_generate_tokens_and_logprobs",
    "_mm_render_response_to_generate_body",
    "flatten",
    "generate",
    "generate_fn",
    "generate_group",
    "generate_rollout",
    "generate_samples",
    "rollout_metrics",
    "sampling_params",
    "score_group",
]
