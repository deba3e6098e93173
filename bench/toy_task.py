"""The learning test's toy task as a run config, shared by the toy benches (staleness_sweep,
objective_sweep, toy_ab): one-digit addition, the tiny Qwen3 warm-started with the flawed SFT of
tests/e2e/test_learning.py (made once per output directory, then reused), 16 prompts × 8 samples."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from test_learning import warm_start  # noqa: E402

from vime.datagen import write_dataset  # noqa: E402

# the benches' run length, as the learning test had it when their results were recorded (the
# test now stops at 30 steps, where it has gained what it asserts)
STEPS = 80


def toy_task(out: Path, steps: int = STEPS, **overrides: Any) -> Path:
    """Write the data, the warm-started model and `out/run.yaml`; returns the config's path."""
    train, test = write_dataset("addition", out / "data", n_train=80, n_test=20, seed=0, digits=1)
    model = out / "warm" if (out / "warm" / "model.safetensors").exists() else warm_start(out / "warm", train)
    cfg = {
        "hf_checkpoint": str(model),
        "prompt_data": str(train),
        "eval_prompt_data": str(test),
        "rollout_batch_size": 16,
        "n_samples_per_prompt": 8,
        "rollout_max_response_len": 4,
        "num_rollout": steps,
        "eval_interval": steps,
        "lr": 5e-4,
        "rollout_shuffle": True,
        **overrides,
    }
    path = out / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path
