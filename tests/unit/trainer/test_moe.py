"""Mixtures of experts in the trainer (issue 70): tiny random Qwen3-MoE and Mixtral train, their
weights leave the trainer under the hub's per-expert names (what save_pretrained writes, what the
engines and vLLM load), and a checkpoint round trips, in vime and in transformers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from unit.trainer.actors import make_args, make_samples
from unit.trainer.moe_models import make_tiny_moe
from vime.models import ModelError
from vime.trainer.actor import Actor
from vime.trainer.checkpoint_check import check_checkpoint
from vime.trainer.moe import MoeShape, fused_tensors, hub_tensors

ADVANTAGES = [1.0, -0.5, 0.25, -1.0]  # not constant: the step has a gradient


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral"])
def moe_model(request, tmp_path_factory) -> Path:
    return make_tiny_moe(tmp_path_factory.mktemp(request.param) / "model", request.param)


def test_grouped_experts_train_and_move_every_kind_of_weight(moe_model):
    """One GRPO step on a tiny MoE: the experts run as transformers 5's grouped GEMM (one
    `grouped_mm` over all experts, not a loop), and the step moves attention, router and expert
    weights alike."""
    actor = Actor(make_args(), moe_model)
    assert actor.model.config._experts_implementation == "grouped_mm"
    assert actor.policy.moe is not None and actor.policy.moe.layers == (0, 1) and actor.policy.moe.top_k == 2
    before = {n: t.clone() for n, t in actor.named_weights()}
    metrics = actor.train_step(make_samples(4), ADVANTAGES)
    assert metrics["train/grad_norm"] > 0
    after = dict(actor.named_weights())
    moved = {n for n, t in after.items() if not torch.equal(t, before[n])}
    block = "block_sparse_moe" if "mixtral" in str(moe_model) else "mlp"
    assert f"model.layers.0.{block}.gate.weight" in moved  # the router learns
    assert any(".experts." in n for n in moved)  # the experts learn
    assert "model.layers.1.self_attn.q_proj.weight" in moved


def test_named_weights_are_what_save_pretrained_writes(moe_model, tmp_path):
    """`named_weights` (what a push sends) yields exactly the tensors of the checkpoint the HF model
    writes, name for name and bit for bit: one tensor per expert and projection, as the hub holds
    them and the engines load them."""
    from transformers import AutoModelForCausalLM

    actor = Actor(make_args(), moe_model)
    pushed = dict(actor.named_weights())
    actor.model.save_pretrained(tmp_path / "hf")
    written = load_file(tmp_path / "hf" / "model.safetensors")
    assert sorted(pushed) == sorted(written)
    assert all(torch.equal(pushed[n], written[n]) for n in written)
    assert any(".experts.3." in n for n in pushed)
    # and what the model loaded from: the starting checkpoint's names
    assert sorted(pushed) == sorted(load_file(moe_model / "model.safetensors"))
    # the model's own tensors come back from them exactly
    model = AutoModelForCausalLM.from_pretrained(moe_model)
    fused = fused_tensors(MoeShape.of(model), pushed)
    assert sorted(fused) == sorted(n for n, _ in model.named_parameters())
    assert all(torch.equal(fused[n], p) for n, p in model.named_parameters())


def test_checkpoint_round_trips_in_vime_and_transformers(moe_model, tmp_path):
    from transformers import AutoModelForCausalLM

    actor = Actor(make_args(), moe_model)
    actor.train_step(make_samples(4), ADVANTAGES)
    trained = dict(actor.named_weights())
    position = {"epoch": 0, "offset": 4, "next_index": 4, "next_group": 1, "requeued": []}
    extra = {"step": 1, "data_source": position}
    ckpt = actor.save(tmp_path / "1", extra)
    assert sorted(load_file(ckpt / "model.safetensors")) == sorted(trained)
    check_checkpoint(ckpt, moe_model, lora=False)  # what --load checks before anything starts

    resumed = Actor(make_args(), moe_model)
    assert resumed.load(ckpt) == extra
    assert all(torch.equal(t, trained[n]) for n, t in resumed.named_weights())
    a = actor.optimizer_step.optimizer.state_dict()["state"]
    b = resumed.optimizer_step.optimizer.state_dict()["state"]
    assert all(torch.equal(a[k]["exp_avg"], b[k]["exp_avg"]) for k in a)

    hf = AutoModelForCausalLM.from_pretrained(ckpt)
    for name, p in hf.named_parameters():
        assert torch.equal(p, dict(resumed.model.named_parameters())[name]), name


def test_a_dense_layer_among_experts(tmp_path):
    """Qwen3-MoE's `mlp_only_layers` leaves a layer dense: its MLP keeps the dense names, the
    routed layers alone are counted and split into experts."""
    model_dir = make_tiny_moe(tmp_path / "m", "qwen3_moe", mlp_only_layers=[0])
    actor = Actor(make_args(), model_dir)
    assert actor.policy.moe.layers == (1,)
    names = dict(actor.named_weights())
    assert "model.layers.0.mlp.gate_proj.weight" in names
    assert "model.layers.1.mlp.experts.0.gate_proj.weight" in names
    assert sorted(names) == sorted(load_file(model_dir / "model.safetensors"))


def test_hub_names_of_one_expert_tensor():
    """The split by hand: expert e's gate rows are the first half of gate_up_proj[e], its up rows
    the second half; Mixtral names them w1, w3 and w2 under block_sparse_moe."""
    from vime.trainer.moe import MOE_FAMILIES

    moe = MoeShape("mixtral", MOE_FAMILIES["mixtral"], (0,), 2, 1, 1)
    gate_up = torch.arange(2 * 4 * 3, dtype=torch.float32).reshape(2, 4, 3)  # E=2, I=2, H=3
    out = dict(hub_tensors(moe, "model.layers.0.mlp.experts.gate_up_proj", gate_up))
    assert list(out) == [
        f"model.layers.0.block_sparse_moe.experts.{e}.{p}.weight" for e in (0, 1) for p in ("w1", "w3")
    ]
    assert torch.equal(out["model.layers.0.block_sparse_moe.experts.1.w3.weight"], gate_up[1, 2:])
    assert dict(hub_tensors(moe, "model.layers.0.mlp.gate.weight", gate_up[0])).keys() == {
        "model.layers.0.block_sparse_moe.gate.weight"
    }
    assert dict(hub_tensors(None, "model.layers.0.mlp.experts.gate_up_proj", gate_up)).keys() == {
        "model.layers.0.mlp.experts.gate_up_proj"
    }


def test_an_moe_family_without_a_row_is_one_line(tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "olmoe", vocab_size=64, hidden_size=16, intermediate_size=8, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, num_experts=2, num_experts_per_tok=1,
    )  # fmt: skip
    with pytest.raises(ModelError, match="olmoe is a mixture of experts vime does not train yet"):
        MoeShape.of(AutoModelForCausalLM.from_config(config))


def test_model_flops_count_the_experts_a_token_runs_through():
    """MFU's FLOPs: an MoE layer multiplies each token by its router and its top-k experts only
    (Qwen3-30B-A3B: 2.73B decoder weights of its 30B, the "A3B" with the embeddings), a dense
    layer by its MLP."""
    from transformers import Qwen3MoeConfig

    from vime.trainer.perf import decoder_matmul_params

    shape = dict(
        hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
    )  # fmt: skip
    attention = 2048 * 32 * 128 * 2 + 2048 * 4 * 128 * 2
    routed = 8 * 3 * 2048 * 768 + 2048 * 128
    assert decoder_matmul_params(Qwen3MoeConfig(**shape)) == 48 * (attention + routed)
    one_dense = Qwen3MoeConfig(**shape, mlp_only_layers=[0])
    assert decoder_matmul_params(one_dense) == 48 * attention + 47 * routed + 3 * 2048 * 6144
