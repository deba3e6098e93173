"""A custom generate's own verdicts on its samples, as vllm-project/vime honours them: a reward it set
is the sample's eval score (tau-bench's agent scores from its environment, and its eval rows
carry no label), and a sample it marks `remove_sample` trains nothing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from own_verdicts import BONUS_ONLY, SOLVED
from safetensors.torch import load_file

from unit.compat.test_plugin_compat import run_tiny
from vime.config import Config
from vime.eval import grade_sample
from vime.models import make_tiny_tokenizer
from vime.rollout.data.prompts import load_eval_samples
from vime.rollout.data.rows import DataError
from vime.rollout.types import Sample, drop_removed

TRAIN_ROWS = [{"input": f"{a}+{a}="} for a in range(4)]  # no label: the generate scores them


def _write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_eval_rows_need_no_label_only_when_a_custom_generate_may_score_them(tmp_path):
    data = _write(tmp_path / "e.jsonl", [{"input": "1+1="}, {"input": "2+2=", "label": "4"}])
    tokenizer = make_tiny_tokenizer()
    with pytest.raises(DataError, match=r"row 0 \(line 1\) has no key 'label'"):  # today's start-up error
        load_eval_samples(Config(), tokenizer, data)
    args = Config(custom_generate_function_path="own_verdicts.parity_scored")
    assert [s.label for s in load_eval_samples(args, tokenizer, data)] == [None, "4"]


def test_a_reward_the_generate_set_is_the_eval_score_and_the_rest_are_graded():
    # correct from eval's own full score (1) up; a bonus alone is not a success
    assert grade_sample(Sample(reward=SOLVED, label="7"), "math", True) == (None, True)
    assert grade_sample(Sample(reward=1.0), "math", True) == (None, True)
    assert grade_sample(Sample(reward=BONUS_ONLY), "math", True) == (None, False)
    kept = Sample(reward=0.0, response="7", label="7")  # its own 0 stands, whatever the answer
    assert grade_sample(kept, "math", True) == (None, False) and kept.reward == 0.0
    graded = Sample(response="so 7", label="7")
    assert grade_sample(graded, "math", True) == ("7", True) and graded.reward == 1.0
    # without a custom generate a reward is eval's own: the answer is read as always
    assert grade_sample(Sample(reward=1.0, response="8", label="7"), "math", False) == ("8", False)
    with pytest.raises(DataError, match="^eval sample 3: the custom generate set no reward and its row has no label"):
        grade_sample(Sample(index=3, response="7"), "math", True)
    with pytest.raises(DataError, match="set reward 'yes', not a number"):
        grade_sample(Sample(reward="yes"), "math", True)  # type: ignore[arg-type]


def test_drop_removed_zeroes_only_the_marked_samples_loss_masks():
    keep, gone = Sample(response_length=3, loss_mask=[1, 0, 1]), Sample(response_length=2, remove_sample=True)
    assert drop_removed([[keep, gone]]) == 1
    assert keep.loss_mask == [1, 0, 1] and gone.loss_mask == [0, 0]


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _weights(tmp_path: Path) -> dict[str, torch.Tensor]:
    return load_file(next((tmp_path / "ckpt").glob("*/model.safetensors")))


def test_eval_accuracy_is_the_share_of_samples_the_generate_scored_a_success(tmp_path, tiny_model):
    """Eval rows without labels, scored by the generate (SOLVED or BONUS_ONLY), and two with
    labels it leaves to eval's answer reading."""
    ev = [{"input": f"{a}*{a}="} for a in range(4)] + [
        {"input": f"{a}-1=", "label": str(a - 1), "metadata": {"grade": True}} for a in (5, 9)
    ]
    run_tiny(
        tmp_path, _write(tmp_path / "t.jsonl", TRAIN_ROWS), tiny_model,
        "--custom-generate-function-path", "own_verdicts.parity_scored",
        "--eval-prompt-data", str(_write(tmp_path / "e.jsonl", ev)), "--eval-interval", "2",
        "--n-samples-per-eval-prompt", "4", "--eval-temperature", "1", "--eval-max-response-len", "4",
    )  # fmt: skip
    evals = [r for r in _rows(tmp_path / "r" / "metrics.jsonl") if "eval/accuracy" in r]
    assert [r["step"] for r in evals] == [0, 2]
    for r in evals:
        samples = _rows(tmp_path / "r" / "eval" / f"{r['step']}.jsonl")
        own = [s for s in samples if s["label"] is None]
        graded = [s for s in samples if s["label"] is not None]
        assert len(own) == 16 and len(graded) == 8 and r["eval/total"] == 24
        assert {s["reward"] for s in own} <= {SOLVED, BONUS_ONLY} and all(s["pred"] is None for s in own)
        assert all(s["correct"] == (s["reward"] == SOLVED) for s in own)
        assert all(s["correct"] == (s["reward"] == 1.0) for s in graded)  # the answer read: 1 or 0
        solved = sum(s["reward"] == SOLVED for s in own) + sum(s["correct"] for s in graded)
        assert r["eval/correct"] == solved and r["eval/accuracy"] == pytest.approx(solved / 24)
        assert r["eval/reward_mean"] == pytest.approx(sum(s["reward"] for s in samples) / 24)
    rewards = {s["reward"] for r in evals for s in _rows(tmp_path / "r" / "eval" / f"{r['step']}.jsonl")}
    assert {SOLVED, BONUS_ONLY} <= rewards  # both kinds of sample were there to count


def test_removed_samples_train_nothing_and_the_others_still_train(tmp_path, tiny_model):
    run_tiny(
        tmp_path, _write(tmp_path / "t.jsonl", TRAIN_ROWS), tiny_model, "--n-samples-per-prompt", "4",
        "--custom-generate-function-path", "own_verdicts.removes_even_indices",
        "--custom-rm-path", "varied_reward.last_token_parity",
        "--save-debug-rollout-data", str(tmp_path / "rollouts/{rollout_id}.pt"),
    )  # fmt: skip
    saved = [s for f in sorted((tmp_path / "rollouts").glob("*.pt")) for s in torch.load(f)["samples"]]
    assert len(saved) == 2 * 2 * 4
    for s in saved:
        assert s["remove_sample"] == (s["index"] % 2 == 0)
        mask = s["loss_mask"] if s["loss_mask"] is not None else [1] * s["response_length"]
        assert (sum(mask) == 0) == s["remove_sample"], s["index"]
    steps = [r for r in _rows(tmp_path / "r" / "metrics.jsonl") if "train/loss" in r]
    assert all(r["rollout/removed_samples"] == 4 for r in steps)
    start = load_file(tiny_model / "model.safetensors")
    assert any(r["train/grad_norm"] > 0 for r in steps)
    assert any(not torch.equal(w, start[k]) for k, w in _weights(tmp_path).items())


def test_a_batch_of_removed_samples_leaves_the_weights_as_they_were(tmp_path, tiny_model):
    run_tiny(
        tmp_path, _write(tmp_path / "t.jsonl", TRAIN_ROWS), tiny_model,
        "--custom-generate-function-path", "own_verdicts.removes_all",
        "--custom-rm-path", "varied_reward.last_token_parity",
    )  # fmt: skip
    steps = [r for r in _rows(tmp_path / "r" / "metrics.jsonl") if "train/loss" in r]
    assert len(steps) == 2 and all(r["train/grad_norm"] == 0 for r in steps)
    start = load_file(tiny_model / "model.safetensors")
    assert all(torch.equal(w, start[k]) for k, w in _weights(tmp_path).items())
