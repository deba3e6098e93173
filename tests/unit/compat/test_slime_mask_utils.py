"""`slime.utils.mask_utils` on vime: agent plug-ins build the tokens and loss mask of a dialogue
with slime's `MultiTurnLossMaskGenerator`, which gives the masks vime's SFT path trains on
(`LossMasks`, slime's rules), under slime's names (tests/plugins/slime_mask_plugins.py)."""

from __future__ import annotations

import pytest
from slime_mask_plugins import sample_from_dialogue

from unit.compat.test_slime_sft import THINKING, qwen3_like  # noqa: F401 (qwen3_like: a fixture)
from vime.rollout.loss_masks import LossMasks


@pytest.mark.parametrize("rule", ["qwen", "qwen3", "qwen3_5"])
def test_a_plugins_dialogue_sample_has_the_tokens_and_mask_vimes_sft_trains(qwen3_like, rule):  # noqa: F811
    sample = sample_from_dialogue(qwen3_like, THINKING, rule)
    ids, mask = LossMasks(qwen3_like, rule).encode(THINKING)
    assert sample.tokens == ids and sample.loss_mask == mask[len(ids) - sample.response_length :]
    assert sample.loss_mask[0] == 1 and sample.response.endswith("4<|im_end|>\n")


def test_the_generator_measures_the_template_as_slime_does(qwen3_like):  # noqa: F811
    from slime.utils.mask_utils import MultiTurnLossMaskGenerator, get_response_lengths

    generator = MultiTurnLossMaskGenerator(qwen3_like, "qwen3")
    # ChatML without a default system prompt: nothing before a message; the header is "<|im_start|>assistant\n"
    assert generator.system_message_length == 0
    assert generator.gen_token_length == len(qwen3_like("<|im_start|>assistant\n")["input_ids"])
    assert get_response_lengths([[0, 1, 1], [0, 0]]) == [2, 0]
    with pytest.raises(ValueError, match="Unsupported tokenizer type: llama"):
        MultiTurnLossMaskGenerator(qwen3_like, "llama")
