"""GRPO really learns: a tiny model's held-out greedy accuracy rises by ≥ 20 points, in sync and in async mode.

The warm start is a short supervised run on the training prompts whose targets carry a
systematic flaw: 70% of them append a stray "0" after the answer (so "6+9=" → "150"). The
warm-started model therefore knows much of the table but, greedily, mostly answers wrong.
GRPO on the same training prompts rewards only exact answers; the test checks that the
behaviour it learns carries over to the 20 held-out prompts it never trains on. Seeded.
"""

from __future__ import annotations

import json
import os
import random
import tempfile
from pathlib import Path

import pytest
from conftest import train_here

JUNK = 0.7  # share of warm-start targets with the stray "0": above 1/2, so greedy decoding keeps it
# Held-out gain in points by step, sync / one-step-off, for warm starts of seeds 0 (the test's), 1
# and 2 (2026-12-04, this test's flags): step 10 +40/+30, +55/+60, +20/+25; step 20 +45/+55,
# +55/+55, +30/+35; step 30 +50/+50, +55/+60, +25/+30; step 80 +55/+50, -, +30/+35. By step 30
# every run was past the 20-point bar, and what the later steps added stayed within the noise.
STEPS = 30


def warm_start(out: Path, train_path: Path, seed: int = 0) -> Path:
    """The warm-started model, written to `out`."""
    from vime.config import parse_args
    from vime.models import load_tokenizer, make_tiny_model
    from vime.rollout.types import Sample
    from vime.trainer.actor import Actor

    with tempfile.TemporaryDirectory() as tmp:  # the random base model, needed only to start from
        base = make_tiny_model(Path(tmp) / "base", hidden_size=128, intermediate_size=256, num_layers=2, seed=seed)
        tok = load_tokenizer(base)
        eos = tok.convert_tokens_to_ids("<|im_end|>")
        rows = [json.loads(line) for line in train_path.read_text().splitlines()]
        args = parse_args(
            [
                "--hf-checkpoint",
                str(base),
                "--prompt-data",
                str(train_path),
                "--num-rollout",
                "1",
                "--lr",
                "3e-3",
                "--rollout-batch-size",
                "32",
                "--n-samples-per-prompt",
                "1",
                "--loss-type",
                "sft_loss",
            ]
        )
        actor = Actor(args, base, "cpu")
        rng = random.Random(seed)

        def example(r: dict) -> Sample:
            prompt = tok(r["input"], add_special_tokens=False).input_ids
            answer = tok(r["label"] + ("0" if rng.random() < JUNK else ""), add_special_tokens=False).input_ids + [eos]
            return Sample(tokens=prompt + answer, response_length=len(answer), label=r["label"])

        for _ in range(200):
            actor.train_step([example(r) for r in rng.sample(rows, 32)], [0.0] * 32)
        actor.save(out, {})
    return out


@pytest.fixture(scope="module")
def data_and_warm_model(tmp_path_factory) -> tuple[Path, Path, Path]:
    """The addition data and the warm-started model, made once for both rows: under xdist in the
    session's directory that both workers share (`build_once`: one builds, the other waits),
    since the rows may run on either."""
    from vime.datagen import write_dataset
    from vime.models import build_once

    here = tmp_path_factory.getbasetemp()
    shared = here.parent if os.environ.get("PYTEST_XDIST_WORKER") else here
    train, test = write_dataset("addition", here / "learning-data", n_train=80, n_test=20, seed=0, digits=1)
    return train, test, build_once(shared / "learning-warm", lambda out: warm_start(out, train))


@pytest.mark.slow
@pytest.mark.parametrize(
    "script, extra",
    [
        ("train.py", []),
        ("train_async.py", ["--use-tis"]),
        # issue 31's objectives passed this bar too (gspo, cispo, REINFORCE++ with and without
        # baseline, dynamic sampling; 2026-12-02) but are not run here: with one optimizer step per
        # rollout GSPO and CISPO take GRPO's gradient exactly (bench/RESULTS.md), so their rows
        # would repeat sync's for CI minutes; tests/unit/algorithms/test_objectives.py shows each training and
        # bench/objective_sweep.py compares them, also off-policy
    ],
    ids=["sync", "one-step-off"],
)
def test_grpo_gains_held_out(tmp_path, data_and_warm_model, script, extra):
    """Both modes must gain 20 points in 30 steps (STEPS). One-step-off trains on samples one policy
    version old, with truncated importance sampling. The learning rate matters for
    it: at 1e-3 stale samples made the gain erratic (15–55 points in 8 runs of 120 steps); at
    5e-4 the gain was 45–65 points over 7 seeds and sync's 50–60 (no run of either below 45)."""
    train, test, model = data_and_warm_model
    train_here(  # in this process: the test reads what the run wrote
        script,
        "--hf-checkpoint",
        str(model),
        "--prompt-data",
        str(train),
        "--eval-prompt-data",
        str(test),
        "--rollout-batch-size",
        "16",
        "--n-samples-per-prompt",
        "8",
        "--rollout-max-response-len",
        "4",
        "--num-rollout",
        str(STEPS),
        "--eval-interval",
        str(STEPS),
        "--lr",
        "5e-4",
        "--rollout-shuffle",
        "--runs-dir",
        str(tmp_path),
        "--run-name",
        "grpo",
        *extra,
    )
    rows = [json.loads(line) for line in (tmp_path / "grpo" / "metrics.jsonl").read_text().splitlines()]
    evals = {r["step"]: r["eval/accuracy"] for r in rows if "eval/accuracy" in r}
    assert set(evals) == {0, STEPS}
    assert evals[STEPS] - evals[0] >= 0.20, f"held-out greedy accuracy {evals[0]:.2f} → {evals[STEPS]:.2f}"
