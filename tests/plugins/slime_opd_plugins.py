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


async def _score(url: str, prompt: dict) -> dict:
    """The teacher's log-prob of every token of `prompt` (ids or text), nothing generated."""
    body = {
        **prompt,
        "sampling_params": {"temperature": 0, "max_new_tokens": 0, "skip_special_tokens": False},
        "return_logprob": True,
        "logprob_start_len": 0,
    }
    async with aiohttp.ClientSession() as session, session.post(url, json=body) as resp:
        resp.raise_for_status()
        return await resp.json()


async def reward_func(args, sample: Sample, **kwargs) -> dict:
    return await _score(args.rm_url, {"input_ids": sample.tokens})


async def reward_func_text(args, sample: Sample, **kwargs) -> dict:
    """The example's earlier form: the prompt and response posted as text."""
    return await _score(args.rm_url, {"text": sample.prompt + sample.response})


def post_process_rewards(args, samples: list[Sample], **kwargs) -> tuple[list[float], list[float]]:
    for sample in samples:
        answer = sample.get_reward_value(args)
        scored = torch.tensor([item[0] for item in answer["meta_info"]["input_token_logprobs"][1:]])
        sample.teacher_log_probs = scored[-sample.response_length :]
    zeros = [0.0] * len(samples)
    return zeros, zeros
