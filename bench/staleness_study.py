"""Why does training on stale samples lose accuracy? A grid of real-model runs, one pool.

Each run is one `vime train` / `train-async` process on bench/real_ab.py's config of the chosen
preset (SmolLM2-135M-Instruct; `lists` by default: sums and lists, a tail the task sets), with
the same seeds and step budget, evaluated greedily on the held-out prompts every
--eval-interval steps. The grid (each cell × each seed):

* sync at each learning rate: the reference;
* decoupled (`train_async.py --max-staleness K`) at each K, each correction and each learning
  rate: staleness bounded by K and reached (the worker runs ahead to the bound);
* fully-async at each `--update-in-flight` policy (what a weight push does to the groups being
  generated: keep them going with the new weights, abort and regenerate them, or resume them)
  and each learning rate, with its default correction.

Every run logs the loss's diagnostics split by the staleness of the trained tokens
(`stale/<k>/...`); the report prints them per cell (means over steps and seeds) beside the
accuracy tables, the accuracy at every eval and the wait share by tenth of the run.

    PYTHONPATH=. python3 bench/staleness_study.py --seeds 1,2,3 --parallel 6 \\
        --staleness 1,2,4 --corrections tis,m2po --lrs 1e-5,2e-5 --in-flight keep,abort,resume
    PYTHONPATH=. python3 bench/staleness_study.py --report-only --out DIR

Runs share the GPU (`--parallel`), so their speed columns are not a quiet machine's; this study
is about accuracy. A finished run is not run again: a later call with the same --out adds only
what is missing. Writes <out>/study.md and <out>/results.json.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench"), str(ROOT / "examples")]

from demo import demo_config  # noqa: E402
from real_ab import (  # noqa: E402
    PRESETS,
    Runner,
    accuracy_table,
    closing,
    per_step_tables,
    plot,
    settings,
    speed_table,
    write_data,
)

from vime.models import resolve_model  # noqa: E402

Job = tuple[str, str | None, list[str], int]


def grid(a: argparse.Namespace, seeds: list[int]) -> tuple[list[str], list[Job]]:
    """The study's labels (in report order) and its jobs."""
    lrs = [x.strip() for x in a.lrs.split(",") if x.strip()]
    cells: list[tuple[str, str, list[str]]] = []  # (arm, tag, flags)
    for lr in lrs:
        cells.append(("sync", f"lr{lr}", ["--lr", lr]))
    for k in [int(x) for x in a.staleness.split(",") if x.strip()]:
        for corr in [x.strip() for x in a.corrections.split(",") if x.strip()]:
            for lr in lrs:
                flags = ["--max-staleness", str(k), "--off-policy-correction", corr, "--lr", lr]
                cells.append(("decoupled", f"K{k}-{corr}-lr{lr}", flags))
    for policy in [x.strip() for x in a.in_flight.split(",") if x.strip()]:
        for lr in lrs:
            cells.append(("fully-async", f"{policy}-lr{lr}", ["--update-in-flight", policy, "--lr", lr]))
    if a.only:
        keep = {x.strip() for x in a.only.split(",") if x.strip()}
        unknown = keep - {tag for _, tag, _ in cells}
        if unknown:
            raise SystemExit(f"--only names cells the grid does not make: {sorted(unknown)}; widen the grid flags")
        cells = [c for c in cells if c[1] in keep]
    labels = [f"{arm} / {tag}" for arm, tag, _ in cells]
    jobs = [(arm, tag, flags, seed) for seed in seeds for arm, tag, flags in cells]
    return labels, jobs


def main() -> int:
    import torch

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="lists", choices=tuple(PRESETS), help="bench/real_ab.py's workload")
    p.add_argument("--seeds", default="1,2,3", help="comma-separated; each sets --seed and --rollout-seed")
    p.add_argument("--staleness", default="1,2,4", help="--max-staleness bounds of the decoupled cells")
    p.add_argument("--corrections", default="tis,m2po", help="--off-policy-correction values of the decoupled cells")
    p.add_argument("--lrs", default="1e-5,2e-5", help="learning rates of every cell")
    p.add_argument(
        "--in-flight",
        default="keep,abort,resume",
        help="--update-in-flight policies of the fully-async cells ('' none)",
    )
    p.add_argument(
        "--only",
        default="",
        help="comma-separated cell tags to keep from the grid (e.g. K2-tis-lr2e-5,abort-lr2e-5); '' all",
    )
    p.add_argument("--steps", type=int, default=None, help="steps per run (default: the preset's)")
    p.add_argument("--eval-interval", type=int, default=None, help="steps between evals (default: the preset's)")
    p.add_argument("--arm-args", default="", help="extra flags for every run, one string")
    p.add_argument("--parallel", type=int, default=1, help="runs at once on the one device")
    p.add_argument("--arm-timeout", type=float, default=None, help="seconds before one run is given up")
    p.add_argument("--model", default="smollm2", help="HF model directory, or 'smollm2' (the embedded default)")
    p.add_argument("--out", default="/tmp/vime-staleness-study", help="runs, tables and results go here")
    p.add_argument("--report-only", action="store_true", help="print the tables of --out's results.json")
    a = p.parse_args()
    seeds = [int(x) for x in a.seeds.split(",") if x.strip()]
    labels, jobs = grid(a, seeds)
    gpu = torch.cuda.is_available()
    s = settings(a.preset, gpu)
    s.update({k: v for k, v in (("steps", a.steps), ("eval_interval", a.eval_interval)) if v is not None})
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    res_path = out / "results.json"
    results: dict[str, dict] = json.loads(res_path.read_text()) if res_path.exists() else {}
    t0 = time.perf_counter()
    failed: list[str] = []
    meta = out / "settings.json"  # what the runs were made with, for --report-only on another machine
    if a.report_only and meta.exists():
        s = json.loads(meta.read_text())
    if not a.report_only:
        meta.write_text(json.dumps(s))
        train, test = write_data(a.preset, out)
        cfg = demo_config(s, resolve_model(a.model), train, test)
        cfg.update(device="cuda" if gpu else "cpu", use_tensorboard=False, quiet=True, eval_interval=s["eval_interval"])
        if a.preset == "lists":
            cfg["rm_type"] = "exact"
        cfg_path = out / "study.yaml"
        import yaml

        cfg_path.write_text(yaml.safe_dump(cfg, sort_keys=False))
        print(f"[study] {a.preset}, settings {s}; {len(labels)} cells × {len(seeds)} seeds", flush=True)
        runner = Runner(out, cfg_path, s["steps"], 2, a.arm_timeout, shlex.split(a.arm_args), results, gpu)
        failed = runner.run_all(jobs, a.parallel)
    done = [lab for lab in labels if any(f"{lab}|{x}" in results for x in seeds)]
    if not done:
        p.error(f"no results in {res_path}: run without --report-only first")
    base = next((r["before"], r["total"]) for r in results.values())
    png = plot(results, done, seeds, out / "accuracy_vs_elapsed.png")
    report = (
        f"SmolLM2-135M-Instruct, preset {a.preset}, settings {s}; runs shared the device ({a.parallel} at a time)\n\n"
        + accuracy_table(results, done, seeds, base)
        + per_step_tables(results, done, seeds)
        + "\n\nspeed (shared device: for the staleness each cell reached, not for speedups)\n\n"
        + speed_table(results, done, seeds)
        + closing(results, done, seeds, png, t0)
    )
    (out / "study.md").write_text(report + "\n")
    print("\n" + report)
    if failed:
        print(f"[study] {len(failed)} runs failed:\n" + "\n".join(failed), flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
