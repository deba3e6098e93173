"""A mixture of experts trained end to end: train.py and train_async.py on a tiny Qwen3-MoE, from
saved rollouts (no engine: R3 through the whole command line) and with the built-in engine (its
routed experts returned, the expert weights pushed and checksummed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import ROOT, train_here
from safetensors.torch import load_file
from unit.trainer.moe_models import make_tiny_moe
from unit.trainer.test_r3 import with_routing

from vime.debug_rollout import save_rollout
from vime.models import load_tokenizer
from vime.rollout.types import RolloutOutput, Sample, Status

TINY = ["--config", "examples/tiny.yaml", "--custom-rm-path", "varied_reward.digit_share"]
FULLY_ASYNC = ["--rollout-function-path", "vime.rollout.fully_async_rollout.generate_rollout_fully_async"]


@pytest.fixture(scope="module")
def moe(tmp_path_factory) -> Path:
    return make_tiny_moe(tmp_path_factory.mktemp("moe") / "qwen3_moe", "qwen3_moe")


def steps(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "perf/step_time" in r]


def saved_rollouts(moe: Path, path: Path, n: int) -> str:
    """`n` rollouts of 2 groups × 2 samples as --save-debug-rollout-data writes them, each sample
    with the engine's log-probs and the routing an engine would send (the experts transformers'
    routers would choose last, so replay matters), rewards that differ within a group."""
    tokenizer = load_tokenizer(moe)
    template = str(path / "{rollout_id}.pt")
    for rollout in range(n):
        groups = []
        for g in range(2):
            prompt = tokenizer(f"{rollout + g}+{g + 2}=", add_special_tokens=False)["input_ids"]
            group = []
            for i in range(2):
                response = tokenizer(f"{i + 3}{g}", add_special_tokens=False)["input_ids"]
                group.append(
                    Sample(index=4 * rollout + 2 * g + i, group_index=2 * rollout + g, prompt="p", label="5",
                           tokens=prompt + response, response_length=len(response), reward=float(i),
                           weight_versions=[rollout] * len(response), temperature=1.0, status=Status.COMPLETED)
                )  # fmt: skip
            groups.append(with_routing(group, moe, pick="bottom"))
        save_rollout(template, rollout, RolloutOutput(groups))
    return template


@pytest.mark.parametrize("entry", ["train.py", "train_async.py"])
def test_r3_trains_an_moe_from_saved_rollouts_through_the_command_line(moe, tmp_path, entry):
    """The flags, the start-up checks, the trainer's replay and its metrics, the checkpoint: sync,
    and one-step-off (its TIS reads the saved log-probs), with no engine."""
    template = saved_rollouts(moe, tmp_path / "rollouts", 2)
    train_here(
        entry, "--hf-checkpoint", str(moe), "--prompt-data", str(ROOT / "examples/data/addition/train.jsonl"),
        "--load-debug-rollout-data", template, "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
        "--num-rollout", "2", "--use-rollout-routing-replay", "--moe-aux-loss-coeff", "0.01",
        "--runs-dir", str(tmp_path), "--run-name", "r", "--save", str(tmp_path / "ckpt"),
    )  # fmt: skip
    rows = steps(tmp_path / "r")
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["train/routing_mismatch"] == 1.0  # the saved routing is never the trainer's own
        assert r["train/logprob_gap_replay"] != r["train/logprob_gap_no_replay"]
        assert r["train/moe_aux_loss"] > 0 and r["train/grad_norm"] > 0
    written = load_file(tmp_path / "ckpt" / "2" / "model.safetensors")
    start = load_file(moe / "model.safetensors")
    assert written.keys() == start.keys()  # the hub's per-expert names
    assert not torch.equal(written["model.layers.0.mlp.gate.weight"], start["model.layers.0.mlp.gate.weight"])


@pytest.mark.parametrize("mode", ["sync", "fully-async"])
def test_an_moe_trains_with_the_builtin_engine(moe, tmp_path, mode):
    """Generation, training, the expert weights pushed under the hub's names (checksummed by the
    engine: --check-weight-push) and trained again, in sync and fully-async mode."""
    entry, extra = ("train.py", []) if mode == "sync" else ("train_async.py", FULLY_ASYNC)
    train_here(
        entry,
        *TINY,
        *extra,
        "--hf-checkpoint",
        str(moe),
        "--num-rollout",
        "2",
        "--runs-dir",
        str(tmp_path),
        "--run-name",
        "r",
    )
    rows = steps(tmp_path / "r")
    assert [r["step"] for r in rows] == [1, 2] and all(r["train/grad_norm"] > 0 for r in rows)
    assert all("train/moe_aux_loss" in r for r in rows)


def test_r3_end_to_end_with_the_builtin_engine(moe, tmp_path):
    train_here(
        "train.py", *TINY, "--hf-checkpoint", str(moe), "--num-rollout", "2", "--use-rollout-routing-replay",
        "--runs-dir", str(tmp_path), "--run-name", "r",
    )  # fmt: skip
    for r in steps(tmp_path / "r"):
        assert 0.0 <= r["train/routing_mismatch"] <= 1.0
        assert r["train/logprob_gap_replay"] >= 0 and r["train/logprob_gap_no_replay"] >= 0
