"""slime's Sample methods that plug-ins call (tests/plugins/slime_generate_style.py):
`update_from_meta_info`, which a generate written after slime's own calls once it has appended an
engine answer by hand, `effective_response_length`, and `to_dict`/`from_dict` for a plug-in that
saves samples; and what slime's generate reads besides (`args.ci_test`, `sample.session_id`)."""

from __future__ import annotations

from unit.compat.tiny_runs import tiny_run
from vime.rollout.types import Sample, Status


def test_update_from_meta_info_sets_the_status_and_stamps_the_new_tokens():
    sample = Sample(tokens=[1, 2, 3, 4], response_length=2, rollout_log_probs=[-0.1, -0.2])
    sample.update_from_meta_info(None, {"finish_reason": {"type": "length", "length": 2}, "weight_version": "3"})
    assert sample.status == Status.TRUNCATED and sample.weight_versions == [3, 3]
    sample.tokens, sample.response_length = sample.tokens + [5], 3  # a second turn, appended by hand
    sample.update_from_meta_info(None, {"finish_reason": {"type": "stop", "matched": 5}, "weight_version": "4"})
    assert sample.status == Status.COMPLETED and sample.weight_versions == [3, 3, 4]
    sample.update_from_meta_info(None, {"finish_reason": {"type": "abort", "message": "x"}})
    assert sample.status == Status.ABORTED


def test_effective_response_length_and_a_dict_round_trip():
    sample = Sample(index=3, tokens=[1, 2, 3], response_length=2, loss_mask=[1, 0], status=Status.COMPLETED)
    sample.reason_content = "why"  # a plug-in's own attribute (multi_agent sets these)
    assert sample.effective_response_length == 1 and Sample(response_length=4).effective_response_length == 4
    saved = sample.to_dict()
    assert saved["status"] == "completed" and saved["reason_content"] == "why"
    back = Sample.from_dict(saved)
    assert back.status == Status.COMPLETED and back.tokens == [1, 2, 3] and back.reason_content == "why"


def test_a_generate_written_after_slimes_trains_with_its_versions_and_status(tmp_path):
    saved = tiny_run(tmp_path, 1, "--custom-generate-function-path", "slime_generate_style.generate").samples
    assert len(saved) == 16
    for s in saved:
        assert s["status"] in ("completed", "truncated", Status.COMPLETED, Status.TRUNCATED)
        assert len(s["weight_versions"]) == s["response_length"] == len(s["rollout_log_probs"]) > 0
