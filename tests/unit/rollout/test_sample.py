"""A Sample keeps its per-token lists (loss mask, rollout log-probs, weight versions) one per
response token through its own methods, whoever appends or cuts."""

from vime.rollout.types import Sample


def test_appending_and_cutting_keep_every_per_token_list_in_step():
    s = Sample(tokens=[1, 2])
    handed = s.tokens
    s.append_generated([3, 4], [-0.1, -0.2], [0, 0])
    assert s.loss_mask is None and s.response_tokens == [3, 4] and handed == [1, 2]  # a new list
    s.append_generated([5], [0.0], [0], trainable=False)  # a tool's answer
    assert s.loss_mask == [1, 1, 0] and s.rollout_log_probs == [-0.1, -0.2, 0.0] and s.weight_versions == [0, 0, 0]
    s.append_generated([6], [-0.3], [1])
    assert s.loss_mask == [1, 1, 0, 1] and s.response_length == 4 and s.prompt_length == 2
    s.truncate_response(2)
    assert s.tokens == [1, 2, 3, 4] and s.loss_mask == [1, 1] and s.rollout_log_probs == [-0.1, -0.2]
    assert s.weight_versions == [0, 0] and s.response_length == 2
