"""slime's newer Sample fields and slime.utils.types' other names on vime: `spec_info` and
`prefix_cache_info` (slime's `Sample.SpecInfo`/`PrefixCacheInfo`, fed by an answer's meta_info),
`generate_function_path` (a sample's own generate, honoured by slime's `generate_and_rm`),
`train_metadata` and `mopd_teacher_log_probs` (kept, training nothing), and `RolloutBatch`,
`ParamInfo`, `MultimodalTypes`. A rollout written with them trains
(tests/plugins/slime_sample_fields.py)."""

from __future__ import annotations

import torch
from slime.utils.types import MultimodalTypes, ParamInfo, RolloutBatch, Sample

from unit.compat.tiny_runs import tiny_run


def test_new_fields_have_slimes_defaults():
    s = Sample()
    assert (s.generate_function_path, s.train_metadata, s.mopd_teacher_log_probs) == (None, None, None)
    assert s.spec_info == Sample.SpecInfo() and s.spec_info.spec_accept_rate == 0.0
    assert s.prefix_cache_info.prefix_cache_hit_rate == 0.0
    assert Sample().spec_info is not s.spec_info  # each sample its own counts


def test_stats_add_an_answers_meta_info_and_survive_a_dict_round_trip():
    s = Sample(prompt="q", tokens=[1, 2, 3])
    s.append_response_tokens(
        None, tokens=[4], log_probs=[-0.5], meta_info={"finish_reason": {"type": "stop"}, "prompt_tokens": 3}
    )
    s.prefix_cache_info.add({"cached_tokens": 2, "prompt_tokens": 1})
    s.spec_info.add(
        {"spec_accept_token_num": 3, "spec_draft_token_num": 4, "spec_verify_ct": 2, "completion_tokens": 6}
    )
    assert s.prefix_cache_info.total_prompt_tokens == 4 and s.prefix_cache_info.prefix_cache_hit_rate == 0.5
    assert (s.spec_info.spec_accept_rate, s.spec_info.spec_accept_length) == (0.75, 3.0)
    s.mopd_teacher_log_probs = {"math": [-0.1]}
    d = s.to_dict()
    assert d["prefix_cache_info"] == {"cached_tokens": 2, "total_prompt_tokens": 4}
    back = Sample.from_dict(d)
    assert back.prefix_cache_info == s.prefix_cache_info and back.spec_info == s.spec_info
    assert back.mopd_teacher_log_probs == {"math": [-0.1]}


def test_slimes_other_type_names():
    assert MultimodalTypes.get("image").placeholder == "<image>" and MultimodalTypes.get("text") is None
    assert [m.name for m in MultimodalTypes.all()] == ["image", "video", "audio"]
    info = ParamInfo(name="w", dtype=torch.bfloat16, shape=torch.Size([2]), attrs={}, size=4, src_rank=0)
    assert info.size == 4
    batch: RolloutBatch = {"rewards": [1.0]}
    assert batch["rewards"] == [1.0]


def test_a_rollout_giving_samples_their_own_generate_trains(tmp_path):
    saved = tiny_run(tmp_path, 1, "--rollout-function-path", "slime_sample_fields.generate_rollout").samples
    own = [s for s in saved if s["generate_function_path"]]
    assert len(own) == 8 and len(saved) == 16
    for s in own:
        assert s["response_length"] <= 2 and s["train_metadata"] == {"generator": "short"}
        assert s["prefix_cache_info"]["total_prompt_tokens"] > 0
        assert isinstance(s["reward"], float)
    assert all(s["train_metadata"] is None for s in saved if not s["generate_function_path"])
