"""slime's names a multimodal example imports, on a text-only vime: `slime.utils.processing_utils`
(geo3k multi-turn's `build_processor_kwargs`, `encode_image_for_rollout_engine`), the Sample's
multimodal fields, and `append_response_tokens` taking the zero log-probs geo3k passes with its
environment's (untrained) observation tokens."""

import pytest


def test_processor_kwargs_are_built_as_slime_builds_them():
    from slime.utils.processing_utils import build_processor_kwargs

    assert build_processor_kwargs() == {
        "text_kwargs": {"return_tensors": None, "return_mm_token_type_ids": False},
        "audio_kwargs": {"return_tensors": "pt"},
        "images_kwargs": {"return_tensors": "pt"},
        "videos_kwargs": {"return_tensors": "pt"},
    }
    given = {"images": ["a"], "images_kwargs": {"max_pixels": 4, "return_tensors": "np"}, "text_kwargs": {"x": 1}}
    out = build_processor_kwargs(given)
    assert out["images"] == ["a"] and out["images_kwargs"] == {"max_pixels": 4, "return_tensors": "pt"}
    assert out["text_kwargs"] == {"x": 1, "return_tensors": None, "return_mm_token_type_ids": False}
    assert given["images_kwargs"]["return_tensors"] == "np"  # the caller's dict is left as it was


def test_a_text_model_has_no_processor_as_in_slime(tiny_model):
    from slime.utils.processing_utils import load_processor

    assert load_processor(str(tiny_model), trust_remote_code=True) is None


def test_an_image_for_the_engine_is_refused_in_one_line():
    from slime.utils.processing_utils import encode_image_for_rollout_engine

    from vime.errors import ConfigError

    with pytest.raises(ConfigError, match="vime rolls out text only") as e:
        encode_image_for_rollout_engine(object())
    assert "\n" not in str(e.value)


def test_the_generate_state_has_no_processor_and_samples_no_media(tiny_model):
    from slime.rollout.sglang_rollout import GenerateState
    from slime.utils.processing_utils import load_tokenizer
    from slime.utils.types import Sample

    from vime.config import Config
    from vime.plugin_args import PluginArgs

    cfg = Config(hf_checkpoint=str(tiny_model)).freeze()
    assert GenerateState(PluginArgs(cfg, None)).processor is None
    assert load_tokenizer(str(tiny_model)).encode("12") == GenerateState(PluginArgs(cfg, None)).tokenizer.encode("12")
    sample = Sample()
    assert sample.multimodal_inputs is None and sample.multimodal_train_inputs is None


def test_untrained_tokens_take_zero_log_probs_and_refuse_others():
    from slime.utils.types import Sample

    sample = Sample(tokens=[1, 2])
    sample.append_response_tokens(tokens=[3], log_probs=[-0.5], meta_info={"weight_version": "2"})
    sample.append_response_tokens(tokens=[4, 5], log_probs=[0.0, 0.0], trainable=False)
    assert sample.loss_mask == [1, 0, 0] and sample.rollout_log_probs == [-0.5, 0.0, 0.0]
    with pytest.raises(ValueError, match="not trainable take no log_probs"):
        sample.append_response_tokens(tokens=[6], log_probs=[-0.1], trainable=False)
    assert sample.tokens == [1, 2, 3, 4, 5]
