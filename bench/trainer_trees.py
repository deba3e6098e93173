"""The trainer bench of several trees side by side, alternately, in one call: the way to pin a trainer
speed regression on a commit range (issue 50) without comparing figures from different machines.

    git archive <rev> vime bench | tar -x -C .old/<rev>      # for each old tree, here
    python3 bench/trainer_trees.py --trees .old/6b009fa,.old/5088f45,. --passes 2 --steps 3

Each tree runs its *own* `bench/bench_trainer.py --no-hf` (the bench of its day, so an old tree is
measured as it was) in a fresh process with the tree first on PYTHONPATH. Pass 1 pays each tree's
compile warm-up; later passes find inductor's cache warm. The table gives every vime variant's
tok/s and MFU per tree: the median over passes, and the spread (max − min) that tells a change
from noise.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

LINE = re.compile(r"^(vime [^:]+): (\d+) ms/step, ([\d,]+) tok/s, MFU ([\d.]+%|n/a)", re.M)


def one_bench(tree: Path, steps: int, extra: list[str], timeout: float) -> dict[str, tuple[float, float]]:
    """{variant: (tok/s, MFU %)} from one run of the tree's own trainer bench."""
    env = {**os.environ, "PYTHONPATH": f"{tree}:{os.environ.get('PYTHONPATH', '')}"}
    cmd = [sys.executable, "bench/bench_trainer.py", "--no-hf", "--steps", str(steps), *extra]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=timeout)
    if p.returncode != 0:
        print(f"{tree}: exit {p.returncode}\n{p.stderr[-2000:]}", flush=True)
        return {}
    found = {
        m[0]: (float(m[2].replace(",", "")), float(m[3].rstrip("%")) if m[3] != "n/a" else float("nan"))
        for m in LINE.findall(p.stdout)
    }
    print(f"{tree}: {time.perf_counter() - t0:.0f} s {found}", flush=True)
    return found


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trees", required=True, help="comma-separated tree folders (each with vime/ and bench/)")
    p.add_argument("--passes", type=int, default=2, help="rounds over all trees, alternately")
    p.add_argument("--steps", type=int, default=3, help="timed steps per variant, passed to each bench")
    p.add_argument("--bench-args", default="", help="more flags for every bench run, one string")
    p.add_argument("--timeout", type=float, default=300, help="seconds before one bench run is given up")
    a = p.parse_args()
    trees = [Path(t).resolve() for t in a.trees.split(",")]
    runs: dict[Path, list[dict[str, tuple[float, float]]]] = {t: [] for t in trees}
    for _ in range(a.passes):
        for t in trees:
            runs[t].append(one_bench(t, a.steps, a.bench_args.split(), a.timeout))
    variants = sorted({v for rs in runs.values() for r in rs for v in r})
    print("\n| tree | variant | tok/s (median) | spread | MFU % (median) | runs |")
    print("|---|---|---:|---:|---:|---:|")
    for t in trees:
        for v in variants:
            vals = [r[v] for r in runs[t] if v in r]
            if not vals:
                continue
            tok = [x[0] for x in vals]
            print(
                f"| {t.name} | {v} | {statistics.median(tok):,.0f} | {max(tok) - min(tok):,.0f} "
                f"| {statistics.median(x[1] for x in vals):.1f} | {len(vals)} |"
            )


if __name__ == "__main__":
    main()
