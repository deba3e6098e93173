"""The models the trainer takes and those it refuses in one line: sliding-window attention scored
exactly within its window (and a run that outgrows it refused at start-up), attention or logits
of another form, layers that would let packed sequences see each other, LongRoPE and dynamic
RoPE, MoE's auxiliary loss and latent attention's CUDA kernels, dropout and router jitter."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from unit.trainer.actors import make_args, make_samples
from vime.rollout.types import Sample
from vime.trainer.actor import Actor
from vime.trainer.packing import plan_packed_micro_batches


def test_a_sliding_window_model_is_scored_exactly_within_its_window_and_refused_beyond(tmp_path):
    """A model whose layers attend through a sliding window (here Qwen2's, 24 positions, every
    layer): vime's packed attention is full causal attention, the model's own at every position
    a sequence of up to 25 tokens is scored at (the last token is predicted, not attended from),
    so those score as HF's eager forward with its sliding mask does; a longer one, whose scores
    the window changes, is refused in one line rather than scored under other attention."""
    import json

    from transformers import AutoModelForCausalLM

    from vime.models import ModelError, make_tiny_model

    path = make_tiny_model(tmp_path / "m", arch="qwen2", seed=0)
    config = json.loads((path / "config.json").read_text())
    config.update(use_sliding_window=True, sliding_window=24, max_window_layers=0, layer_types=None)
    (path / "config.json").write_text(json.dumps(config))
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, attn_implementation="eager")
    assert set(hf.config.layer_types) == {"sliding_attention"}
    trainer = Actor(make_args(), path)
    rng = random.Random(0)
    tokens = [rng.randrange(4, 100) for _ in range(26)]
    with torch.no_grad():
        logp = {n: torch.log_softmax(hf(torch.tensor([tokens[:n]])).logits[0].float(), -1) for n in (25, 26)}
    want = logp[25][torch.arange(14, 24), torch.tensor(tokens[15:25])]
    assert torch.allclose(
        trainer.compute_log_probs([Sample(index=0, tokens=tokens[:25], response_length=10)])[0], want, atol=1e-5
    )
    # at 26 tokens the window masks the first token from the last position scored
    with torch.no_grad():
        full = trainer.model(torch.tensor([tokens])).logits[0].float().log_softmax(-1)[24, tokens[25]]
    assert abs(float(full) - float(logp[26][24, tokens[25]])) > 1e-4
    longer = [Sample(index=0, tokens=tokens, response_length=11)]
    with pytest.raises(ModelError, match="a sequence of 26 tokens is scored with attention over 25 of them") as e:
        trainer.compute_log_probs(longer)
    assert "\n" not in str(e.value)
    with pytest.raises(ModelError, match="sliding window of 24"):
        trainer.train_step(longer, [1.0])


def test_a_run_whose_prompts_and_responses_outgrow_the_window_is_refused_at_start_up(tmp_path):
    """The trainer's refusal above comes when the first long sample arrives, hours in perhaps:
    start-up already knows the longest prompt and --rollout-max-response-len, so a run that can
    make a sequence past the window is refused before step 1, naming the flags, and one that
    cannot starts."""
    import json
    import re

    from vime.config import ConfigError, parse_args
    from vime.models import make_tiny_model
    from vime.preflight import check_inputs

    path = make_tiny_model(tmp_path / "m", arch="qwen2", seed=0)
    config = json.loads((path / "config.json").read_text())
    config.update(use_sliding_window=True, sliding_window=24, max_window_layers=0, layer_types=None)
    (path / "config.json").write_text(json.dumps(config))
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"input": p, "label": "1"}) + "\n" for p in ("1+2=", "11+22=", "3+4=")))
    base = ["--hf-checkpoint", str(path), "--prompt-data", str(data), "--rm-type", "math"]
    # engines by URL (one that runs windowed attention): the built-in engine refuses such a model itself
    base += ["--runs-dir", str(tmp_path / "runs"), "--num-rollout", "1", "--rollout-engine-urls", "http://127.0.0.1:9"]
    with pytest.raises(ConfigError) as e:
        check_inputs(parse_args([*base, "--rollout-max-response-len", "32"]))
    prompt = int(re.search(r"the longest prompt of --prompt-data \((\d+) tokens\)", str(e.value))[1])
    assert f"--rollout-max-response-len 32 makes up to {prompt + 32} tokens" in str(e.value)
    assert "sliding window of 24" in str(e.value) and "\n" not in str(e.value)
    check_inputs(parse_args([*base, "--rollout-max-response-len", str(25 - prompt)])).rewards.close()
    with pytest.raises(ConfigError, match="makes up to 26 tokens"):
        check_inputs(parse_args([*base, "--rollout-max-response-len", str(26 - prompt)]))
    # the context's own bound, named in the refusal, lets the long responses be
    check_inputs(
        parse_args([*base, "--rollout-max-response-len", "32", "--rollout-max-context-len", "25"])
    ).rewards.close()
    # nothing is trained with --debug-rollout-only: no trainer to refuse it
    check_inputs(parse_args([*base, "--rollout-max-response-len", "32", "--debug-rollout-only"])).rewards.close()


def test_a_model_whose_attention_or_logits_take_another_form_is_refused_in_one_line(tmp_path):
    """Gemma 2 soft-caps its final logits and its attention scores: the chunked head and the
    packed attention compute neither, so such a model is refused when the trainer starts (the
    attention by the load's packed forward) rather than trained as another model."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    from vime.models import ModelError, make_tiny_tokenizer

    tokenizer = make_tiny_tokenizer()

    def gemma2(name: str, **overrides) -> Path:
        config = Gemma2Config(
            vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=64, **overrides,
        )  # fmt: skip
        Gemma2ForCausalLM(config).save_pretrained(tmp_path / name)
        tokenizer.save_pretrained(tmp_path / name)
        return tmp_path / name

    for path, match in (
        (gemma2("head", attn_logit_softcapping=None), "applies final_logit_softcapping=30.0 to its logits"),
        (
            gemma2("attention", final_logit_softcapping=None),
            r"attention takes softcap \(Gemma 2's logit soft-capping\)",
        ),
    ):
        with pytest.raises(ModelError, match=match) as e:
            Actor(make_args(), path)
        assert "\n" not in str(e.value)
    plain = Actor(make_args(), gemma2("plain", attn_logit_softcapping=None, final_logit_softcapping=None))
    assert len(plain.compute_log_probs(make_samples(2))) == 2


@pytest.mark.parametrize("model_type", ["stablelm", "nemotron", "bloom"])
def test_a_model_whose_layers_let_packed_sequences_see_each_other_is_refused_at_load(tmp_path, model_type):
    """StableLM's and Nemotron's decoder layers call their attention without the packed-sequence
    boundaries; Bloom never calls the attention interface: each would score every sequence of a
    micro-batch of two or more against its neighbours too. The load's probe (two sequences
    packed against each alone) refuses them; a Qwen3 passes it by four orders of magnitude."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from vime.models import ModelError
    from vime.trainer.model import PACKING_TOLERANCE, forward_gaps, load_model

    sizes = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2)
    sizes.update(num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **sizes)).save_pretrained(tmp_path / "m")
    with pytest.raises(ModelError, match="lets sequences packed into one row change each other's hidden states") as e:
        load_model(tmp_path / "m", torch.device("cpu"))
    assert "\n" not in str(e.value)
    AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen3", **sizes)).save_pretrained(tmp_path / "q")
    assert (
        max(forward_gaps(load_model(tmp_path / "q", torch.device("cpu")), torch.device("cpu")))
        < PACKING_TOLERANCE / 1e2
    )


def _hf_scores(path: Path, sample: Sample) -> torch.Tensor:
    """The sample's response log-probs from transformers' own eager forward of it alone."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        logp = torch.log_softmax(hf(torch.tensor([sample.tokens])).logits[0].float(), -1)
    n = len(sample.tokens)
    return logp[torch.arange(sample.prompt_length - 1, n - 1), torch.tensor(sample.response_tokens)]


def _tiny(tmp_path: Path, model_type: str, **config) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    from vime.models import make_tiny_tokenizer

    tokenizer = make_tiny_tokenizer()
    sizes = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=96, num_hidden_layers=2)
    sizes.update(num_attention_heads=4, num_key_value_heads=2, pad_token_id=0)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **sizes, **config)).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    return tmp_path


