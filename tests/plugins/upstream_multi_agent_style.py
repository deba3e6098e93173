"""A custom generate written the way vllm-project/vime's multi_agent example writes its own, for
tests/e2e/test_upstream_script_examples.py (which puts it where the example's run script looks:
`examples.multi_agent.rollout_with_multi_agents` under SEED_EXAMPLE_DIR's parent's parent).

`generate_with_agents` does what multi_agent's generate does to vime: it stores its state on
`args` itself before copying it, asks the router for each agent's answer, builds each sample by
hand from the token ids (dropping the log-probs the router sent), scores them with its
`batched_async_rm`, scales the rewards by the team's outcome and returns one sample per agent."""

from copy import deepcopy

from vime.rollout.rm_hub import batched_async_rm
from vime.rollout.vllm_rollout import _build_inference_sampling_params, _inference_generate_tokens_and_logprobs
from vime.utils.http_utils import post
from vime.utils.types import Sample

AGENTS = ("solver", "rewriter", "selector")
TEAM_WEIGHTS = {"right": 1.2, "wrong": 0.8}


async def _agent(args, prompt: str) -> Sample:
    sample = deepcopy(args.sample)
    sample.prompt = prompt
    ids = args.tokenizer(prompt, add_special_tokens=False)["input_ids"]
    params = dict(args.sampling_params, max_new_tokens=min(args.sampling_params["max_new_tokens"], 6))
    url = f"http://{args.vllm_router_ip}:{args.vllm_router_port}/inference/v1/generate"
    out = await post(url, {"token_ids": ids, "sampling_params": _build_inference_sampling_params(params)})
    choice = out["choices"][0]
    new, _ = _inference_generate_tokens_and_logprobs(choice)  # the log-probs dropped, as multi_agent does
    sample.tokens = ids + new
    sample.response_length = len(new)
    sample.response = args.tokenizer.decode(new)
    sample.status = Sample.Status.TRUNCATED if choice["finish_reason"] == "length" else Sample.Status.COMPLETED
    return sample


async def run_team(args, sample: Sample) -> list[Sample]:
    args = deepcopy(args)  # as run_agent_system copies the args its caller changed
    args.sample = sample
    team = []
    for name in AGENTS:
        team.append(await _agent(args, f"{name}: {sample.prompt}"))
    rewards = await batched_async_rm(args, team)
    outcome = "right" if rewards[-1] > 0 else "wrong"
    for s, r in zip(team, rewards, strict=True):
        s.reward = r * args.team_weights[outcome] + 0.1 * (s.tokens[-1] % 3)  # spread, so GRPO has a signal
    return team


async def generate_with_agents(args, sample: Sample, sampling_params, evaluation=False) -> list[Sample]:
    from transformers import AutoTokenizer

    args.sampling_params = sampling_params  # on the run's args, as vllm-project/vime's generate does
    args.tokenizer = AutoTokenizer.from_pretrained(args.hf_checkpoint)
    args.team_weights = TEAM_WEIGHTS
    return await run_team(args, sample)
