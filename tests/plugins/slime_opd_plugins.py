"""slime's on-policy distillation plug-ins in the shape of its examples/on_policy_distillation (the
teacher an SGLang server at `--rm-url .../generate`): the reward posts the sample's whole token ids
with `max_new_tokens` 0, `return_logprob` and `logprob_start_len` 0, and hands back the server's
answer; the post-process takes each prompt token's log-prob after the first from
`meta_info.input_token_logprobs`, keeps the response's, stores them as the sample's
`teacher_log_probs` and returns zero rewards. `reward_func_text` is the example's earlier form,
which posts the prompt and response as `text`. For tests/unit/compat/test_slime_opd_teacher.py in
that API, not copied."""

import aiohttp
import torch
from slime.utils.core.types import Sample


async def reward_func(args, sample: Sample, **kwargs) -> dict:
    body = {
        "input_ids": sample.tokens,
        "sampling_params": {"temperature": 0, "max_new_tokens": 0, "skip_special_tokens": False},
        "return_logprob": True,
        "logprob_start_len": 0,
    }
    async with aiohttp.ClientSession() as session, session.post(args.rm_url, json=body) as resp:
        resp.raise_for_status()
        return await resp.json()


async def reward_func_text(args, sample: Sample, **kwargs) -> dict:
    body = {
        "text": sample.prompt + sample.response,
        "sampling_params": {"temperature": 0, "max_new_tokens": 0, "skip_special_tokens": False},
        "return_logprob": True,
        "logprob_start_len": 0,
    }
    async with aiohttp.ClientSession() as session, session.post(args.rm_url, json=body) as resp:
        resp.raise_for_status()
        return await resp.json()


def post_process_rewards(args, samples: list[Sample], **kwargs) -> tuple[list[float], list[float]]:
    for sample in samples:
        answer = sample.get_reward_value(args)
        scored = torch.tensor([item[0] for item in answer["meta_info"]["input_token_logprobs"][1:]])
        sample.teacher_log_probs = scored[-sample.response_length :]
    zeros = [0.0] * len(samples)
    return zeros, zeros
