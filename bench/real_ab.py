"""The founding experiment's two tables, speed and accuracy, on a real model: is async faster, and as accurate?

The founding experiment, the research team's Qwen3-4B GRPO run, set sync and fully-async side by
side in those two tables; here the model is a small one.

SmolLM2-135M-Instruct (`resolve_model("smollm2")`, or --model DIR) is trained with GRPO once per
arm and seed, each run a fresh `vime train` / `vime train-async` process on the same config,
seeds and step budget (vime.ab.run_arm), with default flags unless --arm-args adds some. Every
run evaluates greedily on the same held-out prompts before its first step (the baseline: the
same weights in every run), every --eval-interval steps and after its last.

Presets (the GPU settings when CUDA is visible, else small CPU ones):
* `demo`: the demo's task and settings (examples/demo.py): two-term sums answered in ~11
  tokens. Rollouts are short and even, so async has little to hide there.
* `longtail`: the same sums, but the prompt asks for the working and responses may run to 256
  tokens: most end within ~80, a few run to the cap, and a sync step waits for the longest. RL
  teaches the model within ~10 steps to skip the working, so the tail is gone for most of the run.
* `lists`: a tail the task sets, not the policy. Half the prompts are the demo's sums (an answer
  of a few tokens), half ask for the integers from a to b (`list_range`: the answer is the whole
  list, 2 to 64 numbers, log-uniform, so most are short and a few run to ~260 tokens). Graded
  exactly (`--rm-type exact`): a list is right only in full, in order. No policy can shorten a
  right answer, so a sync step waits for its longest list over the whole run.

Printed last, per arm (each seed a row, then their mean):
* speed: step time, train wait and its share, train, update weights (means per step, evals
  excluded), wall clock (sum of step times), elapsed (the stopwatch from the first step to the
  last, evals included: in async modes generation goes on during an eval, so only this clock
  charges every second), and the speedup in elapsed time against the first arm;
* accuracy: correct/total after the last step, the change in points against the baseline with
  its standard error (paired over the prompts), the mean over seeds with the spread of the seeds
  and the pooled standard error, and points gained per elapsed minute;
* a PNG of held-out accuracy against elapsed time, one line per arm and seed (matplotlib).

    PYTHONPATH=. python3 bench/real_ab.py --preset longtail --seeds 1,2,3      # the founding experiment's two tables
    PYTHONPATH=. python3 bench/real_ab.py --arms fully-async --seeds 1,2,3 \\
        --corrections none,tis,icepop,decoupled-ppo --parallel 4                # the correction sweep
    PYTHONPATH=. python3 bench/real_ab.py --arms sync --seeds 1,2,3 --parallel 5 --variants \\
        'grpo=--advantage-estimator grpo;dr_grpo=--advantage-estimator dr_grpo;gspo=--advantage-estimator gspo
        --eps-clip 4e-4;cispo=--advantage-estimator cispo --eps-clip 1 --eps-clip-high 4;dynamic=--dynamic-sampling-filter-path
        vime.rollout.filters.check_reward_nonzero_std'                            # the objective sweep (issue 31)
    PYTHONPATH=. python3 bench/real_ab.py --steps 1 --eval-limit 4 --batch 2 --n-samples 2   # smoke test
    PYTHONPATH=. python3 bench/real_ab.py --report-only --out DIR [--merge a.json b.json]

A finished run (its final eval logged) is not run again, so a later call with more seeds or
arms and the same --out adds only what is missing. `--parallel N` runs N at once: for accuracy
sweeps only, as runs sharing a device slow each other (their speed columns are then not
comparable with a quiet machine's); on a GPU each built-in engine then gets a fixed 8,192 KV-cache
blocks unless the run's flags give --engine-num-kv-blocks. Writes <out>/real_ab.md, <out>/results.json and
<out>/accuracy_vs_elapsed.png.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "examples")]

from demo import N_TEST, N_TRAIN, demo_config, demo_data, demo_settings  # noqa: E402

from vime.ab import run_arm  # noqa: E402
from vime.datagen import INSTRUCTION, generate  # noqa: E402
from vime.models import resolve_model  # noqa: E402
from vime.modes import MODES  # noqa: E402
from vime.report import eval_results, paired_change, summarize  # noqa: E402

ARMS = tuple(MODES)  # one arm per training mode (vime.modes)
WORKING = "Work it out step by step, then give the final answer after 'Answer:'."
# longtail, GPU: the demo's batch, 256 tokens of room; lr 2e-5 over 40 steps is the demo's lr × steps
LONGTAIL_GPU = dict(steps=40, response_len=256, lr=2e-5, eval_interval=10)
LONGTAIL_CPU = dict(steps=6, batch=4, n=4, response_len=96, eval_limit=40, eval_interval=3)
# lists, GPU: room for the longest list (64 two-digit numbers, ~4 tokens each) and some words
LISTS_GPU = dict(steps=50, response_len=320, lr=1e-5, eval_interval=5)
LISTS_CPU = dict(steps=6, batch=4, n=4, response_len=96, eval_limit=40, eval_interval=3)
LIST_TASK = {"min_len": 2, "max_len": 64, "max_start": 30}
PRESETS = {"demo": ({}, {}), "longtail": (LONGTAIL_GPU, LONGTAIL_CPU), "lists": (LISTS_GPU, LISTS_CPU)}


def settings(preset: str, gpu: bool) -> dict[str, Any]:
    s = demo_settings(gpu)
    s.update(PRESETS[preset][0 if gpu else 1])
    return s


def write_data(preset: str, out: Path) -> tuple[Path, Path]:
    """The demo's train/test split; `longtail` asks each question for its working; `lists`
    interleaves it with as many `list_range` questions (train and test drawn apart)."""
    train, test = demo_data(out / "data")
    if preset == "demo":
        return train, test
    lists = generate("list_range", N_TRAIN + N_TEST, seed=0, **LIST_TASK) if preset == "lists" else []
    paths = []
    for src, extra in ((train, lists[:N_TRAIN]), (test, lists[N_TRAIN:])):
        rows = [json.loads(line) for line in src.read_text().splitlines() if line.strip()]
        if preset == "longtail":
            for r in rows:
                r["input"] = r["input"].replace(INSTRUCTION, WORKING)
        else:  # half and half, alternating; the held-out set keeps its size (N_TEST)
            mixed = [r for pair in zip(rows, extra) for r in pair]
            rows = mixed[: len(rows)]
        dst = out / f"data-{preset}" / src.name
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.write_text("".join(json.dumps(r) + "\n" for r in rows))
        paths.append(dst)
    return paths[0], paths[1]


def summary(run_dir: Path, steps: int) -> dict[str, Any]:
    """What the tables need from one finished run."""
    s = summarize(run_dir)
    evals = eval_results(run_dir)
    before, after = evals[0], evals[steps]
    change, se = paired_change(before, after)
    step_rows = [r for r in s.rows if "perf/step_time" in r]
    elapsed = {r["step"]: r.get("perf/elapsed", r["perf/wall_clock"]) for r in step_rows}
    eval_times = [r["eval/time"] for r in s.rows if "eval/time" in r and r["step"] > 0]
    stale = [r["rollout/staleness_max"] for r in s.rows if "rollout/staleness_max" in r]
    return {
        "correct": sum(after.values()),
        "total": len(after),
        "before": sum(before.values()),
        "change": change,
        "se": se,
        "step_time": s.step_time,
        "wait_time": s.wait_time,
        "train_time": s.train_time,
        "update_time": s.update_time,
        "wall_clock": s.wall_clock,
        "elapsed": elapsed[steps],
        "eval_time": statistics.mean(eval_times) if eval_times else float("nan"),
        "eval_time_first": next((r["eval/time"] for r in s.rows if r["step"] == 0 and "eval/time" in r), float("nan")),
        "staleness_max": max(stale, default=0.0),
        "response_len": statistics.mean(
            r["rollout/response_len_mean"] for r in step_rows if "rollout/response_len_mean" in r
        )
        if any("rollout/response_len_mean" in r for r in step_rows)
        else float("nan"),
        "curve": [(0.0 if k == 0 else elapsed[k], sum(v.values()) / len(v)) for k, v in sorted(evals.items())],
        "by_step": [(k, sum(v.values()) / len(v)) for k, v in sorted(evals.items())],
        "wait_deciles": wait_deciles(step_rows),
        "stale": stale_means(step_rows),
        "run_dir": str(run_dir),
    }


def wait_deciles(rows: list[dict]) -> list[float]:
    """The share of step time spent waiting for the batch, in each tenth of the run's steps:
    does the wait last the whole run, or only its first steps?"""
    n = len(rows)
    out = []
    for d in range(10):
        part = rows[d * n // 10 : (d + 1) * n // 10]
        total = sum(r["perf/step_time"] for r in part)
        out.append(sum(r.get("perf/train_wait_time", 0.0) for r in part) / total if total else float("nan"))
    return out


def stale_means(rows: list[dict]) -> dict[str, dict[str, float]]:
    """Each staleness bucket's diagnostics (`stale/<bucket>/<stat>`), averaged over the steps
    that trained tokens of that bucket; its token share over every step (0 where it had none)."""
    acc: dict[str, dict[str, list[float]]] = {}
    for r in rows:
        for k, v in r.items():
            if k.startswith("stale/") and v is not None:
                _, bucket, stat = k.split("/")
                acc.setdefault(bucket, {}).setdefault(stat, []).append(v)
    out = {b: {k: statistics.mean(v) for k, v in stats.items()} for b, stats in sorted(acc.items())}
    for b, stats in out.items():
        if "token_share" in stats:
            stats["token_share"] = sum(acc[b]["token_share"]) / len(rows)
    return out


def _mean_sd(xs: list[float]) -> tuple[float, float]:
    return statistics.mean(xs), (statistics.stdev(xs) if len(xs) > 1 else float("nan"))


def speed_table(results: dict[str, dict], labels: list[str], seeds: list[int]) -> str:
    lines = [
        "| arm | seed | step time (s) | train wait (s) | wait share | train (s) | update weights (s) | wall clock (s) | elapsed (s) | speedup (elapsed) | eval (s) | max staleness |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    ref = [results[f"{labels[0]}|{s}"]["elapsed"] for s in seeds if f"{labels[0]}|{s}" in results]
    ref_mean = statistics.mean(ref) if ref else float("nan")

    def row(name: str, seed: str, rs: list[dict]) -> str:
        m = {
            k: statistics.mean(r[k] for r in rs)
            for k in ("step_time", "wait_time", "train_time", "update_time", "wall_clock", "elapsed", "eval_time")
        }
        share = m["wait_time"] / m["step_time"] if m["step_time"] else 0.0
        return (
            f"| {name} | {seed} | {m['step_time']:.2f} | {m['wait_time']:.2f} | {100 * share:.0f}% | {m['train_time']:.2f} | "
            f"{m['update_time']:.3f} | {m['wall_clock']:.1f} | {m['elapsed']:.1f} | {ref_mean / m['elapsed']:.2f}× | "
            f"{m['eval_time']:.2f} | {max(r['staleness_max'] for r in rs):.0f} |"
        )

    for label in labels:
        rs = [results[f"{label}|{s}"] for s in seeds if f"{label}|{s}" in results]
        lines += [row(label, str(s), [results[f"{label}|{s}"]]) for s in seeds if f"{label}|{s}" in results]
        if len(rs) > 1:
            lines.append(row(f"**{label}**", f"mean of {len(rs)}", rs))
    return "\n".join(lines)


def accuracy_table(results: dict[str, dict], labels: list[str], seeds: list[int], base: tuple[int, int]) -> str:
    c0, n = base
    lines = [
        "| arm | seed | held-out correct/total | accuracy | change (points) | ± SE (paired) | spread of seeds (sd) | points per elapsed minute |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
        f"| baseline (before training) | – | {c0}/{n} | {100 * c0 / n:.1f}% | | | | |",
    ]
    for label in labels:
        rs = []
        for seed in seeds:
            r = results.get(f"{label}|{seed}")
            if r is None:
                lines.append(f"| {label} | {seed} | (not run) | | | | | |")
                continue
            rs.append(r)
            lines.append(
                f"| {label} | {seed} | {r['correct']}/{r['total']} | {100 * r['correct'] / r['total']:.1f}% | "
                f"{r['change']:+.1f} | {r['se']:.1f} | | {r['change'] / (r['elapsed'] / 60):+.1f} |"
            )
        if len(rs) > 1:
            mean, sd = _mean_sd([r["change"] for r in rs])
            pooled = math.sqrt(sum(r["se"] ** 2 for r in rs)) / len(rs)
            c, t = sum(r["correct"] for r in rs), sum(r["total"] for r in rs)
            per_min = mean / (statistics.mean(r["elapsed"] for r in rs) / 60)
            lines.append(
                f"| **{label}** | mean of {len(rs)} | {c}/{t} | {100 * c / t:.1f}% | **{mean:+.1f}** | {pooled:.1f} | {sd:.1f} | {per_min:+.1f} |"
            )
    return "\n".join(lines)


STALE_COLUMNS = (
    ("token_share", "token share", "{:.0%}"),
    ("train_rollout_logprob_abs_diff", "mean abs(log π_old − log π_rollout)", "{:.3f}"),
    ("log_ratio_sq", "mean (log ratio)²", "{:.3f}"),
    ("is_weight", "correction weight", "{:.3f}"),
    ("is_clipfrac", "outside the TIS band", "{:.1%}"),
    ("pg_clipfrac", "PPO clipped", "{:.1%}"),
    ("advantage", "advantage", "{:+.3f}"),
    ("entropy", "entropy", "{:.3f}"),
    ("response_len", "response length", "{:.0f}"),
)


def staleness_table(results: dict[str, dict], labels: list[str], seeds: list[int]) -> str:
    """Per arm and staleness bucket, the loss's diagnostics averaged over steps and seeds."""
    head = "| arm | staleness | " + " | ".join(t for _, t, _ in STALE_COLUMNS) + " |"
    lines = [head, "|---|---:|" + "---:|" * len(STALE_COLUMNS)]
    for label in labels:
        rs = [results[f"{label}|{s}"] for s in seeds if f"{label}|{s}" in results]
        buckets = sorted({b for r in rs for b in r.get("stale", {})})
        for b in buckets:
            cells = []
            for key, _, fmt in STALE_COLUMNS:
                vals = [r["stale"][b][key] for r in rs if key in r.get("stale", {}).get(b, {})]
                cells.append(fmt.format(statistics.mean(vals)) if vals else "")
            lines.append(f"| {label} | {b} | " + " | ".join(cells) + " |")
    return "\n".join(lines) if len(lines) > 2 else ""