def test_longrope_sequences_on_either_side_of_its_switch_are_never_packed_together(tmp_path):
    """Phi-3's LongRoPE takes its long or short frequencies for a whole row by the row's longest
    position, where a sequence alone gets them by its own length: a 12-token sequence packed
    with a 30-token one (switch at 16) would be scored with the long ones. The planner keeps
    the two sides apart, so each scores as transformers scores it alone."""
    from vime.trainer.model import rope_split

    long_rope = {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 16}
    long_rope.update(short_factor=[1.0] * 8, long_factor=[4.0] * 8)
    path = _tiny(
        tmp_path / "phi3",
        "phi3",
        rope_parameters=long_rope,
        max_position_embeddings=256,
        original_max_position_embeddings=16,
    )
    trainer = Actor(make_args(), path)
    assert rope_split(trainer.model.config) == 16
    assert plan_packed_micro_batches([12, 30, 9, 17], 4096, None, 16) == [[1, 3], [0, 2]]
    assert plan_packed_micro_batches([12, 30, 9, 17], 4096) == [[0, 1, 2, 3]]
    rng = random.Random(0)
    samples = [
        Sample(index=i, tokens=[rng.randrange(4, 100) for _ in range(n)], response_length=5)
        for i, n in enumerate((12, 30))
    ]
    for got, sample in zip(trainer.compute_log_probs(samples), samples):
        assert torch.allclose(got, _hf_scores(path, sample), atol=1e-5)


