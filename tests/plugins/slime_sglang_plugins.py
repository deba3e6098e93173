"""Plug-ins written slime's way (its examples' retool, search-r1, multi_agent, geo3k multi-turn), for
tests/test_slime_sglang_api.py: they import slime's names (`slime.rollout.sglang_rollout`,
`slime.utils.http_utils`, `slime.utils.types`), post SGLang's native `/generate` to
`http://{args.sglang_router_ip}:{args.sglang_router_port}`, with `input_ids` or `text`, one
prompt or a batch, and read `meta_info.output_token_logprobs` and `meta_info.finish_reason` as
slime's examples do."""

from copy import deepcopy

from slime.rollout.rm_hub import batched_async_rm
from slime.rollout.sglang_rollout import GenerateState
from slime.utils.http_utils import post
from slime.utils.processing_utils import build_processor_kwargs
from slime.utils.types import Sample

OBSERVATION = " ok "


def _url(args) -> str:
    return f"http://{args.sglang_router_ip}:{args.sglang_router_port}/generate"


async def generate_with_tool(args, sample: Sample, sampling_params) -> Sample:
    """retool's way: the prompt's ids, a turn by `input_ids`, a tool's answer (not trained), a
    second turn; each turn's tokens and log-probs from `output_token_logprobs`."""
    state = GenerateState(args)
    prompt_ids = state.tokenizer(sample.prompt, add_special_tokens=False)["input_ids"]
    sample.tokens = list(prompt_ids)
    sample.rollout_log_probs, sample.loss_mask, sample.response_length = None, [], 0
    for turn in range(2):
        payload = {"input_ids": sample.tokens, "sampling_params": sampling_params, "return_logprob": True}
        output = await post(_url(args), payload)
        if output["meta_info"]["finish_reason"]["type"] == "abort":
            sample.status = Sample.Status.ABORTED
            return sample
        ids = [item[1] for item in output["meta_info"]["output_token_logprobs"]]
        log_probs = [item[0] for item in output["meta_info"]["output_token_logprobs"]]
        sample.append_response_tokens(
            args, tokens=ids, log_probs=log_probs, trainable=True, meta_info=output["meta_info"], text=output["text"]
        )
        if turn == 0:
            obs = state.tokenizer(OBSERVATION, add_special_tokens=False)["input_ids"]
            sample.append_response_tokens(args, tokens=obs, trainable=False, text=OBSERVATION)
    return sample


async def generate_with_a_pool_of_seven(args, sample: Sample, sampling_params) -> Sample:
    """retool's way, in a run given `--sglang-server-concurrency 7`: the value its args carry."""
    assert args.sglang_server_concurrency == 7, args.sglang_server_concurrency
    return await generate_with_tool(args, sample, sampling_params)


