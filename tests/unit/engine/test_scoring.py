"""Scoring given tokens (vime/engine/core/scoring.py): the engine's log-prob of each input token,
nothing sampled, as an on-policy-distillation teacher gives it. Checked against HF's
teacher-forced log-probs of the same tiny model (float32, within a stated tolerance: the two
compute attention in another order), chunked and from a start position, beside a generation it
must not disturb, and through SGLang's request on the real server."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest
import torch

from vime.backends.builtin.launch import launch_engine
from vime.engine.core.engine import EngineConfig, LLMEngine
from vime.engine.core.sampler import SamplingParams
from vime.engine.core.scoring import EngineBusy, score
from vime.models import make_tiny_model

ATOL = 1e-4  # float32 on CPU; measured gap ~1e-6
TEXT = [(7 * i + 3) % 90 + 5 for i in range(37)]  # 37 tokens: 10 blocks of 4, 3 chunks of 16


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("score") / "qwen3", arch="qwen3", seed=2)


@pytest.fixture(scope="module")
def hf_scores(model_dir) -> list[float]:
    """HF's log-prob of TEXT[p] given TEXT[:p], p = 1 .. len - 1."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(torch.tensor([TEXT])).logits[0, :-1].float()
    return logits.log_softmax(-1).gather(1, torch.tensor(TEXT[1:])[:, None])[:, 0].tolist()


def _engine(model_dir, **kw) -> LLMEngine:
    cfg = {"block_size": 4, "num_kv_blocks": 64, "max_num_batched_tokens": 16, **kw}
    return LLMEngine(EngineConfig(str(model_dir), **cfg))


@pytest.mark.parametrize("start", [0, 1, 21])
def test_scores_are_hfs_teacher_forced_logprobs_from_any_start(model_dir, hf_scores, start):
    engine = _engine(model_dir)
    got = score(engine, TEXT, start)
    assert len(got) == len(TEXT) - start
    if start == 0:
        assert got[0] is None  # nothing predicts the first token
        got = got[1:]
    want = hf_scores[max(start, 1) - 1 :]
    assert torch.allclose(torch.tensor(got), torch.tensor(want), atol=ATOL)
    assert engine.allocator.num_free == engine.allocator.num_blocks  # its blocks went back


def test_scoring_between_steps_leaves_a_generation_as_it_was(model_dir, hf_scores):
    """A greedy generation with a scoring after each of its steps gives the tokens and log-probs
    of the same generation alone, and the scorings the scores of an idle engine."""

    def generate(engine: LLMEngine, interleave: bool) -> tuple[list[int], list[float], list]:
        engine.add_request("g", TEXT[:9], SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True))
        outs, scores = [], []
        while engine.has_work():
            outs += engine.step()
            if interleave:
                scores.append(score(engine, TEXT, 0)[1:])
        return outs[0].outputs[0].output_ids, outs[0].outputs[0].logprobs, scores

    alone = generate(_engine(model_dir), interleave=False)
    mixed = generate(_engine(model_dir), interleave=True)
    assert mixed[0] == alone[0] and mixed[1] == alone[1]
    assert mixed[2] and all(torch.allclose(torch.tensor(s), torch.tensor(hf_scores), atol=ATOL) for s in mixed[2])


def test_a_full_cache_or_a_paused_engine_is_busy_and_bad_input_is_one_line(model_dir):
    engine = _engine(model_dir, num_kv_blocks=12)  # TEXT needs 10 blocks of 4; 3 held leave 9
    held = engine.allocator.allocate(3)
    with pytest.raises(EngineBusy, match="needs 10 free KV blocks, 9 are"):
        score(engine, TEXT)
    engine.allocator.release(held)
    assert len(score(engine, TEXT)) == len(TEXT)
    engine.pause()
    with pytest.raises(EngineBusy, match="paused"):
        score(engine, TEXT)
    engine.unpause()
    with pytest.raises(ValueError, match="logprob_start_len 37 must be in"):
        score(engine, TEXT, 37)
    with pytest.raises(ValueError, match="input_ids must be integers"):
        score(engine, [1, 10**9])


def test_sglangs_scoring_request_on_the_server(model_dir, hf_scores):
    """The request slime's OPD reward function sends a teacher server, answered in SGLang's form:
    `input_token_logprobs` of [log-prob, token id, None] from logprob_start_len; its
    `item[0] for item in ...[1:]` is the teacher's log-prob of every token after the first.
    TEXT is exactly the engine's longest sequence here: the route refused it although the scorer
    takes it (a served-OPD sample that filled the context stopped the run). Generating from it
    is still refused: no room is left for a token."""
    engine = launch_engine(
        str(model_dir), extra_args=["--block-size", "4", "--max-num-batched-tokens", "16", "--max-model-len", "37"]
    )
    try:
        body = {
            "input_ids": TEXT,
            "sampling_params": {"temperature": 0, "max_new_tokens": 0, "skip_special_tokens": False},
            "return_logprob": True,
            "logprob_start_len": 0,
        }
        req = urllib.request.Request(f"{engine.url}/generate", json.dumps(body).encode(), method="POST")
        with urllib.request.urlopen(req, timeout=60) as r:
            out = json.load(r)
        body["sampling_params"]["max_new_tokens"] = 1
        req = urllib.request.Request(f"{engine.url}/generate", json.dumps(body).encode(), method="POST")
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(req, timeout=60)
        assert refused.value.code == 400
        assert (
            "prompt of 37 tokens can never fit: the engine's maximum sequence length is 37"
            in refused.value.read().decode()
        )
    finally:
        engine.shutdown()
    items = out["meta_info"]["input_token_logprobs"]
    assert out["output_ids"] == [] and [i[1] for i in items] == TEXT and items[0][0] is None
    assert torch.allclose(torch.tensor([i[0] for i in items[1:]]), torch.tensor(hf_scores), atol=ATOL)
