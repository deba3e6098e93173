"""vllm-project/vime's run scripts on vime: every flag accepted and acted on, or refused in one line.

The argument lists below are those of vllm-project/vime's `examples/fully_async/run-qwen2.5-0.5B-fully_async.sh`
and `run-qwen3-4b-fully_async.sh` (and the flags `scripts/run-qwen3-4B.sh` adds), written out from
the public flag names, with the model's shape flags and the paths pointed at SmolLM2 and local data.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
from conftest import ROOT, run_cli

from vime import compat
from vime.compat import parse_args
from vime.config import ConfigError
from vime.preflight import startup_notes

SMOLLM2_SHAPE = (
    "--swiglu --num-layers 30 --hidden-size 576 --ffn-hidden-size 1536 --num-attention-heads 9 "
    "--use-rotary-position-embeddings --disable-bias-linear --normalization RMSNorm --norm-epsilon 1e-5 "
    "--rotary-base 100000 --group-query-attention --num-query-groups 3 --kv-channels 64 --vocab-size 49152"
)

# run-qwen2.5-0.5B-fully_async.sh, but for MODEL_ARGS, the paths and the GPU counts
UPSTREAM_05B = (
    "--actor-num-nodes 1 --actor-num-gpus-per-node 1 --rollout-num-gpus 1 "
    "--hf-checkpoint {model} --ref-load {model}_torch_dist --save {out}/save --save-interval 9999 "
    "--rollout-function-path vime.rollout.fully_async_rollout.generate_rollout_fully_async "
    "--prompt-data {data} --input-key prompt --label-key label --apply-chat-template --rollout-shuffle "
    "--rm-type deepscaler --num-rollout 3 --rollout-batch-size 8 --n-samples-per-prompt 4 "
    "--rollout-max-response-len 1024 --rollout-temperature 1 --global-batch-size 32 --balance-data "
    "--tensor-model-parallel-size 1 --sequence-parallel --pipeline-model-parallel-size 1 --context-parallel-size 1 "
    "--expert-model-parallel-size 1 --expert-tensor-parallel-size 1 --use-dynamic-batch-size --max-tokens-per-gpu 4096 "
    "--advantage-estimator grpo --use-kl-loss --kl-loss-coef 0.00 --kl-loss-type low_var_kl --entropy-coef 0.00 "
    "--eps-clip 0.2 --eps-clip-high 0.28 "
    "--optimizer adam --lr 1e-6 --lr-decay-style constant --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.98 "
    "--rollout-num-gpus-per-engine 1 --vllm-gpu-memory-utilization 0.55 "
    "--attention-dropout 0.0 --hidden-dropout 0.0 --accumulate-allreduce-grads-in-fp32 --attention-softmax-in-fp32 "
    "--attention-backend flash"
)

# run-qwen3-4b-fully_async.sh, the same way (its --load and --save name one directory)
UPSTREAM_4B = (
    "--actor-num-nodes 1 --actor-num-gpus-per-node 4 --rollout-num-gpus 4 "
    "--hf-checkpoint {model} --ref-load {model}_torch_dist --load {out}/ckpt --save {out}/ckpt --save-interval 20 "
    "--rollout-function-path vime.rollout.fully_async_rollout.generate_rollout_fully_async "
    "--prompt-data {data} --input-key prompt --label-key label --apply-chat-template --rollout-shuffle "
    "--rm-type dapo --reward-key score --num-rollout 3000 --rollout-batch-size 32 --n-samples-per-prompt 8 "
    "--rollout-max-response-len 8192 --rollout-temperature 1 --global-batch-size 256 --balance-data "
    "--tensor-model-parallel-size 2 --sequence-parallel --pipeline-model-parallel-size 1 --context-parallel-size 1 "
    "--expert-model-parallel-size 1 --expert-tensor-parallel-size 1 "
    "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1 "
    "--use-dynamic-batch-size --max-tokens-per-gpu 9216 "
    "--advantage-estimator grpo --use-kl-loss --kl-loss-coef 0.00 --kl-loss-type low_var_kl --entropy-coef 0.00 "
    "--eps-clip 0.2 --eps-clip-high 0.28 --use-tis "
    "--optimizer adam --lr 1e-6 --lr-decay-style constant --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.98 "
    "--rollout-num-gpus-per-engine 1 "
    "--attention-dropout 0.0 --hidden-dropout 0.0 --accumulate-allreduce-grads-in-fp32 --attention-softmax-in-fp32 "
    "--attention-backend flash"
)

# what scripts/run-qwen3-4B.sh passes besides the flags above (its TP-2 engines aside: see below)
UPSTREAM_4B_SYNC_EXTRA = (
    "--train-backend megatron --colocate --eval-interval 20 --eval-prompt-data aime {eval} "
    "--n-samples-per-eval-prompt 16 --eval-max-response-len 16384 --eval-top-p 1 "
    "--train-memory-margin-bytes 2147483648 --use-wandb --wandb-project vime-dev --wandb-group qwen3-4B-test "
    "--wandb-mode offline"
)

# small enough for two steps on 2 CPU cores; the last value of a flag wins, as in vllm-project/vime's scripts
CPU_SIZES = (
    "--actor-num-gpus-per-node 1 --rollout-num-gpus 1 --num-rollout 2 --rollout-batch-size 2 "
    "--n-samples-per-prompt 2 --global-batch-size 4 --rollout-max-response-len 8 --quiet"
)


def _args(template: str, **paths: object) -> list[str]:
    return template.format(**{k: str(v) for k, v in paths.items()}).split()


def _dapo_style(path: Path, n: int = 16) -> Path:
    """dapo-math-17k's layout as slime uses it: `prompt` as chat messages, `label` the answer."""
    path.write_text(
        "".join(
            json.dumps({"prompt": [{"role": "user", "content": f"What is {i} + {i + 1}?"}], "label": str(2 * i + 1)})
            + "\n"
            for i in range(n)
        )
    )
    return path


