"""Plug-ins written vllm-project/vime's way (its examples/multi_agent, retool, search-r1), for
tests/unit/compat/test_plugin_compat.py: they import its names, talk to the engines through
`args.vllm_router_ip/port`, build their samples with `append_response_tokens` and
`Sample.Status`, return several samples per call, and read dict labels."""

from copy import deepcopy

from vime.rollout.rm_hub import batched_async_rm
from vime.rollout.vllm_rollout import (
    GenerateState,
    _build_inference_sampling_params,
    _inference_generate_tokens_and_logprobs,
)
from vime.utils.http_utils import post
from vime.utils.misc import load_function
from vime.utils.types import Sample

TOOL_ANSWER = " ok "


async def _turn(args, sample: Sample, ids: list[int], sampling_params: dict) -> dict:
    url = f"http://{args.vllm_router_ip}:{args.vllm_router_port}/inference/v1/generate"
    payload = {
        "model": args.hf_checkpoint,
        "token_ids": ids,
        "sampling_params": _build_inference_sampling_params(sampling_params),
    }
    return (await post(url, payload))["choices"][0]


async def generate_two_agents(args, sample: Sample, sampling_params) -> list[Sample]:
    """A solver turn, a tool answer (not trained) and a second turn in one sample; a checker
    turn in another; both scored by the run's reward through its batched_async_rm."""
    args = deepcopy(args)  # as multi_agent's run_agent_system does
    state = GenerateState(args)
    solver, checker = deepcopy(sample), deepcopy(sample)
    for s in (solver, checker):
        s.tokens = state.tokenizer(s.prompt, add_special_tokens=False)["input_ids"]
    choice = await _turn(args, solver, solver.tokens, sampling_params)
    ids, lps = _inference_generate_tokens_and_logprobs(choice)
    solver.append_response_tokens(args, tokens=ids, log_probs=lps, meta_info={"finish_reason": choice["finish_reason"]})
    tool = state.tokenizer(TOOL_ANSWER, add_special_tokens=False)["input_ids"]
    solver.append_response_tokens(args, tokens=tool, trainable=False, text=TOOL_ANSWER)
    choice = await _turn(args, solver, solver.tokens, sampling_params)
    ids, lps = _inference_generate_tokens_and_logprobs(choice)
    solver.append_response_tokens(args, tokens=ids, log_probs=lps, meta_info=choice, text=state.tokenizer.decode(ids))
    choice = await _turn(args, checker, checker.tokens, sampling_params)
    ids, lps = _inference_generate_tokens_and_logprobs(choice)
    checker.append_response_tokens(args, tokens=ids, log_probs=lps, meta_info=choice, text=state.tokenizer.decode(ids))
    for s in (solver, checker):
        assert s.status in (Sample.Status.COMPLETED, Sample.Status.TRUNCATED), s.status
    rewards = await batched_async_rm(args, [solver, checker])
    for s, r in zip((solver, checker), rewards):
        s.reward = r
    return [solver, checker]


def first_token_parity(args, sample: Sample) -> float:
    """Varies from sample to sample (so the weights move); refuses a label that is not the
    data's dict, as search-r1's reward reads `sample.label["ground_truth"]`."""
    if not isinstance(sample.label, dict):
        raise TypeError(f"label is {type(sample.label).__name__}, not the data's dict")
    assert sample.label["ground_truth"]["target"]
    return float(sample.response_tokens[0] % 2) if sample.response_length else 0.0


def loads_itself(args, sample: Sample) -> float:
    """vime.utils.misc.load_function, as multi_agent loads its agent system."""
    return load_function("upstream_plugins.first_token_parity")(args, sample)
