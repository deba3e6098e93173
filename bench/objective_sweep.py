"""Held-out accuracy and step time of each objective on the learning test's toy task (CPU).

The stand-in for issue 31's H200 table until device time allows it (that one is
`bench/real_ab.py --variants` on the demo task): the tiny Qwen3, warm-started once with the
learning test's flawed SFT (tests/e2e/test_learning.py), trained in sync mode for 80 steps of 16
prompts × 8 samples on one-digit addition with each objective and seed, every run a fresh
process (vime.ab.run_arm). Held-out: the 20 test prompts, greedy, before the first step and after
the last. Step time is the mean `perf/step_time` (CPU: compare within one call only).

    PYTHONPATH=. python3 bench/objective_sweep.py [--seeds 1,2,3] [--objectives grpo,gspo] [--out DIR]
    PYTHONPATH=. python3 bench/objective_sweep.py --objectives grpo,gspo,cispo,reinforce_pp_baseline \\
        --extra '--num-steps-per-rollout 4' --out /tmp/vime-objectives-4   # off-policy steps
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from bench.toy_task import STEPS, toy_task  # noqa: E402
from vime.ab import run_arm  # noqa: E402

OBJECTIVES: dict[str, list[str]] = {
    "grpo": [],
    "dr_grpo": ["--advantage-estimator", "dr_grpo"],
    "gspo": ["--advantage-estimator", "gspo", "--eps-clip", "4e-4"],
    "cispo": ["--advantage-estimator", "cispo", "--eps-clip", "1", "--eps-clip-high", "4"],
    "reinforce_pp_baseline": ["--advantage-estimator", "reinforce_plus_plus_baseline"],
    "dynamic-sampling": ["--dynamic-sampling-filter-path", "vime.rollout.filters.check_reward_nonzero_std"],
}


def summarize(run_dir: Path) -> dict[str, float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = {r["step"]: r for r in rows if "eval/correct" in r}
    steps = [r for r in rows if "perf/step_time" in r]
    first, last = evals[min(evals)], evals[max(evals)]
    return {
        "before": first["eval/correct"],
        "correct": last["eval/correct"],
        "total": last["eval/total"],
        "step_time": statistics.mean(r["perf/step_time"] for r in steps),
        "dropped": sum(r.get("rollout/dynamic_filter/dropped", 0.0) for r in steps),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="/tmp/vime-objectives")
    p.add_argument("--objectives", default=",".join(OBJECTIVES), help=f"comma-separated, of {', '.join(OBJECTIVES)}")
    p.add_argument("--seeds", default="1,2,3", help="comma-separated; each sets --seed and --rollout-seed")
    p.add_argument("--steps", type=int, default=STEPS)
    p.add_argument(
        "--extra",
        default="",
        help="flags added to every run, one string (e.g. '--num-steps-per-rollout 4': off-policy optimizer steps, "
        "where the objectives differ; with one step per rollout GRPO, GSPO and CISPO take the same gradient)",
    )
    a = p.parse_args()
    objectives = [x for x in a.objectives.split(",") if x]
    unknown = set(objectives) - set(OBJECTIVES)
    if unknown:
        p.error(f"unknown objective(s) {', '.join(sorted(unknown))}: choose from {', '.join(OBJECTIVES)}")
    seeds = [int(x) for x in a.seeds.split(",")]
    out = Path(a.out)
    config = toy_task(out, a.steps)
    results: dict[tuple[str, int], dict[str, float]] = {}
    t_all = time.perf_counter()
    for seed in seeds:
        for obj in objectives:
            name = f"{obj}-s{seed}"
            run_dir = out / "runs" / name
            if not (run_dir / "metrics.jsonl").exists():
                extra = [*OBJECTIVES[obj], *shlex.split(a.extra), "--seed", str(seed), "--rollout-seed", str(seed)]
                run_arm("sync", str(config), name, str(out / "runs"), extra)
            r = results[(obj, seed)] = summarize(run_dir)
            print(
                f"[objectives] {name}: {r['before']}/{r['total']} -> {r['correct']}/{r['total']} held-out, "
                f"step {r['step_time']:.2f} s",
                flush=True,
            )
    (out / "results.json").write_text(json.dumps({f"{o}|{s}": v for (o, s), v in results.items()}, indent=1))
    print(
        f"\nheld-out greedy correct after {a.steps} steps (20 prompts), per seed ({', '.join(map(str, seeds))}), "
        "summed, and the gain over the warm start; mean step time over the seeds"
    )
    print(
        "\n| objective | correct per seed | total | gain (points) | step (s) | groups dropped |\n|---|---|---:|---:|---:|---:|"
    )
    for obj in objectives:
        runs = [results[(obj, s)] for s in seeds if (obj, s) in results]
        total = sum(r["total"] for r in runs)
        gain = 100 * (sum(r["correct"] for r in runs) - sum(r["before"] for r in runs)) / total
        print(
            f"| {obj} | {' + '.join(str(r['correct']) for r in runs)} | {sum(r['correct'] for r in runs)}/{total} "
            f"| {gain:+.1f} | {statistics.mean(r['step_time'] for r in runs):.2f} "
            f"| {sum(r['dropped'] for r in runs):.0f} |"
        )
    print(f"\nsweep wall time {time.perf_counter() - t_all:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