def _parse(argv: list[str], entry: str = "async"):
    return parse_args(argv, prog="train_async.py", entry=entry)


def test_the_upstream_argument_lists_parse_and_every_foreign_flag_is_said_once(tmp_path):
    from vime.config.checks_train import inert_flags

    for template in (UPSTREAM_05B, UPSTREAM_4B):
        cfg = _parse(SMOLLM2_SHAPE.split() + _args(template, model="m", out=tmp_path, data="d.jsonl"))
        assert cfg.mode == "fully-async"
        optimizer = ("--adam", "--sgd", "--min-lr", "--lr-decay")
        assert not [f for f in inert_flags(cfg) if f.startswith(optimizer)]  # vllm-project/vime's all apply to its adam
        lines = startup_notes(cfg)
        said = " ".join(lines)
        for name in cfg.slime_flags:
            f = compat.FLAGS[name]
            if f.kind in ("shape", "recompute"):
                continue  # checked against the model / turned into a setting: tested below
            assert said.count(f.flag + " ") + said.count(f.flag + ")") >= 1, f.flag
        assert "--vllm-gpu-memory-utilization 0.55" in said or "vllm" not in template
        assert "--ref-load" in said and "--use-kl-loss" in said  # KL 0: no reference read, said so
    cfg = _parse(SMOLLM2_SHAPE.split() + _args(UPSTREAM_4B, model="m", out=tmp_path, data="d.jsonl"))
    assert cfg.gradient_checkpointing and cfg.gradient_checkpointing_layers is None  # full + uniform: every layer
    assert cfg.reward_key == "score" and cfg.use_tis and cfg.weight_decay == 0.1 and cfg.eps_clip_high == 0.28