async def generate_with_search(args, sample: Sample, sampling_params) -> Sample:
    """search-r1's way: each turn posts the text so far (`text`), keeps `output["text"]` and takes
    the tokens and log-probs from `output_token_logprobs`; the observation is tokenized. Its
    connection pool sized from args as strands-sglang's `get_client_from_slime_args` sizes it."""
    pool = int(args.sglang_server_concurrency * args.rollout_num_gpus // args.rollout_num_gpus_per_engine)
    assert pool == 512, pool  # slime's default concurrency, one engine of one device
    state = GenerateState(args)
    prompt_ids = state.tokenizer(sample.prompt, add_special_tokens=False)["input_ids"]
    sample.tokens, sample.loss_mask = list(prompt_ids), []
    response = ""
    for turn in range(2):
        payload = {"text": sample.prompt + response, "sampling_params": sampling_params, "return_logprob": True}
        output = await post(_url(args), payload)
        if output["meta_info"]["finish_reason"]["type"] == "abort":
            sample.status = Sample.Status.ABORTED
            return sample
        response += output["text"]
        ids = [item[1] for item in output["meta_info"]["output_token_logprobs"]]
        log_probs = [item[0] for item in output["meta_info"]["output_token_logprobs"]]
        sample.append_response_tokens(args, tokens=ids, log_probs=log_probs, meta_info=output["meta_info"])
        if output["meta_info"]["finish_reason"]["type"] == "length" and turn == 1:
            break
        if turn == 0:
            obs = state.tokenizer(OBSERVATION, add_special_tokens=False)["input_ids"]
            response += OBSERVATION
            sample.append_response_tokens(args, tokens=obs, trainable=False)
    sample.response = response
    return sample


async def generate_best_of_two(args, sample: Sample, sampling_params) -> Sample:
    """A batch: the prompt twice in one request (`input_ids` as a list of lists, one sampling
    params per prompt, a rid prefix), the answer with the higher log-prob kept."""
    state = GenerateState(args)
    ids = state.tokenizer(sample.prompt, add_special_tokens=False)["input_ids"]
    payload = {
        "input_ids": [ids, ids],
        "sampling_params": [dict(sampling_params, sampling_seed=s) for s in (sample.index, sample.index + 7)],
        "return_logprob": True,
        "rid": f"best-{sample.index}-{sample.group_index}-{id(sample)}",
    }
    outputs = await post(_url(args), payload)
    assert isinstance(outputs, list) and len(outputs) == 2, outputs
    best = max(outputs, key=lambda o: sum(item[0] for item in o["meta_info"]["output_token_logprobs"]))
    sample.tokens = list(ids)
    pairs = best["meta_info"]["output_token_logprobs"]
    sample.append_response_tokens(
        args, tokens=[p[1] for p in pairs], log_probs=[p[0] for p in pairs], meta_info=best["meta_info"]
    )
    return sample


async def generate_env_turns(args, sample: Sample, sampling_params) -> Sample:
    """geo3k multi-turn's way: the processor if the state has one (vime's has none: the tokenizer),
    `sample.multimodal_inputs` read for images, a budget of new tokens, the env's observation
    appended untrained with log-probs of 0.0 passed along."""
    state = GenerateState(args)
    if state.processor:
        ids = state.processor(text=sample.prompt, **build_processor_kwargs(sample.multimodal_inputs))["input_ids"][0]
    else:
        ids = state.tokenizer.encode(sample.prompt, add_special_tokens=False)
    assert not (sample.multimodal_inputs and sample.multimodal_inputs.get("images"))
    sample.tokens, sample.loss_mask, sample.rollout_log_probs = list(ids), [], []
    budget = sampling_params["max_new_tokens"]
    for turn in range(2):
        params = dict(sampling_params, max_new_tokens=max(1, budget // 2) if turn == 0 else budget)
        output = await post(_url(args), {"input_ids": sample.tokens, "sampling_params": params, "return_logprob": True})
        pairs = output["meta_info"]["output_token_logprobs"]
        sample.append_response_tokens(
            args, tokens=[p[1] for p in pairs], log_probs=[p[0] for p in pairs], meta_info=output["meta_info"]
        )
        budget -= len(pairs)
        if turn == 1 or budget <= 0 or output["meta_info"]["finish_reason"]["type"] == "abort":
            break
        obs = state.tokenizer.encode(OBSERVATION, add_special_tokens=False)
        sample.append_response_tokens(args, tokens=obs, log_probs=[0.0] * len(obs), trainable=False)
    sample.response = state.tokenizer.decode(sample.tokens[len(ids) :])
    sample.multimodal_train_inputs = None
    return sample


async def _agent(args, prompt: str) -> None:
    """multi_agent's generate_response: its own try/except, the sample built by hand from the
    answer's token ids (the log-probs dropped), kept in `args.results`."""
    try:
        sample = deepcopy(args.sample)
        sample.prompt = prompt
        ids = args.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        params = deepcopy(args.sampling_params)
        output = await post(_url(args), {"input_ids": ids, "sampling_params": params, "return_logprob": True})
        new = [item[1] for item in output["meta_info"]["output_token_logprobs"]]
        sample.tokens = ids + new
        sample.response_length = len(new)
        sample.response = output["text"]
        match output["meta_info"]["finish_reason"]["type"]:
            case "length":
                sample.status = Sample.Status.TRUNCATED
            case "stop":
                sample.status = Sample.Status.COMPLETED
        args.results.append(sample)
    except Exception as e:
        print(f"Error generating response: {e}")


async def generate_agents(args, sample: Sample, sampling_params, evaluation=False) -> list[Sample]:
    """multi_agent's generate: its state written on `args`, a deep copy, three agents."""
    args.sampling_params = sampling_params
    args.tokenizer = GenerateState(args).tokenizer
    args = deepcopy(args)
    args.sample, args.results = sample, []
    for name in ("solver", "rewriter", "selector"):
        await _agent(args, f"{name}: {sample.prompt}")
    rewards = await batched_async_rm(args, args.results)
    for s, r in zip(args.results, rewards, strict=True):
        s.reward = r
    return args.results


async def generate_agents_refused(args, sample: Sample, sampling_params, evaluation=False) -> list[Sample]:
    """multi_agent's generate whose every request the router refuses (a sampling param vime's
    engines cannot honour), hidden by the agents' own try/except: it returns no sample."""
    return await generate_agents(args, sample, dict(sampling_params, min_new_tokens=2), evaluation)


async def generate_agents_broken(args, sample: Sample, sampling_params, evaluation=False) -> list[Sample]:
    """multi_agent's generate failing in its own code (no tokenizer where it looks for one)."""
    args.sampling_params = sampling_params
    args = deepcopy(args)
    args.sample, args.results, args.tokenizer = sample, [], None
    await _agent(args, sample.prompt)
    return args.results


def response_parity(args, sample: Sample) -> float:
    """A reward that varies from sample to sample, so the weights move."""
    return float(sample.response_tokens[0] % 2) if sample.response_length else 0.0
