"""The seed's accuracy table on a real model: does async training cost accuracy?

SmolLM2-135M-Instruct (`resolve_model("smollm2")`, or --model DIR) is trained with GRPO on the
demo's task (examples/demo.py: its data, prompt wording, reward and settings, GPU or CPU ones)
once per arm and seed: sync, one-step-off, fully-async (and, asked for, decoupled with
`--max-staleness --staleness`), each a fresh `vime train` / `vime train-async` process on the
same config, seeds and step budget (vime.ab.run_arm). Every
run evaluates greedily on the same held-out prompts before its first step (the baseline row:
the same weights in every run) and after its last; the table gives correct/total, the change in
points against the baseline, and the standard error of that change (paired over the prompts).

    PYTHONPATH=. python3 bench/real_ab.py                      # GPU settings when CUDA is visible, else CPU
    PYTHONPATH=. python3 bench/real_ab.py --seeds 1,2 --steps 40 --out /tmp/vime-real-ab
    PYTHONPATH=. python3 bench/real_ab.py --steps 1 --eval-limit 4 --batch 2 --n-samples 2   # smoke test

A finished run (its final eval logged) is not run again, so a later call with more seeds or
arms and the same --out adds only what is missing; the table covers everything asked for.
Writes <out>/real_ab.md (the table) and <out>/results.json.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "examples")]

from demo import demo_config, demo_data, demo_settings  # noqa: E402

from vime.ab import run_arm  # noqa: E402
from vime.models import resolve_model  # noqa: E402
from vime.report import eval_results, paired_change  # noqa: E402

ARMS = ("sync", "one-step-off", "fully-async", "decoupled")


def table(results: dict[str, dict], arms: list[str], seeds: list[int], base: dict[int, bool]) -> str:
    n = len(base)
    c0 = sum(base.values())
    lines = [
        "| arm | seed | held-out correct/total | accuracy | change (points) | ± SE (paired) | wall time (s) |",
        "|---|---:|---:|---:|---:|---:|---:|",
        f"| baseline (before training) | – | {c0}/{n} | {100 * c0 / n:.1f}% | | | |",
    ]
    for arm in arms:
        for seed in seeds:
            r = results.get(f"{arm}|{seed}")
            if r is None:
                lines.append(f"| {arm} | {seed} | (not run) | | | | |")
                continue
            lines.append(
                f"| {arm} | {seed} | {r['correct']}/{r['total']} | {100 * r['correct'] / r['total']:.1f}% | "
                f"{r['change']:+.1f} | {r['se']:.1f} | {r['wall']:.0f} |"
            )
        done = [results[f"{arm}|{s}"] for s in seeds if f"{arm}|{s}" in results]
        if len(done) > 1:
            c, t = sum(r["correct"] for r in done), sum(r["total"] for r in done)
            change = sum(r["change"] for r in done) / len(done)
            se = math.sqrt(sum(r["se"] ** 2 for r in done)) / len(done)
            lines.append(
                f"| **{arm}, {len(done)} seeds** | all | {c}/{t} | {100 * c / t:.1f}% | **{change:+.1f}** | {se:.1f} | |"
            )
    return "\n".join(lines)


def main() -> int:
    import torch

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arms", default="sync,one-step-off,fully-async", help=f"comma-separated, of {', '.join(ARMS)}")
    p.add_argument("--seeds", default="1", help="comma-separated; each sets --seed and --rollout-seed of every arm")
    p.add_argument(
        "--steps", type=int, default=None, help="training steps per run (default: the demo's for this device)"
    )
    p.add_argument("--eval-limit", type=int, default=None, help="held-out prompts evaluated (default: the demo's, 200)")
    p.add_argument("--batch", type=int, default=None, help="prompts per step (default: the demo's for this device)")
    p.add_argument(
        "--n-samples", type=int, default=None, help="samples per prompt (default: the demo's for this device)"
    )
    p.add_argument(
        "--device",
        default="auto",
        choices=("auto", "cpu", "cuda"),
        help="settings and trainer device (auto: cuda when visible)",
    )
    p.add_argument(
        "--model", default="smollm2", help="HF model directory, or 'smollm2' (the embedded SmolLM2-135M-Instruct)"
    )
    p.add_argument("--staleness", type=int, default=2, help="--max-staleness of the decoupled arm")
    p.add_argument("--out", default="/tmp/vime-real-ab", help="runs, table and results go here")
    p.add_argument("--arm-timeout", type=float, default=None, help="seconds before one run is given up")
    a = p.parse_args()
    arms = [x.strip() for x in a.arms.split(",") if x.strip()]
    bad = set(arms) - set(ARMS)
    if bad:
        p.error(f"unknown arm(s) {', '.join(sorted(bad))}: choose from {', '.join(ARMS)}")
    seeds = [int(x) for x in a.seeds.split(",") if x.strip()]
    gpu = a.device == "cuda" or (a.device == "auto" and torch.cuda.is_available())
    s = demo_settings(gpu)
    if a.steps is not None:
        s["steps"] = a.steps
    for key, value in (("eval_limit", a.eval_limit), ("batch", a.batch), ("n", a.n_samples)):
        if value is not None:
            s[key] = value
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    t_all = time.perf_counter()
    model_dir = resolve_model(a.model)
    train, test = demo_data(out / "data")
    cfg = demo_config(s, model_dir, train, test)
    cfg.update(device="cuda" if gpu else "cpu", use_tensorboard=False, quiet=True)
    cfg_path = out / "real_ab.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    print(
        f"[real-ab] {'GPU' if gpu else 'CPU'} settings {s}; arms {arms}; seeds {seeds}; config {cfg_path}", flush=True
    )

    res_path = out / "results.json"
    results: dict[str, dict] = json.loads(res_path.read_text()) if res_path.exists() else {}
    base: dict[int, bool] | None = None
    for seed in seeds:
        for arm in arms:
            name = f"{arm}-s{seed}-n{s['steps']}"
            run_dir = out / "runs" / name
            evals = eval_results(run_dir) if run_dir.exists() else {}
            if s["steps"] not in evals:
                if run_dir.exists():  # an unfinished run of an earlier call: start it again
                    run_dir.rename(run_dir.with_name(f"{name}.unfinished-{time.strftime('%H%M%S')}"))
                t0 = time.perf_counter()
                run_arm(
                    arm,
                    str(cfg_path),
                    name,
                    str(out / "runs"),
                    ["--seed", str(seed), "--rollout-seed", str(seed)],
                    staleness=a.staleness,
                    timeout=a.arm_timeout,
                )
                wall = time.perf_counter() - t0
                evals = eval_results(run_dir)
            else:
                wall = results.get(f"{arm}|{seed}", {}).get("wall", float("nan"))
            before, after = evals[0], evals[s["steps"]]
            if base is None:
                base = before
            elif before != base:
                print(
                    f"[real-ab] note: {name}'s baseline eval differs from the first run's ({sum(before.values())} vs {sum(base.values())} correct)",
                    flush=True,
                )
            change, se = paired_change(before, after)
            results[f"{arm}|{seed}"] = {
                "correct": sum(after.values()),
                "total": len(after),
                "before": sum(before.values()),
                "change": change,
                "se": se,
                "wall": wall,
                "run_dir": str(run_dir),
            }
            res_path.write_text(json.dumps(results, indent=1))
            print(
                f"[real-ab] {name}: {sum(before.values())}/{len(before)} -> {sum(after.values())}/{len(after)} held-out "
                f"({change:+.1f} ± {se:.1f} points), {wall:.0f} s",
                flush=True,
            )
    assert base is not None
    report = (
        f"SmolLM2-135M-Instruct, {'GPU' if gpu else 'CPU'} settings {s}; greedy held-out accuracy after {s['steps']} steps\n\n"
        + table(results, arms, seeds, base)
        + f"\n\ntotal time of this call {time.perf_counter() - t_all:.0f} s"
    )
    (out / "real_ab.md").write_text(report + "\n")
    print("\n" + report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
