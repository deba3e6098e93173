"""`vime convert`: slime's torch_dist checkpoints (Megatron's GPT key names, written here with
torch.distributed.checkpoint as the layout in vime/compat/torch_dist.py's docstring says Megatron
writes them) come back as the HF model they were made from, every tensor bit for bit: tied and
untied embeddings, GQA's per-group q/k/v interleaving, Qwen2's biases, Qwen3's q/k norms, layers
one key each or stacked under one, a padded vocabulary. Bad input is one line, and --load,
--ref-load, --opd-teacher-load and --hf-checkpoint on such a checkpoint name the command."""

from __future__ import annotations

import io
import json
import pickle
import sys
import types
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import run_cli
from safetensors.torch import load_file

from vime.compat.torch_dist import convert
from vime.compat.torch_dist import main as convert_main
from vime.errors import ConfigError
from vime.models import ModelError, make_tiny_model, resolve_model

PAD_ROWS = 29  # Megatron pads the vocabulary to a multiple of 128 x TP: rows HF has not


def hf_state(model_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(model_dir / "model.safetensors"))


def megatron_state(model_dir: Path, stacked: bool = False, te: bool = True, singleton: bool = False) -> dict:
    """The HF model's tensors under Megatron's GPT keys: q/k/v fused per query group, gate and up
    fused (or `_w`/`_v` with singleton local shards), the norms under TE's fused names (or the
    local spec's), padded embedding rows; plus what a real checkpoint holds beside the model."""
    config = json.loads((model_dir / "config.json").read_text())
    hf = hf_state(model_dir)
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    hd = config.get("head_dim") or config["hidden_size"] // heads

    def fused_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        tail = q.shape[1:]
        parts = (q.reshape(kv, heads // kv, hd, *tail), k.reshape(kv, 1, hd, *tail), v.reshape(kv, 1, hd, *tail))
        return torch.cat(parts, dim=1).reshape(-1, *tail)

    def padded(t: torch.Tensor) -> torch.Tensor:
        return torch.cat([t, torch.randn(PAD_ROWS, t.shape[1], dtype=t.dtype)])

    norms = ("self_attention.linear_qkv.layer_norm_weight", "mlp.linear_fc1.layer_norm_weight")
    if not te:
        norms = ("input_layernorm.weight", "pre_mlp_layernorm.weight")
    layers = []
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        layer = {
            "self_attention.linear_qkv.weight": fused_qkv(*(hf[f"{p}self_attn.{x}_proj.weight"] for x in "qkv")),
            "self_attention.linear_proj.weight": hf[f"{p}self_attn.o_proj.weight"],
            norms[0]: hf[f"{p}input_layernorm.weight"],
            norms[1]: hf[f"{p}post_attention_layernorm.weight"],
            "mlp.linear_fc2.weight": hf[f"{p}mlp.down_proj.weight"],
        }
        gate, up = hf[f"{p}mlp.gate_proj.weight"], hf[f"{p}mlp.up_proj.weight"]
        if singleton:
            layer |= {"mlp.linear_fc1.weight_w": gate, "mlp.linear_fc1.weight_v": up}
        else:
            layer["mlp.linear_fc1.weight"] = torch.cat([gate, up])
        if f"{p}self_attn.q_proj.bias" in hf:  # Qwen2
            layer["self_attention.linear_qkv.bias"] = fused_qkv(*(hf[f"{p}self_attn.{x}_proj.bias"] for x in "qkv"))
        if f"{p}self_attn.q_norm.weight" in hf:  # Qwen3
            layer["self_attention.q_layernorm.weight"] = hf[f"{p}self_attn.q_norm.weight"]
            layer["self_attention.k_layernorm.weight"] = hf[f"{p}self_attn.k_norm.weight"]
        layers.append(layer)
    if stacked:  # homogeneous layers: one key per kind, the layer a leading dimension
        out = {f"decoder.layers.{k}": torch.stack([layer[k] for layer in layers]) for k in layers[0]}
    else:
        out = {f"decoder.layers.{i}.{k}": t for i, layer in enumerate(layers) for k, t in layer.items()}
    out["embedding.word_embeddings.weight"] = padded(hf["model.embed_tokens.weight"])
    out["decoder.final_layernorm.weight"] = hf["model.norm.weight"]
    if "lm_head.weight" in hf:
        out["output_layer.weight"] = padded(hf["lm_head.weight"])
    # what a checkpoint holds besides the model: optimizer state, byte entries of Transformer
    # Engine's and the trainer's state
    out["optimizer.state.exp_avg.decoder.final_layernorm.weight"] = torch.zeros_like(hf["model.norm.weight"])
    out["decoder.layers.0.self_attention.core_attention._extra_state/shard_0_1"] = io.BytesIO(b"te")
    out["rng_state/shard_0.0_1.1"] = io.BytesIO(b"rng")
    return out


def write_save_dir(save: Path, state: dict, iteration: int = 5) -> Path:
    """slime's --save directory: an older iteration, the one the tracker names, Megatron's metadata.json."""
    for it, s in ((iteration - 3, {"decoder.final_layernorm.weight": torch.ones(1)}), (iteration, state)):
        d = save / f"iter_{it:07d}"
        dcp.save(s, storage_writer=dcp.FileSystemWriter(str(d)), no_dist=True)
        (d / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist", "sharded_backend_version": 1}))
    (save / "latest_checkpointed_iteration.txt").write_text(str(iteration))
    return save


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    return {
        "qwen3": make_tiny_model(root / "qwen3", arch="qwen3", seed=1, num_heads=4, num_kv_heads=2),
        "qwen3-mha": make_tiny_model(root / "qwen3-mha", arch="qwen3", seed=1, num_heads=4, num_kv_heads=4),
        "qwen2": make_tiny_model(root / "qwen2", arch="qwen2", seed=2, num_heads=6, num_kv_heads=2, hidden_size=48),
        "llama-tied": make_tiny_model(root / "llama", arch="llama", seed=3, tie_word_embeddings=True, head_dim=8),
    }


def assert_same_model(out: Path, original: Path) -> None:
    ours, theirs = hf_state(out), hf_state(original)
    assert sorted(ours) == sorted(theirs)
    for name, t in theirs.items():
        assert ours[name].dtype == t.dtype and torch.equal(ours[name], t), name
    assert (out / "config.json").read_bytes() == (original / "config.json").read_bytes()
    assert (out / "tokenizer.json").is_file() and resolve_model(str(out)) == out


@pytest.mark.parametrize(
    "model, layout",
    [
        ("qwen3", {}),
        ("qwen3", {"stacked": True}),
        ("qwen2", {"te": False, "singleton": True}),
        ("qwen2", {"stacked": True}),
        ("llama-tied", {}),
    ],
)
def test_a_converted_checkpoint_is_the_model_it_was_made_from_bit_for_bit(tmp_path, models, model, layout):
    save = write_save_dir(tmp_path / "save", megatron_state(models[model], **layout))
    ckpt = convert(save, models[model], tmp_path / "hf")
    assert ckpt == save / "iter_0000005"  # the iteration the tracker names, not the older one
    assert_same_model(tmp_path / "hf", models[model])


def test_vime_convert_with_slimes_spellings_reads_megatron_metadata_without_megatron(tmp_path, models):
    save = write_save_dir(tmp_path / "save", megatron_state(models["qwen3"]))
    # older Megatron pickled its own classes into .metadata: make one that names them
    meta_path = save / "iter_0000005" / ".metadata"
    metadata = pickle.loads(meta_path.read_bytes())
    path = "megatron.core.dist_checkpointing.strategies.torch"
    fakes = {".".join(path.split(".")[:n]): types.ModuleType("fake") for n in range(1, 6)}
    fakes[path].MCoreMetadata = type("MCoreMetadata", (), {"__module__": path})
    sys.modules.update(fakes)
    try:
        metadata.mcore_data = fakes[path].MCoreMetadata()
        meta_path.write_bytes(pickle.dumps(metadata))
    finally:
        for name in fakes:
            del sys.modules[name]
    assert b"megatron.core" in meta_path.read_bytes()
    out = run_cli(
        "-m", "vime", "convert", "--input-dir", str(save / "iter_0000005"), "--origin-hf-dir", str(models["qwen3"]),
        "--output-dir", str(tmp_path / "hf"), "--vocab-size", "100", timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == f"converted {save / 'iter_0000005'} to {tmp_path / 'hf'}"
    assert "converting iter_0000005" in out.stderr  # the progress bar
    assert_same_model(tmp_path / "hf", models["qwen3"])
    again = run_cli(
        "-m", "vime", "convert", str(save), "--hf-checkpoint", str(models["qwen3"]), "--output", str(tmp_path / "hf")
    )
    assert again.returncode == 2 and again.stderr.strip().splitlines()[-1] == (
        f"error: --output {tmp_path / 'hf'} exists: give a new directory, or --force to replace it"
    )
    with pytest.raises(ConfigError, match=r"--vocab-size 128: the --hf-checkpoint's config has 100: drop --vocab-size"):
        convert_main(
            [
                str(save),
                "--hf-checkpoint",
                str(models["qwen3"]),
                "--output",
                str(tmp_path / "hf2"),
                "--vocab-size",
                "128",
            ]
        )


def test_bad_checkpoints_are_one_line(tmp_path, models):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"empty is not a Megatron torch_dist checkpoint \(no \.metadata"):
        convert(tmp_path / "empty", models["qwen3"], tmp_path / "out")
    moe = megatron_state(models["qwen3"]) | {"decoder.layers.0.mlp.experts.linear_fc1.weight0": torch.zeros(4, 4)}
    write_save_dir(tmp_path / "moe", moe)
    with pytest.raises(ConfigError, match="is a mixture-of-experts checkpoint .*not MoE ones yet"):
        convert(tmp_path / "moe", models["qwen3"], tmp_path / "out")
    # another shape than the HF config says: 2 KV heads fused against a config of 4
    write_save_dir(tmp_path / "q3", megatron_state(models["qwen3"]))
    with pytest.raises(ConfigError, match=r"linear_qkv.weight \[128, 64\] does not split into the --hf-checkpoint's"):
        convert(tmp_path / "q3", models["qwen3-mha"], tmp_path / "out")
    with pytest.raises(ConfigError, match=r"model.embed_tokens.weight of shape \[100, 64\], and the --hf-checkpoint's"):
        convert(tmp_path / "q3", models["qwen2"], tmp_path / "out")  # hidden 64 against 48
    untied = megatron_state(models["qwen3"])
    del untied["output_layer.weight"]
    write_save_dir(tmp_path / "no-head", untied)
    with pytest.raises(ConfigError, match=r"has no tensor for lm_head.weight of the --hf-checkpoint's model"):
        convert(tmp_path / "no-head", models["qwen3"], tmp_path / "out")
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()


def test_loading_a_torch_dist_checkpoint_names_the_format_and_the_command(tmp_path, models, addition_data):
    from vime.algorithms.settings import AlgorithmConfig
    from vime.trainer.teacher import teacher_dir

    save = write_save_dir(tmp_path / "qwen3_torch_dist", megatron_state(models["qwen3"]))
    hf = str(models["qwen3"])
    command = f"`vime convert {save} --hf-checkpoint {hf} --output {save}_hf`"
    for flags, give_to in (
        (["--load", str(save)], "--hf-checkpoint (and --load/--save a new directory)"),
        (
            ["--ref-load", str(save), "--kl-loss-coef", "0.1"],
            "--ref-load (or leave --ref-load out when it is --hf-checkpoint's model)",
        ),
    ):
        out = run_cli(
            "train.py", "--hf-checkpoint", hf, "--prompt-data", str(addition_data[0]), "--num-rollout", "1",
            "--runs-dir", str(tmp_path), *flags,
        )  # fmt: skip
        assert out.returncode == 2, out.stderr[-2000:]
        assert out.stderr.strip().splitlines()[-1] == (
            f"error: {flags[0]} {save} is a Megatron torch_dist checkpoint (slime's --save format), which vime does "
            f"not read: convert it to an HF directory with {command} and give {save}_hf to {give_to}"
        )
    with pytest.raises(ConfigError, match="--opd-teacher-load .* is a Megatron torch_dist checkpoint .*`vime convert"):
        teacher_dir(AlgorithmConfig(opd_teacher_load=str(save)))
    with pytest.raises(ModelError, match=r"--hf-checkpoint .*iter_0000005 is a Megatron torch_dist checkpoint"):
        resolve_model(str(save / "iter_0000005"))
