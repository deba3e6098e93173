"""A generate written slime's way for a plug-in that owns its HTTP client set-up: it calls
`slime.utils.http_utils.init_http_client(args)` once, as slime's rollout manager does before any
post, then posts SGLang's /generate with `post`. For tests/unit/compat/test_slime_http_client.py,
in slime's API, not copied."""

from slime.rollout.sglang_rollout import GenerateState
from slime.utils import http_utils
from slime.utils.http_utils import init_http_client, post
from slime.utils.types import Sample

_ready = False


async def generate(args, sample: Sample, sampling_params) -> Sample:
    global _ready
    if not _ready:
        init_http_client(args)
        _ready = True
    assert http_utils._connection_limit == args.sglang_server_concurrency * http_utils.get_rollout_num_engines(args)
    state = GenerateState(args)
    if not sample.tokens:
        sample.tokens = state.tokenizer(sample.prompt, add_special_tokens=False)["input_ids"]
    url = f"http://{args.sglang_router_ip}:{args.sglang_router_port}/generate"
    output = await post(url, {"input_ids": sample.tokens, "sampling_params": sampling_params, "return_logprob": True})
    pairs = output["meta_info"]["output_token_logprobs"]
    sample.append_response_tokens(
        args, tokens=[p[1] for p in pairs], log_probs=[p[0] for p in pairs], meta_info=output["meta_info"]
    )
    sample.response = state.tokenizer.decode(sample.response_tokens)
    return sample