def curve_table(results: dict[str, dict], labels: list[str], seeds: list[int]) -> str:
    """Held-out accuracy at every eval (mean over seeds), and the wait share by tenth of the run."""
    steps = sorted({k for r in results.values() for k, _ in r.get("by_step", [])})
    if not steps:
        return ""
    lines = [
        "| arm | " + " | ".join(f"step {k}" for k in steps) + " | wait share by tenth of the run |",
        "|---|" + "---:|" * len(steps) + "---|",
    ]
    for label in labels:
        rs = [results[f"{label}|{s}"] for s in seeds if f"{label}|{s}" in results]
        if not rs:
            continue
        cells = []
        for k in steps:
            vals = [dict(r.get("by_step", [])).get(k) for r in rs]
            vals = [v for v in vals if v is not None]
            cells.append(f"{100 * statistics.mean(vals):.1f}" if vals else "")
        deciles = [r["wait_deciles"] for r in rs if "wait_deciles" in r]
        shares = " ".join(f"{100 * statistics.mean(d[i] for d in deciles):.0f}" for i in range(10)) if deciles else ""
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {shares} |")
    return "\n".join(lines)


def per_step_tables(results: dict[str, dict], labels: list[str], seeds: list[int]) -> str:
    """The accuracy curve with the wait share by tenth of the run, and the staleness diagnostics."""
    return (
        "\n\nheld-out accuracy (%) at each eval, mean of the seeds; wait share (%) by tenth of the run\n\n"
        + curve_table(results, labels, seeds)
        + "\n\nby staleness of the trained tokens (optimizer steps), means over steps and seeds\n\n"
        + staleness_table(results, labels, seeds)
    )


