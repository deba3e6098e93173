"""The accuracy A/B on the toy task, on CPU: the learning test's setting through every mode.

A tiny Qwen3 is warm-started with the learning test's flawed SFT (tests/e2e/test_learning.py: 70% of
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

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from bench.toy_task import toy_task  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="/tmp/vime-toy-ab")
    p.add_argument("--arms", default="sync,one-step-off,fully-async,decoupled")
    a = p.parse_args()
    out = Path(a.out)
    config = toy_task(out, use_tis=True)
    cmd = [
        sys.executable,
        "-m",
        "vime.cli",
        "bench",
        "ab",
        "--config",
        str(config),
        "--arms",
        a.arms,
        "--runs-dir",
        str(out / "runs"),
    ]
    return subprocess.run(cmd).returncode


if __name__ == "__main__":
    sys.exit(main())
