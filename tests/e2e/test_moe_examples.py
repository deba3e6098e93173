"""vllm-project/vime's and slime's MoE scripts on vime (issue 70): Megatron's MoE shape flags of
scripts/models/qwen3-30B-A3B.sh describe Qwen3-30B-A3B's config.json (checked on its config and
tensor names, no weights), a flag that contradicts it is one line, and the multi-agent example's
30B script runs on a tiny MoE once the built-in engine runs MoE models (skipped until then, as the
engine itself says)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from conftest import ROOT
from unit.trainer.moe_models import make_tiny_moe

from e2e.test_upstream_script_examples import _check_team_trained, _multi_agent_env, _run_script
from vime import compat
from vime.compat import SLIME
from vime.config import parse_args
from vime.models import read_config

# Qwen3-30B-A3B's config.json (the hub's), the model vllm-project/vime's multi-agent script trains
QWEN3_30B_A3B = dict(
    model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], vocab_size=151936, hidden_size=2048,
    intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48, num_attention_heads=32,
    num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
    decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=40960, rms_norm_eps=1e-6,
    rope_theta=1000000.0, tie_word_embeddings=False, hidden_act="silu", output_router_logits=False,
)  # fmt: skip


def model_args(shape: str) -> list[str]:
    """A scripts/models/<shape>.sh file's MODEL_ARGS, as bash expands them."""
    script = f'source "{ROOT}/scripts/models/{shape}.sh"; printf "%s\\n" "${{MODEL_ARGS[@]}}"'
    return subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True).stdout.splitlines()


def refusals(model_dir: Path, flags: list[str]) -> list[str]:
    cfg = parse_args(
        ["--hf-checkpoint", str(model_dir), "--prompt-data", "d", "--num-rollout", "1", *flags], dialect=SLIME
    )
    return compat.check_model(cfg, model_dir, read_config, gpu_bytes=None)


@pytest.fixture(scope="module")
def qwen3_30b_a3b(tmp_path_factory) -> Path:
    """Qwen3-30B-A3B's config.json and its tensor names (an index over no weights, built on the
    meta device): what the shape check reads of a checkpoint."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    from vime.trainer.moe import MoeShape, hub_tensors

    out = tmp_path_factory.mktemp("qwen3-30b-a3b")
    config = {k: v for k, v in QWEN3_30B_A3B.items() if k != "model_type"}
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(Qwen3MoeConfig(**config))
    moe = MoeShape.of(model)
    names = [h for n, p in model.state_dict().items() for h, _ in hub_tensors(moe, n, p)]
    (out / "config.json").write_text(json.dumps(QWEN3_30B_A3B))
    (out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": dict.fromkeys(names, "x")}))
    return out


def test_slimes_qwen3_30b_a3b_flags_describe_qwen3_30b_a3b(qwen3_30b_a3b):
    flags = model_args("qwen3-30B-A3B")
    assert "--num-experts" in flags and "--moe-layer-freq" in flags
    assert refusals(qwen3_30b_a3b, flags) == []
    for layers in ("1", "([1]*48)"):  # every layer, as an int and as Megatron's list expression
        assert refusals(qwen3_30b_a3b, [*flags, "--moe-layer-freq", layers]) == []


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        (["--num-experts", "64"], "--num-experts 64 (checkpoint: 128)"),
        (["--moe-router-topk", "2"], "--moe-router-topk 2 (checkpoint: 8)"),
        (["--moe-ffn-hidden-size", "1536"], "--moe-ffn-hidden-size 1536 (checkpoint: 768)"),
        (["--moe-layer-freq", "([0]*1+[1]*47)"], "--moe-layer-freq ([0]*1+[1]*47) (checkpoint: [1, 1,"),
        (["--moe-shared-expert-intermediate-size", "512"], "--moe-shared-expert-intermediate-size 512 (checkpoint: 0)"),
    ],
)
def test_an_moe_flag_that_contradicts_the_checkpoint_is_one_line(qwen3_30b_a3b, extra, named):
    (line,) = refusals(qwen3_30b_a3b, [*model_args("qwen3-30B-A3B"), *extra])
    assert named in line and "\n" not in line


def test_experts_asked_of_a_dense_model_are_refused(tiny_model):
    (line,) = refusals(tiny_model, ["--num-layers", "2", "--num-experts", "8"])
    assert "--num-experts 8 (checkpoint: 0)" in line


def test_the_30b_multi_agent_script_runs_on_a_mixture_of_experts(tmp_path):
    """examples/multi_agent/run-qwen3-30B-A3B-multi-agent.sh as vllm-project/vime runs it (sync, colocated),
    on the tiny Qwen3-MoE with its own shape file (checked against it: none contradicts)."""
    moe = make_tiny_moe(tmp_path / "moe", "qwen3_moe")
    assert refusals(moe, model_args("tiny-qwen3-moe")) == []
    env = {**_multi_agent_env(tmp_path, moe), "MODEL_SHAPE": "tiny-qwen3-moe"}
    rows = _run_script(
        "multi_agent/run-qwen3-30B-A3B-multi-agent.sh", tmp_path, env, "--num-rollout", "1", "--lr", "1e-2"
    )
    _check_team_trained(rows, 1)


def test_vllms_expert_parallelism_reaches_its_servers():
    """vLLM engines split their experts with vLLM's own switch, passed through as any --vllm-NAME
    (the trainer's --expert-model-parallel-size is another thing: the trainer's ranks)."""
    from vime.backends.vllm.launch import server_command

    cfg = parse_args(
        ["--hf-checkpoint", "m", "--prompt-data", "d", "--num-rollout", "1", "--rollout-backend", "vllm",
         "--rollout-num-gpus-per-engine", "2", "--vllm-enable-expert-parallel"],
    )  # fmt: skip
    command = server_command("m", port=1, device="cuda", tp_size=2, vllm_args=cfg.vllm_args)
    assert "--enable-expert-parallel" in command and "--tensor-parallel-size" in command
