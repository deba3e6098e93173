"""LoRA (issue 32, first part): only the adapters train, the base stays bit for bit, what leaves
the trainer is the merged model, the engine computes with it, and a resumed run goes on exactly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import ROOT, train_here

from unit.trainer.actors import make_args, make_samples
from vime.config import ConfigError
from vime.trainer.actor import Actor
from vime.trainer.checkpoint import CheckpointError
from vime.trainer.lora import read_adapter

ADVANTAGES = [1.0, -0.5, 0.25, -1.0]


def lora_args(**kw):
    return make_args(lora_rank=4, lora_alpha=8.0, **kw)


def test_only_the_adapters_train_and_the_base_stays_bit_for_bit(tiny_model):
    actor = Actor(lora_args(), tiny_model)
    base = {n: p.detach().clone() for n, p in actor.model.named_parameters() if "lora_" not in n}
    trainable = [n for n, p in actor.model.named_parameters() if p.requires_grad]
    assert trainable and all(n.endswith((".lora_A", ".lora_B")) for n in trainable)
    # every linear layer of the decoder has one (all-linear), never the LM head
    assert {n.rsplit(".", 2)[-2] for n in trainable} == {
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
    }  # fmt: skip
    # the optimizer holds the adapters only
    held = {id(p) for g in actor.optimizer_step.optimizer.param_groups for p in g["params"]}
    assert held == {id(p) for n, p in actor.model.named_parameters() if p.requires_grad}
    # B starts at zero: before any step the merged model is the base model
    assert all(torch.equal(t, base[n]) for n, t in actor.named_weights() if n in base)
    for _ in range(2):  # the second step is off-policy against the first's weights
        m = actor.train_step(make_samples(4), ADVANTAGES)
        assert m["train/grad_norm"] > 0
    for n, p in actor.model.named_parameters():
        if n in base:
            assert torch.equal(p, base[n]), n
    assert any(p.abs().sum() > 0 for n, p in actor.model.named_parameters() if n.endswith(".lora_B"))


def test_the_merged_weights_are_what_the_model_computes(tiny_model):
    """named_weights (what is pushed and saved) loaded into a plain model gives the LoRA model's
    log-probs, and each merged weight is W + (alpha / r) B A."""
    actor = Actor(lora_args(), tiny_model)
    actor.train_step(make_samples(4), ADVANTAGES)
    weights = dict(actor.named_weights())
    assert not any("lora_" in n for n in weights)
    layer = actor.model.get_submodule("model.layers.0.self_attn.q_proj")
    expect = layer.weight + 2.0 * layer.lora_B @ layer.lora_A
    assert torch.allclose(weights["model.layers.0.self_attn.q_proj.weight"], expect, atol=1e-6)
    plain = Actor(make_args(), tiny_model)
    plain.model.load_state_dict(weights, strict=False)
    for a, b in zip(actor.compute_log_probs(make_samples(4)), plain.compute_log_probs(make_samples(4))):
        assert torch.allclose(a, b, atol=1e-5)


def test_target_and_exclude_modules_pick_the_layers_and_a_miss_is_one_line(tiny_model):
    actor = Actor(
        lora_args(target_modules=["q_proj", "v_proj"], exclude_modules=["model.layers.0.self_attn.v_proj"]), tiny_model
    )
    names = {n.removesuffix(".lora_A") for n, _ in actor.model.named_parameters() if n.endswith(".lora_A")}
    assert "model.layers.0.self_attn.q_proj" in names and "model.layers.0.self_attn.v_proj" not in names
    assert "model.layers.1.self_attn.v_proj" in names and not any("k_proj" in n for n in names)
    with pytest.raises(ConfigError, match="matches no linear layer") as e:
        Actor(lora_args(target_modules=["qkv"]), tiny_model)
    assert "\n" not in str(e.value)


def test_a_checkpoint_holds_merged_weights_and_a_peft_adapter_and_resumes_exactly(tiny_model, tmp_path):
    from safetensors.torch import load_file

    samples = make_samples(4)
    straight = Actor(lora_args(), tiny_model)
    for _ in range(3):
        straight.train_step(samples, ADVANTAGES)

    first = Actor(lora_args(), tiny_model)
    first.train_step(samples, ADVANTAGES)
    ckpt = first.save(tmp_path / "1", {"step": 1})
    config = json.loads((ckpt / "adapter" / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4 and config["lora_alpha"] == 8
    keys = set(load_file(str(ckpt / "adapter" / "adapter_model.safetensors")))
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in keys
    saved = load_file(str(ckpt / "model.safetensors"))
    assert not any("lora_" in k for k in saved)  # a plain model: transformers and vLLM load it as is
    adapter = read_adapter(ckpt / "adapter")
    base = load_file(str(Path(tiny_model) / "model.safetensors"))
    q = "model.layers.1.mlp.down_proj"
    by_hand = base[f"{q}.weight"] + 2.0 * adapter[f"{q}.lora_B"] @ adapter[f"{q}.lora_A"]
    assert torch.allclose(saved[f"{q}.weight"], by_hand, atol=1e-6)

    resumed = Actor(lora_args(), tiny_model)
    assert resumed.load(ckpt) == {"step": 1}
    for _ in range(2):
        resumed.train_step(samples, ADVANTAGES)
    a, b = dict(straight.named_weights()), dict(resumed.named_weights())
    assert all(torch.equal(a[n], b[n]) for n in a)

    with pytest.raises(Exception, match="was trained with LoRA") as e:
        Actor(make_args(), tiny_model).load(ckpt)
    assert "\n" not in str(e.value)
    # another rank, alpha or set of layers is named as such (it used to be blamed on the base model)
    for change, said in [
        ({"lora_rank": 8}, "rank 4, this run's --lora-rank 8: resume with --lora-rank 4$"),
        ({"lora_alpha": 16.0}, "alpha 8, this run's --lora-alpha 16: resume with --lora-alpha 8$"),
        (
            {"target_modules": ["q_proj"]},
            "14 layers \\(down_proj gate_proj k_proj o_proj q_proj up_proj v_proj\\), this run adapts 2: resume with "
            "the --target-modules/--exclude-modules it was trained with$",
        ),
    ]:
        with pytest.raises(CheckpointError, match="'s LoRA adapters differ from this run's: " + said) as e:
            Actor(make_args(**{"lora_rank": 4, "lora_alpha": 8.0, **change}), tiny_model).load(ckpt)
        assert "\n" not in str(e.value)


def test_a_rank_above_a_target_layers_width_is_refused_before_any_adapter_is_made(tiny_model, tmp_path, monkeypatch):
    """--lora-rank 100000 on the tiny model's 64-wide layers was taken: adapters of 100000 rows
    made every step 40 times as slow, for nothing (B A has rank at most min(in, out))."""
    for rank in (33, 100000):
        with pytest.raises(
            ConfigError,
            match=f"--lora-rank {rank} is larger than the layer model.layers.0.self_attn.k_proj allows \\(64 in, 32 out features\\): give at most 32",
        ) as e:
            Actor(make_args(lora_rank=rank), tiny_model)
        assert "\n" not in str(e.value)
    # the narrowest layer decides: without k_proj and v_proj (32 out), 64 is allowed
    actor = Actor(make_args(lora_rank=64, exclude_modules=["k_proj", "v_proj"]), tiny_model)
    assert actor.model.get_submodule("model.layers.0.self_attn.q_proj").lora_A.shape == (64, 64)
    # a run refuses it before it starts (the model's layers read on the meta device): no run directory
    from vime.cli import train_main

    monkeypatch.chdir(ROOT)
    argv = ["--config", "examples/tiny.yaml", "--num-rollout", "1", "--runs-dir", str(tmp_path), "--run-name", "r"]
    with pytest.raises(
        ConfigError, match="^--lora-rank 100000 is larger than the layer model.layers.0.self_attn.k_proj"
    ):
        train_main([*argv, "--lora-rank", "100000"])
    assert not (tmp_path / "r").exists()


FULLY_ASYNC = ["--rollout-function-path", "vime.rollout.fully_async_rollout.generate_rollout_fully_async"]


@pytest.mark.parametrize(
    "script, transport, extra",
    [("train.py", "shm", []), ("train.py", "gloo", []), ("train_async.py", "gloo", FULLY_ASYNC)],
    ids=["sync-shm", "sync-gloo", "fully-async-gloo"],
)
def test_a_lora_run_pushes_only_adapters_and_the_engine_computes_the_merged_model(tmp_path, script, transport, extra):
    """A whole run: the engine gets the base once, then only the adapters (every byte of each
    push is adapter), pushed between steps as the mode pushes (fully-async: while its worker
    generates ahead); the adapters moved the weights off the base. In sync mode every step
    samples with exactly base + adapters, so the engine's and the trainer's log-probs agree."""
    train_here(  # in this process: the test reads what the run wrote
        script, "--config", "examples/tiny.yaml", "--custom-rm-path", "varied_reward.digit_share",
        "--lora-rank", "8", "--lora-alpha", "16", "--lr", "1e-2", "--num-rollout", "3",
        "--weight-transport", transport, *extra,
        "--runs-dir", str(tmp_path), "--run-name", "r", "--save", str(tmp_path / "ckpt"),
    )  # fmt: skip
    rows = [json.loads(x) for x in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "train/loss" in r]
    if script == "train.py":
        assert all(r["train/train_rollout_logprob_abs_diff"] < 1e-4 for r in rows)
    from safetensors.torch import load_file

    from vime.models import resolve_model

    base = load_file(str(resolve_model("tiny") / "model.safetensors"))
    final = load_file(str(tmp_path / "ckpt" / "3" / "model.safetensors"))
    moved = [k for k in base if not torch.equal(base[k], final[k])]
    # only adapted layers moved: no embedding, norm or LM head
    assert moved and all(k.rsplit(".", 2)[-2].endswith("_proj") for k in moved)
    adapter_bytes = sum(t.numel() * 4 for t in read_adapter(tmp_path / "ckpt" / "3" / "adapter").values())
    pushes = [r for r in rows if "perf/update_weights_bytes" in r]
    assert len(pushes) == 3 and all(r["perf/update_weights_bytes"] == adapter_bytes for r in pushes)
    # the base went once, with the first push (the run's start pushes nothing else)
    assert sum("perf/update_weights_base_time" in r for r in rows) == 1


# ---- adapter-only pushes: the built-in engine merges what it is sent --------------------------


def _engine(model_dir):
    from vime.engine.core.engine import EngineConfig, LLMEngine

    return LLMEngine(EngineConfig(str(model_dir), block_size=4, num_kv_blocks=64, max_num_batched_tokens=16))


def _layout(items):
    return [(n, tuple(t.shape), t.dtype) for n, t in items]


def _push(engine, items, buckets: int = 1):
    """A whole update, or `buckets` announced pieces as the nccl / gloo path delivers them."""
    if buckets == 1:
        return engine.replace_weights(_layout(items), lambda: items)
    size = -(-len(items) // buckets)
    pieces = [items[i : i + size] for i in range(0, len(items), size)]
    n = 0
    for i, piece in enumerate(pieces):
        engine.check_weights(_layout(piece))
        n += engine.update_weights(piece, flush=i == len(pieces) - 1)
    return n


def _greedy(engine, prompt: list[int], n: int):
    from vime.engine.core.sampler import SamplingParams
    from vime.rollout.types import Sample

    engine.add_request("probe", prompt, SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True))
    while True:
        done = [o for o in engine.step() if o.rid == "probe"]
        if done:
            out = done[0].outputs[0]
            return Sample(index=0, tokens=prompt + out.output_ids, response_length=n, rollout_log_probs=out.logprobs)


def _trained_lora_actor(tiny_model, steps: int = 1, **kw):
    actor = Actor(lora_args(**kw), tiny_model)
    for _ in range(steps):
        actor.train_step(make_samples(4), ADVANTAGES)
    return actor


def _held_like(engine, actor) -> bool:
    """The engine's weights are the trainer's merged weights, bit for bit."""
    from vime.transport.checksums import checksum_mismatches, checksums

    want = dict(actor.named_weights())
    have = engine.weight_checksums()
    return not checksum_mismatches(dict(zip(want, checksums(want.values()))), have)


@pytest.mark.parametrize("buckets", [1, 4])  # 28 tensors in buckets of 7: pairs split
def test_the_engine_merges_pushed_adapters_into_the_trainers_merged_weights_bit_for_bit(tiny_model, buckets):
    """Adapters alone (B pre-scaled by alpha / r = 2, a power of two, so the merge is exact in
    float32) give the engine exactly the weights a full merged push gives; a second push merges
    into the base, not on top of the first; the engine then computes the trainer's log-probs;
    a plain push makes its weights the new base."""
    actor = _trained_lora_actor(tiny_model)
    engine = _engine(tiny_model)
    adapters = list(actor.adapter_weights())
    assert {n.rsplit(".", 1)[1] for n, _ in adapters} == {"lora_A", "lora_B"}
    assert _push(engine, adapters, buckets) == len(adapters)  # A and B of a layer may land in different buckets
    assert _held_like(engine, actor) and engine.weight_checksums()[adapters[0][0]]
    actor.train_step(make_samples(4), ADVANTAGES)
    assert not _held_like(engine, actor)
    _push(engine, list(actor.adapter_weights()), buckets)
    assert _held_like(engine, actor)
    sample = _greedy(engine, [5, 17, 42, 9], 6)  # the engine's tokens and log-probs, scored by the trainer
    (trainer,) = actor.compute_log_probs([sample])
    assert torch.allclose(trainer, torch.tensor(sample.rollout_log_probs), atol=1e-4)
    fresh = Actor(lora_args(), tiny_model)  # B = 0: its base push resets the engine to the base
    _push(engine, list(fresh.named_weights(merge=False)))
    assert not engine.lora.base and _held_like(engine, fresh)
    _push(engine, list(actor.adapter_weights()))
    assert _held_like(engine, actor)


def test_a_wrong_adapter_update_is_refused_before_anything_changes(tiny_model):
    from vime.engine.core.engine import WeightsIncomplete

    actor = _trained_lora_actor(tiny_model)
    engine = _engine(tiny_model)
    before = engine.weight_checksums()
    adapters = dict(actor.adapter_weights())
    q = "model.layers.0.self_attn.q_proj"
    a, b = adapters[f"{q}.lora_A"], adapters[f"{q}.lora_B"]
    embed = ("model.embed_tokens.weight", engine.model.named_weights()["model.embed_tokens.weight"].clone())
    cases = {
        "mixes LoRA adapters with plain weights": [(f"{q}.lora_A", a), (f"{q}.lora_B", b), embed],
        "came without its lora_B": [(f"{q}.lora_A", a)],
        "takes \\[r, 64\\]": [(f"{q}.lora_A", a[:, :-1]), (f"{q}.lora_B", b)],
        "lora_A has rank 4, lora_B rank 3": [(f"{q}.lora_A", a), (f"{q}.lora_B", b[:, :3])],
        "no weight 'model.layers.0.self_attn.qkv.weight'": [("model.layers.0.self_attn.qkv.lora_A", a)],
    }
    for message, items in cases.items():
        with pytest.raises(ValueError, match=message) as e:
            _push(engine, items)
        assert "\n" not in str(e.value)
        assert engine.weight_checksums() == before and engine.weights_incomplete is None
    # a bucketed update whose last bucket leaves a pair open: the weights are a mix, said so
    engine.check_weights(_layout([(f"{q}.lora_A", a)]))
    with pytest.raises(ValueError, match="ended with half an adapter"):
        engine.update_weights([(f"{q}.lora_A", a)], flush=True)
    with pytest.raises(WeightsIncomplete):
        _greedy(engine, [5, 17], 1)


def test_a_frozen_base_takes_no_weight_gradient_flops(tiny_model):
    """perf/mfu of a LoRA run: the base matmuls cost forward + input gradient (4 × params ×
    tokens), not 6 ×; attention's cost is the same as a full step's."""
    from transformers import AutoConfig

    from vime.trainer.perf import decoder_matmul_params, train_flops

    config = AutoConfig.from_pretrained(tiny_model)
    lens, scored = [7, 12], [3, 5]
    matmul_fwd = 2.0 * (
        decoder_matmul_params(config) * sum(lens) + config.vocab_size * config.hidden_size * sum(scored)
    )
    full = train_flops(config, lens, scored, forwards=0)
    assert train_flops(config, lens, scored, forwards=0, frozen=True) == pytest.approx(full - matmul_fwd)
