"""A helper written slime's way for agent plug-ins that train a whole dialogue (tau-bench's
trainable agents build their samples so): the conversation through slime's
`MultiTurnLossMaskGenerator`, the sample's prompt the tokens before the first trained one, its
response everything after, masked by the generator. For
tests/unit/compat/test_slime_mask_utils.py in that API, not copied."""

from slime.utils.mask_utils import MultiTurnLossMaskGenerator
from slime.utils.types import Sample


def sample_from_dialogue(tokenizer, messages: list[dict], loss_mask_type: str = "qwen3") -> Sample:
    generator = MultiTurnLossMaskGenerator(tokenizer, tokenizer_type=loss_mask_type)
    token_ids, loss_mask = generator.get_loss_mask(messages)
    prompt_length = loss_mask.index(1)
    sample = Sample(prompt=messages[0]["content"], tokens=token_ids, status=Sample.Status.COMPLETED)
    sample.loss_mask = loss_mask[prompt_length:]
    sample.response_length = len(token_ids) - prompt_length
    sample.response = "".join(generator.get_text_from_loss_mask(token_ids, loss_mask))
    assert generator.get_response_lengths([sample.loss_mask]) == [sum(sample.loss_mask)]
    return sample
