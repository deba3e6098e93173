"""Old tree against this one, side by side on this machine: the same tiny CPU run (examples/tiny.yaml),
alternately, so a restructuring that claims "behaviour and speed unchanged" is held to it.

    python bench/tree_ab.py --old ccd06a0 --rollouts 40 --repeats 3

The old tree is checked out with `git worktree add --detach` into a temporary folder and run with
this checkout's Python environment; each run's per-step means skip the first 5 steps (warm-up).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KEYS = {
    "train_time": "perf/train_time",
    "rollout_time": "perf/rollout_time",
    "update_weights": "perf/update_weights_time",
}


def one_run(tree: Path, out: Path, rollouts: int) -> dict[str, float]:
    """Wall seconds of one run from the command to its end, and its per-step means in ms."""
    cmd = [sys.executable, "train.py", "--config", "examples/tiny.yaml", "--num-rollout", str(rollouts)]
    start = time.perf_counter()
    subprocess.run([*cmd, "--runs-dir", str(out), "--run-name", "r"], cwd=tree, check=True, capture_output=True)
    wall = time.perf_counter() - start
    rows = [json.loads(line) for line in (out / "r" / "metrics.jsonl").read_text().splitlines()][5:]
    return {"wall": wall, **{k: 1e3 * statistics.mean(r[m] for r in rows) for k, m in KEYS.items()}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--old", required=True, help="the git revision to compare with (e.g. the commit before a restructuring)"
    )
    p.add_argument("--rollouts", type=int, default=40)
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        old = Path(tmp) / "old"
        subprocess.run(["git", "worktree", "add", "-q", "--detach", str(old), a.old], cwd=ROOT, check=True)
        try:
            results: dict[str, list[dict[str, float]]] = {"old": [], "new": []}
            for i in range(a.repeats):
                for name, tree in (("old", old), ("new", ROOT)):
                    results[name].append(one_run(tree, Path(tmp) / f"{name}{i}", a.rollouts))
                    print(name, i, {k: round(v, 2) for k, v in results[name][-1].items()}, flush=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(old)], cwd=ROOT, check=False)
    print(
        f"\n| tree | wall s | train ms/step | rollout ms/step | push ms/step |  ({a.repeats} runs each, {a.rollouts} rollouts)"
    )
    print("|---|---:|---:|---:|---:|")
    for name, runs in results.items():
        cells = [
            f"{statistics.mean(r[k] for r in runs):.2f} ± {statistics.pstdev(r[k] for r in runs):.2f}"
            for k in ("wall", *KEYS)
        ]
        print(f"| {name} ({a.old if name == 'old' else 'HEAD'}) | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
