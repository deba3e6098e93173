"""The accuracy A/B on the toy task, on CPU: the learning test's setting through every mode.

A tiny Qwen3 is warm-started with the learning test's flawed SFT (tests/test_learning.py: 70% of
its targets carry a stray "0"), then `vime bench ab` trains it with GRPO on one-digit addition in
each mode (same config, seeds and 80 steps; TIS on) and prints the speed and held-out accuracy
tables. CPU speeds here are not the point (trainer and engine share two cores); accuracy is.

    PYTHONPATH=. python3 bench/toy_ab.py [--out /tmp/vime-toy-ab]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from test_learning import STEPS, warm_start  # noqa: E402

from vime.datagen import write_dataset  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="/tmp/vime-toy-ab")
    p.add_argument("--arms", default="sync,one-step-off,fully-async,decoupled")
    a = p.parse_args()
    out = Path(a.out)
    train, test = write_dataset("addition", out / "data", n_train=80, n_test=20, seed=0, digits=1)
    model = warm_start(out, train)
    cfg = {
        "hf_checkpoint": str(model),
        "prompt_data": str(train),
        "eval_prompt_data": str(test),
        "rollout_batch_size": 16,
        "n_samples_per_prompt": 8,
        "rollout_max_response_len": 4,
        "num_rollout": STEPS,
        "eval_interval": STEPS,
        "lr": 5e-4,
        "rollout_shuffle": True,
        "use_tis": True,
    }
    (out / "run.yaml").write_text(yaml.safe_dump(cfg))
    cmd = [
        sys.executable,
        "-m",
        "vime.cli",
        "bench",
        "ab",
        "--config",
        str(out / "run.yaml"),
        "--arms",
        a.arms,
        "--runs-dir",
        str(out / "runs"),
    ]
    return subprocess.run(cmd).returncode


if __name__ == "__main__":
    sys.exit(main())
