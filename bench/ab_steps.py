"""Per-step timings of every run under a directory (bench_ab.py's --out): step, train, train
wait and push seconds, one row per step, so a compile step or a stall is seen rather than
averaged away.

    python3 bench/ab_steps.py /tmp/vime-ab
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

KEYS = ("perf/step_time", "perf/train_time", "perf/train_wait_time", "perf/update_weights_time", "perf/mfu")


def main(root: str) -> None:
    for metrics in sorted(Path(root).rglob("metrics.jsonl")):
        rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
        rows = [r for r in rows if "perf/step_time" in r]
        print(f"\n{metrics.parent.name}\n\n| step | " + " | ".join(k.split("/")[1] for k in KEYS) + " |")
        print("|---" * (len(KEYS) + 1) + "|")
        for r in rows:
            cells = [f"{r[k]:.3f}" if k in r else "" for k in KEYS]
            print(f"| {r['step']} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "/tmp/vime-ab")
