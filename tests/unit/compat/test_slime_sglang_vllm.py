"""The router's SGLang `/generate` in front of vLLM, without a vLLM server (the main environment
has none; `make test-vllm` runs the server tests): what the vLLM client sends for the sampling
params slime's `GenerateState` hands a plug-in, and the one SGLang option only vime's engine serves."""

import asyncio

import pytest

from vime.backends.client import EngineError
from vime.backends.vllm.client import VLLMClient


def sent_body(params: dict, **kwargs) -> dict:
    """The body the vLLM client would send for one request (read where it would leave)."""
    sent: list[dict] = []

    async def record(route: str, body: dict) -> None:
        sent.append(body)
        raise EngineError("recorded")

    client = VLLMClient("http://127.0.0.1:9")
    client.apost = record
    with pytest.raises(EngineError, match="recorded"):
        asyncio.run(client.generate([1, 2, 3], params, **kwargs))
    return sent[0]


def test_slimes_decoding_options_are_taken_and_not_sent_to_vllm():
    """SGLang's text options (`skip_special_tokens`, `no_stop_trim`, `spaces_between_special_tokens`)
    change how the router decodes, not what is generated: vLLM is asked the rest."""
    from types import SimpleNamespace

    from slime.rollout.sglang_rollout import slime_sampling_params

    args = SimpleNamespace(
        rollout_temperature=0.7, rollout_top_p=0.9, rollout_top_k=-1, rollout_max_response_len=5,
        rollout_stop=["</a>"], rollout_stop_token_ids=None,
    )  # fmt: skip
    body = sent_body(slime_sampling_params(args))
    params = body["sampling_params"]
    assert not {"skip_special_tokens", "no_stop_trim", "spaces_between_special_tokens"} & set(params)
    assert params["max_tokens"] == 5 and params["temperature"] == 0.7 and params["stop"] == ["</a>"]


def test_prompt_log_probs_are_refused_in_front_of_vllm_in_one_line():
    with pytest.raises(ValueError, match="logprob_start_len: .*vime's engine, not vLLM"):
        asyncio.run(VLLMClient("http://127.0.0.1:9").generate([1, 2, 3], {"max_new_tokens": 1}, logprob_start_len=0))