def closing(results: dict[str, dict], labels: list[str], seeds: list[int], png: Path | None, t0: float) -> str:
    """The verdict, where the plot went and how long the call took."""
    return (
        "\n\n"
        + verdict(results, labels, seeds)
        + (f"\n\nplot: {png}" if png else "")
        + f"\n\ntotal time of this call {time.perf_counter() - t0:.0f} s"
    )


def verdict(results: dict[str, dict], labels: list[str], seeds: list[int]) -> str:
    """The targets (../shared/DESIGN.md), read off the tables: an async arm's elapsed time ≥ 1.5×
    faster than sync's on one GPU, its mean change at most one pooled standard error below
    sync's, and more points gained per elapsed minute than sync; and beside its step-time
    speedup the ideal one, sync's step with generation and training fully overlapped from sync's
    own phases (max(train wait, train) + the arm's push), with the share of it reached."""

    def arm(label: str) -> list[dict]:
        return [results[f"{label}|{s}"] for s in seeds if f"{label}|{s}" in results]

    sync = arm("sync")
    if not sync or len(labels) < 2:
        return ""
    s_change = statistics.mean(r["change"] for r in sync)
    s_elapsed = statistics.mean(r["elapsed"] for r in sync)
    s_step, s_wait, s_train = (statistics.mean(r[k] for r in sync) for k in ("step_time", "wait_time", "train_time"))
    out = []
    for label in labels[1:]:
        rs = arm(label)
        if not rs:
            continue
        change = statistics.mean(r["change"] for r in rs)
        pooled = math.sqrt(
            (sum(r["se"] ** 2 for r in rs) / len(rs) ** 2) + (sum(r["se"] ** 2 for r in sync) / len(sync) ** 2)
        )
        elapsed = statistics.mean(r["elapsed"] for r in rs)
        speed = s_elapsed / elapsed
        ok = "within" if change >= s_change - pooled else "BELOW"
        per_min, s_per_min = change / (elapsed / 60), s_change / (s_elapsed / 60)
        step = s_step / statistics.mean(r["step_time"] for r in rs)
        ideal = s_step / (max(s_wait, s_train) + statistics.mean(r["update_time"] for r in rs))
        out.append(
            f"* {label}: {step:.2f}× sync's step time; the ideal overlap {ideal:.2f}× (max(sync's train wait, its train) "
            f"+ push), {step / ideal:.0%} of it reached"
        )
        out.append(
            f"* {label}: {speed:.2f}× sync's elapsed time ({'meets' if speed >= 1.5 else 'short of'} 1.5×); mean change "
            f"{change:+.1f} against sync's {s_change:+.1f} ({change - s_change:+.1f}, pooled SE {pooled:.1f}: {ok} one SE); "
            f"{per_min:+.1f} points per elapsed minute against sync's {s_per_min:+.1f} ({'above' if per_min > s_per_min else 'NOT above'})"
        )
    return "\n".join(out)


