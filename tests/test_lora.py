"""LoRA (issue 32, first part): only the adapters train, the base stays bit for bit, what leaves
the trainer is the merged model, the engine computes with it, and a resumed run goes on exactly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import run_cli
from test_actor import make_args, make_samples

from vime.config import ConfigError
from vime.trainer.actor import Actor
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
    held = {id(p) for g in actor.optimizer.param_groups for p in g["params"]}
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


def test_a_lora_run_pushes_merged_weights_the_engine_computes_with(tmp_path):
    """A whole sync run: from step 2 on, the engine samples with the weights pushed after step 1
    (merged: base + adapters), and the trainer scores those samples with the same weights, so
    the engine's and the trainer's log-probs agree; the adapters moved them off the base."""
    res = run_cli(
        "train.py", "--config", "examples/tiny.yaml", "--custom-rm-path", "varied_reward.digit_share",
        "--lora-rank", "8", "--lora-alpha", "16", "--lr", "1e-2", "--num-rollout", "3",
        "--runs-dir", str(tmp_path), "--run-name", "r", "--save", str(tmp_path / "ckpt"),
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [json.loads(x) for x in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "train/loss" in r]
    assert all(r["train/train_rollout_logprob_abs_diff"] < 1e-4 for r in rows)
    from safetensors.torch import load_file

    from vime.models import resolve_model

    base = load_file(str(resolve_model("tiny") / "model.safetensors"))
    final = load_file(str(tmp_path / "ckpt" / "3" / "model.safetensors"))
    moved = [k for k in base if not torch.equal(base[k], final[k])]
    # only adapted layers moved: no embedding, norm or LM head
    assert moved and all(k.rsplit(".", 2)[-2].endswith("_proj") for k in moved)