def test_the_upstream_sync_script_flags_parse_or_are_refused_with_the_reason(tmp_path):
    """scripts/run-qwen3-4B.sh: train.py, colocated, an AIME eval set named as slime names it, and
    SGLang engines of two GPUs each, which the built-in engine (no tensor parallelism) runs as one
    engine per GPU, said at start-up; a vime user's own --rollout-num-gpus-per-engine 2, without
    a slime script's SGLang flags, stays refused."""
    upstream = _args(UPSTREAM_4B, model="m", out=tmp_path, data="d.jsonl")
    fn = upstream.index("--rollout-function-path")
    sync = upstream[:fn] + upstream[fn + 2 :] + _args(UPSTREAM_4B_SYNC_EXTRA, eval="/e/aime.jsonl")
    with pytest.raises(ConfigError, match="--rollout-num-gpus-per-engine 2: the built-in engine has no tensor"):
        _parse(SMOLLM2_SHAPE.split() + sync + ["--rollout-num-gpus-per-engine", "2"], entry="sync")
    sglang = ["--sglang-mem-fraction-static", "0.7", "--rollout-num-gpus", "8", "--rollout-num-gpus-per-engine", "2"]
    cfg = _parse(SMOLLM2_SHAPE.split() + sync + sglang, entry="sync")
    assert cfg.rollout_num_gpus_per_engine == 1 and cfg.rollout_num_gpus == 8
    assert "--rollout-num-gpus-per-engine 2 → 1 (the built-in engine has no tensor parallelism" in " ".join(
        startup_notes(cfg)
    )
    vllm = _parse(SMOLLM2_SHAPE.split() + sync + sglang + ["--rollout-backend", "vllm"], entry="sync")
    assert vllm.rollout_num_gpus_per_engine == 2  # vLLM's tensor parallelism honours it
    cfg = _parse(SMOLLM2_SHAPE.split() + sync, entry="sync")
    assert cfg.mode == "sync" and cfg.colocate and cfg.eval_sets == [{"name": "aime", "path": "/e/aime.jsonl"}]
    assert cfg.eval_top_p == 1 and cfg.n_samples_per_eval_prompt == 16 and cfg.use_wandb
    said = " ".join(startup_notes(cfg))
    assert "--train-backend megatron (vime trains with FSDP2" in said and "--train-memory-margin-bytes" in said


def test_every_flag_of_the_table_is_acted_on_or_said():
    """No accepted flag is silently ignored: each non-shape flag of the table, given alone, either
    changes a setting or is named in a start-up line."""
    base = ["--hf-checkpoint", "m", "--prompt-data", "d", "--num-rollout", "1"]
    default = _parse(base)
    for name, f in compat.FLAGS.items():
        if f.kind == "shape":
            continue
        value = {
            "recompute_granularity": ["full", "--recompute-method", "block", "--recompute-num-layers", "2"],
            "recompute_method": ["uniform"],
            "train_backend": ["megatron"],
        }.get(name, [] if f.type is bool else ["0" if f.kind == "zero" else "flash" if f.type is str else "1"])
        cfg = _parse(base + [f.flag, *value])
        changed = {k for k, v in vars(cfg).items() if k != "slime_flags" and getattr(default, k) != v}
        said = " ".join(startup_notes(cfg))
        assert changed or f.flag in said, f"{f.flag} is accepted but neither acted on nor said"


def test_unknown_flags_get_argparse_errors_and_vllm_flags_are_collected():
    r = run_cli("train_async.py", "--hf-checkpoint", "tiny", "--no-such-flag", "3", timeout=60)
    assert r.returncode == 2 and "unrecognized arguments: --no-such-flag 3" in r.stderr
    cfg = _parse(
        [
            "--hf-checkpoint",
            "m",
            "--prompt-data",
            "d",
            "--num-rollout",
            "1",
            "--vllm-enforce-eager",
            "--vllm-max-model-len=512",
        ]
    )
    assert cfg.vllm_args == {"enforce-eager": True, "max-model-len": "512"}
    assert "--vllm-enforce-eager" in " ".join(startup_notes(cfg))  # no vLLM engine: said


def test_refusals_name_the_flag_and_the_fix():
    base = ["--hf-checkpoint", "m", "--prompt-data", "d", "--num-rollout", "1"]
    cases = {
        ("--hidden-dropout", "0.1"): "--hidden-dropout 0.1: vime trains without dropout",
        ("--recompute-granularity", "full"): "needs --recompute-method",
        ("--recompute-method", "block", "--recompute-granularity", "full"): "needs --recompute-num-layers",
        ("--rollout-num-gpus-per-engine", "2"): "--rollout-num-gpus-per-engine 2: the built-in engine has no tensor",
        ("--num-steps-per-rollout", "2", "--global-batch-size", "32"): "give only one of them",
        ("--eval-prompt-data", "a", "x", "b"): "give PATH, or NAME PATH pairs",
    }
    for extra, needle in cases.items():
        with pytest.raises(ConfigError, match=re.escape(needle)) as e:
            _parse(base + list(extra))
        assert "\n" not in str(e.value)
    cfg = _parse(base + ["--num-steps-per-rollout", "2"])  # 8 prompts x 4 samples / 2 steps
    assert cfg.global_batch_size == 16 and cfg.steps_per_rollout == 2
    cfg = _parse(base + ["--eval-prompt-data", "aime", "/x/aime.jsonl"])
    assert cfg.eval_sets == [{"name": "aime", "path": "/x/aime.jsonl"}]