def test_a_sequence_past_dynamic_ropes_original_length_is_refused_in_one_line(tmp_path):
    """Dynamic NTK RoPE rescales by the longest sequence transformers has seen once past
    `max_position_embeddings`: within it a sequence scores as alone, past it it is refused."""
    from vime.models import ModelError

    dynamic = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}
    path = _tiny(tmp_path / "llama", "llama", rope_parameters=dynamic, max_position_embeddings=24)
    trainer = Actor(make_args(), path)
    rng = random.Random(0)
    inside = Sample(index=0, tokens=[rng.randrange(4, 100) for _ in range(24)], response_length=6)
    assert torch.allclose(trainer.compute_log_probs([inside])[0], _hf_scores(path, inside), atol=1e-5)
    longer = Sample(index=0, tokens=inside.tokens + [5], response_length=7)
    with pytest.raises(ModelError, match="a sequence of 25 tokens is longer than the 24 past which") as e:
        trainer.compute_log_probs([longer])
    assert "\n" not in str(e.value)


def test_moe_aux_loss_and_the_cuda_kernels_for_latent_attention_are_refused_at_load(tmp_path):
    from vime.errors import ConfigError
    from vime.models import ModelError
    from vime.trainer.model import load_model

    moe = _tiny(tmp_path / "moe", "qwen3_moe", output_router_logits=True, num_experts=4, num_experts_per_tok=2)
    with pytest.raises(ModelError, match="sets output_router_logits"):
        load_model(moe, torch.device("cpu"))
    mla = dict(kv_lora_rank=16, q_lora_rank=None, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
    mla = _tiny(
        tmp_path / "mla", "deepseek_v3", **mla, n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=2
    )
    with pytest.raises(ConfigError, match="this model's values have 16 dims against 24 for queries and keys"):
        load_model(mla, torch.device("cpu"), "fa2")
    assert load_model(mla, torch.device("cpu")).config.v_head_dim == 16  # auto: SDPA, which is exact here
    # compiled, SDPA per sequence is an opaque op whose fake must give the values' width
    eager, compiled = (Actor(make_args(compile=c), mla).compute_log_probs(make_samples(2)) for c in (False, True))
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(eager, compiled))


def test_the_training_forward_is_the_scoring_forward_dropout_off_and_router_jitter_refused(tmp_path):
    """The policy ratio compares the training forward (train mode) with the scoring forward
    (eval mode). GPT-2 ships dropout 0.1 on its residuals, embeddings and attention: the
    trainer's model has it off, so its train-mode forward is its eval-mode one (transformers'
    own, dropout on, is not). Mixtral with router jitter routes by noise in train mode: refused."""
    from transformers import AutoModelForCausalLM

    from vime.models import ModelError
    from vime.trainer.model import load_model

    gpt2 = _tiny(tmp_path / "gpt2", "gpt2", n_positions=256)
    ids = torch.tensor([make_samples(1)[0].tokens])
    for model, same in (
        (load_model(gpt2, torch.device("cpu")), True),
        (AutoModelForCausalLM.from_pretrained(gpt2), False),
    ):
        with torch.no_grad():
            torch.manual_seed(0)
            trained = model.train()(ids).logits
            scored = model.eval()(ids).logits
        assert torch.allclose(trained, scored, atol=1e-6) == same
    jitter = _tiny(tmp_path / "mixtral", "mixtral", num_local_experts=4, num_experts_per_tok=2, router_jitter_noise=0.1)
    with pytest.raises(ModelError, match="training forward differs from its scoring forward") as e:
        load_model(jitter, torch.device("cpu"))
    assert "\n" not in str(e.value)
    assert load_model(jitter, torch.device("cpu"), trained=False).training is False  # a reference runs in eval only
