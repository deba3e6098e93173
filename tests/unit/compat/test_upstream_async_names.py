"""The rest of the names vllm-project/vime's public examples import (issue 68), each checked for
what it does: the router URL of a named model, a sample's prompt ids, what rollout functions
return, and the dynamic-sampling helpers of slime's rollout loop, at both their import paths."""

from __future__ import annotations

from types import SimpleNamespace

from transformers import AutoTokenizer

from vime.compat import imports
from vime.rollout.types import Sample

imports.install()

from vime.rollout.filter_hub.base_types import (  # noqa: E402 (vllm-project/vime's paths: after install)
    DynamicFilterOutput,
    MetricGatherer,
    call_dynamic_filter,
    should_drop_dynamic_filter_output,
)
from vime.rollout.vllm_rollout import _prepare_prompt_ids, get_model_url  # noqa: E402


def test_every_model_name_is_the_runs_router():
    args = SimpleNamespace(vllm_router_ip="127.0.0.1", vllm_router_port=8123)
    assert get_model_url(args, "actor") == "http://127.0.0.1:8123/inference/v1/generate"
    assert get_model_url(args, "judge", "/v1/chat/completions") == "http://127.0.0.1:8123/v1/chat/completions"


def test_prompt_ids_are_the_samples_tokens_or_its_prompt_rendered(tiny_model):
    tok = AutoTokenizer.from_pretrained(tiny_model)
    assert _prepare_prompt_ids(Sample(prompt="ignored", tokens=[5, 6, 7]), tok) == [5, 6, 7]
    assert _prepare_prompt_ids(Sample(prompt="6+9="), tok) == tok.encode("6+9=", add_special_tokens=False)
    chat = [{"role": "user", "content": "6+9="}]
    rendered = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert _prepare_prompt_ids(Sample(prompt=chat), tok) == tok.encode(rendered, add_special_tokens=False)


def test_rollout_outputs_under_slimes_names():
    from slime.rollout.base_types import RolloutFnTrainOutput as SlimeOutput

    from vime.rollout.base_types import RolloutFnEvalOutput, RolloutFnTrainOutput

    assert SlimeOutput is RolloutFnTrainOutput
    out = RolloutFnTrainOutput(samples=[[Sample(prompt="p")]], metrics=None)
    assert out.metrics == {} and len(out.samples) == 1
    assert RolloutFnEvalOutput(data={"aime": {"rewards": [1.0]}}).metrics is None


def test_slimes_loop_helpers_judge_groups_as_slime_does():
    assert call_dynamic_filter(None, "args", []).keep
    assert call_dynamic_filter(lambda args, group: False, "args", []) == DynamicFilterOutput(keep=False)
    fallback = DynamicFilterOutput(keep=False, reason="zero_std", keep_when_insufficient=True)
    assert call_dynamic_filter(lambda args, group: fallback, "args", []) is fallback
    # a fallback group is kept once the groups started could no longer fill the batch without it
    assert should_drop_dynamic_filter_output(fallback, remaining_batch_size=9, target_data_size=8)
    assert not should_drop_dynamic_filter_output(fallback, remaining_batch_size=8, target_data_size=8)
    assert should_drop_dynamic_filter_output(
        DynamicFilterOutput(keep=False), remaining_batch_size=1, target_data_size=8
    )
    assert not should_drop_dynamic_filter_output(
        DynamicFilterOutput(keep=True), remaining_batch_size=99, target_data_size=8
    )
    gatherer = MetricGatherer()
    for reason in ("zero_std", "zero_std", None, "too_long"):
        gatherer.on_dynamic_filter_drop(reason)
    assert gatherer.collect() == {
        "rollout/dynamic_filter/drop_zero_std": 2.0,
        "rollout/dynamic_filter/drop_too_long": 1.0,
    }
