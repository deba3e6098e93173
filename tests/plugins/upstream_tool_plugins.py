"""Plug-ins written the way vllm-project/vime's tool examples are (retool, search-r1, tau-bench),
for tests/e2e/test_upstream_tool_examples.py. They reach vime through the same names and paths those
examples do: `slime.*` imports (search-r1's), a tool template of their own, the router's
generate and render routes, tool answers appended as tokens that are not trained, retool's
loss-mask alias written back at the end, search-r1's dict labels, DAPO's `compute_score`, and
tau-bench's agent loop (settings kept on `args`, a sample whose reward the generate sets).

The search engine is examples/search-r1/retrieval_standin.py at $VIME_TEST_SEARCH_URL; the
tau-bench user and environment are the scripted `ToyShop` below.
"""

from __future__ import annotations

import json
import os

from slime.rollout.vllm_rollout import (  # search-r1 imports the old package's names
    GenerateState,
    _build_inference_sampling_params,
    _inference_generate_tokens_and_logprobs,
)
from slime.utils.http_utils import post

from vime.rollout.rm_hub.math_dapo_utils import compute_score
from vime.rollout.vllm_rollout import _coerce_flat_int_token_ids, _mm_render_response_to_generate_body
from vime.utils.types import Sample

TEMPLATE = "<|im_start|>system\nYou may search.<|im_end|>\n<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n"


async def _turn(args, ids: list[int], params: dict) -> dict:
    url = f"http://{args.vllm_router_ip}:{args.vllm_router_port}/inference/v1/generate"
    body = {"model": args.hf_checkpoint, "token_ids": ids, "sampling_params": _build_inference_sampling_params(params)}
    return (await post(url, body))["choices"][0]


async def search_then_answer(args, sample: Sample, sampling_params) -> Sample:
    """Two model turns around one search: the question's first word is searched (whatever the
    model wrote, so every sample calls the tool), and the engine's answer comes back between
    <information> tags as tokens the model did not write."""
    assert not args.partial_rollout
    assert not sample.tokens, "a fresh sample comes without tokens, as vllm-project/vime hands it over"
    state = GenerateState(args)
    prompt_ids = state.tokenizer(TEMPLATE.format(q=sample.prompt), add_special_tokens=False)["input_ids"]
    sample.tokens, sample.loss_mask, sample.response = list(prompt_ids), [], ""
    loss_masks = sample.loss_mask  # retool keeps this alias and writes it back at the end
    choice = await _turn(args, sample.tokens, sampling_params)
    ids, lps = _inference_generate_tokens_and_logprobs(choice)
    sample.append_response_tokens(args, tokens=ids, log_probs=lps, meta_info={"finish_reason": {"type": "stop"}})
    hits = await post(os.environ["VIME_TEST_SEARCH_URL"], {"queries": [sample.prompt], "topk": 1})
    info = f"\n<information>{hits['result'][0][0]['contents']}</information>\n"
    info_ids = state.tokenizer(info, add_special_tokens=False)["input_ids"]
    sample.append_response_tokens(args, tokens=info_ids, trainable=False)
    choice = await _turn(args, sample.tokens, sampling_params)
    ids, lps = _inference_generate_tokens_and_logprobs(choice)
    sample.append_response_tokens(args, tokens=ids, log_probs=lps, meta_info=choice)
    sample.loss_mask = loss_masks
    sample.response = state.tokenizer.decode(sample.response_tokens)
    sample.tool_call_count = 1  # an attribute of the plug-in's own, read by its reward
    sample.metadata["information_tokens"] = len(info_ids)
    return sample


def em_reward(args, sample: Sample) -> dict:
    """search-r1's label (a dict) and retool's DAPO verifier, plus a term that differs from sample
    to sample (so the weights move); `--reward-key score` trains on it."""
    targets = sample.label["ground_truth"]["target"]
    result = compute_score(sample.response, targets[0], strict_box_verify=True)
    result["score"] += 0.5 * (sample.response_tokens[0] % 2) + 0.1 * sample.tool_call_count
    return result


# ---------------------------------------------------------------- tau-bench's agent loop


class ToyShop:
    """A scripted stand-in for tau-bench's environment and its simulated user: the user asks
    for an order's status, one tool (`get_order`) answers it, and the task is solved when the
    agent has called it; every turn of the agent counts."""

    tools_info = [{"type": "function", "function": {"name": "get_order", "parameters": {"type": "object"}}}]

    def __init__(self, task: int) -> None:
        self.task, self.turns, self.called = task, 0, False

    def reset(self) -> str:
        return f"Where is order #{self.task}?"

    def step(self, text: str) -> tuple[str, str, bool]:
        """(role, observation, done) after the agent's `text`: any turn of an agent that has
        called the tool ends the episode; the tool is called on the agent's first turn."""
        self.turns += 1
        if not self.called:
            self.called = True
            return "tool", json.dumps({"order": self.task, "status": "shipped"}), False
        return "user", "Thanks!", True


