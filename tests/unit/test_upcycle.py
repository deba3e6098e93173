"""`vime upcycle` (issue 70): a dense Llama made a Mixtral mixture of experts computes the dense
model's function at step 0 (every expert its MLP, top-k weights renormalised to 1), trains in vime
with its experts pulled apart, is seeded, and refuses what it cannot make in one line."""

from __future__ import annotations

import pytest
import torch
from conftest import run_cli
from safetensors.torch import load_file

from unit.trainer.actors import make_args, make_samples
from vime.models import ModelError, make_tiny_model
from vime.trainer.actor import Actor
from vime.upcycle import upcycle

# float32: the renormalised weights sum to 1 within an ulp and each layer adds its rounding; a
# model that computed anything else (a wrong expert, a missing layer) is off by far more
TOLERANCE = 1e-5


def logits(model_dir, tokens: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0]


@pytest.mark.parametrize("tied", [False, True])
def test_the_upcycled_model_computes_the_dense_models_function(tmp_path, tied):
    dense = make_tiny_model(tmp_path / "dense", arch="llama", tie_word_embeddings=tied, num_layers=3)
    moe = upcycle(dense, tmp_path / "moe", num_experts=4, top_k=2, seed=0)
    tokens = [5, 17, 40, 41, 60, 88, 3, 9, 70]
    a, b = logits(dense, tokens), logits(moe, tokens)
    assert (a - b).abs().max() <= TOLERANCE * a.abs().max()
    written = {}
    for shard in sorted(moe.glob("model-*.safetensors")):
        written.update(load_file(shard))
    dense_w = load_file(dense / "model.safetensors")
    for e in range(4):  # every expert its layer's MLP, under Mixtral's hub names
        assert torch.equal(
            written[f"model.layers.2.block_sparse_moe.experts.{e}.w3.weight"],
            dense_w["model.layers.2.mlp.up_proj.weight"],
        )
    assert written["model.layers.0.block_sparse_moe.gate.weight"].shape == (4, 64)
    assert (moe / "tokenizer.json").exists() and "MixtralForCausalLM" in (moe / "config.json").read_text()
    again = upcycle(dense, tmp_path / "again", num_experts=4, top_k=2, seed=0)
    first = load_file(next(moe.glob("model-00001-*")))
    assert all(torch.equal(t, load_file(next(again.glob("model-00001-*")))[n]) for n, t in first.items())


def test_the_upcycled_model_trains_and_its_experts_part(tmp_path):
    moe = upcycle(make_tiny_model(tmp_path / "dense", arch="llama"), tmp_path / "moe", num_experts=4, top_k=2)
    actor = Actor(make_args(), moe)
    assert actor.policy.moe.model_type == "mixtral" and actor.policy.moe.num_experts == 4
    actor.train_step(make_samples(4), [1.0, -0.5, 0.25, -1.0])
    w = dict(actor.named_weights())
    experts = [w[f"model.layers.0.block_sparse_moe.experts.{e}.w1.weight"] for e in range(4)]
    assert not all(torch.equal(experts[0], x) for x in experts[1:])


def test_what_cannot_be_upcycled_is_one_line(tmp_path):
    qwen3 = make_tiny_model(tmp_path / "qwen3", arch="qwen3")
    with pytest.raises(ModelError, match="a qwen3 model is not of the Llama family"):
        upcycle(qwen3, tmp_path / "a", num_experts=4, top_k=2)
    llama = make_tiny_model(tmp_path / "llama", arch="llama")
    with pytest.raises(ModelError, match="--top-k 5: each token goes to between 1 and --num-experts 4"):
        upcycle(llama, tmp_path / "b", num_experts=4, top_k=5)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    r = run_cli("-m", "vime", "upcycle", "--hf-checkpoint", str(llama), "--out", str(tmp_path / "full"))
    assert (
        r.returncode == 2 and r.stderr.strip() == f"error: --out {tmp_path / 'full'} is not empty: give a new directory"
    )
    (tmp_path / "afile").write_text("keep me")  # NotADirectoryError's traceback
    with pytest.raises(ModelError, match=r"--out .*afile is a file: give a new directory"):
        upcycle(llama, tmp_path / "afile", num_experts=4, top_k=2)
    assert (tmp_path / "afile").read_text() == "keep me"


@pytest.mark.slow
def test_smollm2_upcycled_is_smollm2_at_step_zero(tmp_path):
    """The real model, through the command: the embedded SmolLM2-135M with 2 experts per layer."""
    from vime.models import resolve_model

    r = run_cli(
        "-m", "vime", "upcycle", "--num-experts", "2", "--top-k", "2", "--out", str(tmp_path / "moe"), timeout=600
    )
    assert r.returncode == 0, r.stderr[-2000:]
    tokens = [1, 504, 3458, 282, 4000, 314, 253, 1345, 30, 2]
    a, b = logits(resolve_model("smollm2"), tokens), logits(tmp_path / "moe", tokens)
    assert (a - b).abs().max() <= TOLERANCE * a.abs().max()