def test_shape_flags_are_checked_against_the_checkpoint(tiny_model, addition_data, tmp_path):
    from vime.models import read_config

    config = read_config(tiny_model)
    facts = compat.model_facts(config, compat.weight_names(tiny_model))
    assert facts["qk_layernorm"] and facts["num_layers"] == config["num_hidden_layers"]
    shape = [
        "--num-layers", str(config["num_hidden_layers"]), "--hidden-size", str(config["hidden_size"]),
        "--num-attention-heads", str(config["num_attention_heads"]), "--qk-layernorm", "--swiglu",
        "--disable-bias-linear", "--use-rotary-position-embeddings",
    ]  # fmt: skip
    if facts["group_query_attention"]:
        shape += ["--group-query-attention", "--num-query-groups", str(facts["num_query_groups"])]
    if facts["untie_embeddings_and_output_weights"]:
        shape.append("--untie-embeddings-and-output-weights")
    cfg = _parse(shape + ["--hf-checkpoint", str(tiny_model), "--prompt-data", "d", "--num-rollout", "1"])
    assert compat.check_model(cfg, tiny_model, read_config, gpu_bytes=None) == []

    wrong = list(shape)
    wrong[1] = str(config["num_hidden_layers"] + 1)
    wrong.remove("--qk-layernorm")
    r = run_cli(
        "train_async.py", "--hf-checkpoint", str(tiny_model), "--prompt-data", str(addition_data[0]),
        "--num-rollout", "1", "--runs-dir", str(tmp_path), *wrong, timeout=120,
    )  # fmt: skip
    assert r.returncode != 0
    line = r.stderr.strip().splitlines()[-1]
    assert f"--num-layers {config['num_hidden_layers'] + 1} (checkpoint: {config['num_hidden_layers']})" in line
    assert "--qk-layernorm left out (checkpoint: yes)" in line and "Traceback" not in r.stderr
    assert not (tmp_path / "run").exists() and not any(tmp_path.glob("*/engine0.log"))  # refused before anything ran


def test_megatron_sizes_that_cannot_be_honoured_are_refused(tiny_model):
    from vime.models import read_config

    cfg = _parse(
        [
            "--hf-checkpoint",
            str(tiny_model),
            "--prompt-data",
            "d",
            "--num-rollout",
            "1",
            "--expert-model-parallel-size",
            "2",
        ]
    )
    (line,) = compat.check_model(cfg, tiny_model, read_config, gpu_bytes=None)
    assert "--expert-model-parallel-size 2" in line and "no experts" in line
    # 4B parameters: 64 GiB of sharded state on one GPU does not fit 40 GiB; over 4 GPUs it does
    assert compat.memory_refusal(4 * 10**9, 1, False, 40 * 2**30, "--tensor-model-parallel-size 2") is not None
    assert compat.memory_refusal(4 * 10**9, 4, False, 40 * 2**30, "--tensor-model-parallel-size 2") is None
    assert compat.fsdp_bytes_per_gpu(10**9, 2, with_ref=True) == 10**9 * 20 / 2
    # a slime script's TP-2 SGLang engines run one per GPU on the built-in engine: refused where
    # the whole model's bf16 weights leave too little of one GPU (32B: 60 GiB of a 40 GiB GPU)
    from vime.compat.model import engine_memory_refusal

    assert engine_memory_refusal(4 * 10**9, 2, 80 * 2**30) is None
    assert "--rollout-backend vllm" in engine_memory_refusal(32 * 10**9, 2, 40 * 2**30)
    tp2 = ["--sglang-mem-fraction-static", "0.7", "--rollout-num-gpus-per-engine", "2"]
    cfg = _parse(["--hf-checkpoint", str(tiny_model), "--prompt-data", "d", "--num-rollout", "1", *tp2])
    lines = compat.check_model(cfg, tiny_model, read_config, gpu_bytes=1024)  # the trainer's state is refused too
    assert lines[0].startswith("--rollout-num-gpus-per-engine 2: the built-in engine has no tensor parallelism")
    assert compat.check_model(cfg, tiny_model, read_config, gpu_bytes=80 * 2**30) == []
    assert compat.parameter_count(tiny_model) == sum(
        p.numel()
        for p in __import__("safetensors.torch").torch.load_file(str(tiny_model / "model.safetensors")).values()
    )


