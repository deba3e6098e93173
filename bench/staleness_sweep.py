"""Held-out accuracy against staleness on CPU: AReaL's staleness study on the learning test's toy task.

The tiny Qwen3 is warm-started once with the learning test's flawed SFT (tests/e2e/test_learning.py:
70% of its targets carry a stray "0"), then trained with GRPO on one-digit addition in decoupled
mode (`train_async.py --max-staleness K`) for each bound K, each objective and each seed, 80 steps
as in the learning test. The worker admits a prompt only when its tokens can stay within K
optimizer steps of the weights that train them, and generation here is much faster than
training, so it runs ahead to the bound: the measured staleness (printed) is what the row says.

Objectives (one optimizer step per rollout, so the ratio against the current weights starts at 1):
  ppo-clip   coupled PPO: the ratio and its clip against the engine's log-probs (--use-rollout-logprobs),
             AReaL's "naive PPO"
  none       the clip against the current weights (the proximal policy), no correction for who
             sampled (with one step per rollout, a plain policy gradient; vime's default when this
             sweep was first run, --off-policy-correction none since)
  tis        vime's default now: the clip against the current weights (the proximal policy),
             each token weighted by π_prox/π_behav truncated at 2 (--use-tis)
  decoupled  AReaL's decoupled PPO: as tis, but the weight untruncated and tokens whose weight
             exceeds 5 dropped (--use-tis --tis-mode mask --tis-clip 5)
  m2po       M2PO: no weight; the tokens of largest (log π_prox/π_behav)² masked until the rest's
             mean is at most 0.04 (--off-policy-correction m2po)

    PYTHONPATH=. python3 bench/staleness_sweep.py [--out /tmp/vime-staleness] [--staleness 0,1,2,4,8] [--seeds 1,2]

Prints one line per run as it finishes, then the table (correct/total on the 20 held-out prompts,
greedy, after the last step; staleness mean/max over all trained tokens).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from bench.toy_task import STEPS, toy_task  # noqa: E402
from vime.ab import run_arm  # noqa: E402

OBJECTIVES: dict[str, list[str]] = {
    "ppo-clip": ["--use-rollout-logprobs"],
    # explicit: since the auto correction became tis wherever samples can be stale, no flag is tis
    "none": ["--off-policy-correction", "none"],
    "tis": ["--use-tis"],
    "decoupled": ["--use-tis", "--tis-mode", "mask", "--tis-clip", "5"],
    "m2po": ["--off-policy-correction", "m2po"],
}


def summarize(run_dir: Path) -> dict[str, float]:
    """Held-out accuracy before and after, and the staleness the run trained at."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = {r["step"]: r for r in rows if "eval/correct" in r}
    steps = [r for r in rows if "rollout/staleness_mean" in r]
    first, last = evals[min(evals)], evals[max(evals)]
    return {
        "correct_before": first["eval/correct"],
        "correct": last["eval/correct"],
        "total": last["eval/total"],
        "staleness_mean": sum(r["rollout/staleness_mean"] for r in steps) / len(steps),
        "staleness_max": max(r["rollout/staleness_max"] for r in steps),
        "dropped_stale": max((r.get("rollout/dropped_stale", 0.0) for r in steps), default=0.0),
    }


def table(
    results: dict[tuple[str, int, int], dict[str, float]], objectives: list[str], bounds: list[int], seeds: list[int]
) -> str:
    head = "| objective | " + " | ".join(f"K={k}" for k in bounds) + " |"
    lines = [head, "|---|" + "---:|" * len(bounds)]
    for obj in objectives:
        cells = []
        for k in bounds:
            runs = [results[(obj, k, s)] for s in seeds if (obj, k, s) in results]
            if not runs:
                cells.append("–")
                continue
            per_seed = " + ".join(f"{r['correct']}" for r in runs)
            total = sum(r["total"] for r in runs)
            stale = sum(r["staleness_mean"] for r in runs) / len(runs)
            cells.append(f"{per_seed} = **{sum(r['correct'] for r in runs)}/{total}** (stale {stale:.2f})")
        lines.append(f"| {obj} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="/tmp/vime-staleness")
    p.add_argument("--staleness", default="0,1,2,4,8", help="comma-separated --max-staleness bounds")
    p.add_argument("--objectives", default=",".join(OBJECTIVES), help=f"comma-separated, of {', '.join(OBJECTIVES)}")
    p.add_argument("--seeds", default="1,2", help="comma-separated; each sets --seed and --rollout-seed")
    p.add_argument("--steps", type=int, default=STEPS)
    a = p.parse_args()
    bounds = [int(x) for x in a.staleness.split(",")]
    objectives = [x for x in a.objectives.split(",") if x]
    seeds = [int(x) for x in a.seeds.split(",")]
    unknown = set(objectives) - set(OBJECTIVES)
    if unknown:
        p.error(f"unknown objective(s) {', '.join(sorted(unknown))}: choose from {', '.join(OBJECTIVES)}")
    out = Path(a.out)
    config = toy_task(out, a.steps)
    results: dict[tuple[str, int, int], dict[str, float]] = {}
    t_all = time.perf_counter()
    for seed in seeds:
        for k in bounds:
            for obj in objectives:
                name = f"{obj}-k{k}-s{seed}"
                run_dir = out / "runs" / name
                if not (run_dir / "metrics.jsonl").exists():
                    t0 = time.perf_counter()
                    run_arm(
                        "decoupled",
                        str(config),
                        name,
                        str(out / "runs"),
                        [*OBJECTIVES[obj], "--seed", str(seed), "--rollout-seed", str(seed)],
                        staleness=k,
                    )
                    print(f"[sweep] {name} took {time.perf_counter() - t0:.0f} s", flush=True)
                r = results[(obj, k, seed)] = summarize(run_dir)
                print(
                    f"[sweep] {name}: {r['correct_before']}/{r['total']} -> {r['correct']}/{r['total']} held-out, "
                    f"staleness mean {r['staleness_mean']:.2f} max {r['staleness_max']:.0f}, dropped stale {r['dropped_stale']:.0f}",
                    flush=True,
                )
    (out / "results.json").write_text(json.dumps({f"{o}|{k}|{s}": v for (o, k, s), v in results.items()}, indent=1))
    print(
        f"\nheld-out greedy correct after {a.steps} steps, per seed ({', '.join(map(str, seeds))}) and summed; mean staleness in optimizer steps"
    )
    print(table(results, objectives, bounds, seeds))
    print(f"\nsweep wall time {time.perf_counter() - t_all:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
