"""A custom generate written after slime's own `sglang_rollout.generate` (the shape users copy
and extend): its check of `args.ci_test`, the prompt's ids (with `load_processor`'s processor,
None for a text model), SGLang's `/generate` through the router (with slime's routing header
when the sample has a `session_id`), the answer's tokens, text and log-probs appended to the
sample by hand, then `sample.update_from_meta_info(args, meta_info)` for the status and weight
version. For
tests/unit/compat/test_slime_sample_methods.py in that API, not copied."""

from slime.rollout.sglang_rollout import GenerateState, _prepare_prompt_ids
from slime.utils.http_utils import post
from slime.utils.processing_utils import load_processor
from slime.utils.types import Sample


async def generate(args, sample: Sample, sampling_params) -> Sample:
    if args.ci_test:
        assert isinstance(sample.prompt, str)
    state = GenerateState(args)
    url = f"http://{args.sglang_router_ip}:{args.sglang_router_port}/generate"
    processor = load_processor(args.hf_checkpoint, trust_remote_code=True)
    sample.tokens = _prepare_prompt_ids(sample, state.tokenizer, processor)
    payload = {"input_ids": sample.tokens, "sampling_params": sampling_params, "return_logprob": True}
    headers = {"X-SMG-Routing-Key": sample.session_id} if sample.session_id else None
    output = await post(url, payload, headers=headers)
    pairs = output["meta_info"].get("output_token_logprobs", [])
    sample.tokens = sample.tokens + [item[1] for item in pairs]
    sample.response_length += len(pairs)
    sample.response += output["text"]
    if sample.rollout_log_probs is None:
        sample.rollout_log_probs = []
    sample.rollout_log_probs += [item[0] for item in pairs]
    sample.update_from_meta_info(args, output["meta_info"])
    return sample