def test_our_example_scripts_pass_the_upstream_flags(tmp_path):
    """examples/fully_async/run-*.sh hold vllm-project/vime's flags, every one of them."""
    for script, template in (
        ("run-qwen2.5-0.5B-fully_async.sh", UPSTREAM_05B),
        ("run-qwen3-4b-fully_async.sh", UPSTREAM_4B),
    ):
        text = (ROOT / "examples" / "fully_async" / script).read_text()
        ours = set(re.findall(r"^\s+(--[a-z0-9-]+)", text, flags=re.M)) | set(
            re.findall(r"   (--[a-z-]+) \\$", text, re.M)
        )
        upstream = {t for t in _args(template, model="m", out="o", data="d") if t.startswith("--")}
        assert upstream <= ours | {"--actor-num-nodes", "--actor-num-gpus-per-node", "--rollout-num-gpus"}, (
            upstream - ours
        )
    for shape in ("qwen2.5-0.5B", "qwen3-4B", "smollm2-135M"):
        text = (ROOT / "scripts" / "models" / f"{shape}.sh").read_text()
        assert "MODEL_ARGS=(" in text and "--num-layers" in text


@pytest.mark.slow
def test_the_05b_example_script_runs_two_steps_on_smollm2(tmp_path):
    """The example script itself, as a user runs it, on SmolLM2 with its own shape flags."""
    from vime.models import resolve_model

    data = _dapo_style(tmp_path / "dapo.jsonl")
    env = {
        "MODEL_DIR": str(resolve_model("smollm2")),
        "DATA_PATH": str(data),
        "MODEL_SHAPE": "smollm2-135M",
        "PYTHON": __import__("sys").executable,
    }
    r = subprocess.run(
        ["bash", str(ROOT / "examples/fully_async/run-qwen2.5-0.5B-fully_async.sh"), *CPU_SIZES.split(),
         "--save", str(tmp_path / "save"), "--runs-dir", str(tmp_path), "--run-name", "r"],
        env={**__import__("os").environ, **env}, capture_output=True, text=True, timeout=400,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2]
    inert = next(line for line in r.stderr.splitlines() if "flags with no effect in vime: " in line)
    assert "--sequence-parallel" in inert
    assert (tmp_path / "save" / "2" / "model.safetensors").exists()


@pytest.mark.slow
def test_the_4b_argument_list_runs_two_steps_on_smollm2(tmp_path):
    """The 4B script's list (recompute, dapo with --reward-key, TIS, --load = --save on a first run)
    on SmolLM2 with its own shape flags."""
    from vime.models import resolve_model

    model = resolve_model("smollm2")
    r = run_cli(
        "train_async.py", *SMOLLM2_SHAPE.split(),
        *_args(UPSTREAM_4B, model=model, out=tmp_path, data=_dapo_style(tmp_path / "dapo.jsonl")),
        *CPU_SIZES.split(), "--runs-dir", str(tmp_path), "--run-name", "a", timeout=400,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"--load {tmp_path}/ckpt holds no checkpoint yet: starting from --hf-checkpoint" in r.stderr
    assert "activation checkpointing of every decoder layer" in r.stderr
    assert "--tensor-model-parallel-size 2" in r.stderr and "FSDP2" in r.stderr
    rows = [json.loads(line) for line in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2]
    # dapo scores ±1 (read at --reward-key score), so four samples sum to an even number; acc is logged
    assert all(round(row["rollout/reward_mean"] * 4) % 2 == 0 for row in rows)
    assert all("rollout/reward_acc" in row for row in rows)
    assert (tmp_path / "ckpt" / "2" / "trainer_state.pt").exists()  # where the next run's --load resumes


def test_the_compatibility_table_names_every_flag_of_the_three_scripts():
    doc = (ROOT / "docs" / "slime-flags.md").read_text()
    flags = (
        {
            tok
            for t in (UPSTREAM_05B, UPSTREAM_4B, UPSTREAM_4B_SYNC_EXTRA, SMOLLM2_SHAPE)
            for tok in t.split()
            if tok.startswith("--")
        }
        | {"--add-qkv-bias", "--qk-layernorm", "--wandb-key", "--micro-batch-size"}
        | {f.flag for f in compat.FLAGS.values()}
    )
    missing = {f for f in flags if f not in doc and not f.startswith("--vllm-")}
    assert not missing, f"docs/slime-flags.md lacks {sorted(missing)}"
