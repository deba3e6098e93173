"""A rollout function and generate written slime's way that use slime's newer Sample fields and
types: the rollout gives every other group a generate of its own through
`sample.generate_function_path` (as slime's eval config does per data set) and runs the groups
with `generate_and_rm_group`; that generate posts SGLang's /generate for at most two tokens,
feeds the answer's meta_info to the sample (its `prefix_cache_info`), and tags the sample's
`train_metadata`. For tests/unit/compat/test_slime_sample_fields.py, in slime's API, not copied."""

import asyncio

from slime.rollout.base_types import RolloutFnTrainOutput
from slime.rollout.sglang_rollout import GenerateState, generate_and_rm_group
from slime.utils.async_utils import run
from slime.utils.http_utils import post
from slime.utils.types import RolloutBatch, Sample

SHORT = "slime_sample_fields.short_generate"


async def short_generate(args, sample: Sample, sampling_params) -> Sample:
    state = GenerateState(args)
    if not sample.tokens:
        sample.tokens = state.tokenizer(sample.prompt, add_special_tokens=False)["input_ids"]
    url = f"http://{args.sglang_router_ip}:{args.sglang_router_port}/generate"
    payload = {"input_ids": sample.tokens, "sampling_params": {**sampling_params, "max_new_tokens": 2}}
    output = await post(url, {**payload, "return_logprob": True})
    pairs = output["meta_info"]["output_token_logprobs"]
    sample.append_response_tokens(
        args, tokens=[p[1] for p in pairs], log_probs=[p[0] for p in pairs], meta_info=output["meta_info"]
    )
    sample.response = state.tokenizer.decode(sample.response_tokens)
    sample.train_metadata = {"generator": "short"}
    return sample


async def _groups(args, data_source) -> list[list[Sample]]:
    state = GenerateState(args)
    groups = data_source.get_samples(args.rollout_batch_size)
    for group in groups[::2]:
        for sample in group:
            sample.generate_function_path = SHORT
    jobs = [generate_and_rm_group(args, g, sampling_params=state.sampling_params.copy()) for g in groups]
    return list(await asyncio.gather(*jobs))


def summary(groups: list[list[Sample]]) -> RolloutBatch:
    """The rollout's data in slime's batch shape, by key over samples."""
    samples = [s for g in groups for s in g]
    return {"response_lengths": [s.response_length for s in samples], "rewards": [s.reward for s in samples]}


def generate_rollout(args, rollout_id: int, data_source, evaluation: bool = False) -> RolloutFnTrainOutput:
    groups = run(_groups(args, data_source))
    batch = summary(groups)
    return RolloutFnTrainOutput(samples=groups, metrics={"short_share": batch["response_lengths"].count(2) / 16})