def plot(results: dict[str, dict], labels: list[str], seeds: list[int], path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("[real-ab] matplotlib is not installed: no PNG (pip install matplotlib)", flush=True)
        return None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, label in enumerate(labels):
        color = f"C{i}"
        for j, seed in enumerate(seeds):
            r = results.get(f"{label}|{seed}")
            if r:
                xs, ys = zip(*r["curve"])
                ax.plot(
                    xs, [100 * y for y in ys], marker="o", ms=3, color=color, alpha=0.8, label=label if j == 0 else None
                )
    ax.set_xlabel("elapsed training time (s), evals included")
    ax.set_ylabel("held-out greedy accuracy (%)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# the most GPU memory one SmolLM2 run of these presets held with --engine-num-kv-blocks 8192
# --max-tokens-per-gpu 8192 --no-compile (6 at once peaked at 91 GiB, 9 at once ran clean)
RUN_PEAK_GIB = 15.2
SHARED_GPU_KV_BLOCKS = 8192


def flag_value(args: list[str], name: str) -> str | None:
    """The value `args` give the flag `name` (the last one, as `name V` or `name=V`), if any."""
    value = None
    for i, x in enumerate(args):
        if x == name and i + 1 < len(args):
            value = args[i + 1]
        elif x.startswith(name + "="):
            value = x.split("=", 1)[1]
    return value


def kv_cache_flags(gpu: bool, parallel: int, args: list[str]) -> list[str]:
    """What one of several runs sharing a GPU adds to its flags `args`: a fixed KV cache for its
    built-in engines. An engine left to choose takes half the GPU memory free when it starts: the
    first run's engine half the device, the next half of what is left, and beyond three runs at
    once the later trainers ran out of memory. RUN_PEAK_GIB was measured with this count (and
    8,192-token micro-batches, uncompiled). Nothing where the run sets the count itself or runs
    vLLM engines, which size theirs by --vllm-gpu-memory-utilization (and refuse this flag)."""
    if not gpu or parallel < 2 or flag_value(args, "--engine-num-kv-blocks") is not None:
        return []
    if flag_value(args, "--rollout-backend") not in (None, "vime"):
        return []
    return ["--engine-num-kv-blocks", str(SHARED_GPU_KV_BLOCKS)]


def runs_that_fit() -> int:
    """How many runs at once the GPU's memory holds (any number on a CPU)."""
    import torch

    if not torch.cuda.is_available():
        return 1 << 30
    return max(1, int(torch.cuda.get_device_properties(0).total_memory / 2**30 // RUN_PEAK_GIB))


class Runner:
    """Runs (arm, tag, flags, seed) jobs into `out/runs`, N at a time, and keeps `results` (and
    results.json) up to date; a finished run (its last eval logged) is read back, not run again."""

    def __init__(
        self,
        out: Path,
        cfg_path: Path,
        steps: int,
        staleness: int,
        timeout: float | None,
        arm_args: list[str],
        results: dict[str, dict],
        gpu: bool = False,
    ) -> None:
        self.out, self.cfg_path, self.steps, self.staleness = out, cfg_path, steps, staleness
        self.timeout, self.arm_args, self.results, self.gpu = timeout, arm_args, results, gpu
        self.parallel = 1
        self.lock = threading.Lock()

    def one(self, arm: str, tag: str | None, flags: list[str], seed: int) -> None:
        label = arm if tag is None else f"{arm} / {tag}"
        name = f"{arm}{'' if tag is None else '-' + tag}-s{seed}-n{self.steps}"
        run_dir = self.out / "runs" / name
        if not (run_dir.exists() and self.steps in eval_results(run_dir)):
            if run_dir.exists():  # an unfinished run of an earlier call: start it again
                run_dir.rename(run_dir.with_name(f"{name}.unfinished-{time.strftime('%H%M%S')}"))
            extra = ["--seed", str(seed), "--rollout-seed", str(seed), *self.arm_args, *flags]
            extra += kv_cache_flags(self.gpu, self.parallel, extra)
            run_arm(
                arm,
                str(self.cfg_path),
                name,
                str(self.out / "runs"),
                extra,
                staleness=self.staleness,
                timeout=self.timeout,
            )
        r = summary(run_dir, self.steps)
        with self.lock:
            self.results[f"{label}|{seed}"] = r
            (self.out / "results.json").write_text(json.dumps(self.results, indent=1))
        print(
            f"[real-ab] {name}: {r['before']}/{r['total']} -> {r['correct']}/{r['total']} held-out "
            f"({r['change']:+.1f} ± {r['se']:.1f} points), step {r['step_time']:.2f} s, elapsed {r['elapsed']:.0f} s",
            flush=True,
        )

    def run_all(self, jobs: list[tuple[str, str | None, list[str], int]], parallel: int) -> list[str]:
        """Every job, `parallel` at a time; a failed run is reported and the others go on, so a
        long sweep is not lost to one run. Returns what failed."""
        fits = runs_that_fit()
        if parallel > fits:
            raise SystemExit(
                f"--parallel {parallel}: {fits} runs fit this GPU's memory at {RUN_PEAK_GIB:g} GiB each "
                f"(12 at once on one H200 ran out: trainers died, engines hung); give --parallel {fits} or fewer"
            )
        self.parallel = parallel
        if kv_cache_flags(self.gpu, parallel, []):
            print(f"[parallel] {parallel} runs on one GPU: each built-in engine gets {SHARED_GPU_KV_BLOCKS} KV blocks")
        failed = []
        with ThreadPoolExecutor(max_workers=max(1, parallel)) as pool:
            futures = {pool.submit(self.one, *job): job for job in jobs}
            for f, job in futures.items():
                try:
                    f.result()
                except Exception as e:  # a VimeError of run_arm, or a run that logged no final eval
                    failed.append(f"{job[0]} {job[1] or ''} seed {job[3]}: {e}")
                    print(f"[real-ab] FAILED {failed[-1]}", flush=True)
        return failed


def main() -> int:
    import torch

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="demo", choices=tuple(PRESETS), help="the workload (see above)")
    p.add_argument(
        "--arms",
        default=None,
        help=f"comma-separated, of {', '.join(ARMS)}; the first is the speedup reference "
        "(default: all four, but the first three for demo)",
    )
    p.add_argument("--seeds", default="1", help="comma-separated; each sets --seed and --rollout-seed of every arm")
    p.add_argument(
        "--corrections",
        default=None,
        help="comma-separated --off-policy-correction values: every arm runs once per value (a sweep); default: the arms' defaults",
    )
    p.add_argument(
        "--variants",
        default=None,
        help="'name=flags;name=flags': every arm runs once per variant with its flags (an objective sweep, e.g. "
        "'grpo=--advantage-estimator grpo;gspo=--advantage-estimator gspo --eps-clip 4e-4'); not with --corrections",
    )
    p.add_argument("--arm-args", default="", help="extra flags for every run, one string (e.g. '--eps-clip 0.1')")
    p.add_argument("--steps", type=int, default=None, help="training steps per run (default: the preset's)")
    p.add_argument("--eval-interval", type=int, default=None, help="steps between evals (default: the preset's)")
    p.add_argument(
        "--eval-limit", type=int, default=None, help="held-out prompts evaluated (default: the preset's, 200)"
    )
    p.add_argument("--batch", type=int, default=None, help="prompts per step (default: the preset's)")
    p.add_argument("--n-samples", type=int, default=None, help="samples per prompt (default: the preset's)")
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
    p.add_argument("--parallel", type=int, default=1, help="runs at once (accuracy sweeps only: see above)")
    p.add_argument("--out", default="/tmp/vime-real-ab", help="runs, tables and results go here")
    p.add_argument("--arm-timeout", type=float, default=None, help="seconds before one run is given up")
    p.add_argument(
        "--report-only",
        action="store_true",
        help="print the tables of --out's results.json (and --merge's) without running",
    )
    p.add_argument("--merge", nargs="*", default=[], help="more results.json files to add before the report")
    a = p.parse_args()
    arms = [
        x.strip()
        for x in (
            a.arms
            or ("sync,one-step-off,fully-async,decoupled" if a.preset != "demo" else "sync,one-step-off,fully-async")
        ).split(",")
        if x.strip()
    ]
    bad = set(arms) - set(ARMS)
    if bad:
        p.error(f"unknown arm(s) {', '.join(sorted(bad))}: choose from {', '.join(ARMS)}")
    if a.corrections and a.variants:
        p.error("--corrections and --variants are two sweeps: give one")
    # each run of an arm: (its label's suffix, its flags)
    sweep: list[tuple[str | None, list[str]]] = [(None, [])]
    if a.corrections:
        sweep = [(c.strip(), ["--off-policy-correction", c.strip()]) for c in a.corrections.split(",")]
    elif a.variants:
        sweep = []
        for item in a.variants.split(";"):
            name, eq, flags = item.partition("=")
            if not eq or not name.strip():
                p.error(f"--variants item {item!r}: write name=flags")
            sweep.append((name.strip(), shlex.split(flags)))
    labels = [arm if c is None else f"{arm} / {c}" for arm in arms for c, _ in sweep]
    seeds = [int(x) for x in a.seeds.split(",") if x.strip()]
    gpu = a.device == "cuda" or (a.device == "auto" and torch.cuda.is_available())
    s = settings(a.preset, gpu)
    for key, value in (
        ("steps", a.steps),
        ("eval_interval", a.eval_interval),
        ("eval_limit", a.eval_limit),
        ("batch", a.batch),
        ("n", a.n_samples),
    ):
        if value is not None:
            s[key] = value
    s.setdefault("eval_interval", s["steps"])  # demo: before the first step and after the last
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    res_path = out / "results.json"
    results: dict[str, dict] = json.loads(res_path.read_text()) if res_path.exists() else {}
    for extra in a.merge:
        results.update(json.loads(Path(extra).read_text()))
    meta_path = out / "settings.json"  # what the runs were made with, for --report-only elsewhere
    t_all = time.perf_counter()
    failed: list[str] = []
    if not a.report_only:
        model_dir = resolve_model(a.model)
        train, test = write_data(a.preset, out)
        cfg = demo_config(s, model_dir, train, test)
        cfg.update(device="cuda" if gpu else "cpu", use_tensorboard=False, quiet=True, eval_interval=s["eval_interval"])
        if a.preset == "lists":
            cfg["rm_type"] = "exact"  # a list is one answer only in full and in order (math-verify reads a set)
        cfg_path = out / "real_ab.yaml"
        cfg_path.write_text(yaml.safe_dump(cfg, sort_keys=False))
        meta_path.write_text(json.dumps({"preset": a.preset, "device": "GPU" if gpu else "CPU", "settings": s}))
        print(
            f"[real-ab] {a.preset}, {'GPU' if gpu else 'CPU'} settings {s}; arms {labels}; seeds {seeds}; config {cfg_path}",
            flush=True,
        )

        runner = Runner(out, cfg_path, s["steps"], a.staleness, a.arm_timeout, shlex.split(a.arm_args), results, gpu)
        failed = runner.run_all(
            [(arm, tag, flags, seed) for seed in seeds for arm in arms for tag, flags in sweep], a.parallel
        )
    done = list(results.values())
    if not done:
        p.error(f"no results in {res_path}: run without --report-only first")
    first = done[0]
    base = (first["before"], first["total"])
    if any(r["before"] != base[0] for r in done):
        print(
            "[real-ab] note: the baseline evals of the runs differ: " + ", ".join(str(r["before"]) for r in done),
            flush=True,
        )
    png = plot(results, labels, seeds, out / "accuracy_vs_elapsed.png")
    meta = (
        json.loads(meta_path.read_text()) if meta_path.exists() else {"preset": a.preset, "device": "?", "settings": s}
    )
    s = meta["settings"]
    report = (
        f"SmolLM2-135M-Instruct, preset {meta['preset']}, {meta['device']} settings {s}\n\n"
        "speed (means per step, evals excluded; elapsed includes evals; speedup = first arm's elapsed / this one's)\n\n"
        + speed_table(results, labels, seeds)
        + f"\n\nheld-out greedy accuracy after {s['steps']} steps\n\n"
        + accuracy_table(results, labels, seeds, base)
        + per_step_tables(results, labels, seeds)
        + closing(results, labels, seeds, png, t_all)
    )
    (out / "real_ab.md").write_text(report + "\n")
    print("\n" + report)
    if failed:
        print(f"[real-ab] {len(failed)} runs failed:\n" + "\n".join(failed), flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