async def tau_agent(args, sample: Sample, sampling_params) -> Sample:
    """tau-bench's TrainableTauBenchAgent reduced to its API paths: its settings on `args`, the
    conversation rendered by the router's chat route, generate with a repetition penalty, each
    environment message appended untrained, and the reward set by the generate itself."""
    if getattr(args, "tau_max_turns", None) is None:
        args.tau_max_turns = 3  # tau-bench keeps max_turns and its config on args
    env = ToyShop(int(sample.prompt))
    base = f"http://{args.vllm_router_ip}:{args.vllm_router_port}"
    messages = [{"role": "system", "content": "You run a shop."}, {"role": "user", "content": env.reset()}]
    sample.tokens = list(sample.tokens) if sample.tokens else []
    params = dict(_build_inference_sampling_params(sampling_params), repetition_penalty=1.1)
    state = GenerateState(args)
    for _ in range(args.tau_max_turns):
        rendered = await post(f"{base}/v1/chat/completions/render", {"model": args.hf_checkpoint, "messages": messages})
        body = _mm_render_response_to_generate_body(rendered, args.hf_checkpoint)
        ids = _coerce_flat_int_token_ids(body["token_ids"])
        if not sample.tokens:
            sample.tokens = list(ids)  # the first render is the prompt
        elif ids[: len(sample.tokens)] == sample.tokens:  # what the template added since: not trained
            sample.append_response_tokens(args, tokens=ids[len(sample.tokens) :], trainable=False)
        choice = (await post(f"{base}/inference/v1/generate", {**body, "sampling_params": params}))["choices"][0]
        out, lps = _inference_generate_tokens_and_logprobs(choice)
        sample.append_response_tokens(args, tokens=out, log_probs=lps, meta_info=choice)
        text = state.tokenizer.decode(out)
        messages.append({"role": "assistant", "content": text})
        role, obs, done = env.step(text)
        if done:
            break
        messages.append({"role": role, "content": obs})
    sample.response = state.tokenizer.decode(sample.response_tokens)
    sample.reward = 1.0 if env.called else 0.0
    sample.reward += 0.1 * (sample.response_tokens[0] % 2)  # differs within a group: GRPO has a signal
    sample.metadata["agent_turns"] = env.turns
    return sample


async def tau_standin_agent(args, sample: Sample, sampling_params) -> Sample:
    """The same loop against examples/tau-bench/standin's `tau_bench` package (on PYTHONPATH):
    `get_env`, `reset(task_index=...)`, `step(Action)` and the env's reward at ###STOP###. A tiny
    random model writes no tool calls, so the first action is chosen by the model's first token:
    even, the task's own action (the cancellation); odd, a look-up that changes nothing. The
    env's reward from the final database then tells the two apart."""
    from tau_bench.envs import get_env
    from tau_bench.types import RESPOND_ACTION_NAME, Action

    task_index = int(sample.prompt)
    env = get_env("retail", "llm", "scripted", "train", task_index=task_index)
    messages = [{"role": "system", "content": env.wiki}, {"role": "user", "content": env.reset(task_index).observation}]
    base = f"http://{args.vllm_router_ip}:{args.vllm_router_port}"
    params = dict(_build_inference_sampling_params(sampling_params), repetition_penalty=1.1)
    state, order = GenerateState(args), env.task.actions[0].kwargs["order_id"]
    sample.tokens, res = list(sample.tokens) if sample.tokens else [], None
    for turn in range(4):
        rendered = await post(f"{base}/v1/chat/completions/render", {"model": args.hf_checkpoint, "messages": messages})
        ids = _coerce_flat_int_token_ids(
            _mm_render_response_to_generate_body(rendered, args.hf_checkpoint)["token_ids"]
        )
        if not sample.tokens:
            sample.tokens = list(ids)
        elif ids[: len(sample.tokens)] == sample.tokens:  # the env's message, as the template wraps it: untrained
            sample.append_response_tokens(args, tokens=ids[len(sample.tokens) :], trainable=False)
        body = {"model": args.hf_checkpoint, "token_ids": ids, "sampling_params": params}
        out, lps = _inference_generate_tokens_and_logprobs(
            (await post(f"{base}/inference/v1/generate", body))["choices"][0]
        )
        sample.append_response_tokens(args, tokens=out, log_probs=lps, meta_info={"finish_reason": {"type": "stop"}})
        text = state.tokenizer.decode(out)
        if turn > 0:
            action = Action(name=RESPOND_ACTION_NAME, kwargs={"content": text})
        elif out and out[0] % 2 == 0:
            action = env.task.actions[0]
        else:
            action = Action(name="get_order_details", kwargs={"order_id": order})
        res = env.step(action)
        if res.done:
            break
        messages += [
            {"role": "assistant", "content": text},
            {"role": "user" if turn else "tool", "content": res.observation},
        ]
        if turn == 0:
            sample.metadata["tool_observation"] = res.observation
    sample.response = state.tokenizer.decode(sample.response_tokens)
    sample.reward = res.reward if res is not None and res.done else 0.0
    sample.metadata.update(done=bool(res and res.done), cancelled=env.data["orders"][order]["status"] == "cancelled")
    return sample
