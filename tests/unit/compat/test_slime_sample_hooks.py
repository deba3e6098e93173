"""`slime.rollout.sample_hooks`: slime's per-sample hooks (`apply_rollout_sample_hooks`,
`set_current_rollout_id`), run over a Sample or nested lists of them, each hook given only the
keywords it takes; slime's `generate_and_rm` runs them before the reward, so a rollout that
names them trains on the hooked samples (tests/plugins/slime_sample_hooks.py)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from slime.rollout import sample_hooks
from slime.rollout.sample_hooks import apply_rollout_sample_hooks, set_current_rollout_id
from slime.utils.types import Sample

from unit.compat.tiny_runs import tiny_run


def test_hooks_keep_the_shape_and_get_only_the_keywords_they_take(monkeypatch):
    monkeypatch.setattr(sample_hooks, "_current_rollout_id", None)
    set_current_rollout_id(3)
    args = SimpleNamespace(
        rollout_sample_hook_path=["slime_sample_hooks.note_rollout", "slime_sample_hooks.note_length"]
    )
    value = [[Sample(index=0, response_length=2)], Sample(index=1)]
    out = asyncio.run(apply_rollout_sample_hooks(args, value, evaluation=True, unknown="x"))
    assert isinstance(out[0], list) and out[0][0].metadata == {
        "hooked_rollout": 3,
        "hooked_length": 2,
        "hooked_evaluation": True,
    }
    assert out[1].metadata["hooked_rollout"] == 3


def test_no_hooks_return_the_value_itself():
    sample = Sample()
    assert asyncio.run(apply_rollout_sample_hooks(SimpleNamespace(), sample)) is sample


def test_a_hook_returning_something_else_or_a_value_of_no_samples_is_named():
    args = SimpleNamespace(rollout_sample_hook_path=["operator.is_"])
    with pytest.raises(TypeError, match="'operator.is_' returned bool"):
        asyncio.run(apply_rollout_sample_hooks(args, Sample()))
    with pytest.raises(TypeError, match="not dict"):
        asyncio.run(apply_rollout_sample_hooks(args, {"a": 1}))


def test_a_rollout_that_names_hooks_trains_on_hooked_samples(tmp_path):
    saved = tiny_run(tmp_path, 1, "--rollout-function-path", "slime_sample_hooks.generate_rollout").samples
    assert len(saved) == 16
    for s in saved:
        assert s["metadata"]["hooked_rollout"] == 0 and s["metadata"]["hooked_evaluation"] is False
        assert s["metadata"]["hooked_length"] == s["response_length"] and isinstance(s["reward"], float)
