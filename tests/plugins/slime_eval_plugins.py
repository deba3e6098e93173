"""A custom generate written as slime's plug-ins are, whose answer is fixed: a boxed number with no
reasoning block, which math's reading grades right and slime's deepscaler rule (the last box after
`</think>`) grades wrong. The eval-rule test (tests/test_slime_eval_rule.py) evaluates with it."""

from slime.rollout.vllm_rollout import GenerateState

ANSWER = "2+2 is \\boxed{4}"


async def boxed_answer(args, sample, sampling_params):
    ids = GenerateState(args).tokenizer(ANSWER, add_special_tokens=False)["input_ids"]
    sample.append_response_tokens(
        args, tokens=ids, log_probs=[0.0] * len(ids), text=ANSWER, meta_info={"finish_reason": "stop"}
    )
    return sample
