"""`vime report runs/a runs/b ...`: the speed and accuracy tables of runs, side by side, + plots.

The first run given is the reference of the speedup column (put the sync arm first). Means
are over all logged training steps; the first step of an async run includes its pipeline fill,
which is part of the real cost and is kept.
"""

from __future__ import annotations

import argparse
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from vime.errors import VimeError
from vime.eval_sets import set_accuracies
from vime.metrics import mean, read_metrics
from vime.modes import FULLY_ASYNC_FN


@dataclass
class RunSummary:
    name: str
    mode: str
    steps: int
    step_time: float
    wait_time: float
    train_time: float
    update_time: float
    wall_clock: float
    rows: list[dict[str, Any]]
    evals: list[dict[str, Any]]  # rows carrying eval/accuracy (all sets together), with step

    @property
    def wait_share(self) -> float:
        return self.wait_time / self.step_time if self.step_time else 0.0


def summarize(run_dir: str | Path) -> RunSummary:
    run_dir = Path(run_dir)
    rows = read_metrics(run_dir)
    cfg_path = run_dir / "config.yaml"
    try:
        cfg = yaml.safe_load(cfg_path.read_text(encoding="utf-8")) if cfg_path.exists() else {}
    except (UnicodeDecodeError, yaml.YAMLError) as e:
        raise VimeError(f"{cfg_path} is not a config vime wrote ({type(e).__name__}): repair or remove it") from None
    _check_numbers(run_dir, rows)
    steps = [r for r in rows if "perf/step_time" in r]
    if not steps:
        raise VimeError(
            f"{run_dir}/metrics.jsonl has no training steps yet: report a run that has trained at least one step"
        )

    def col(key: str) -> float:
        return mean([r.get(key, 0.0) or 0.0 for r in steps])

    mode = cfg.get("mode", "?")
    if mode == "one-step-off" and cfg.get("rollout_function_path") == FULLY_ASYNC_FN:
        mode = "fully-async"  # config.yaml of a vime before fully-async was a mode of its own
    return RunSummary(
        name=run_dir.name,
        mode=mode,
        steps=len(steps),
        step_time=col("perf/step_time"),
        wait_time=col("perf/train_wait_time"),
        train_time=col("perf/train_time"),
        update_time=col("perf/update_weights_time"),
        wall_clock=steps[-1].get("perf/wall_clock", 0.0),
        rows=rows,
        evals=[r for r in rows if "eval/accuracy" in r],
    )


# the columns the tables, the reward line and the plots read
REPORTED = (
    "step",
    "perf/step_time",
    "perf/train_wait_time",
    "perf/train_time",
    "perf/update_weights_time",
    "perf/wall_clock",
    "rollout/reward_mean",
    "eval/accuracy",
    "eval/correct",
    "eval/total",
)


_PER_SET_KEY = re.compile(r"^eval/[^/]+/(accuracy|correct|total)$")  # the per-set columns, with several sets


def _check_numbers(run_dir: Path, rows: list[dict[str, Any]]) -> None:
    """Every value the report reads is a number (a hand-edited or foreign metrics file held text
    there, and the report ended in a traceback), or null: vime writes a non-finite value as null,
    read here as NaN (a gap in the reward line)."""
    for k, row in enumerate(rows):
        for key in (key for key in row if key in REPORTED or _PER_SET_KEY.match(key)):
            value = row[key]
            if value is None and key != "step":
                row[key] = float("nan")
                continue
            number = isinstance(value, (int, float)) and not isinstance(value, bool)
            if not number or (key == "step" and not float(value).is_integer()):
                raise VimeError(
                    f"{run_dir}/metrics.jsonl row {k + 1}: {key} is {value!r}, not a {'step ' if key == 'step' else ''}"
                    "number: repair or remove that row"
                )


def speed_table(runs: list[RunSummary]) -> str:
    ref = runs[0].wall_clock
    lines = [
        "| run | mode | steps | step time (s) | train wait (s) | wait share | train (s) | update weights (s) | wall clock (s) | speedup |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in runs:
        speedup = ref / r.wall_clock if r.wall_clock else float("nan")
        lines.append(
            f"| {r.name} | {r.mode} | {r.steps} | {r.step_time:.2f} | {r.wait_time:.2f} | {100 * r.wait_share:.0f}% | "
            f"{r.train_time:.2f} | {r.update_time:.3f} | {r.wall_clock:.1f} | {speedup:.2f}× |"
        )
    return "\n".join(lines)


def accuracy_table(runs: list[RunSummary]) -> str:
    base = next((e for r in runs for e in r.evals if e["step"] == 0), None)
    lines = ["| run | mode | held-out accuracy | correct/total | change (points) |", "|---|---|---:|---:|---:|"]
    if base is not None:
        lines.append(
            f"| baseline | before training | {100 * base['eval/accuracy']:.1f}% | {base['eval/correct']}/{base['eval/total']} | |"
        )
    for r in runs:
        if not r.evals:
            lines.append(f"| {r.name} | {r.mode} | (no eval) | | |")
            continue
        last = r.evals[-1]
        delta = f"{100 * (last['eval/accuracy'] - base['eval/accuracy']):+.1f}" if base is not None else ""
        lines.append(
            f"| {r.name} | {r.mode} | {100 * last['eval/accuracy']:.1f}% | {last['eval/correct']}/{last['eval/total']} | {delta} |"
        )
    return "\n".join(lines)


def eval_set_table(runs: list[RunSummary]) -> str | None:
    """Each set's accuracy at the last eval of runs that evaluated several sets (None: no such
    run), the change against the first before-training eval of that set."""
    lines = ["| run | set | held-out accuracy | correct/total | change (points) |", "|---|---|---:|---:|---:|"]
    for r in runs:
        if not r.evals:
            continue
        last = r.evals[-1]
        for name, acc in set_accuracies(last).items():
            base = next((e for x in runs for e in x.evals if e["step"] == 0 and f"eval/{name}/accuracy" in e), None)
            delta = f"{100 * (acc - base[f'eval/{name}/accuracy']):+.1f}" if base is not None else ""
            lines.append(
                f"| {r.name} | {name} | {100 * acc:.1f}% | {last[f'eval/{name}/correct']}/{last[f'eval/{name}/total']} | {delta} |"
            )
    return "\n".join(lines) if len(lines) > 2 else None


def eval_results(run_dir: str | Path) -> dict[int, dict[int, bool]]:
    """step -> {prompt index: correct}, from the per-sample files the run's evals wrote (eval/<step>.jsonl)."""
    out = {}
    for f in sorted((Path(run_dir) / "eval").glob("*.jsonl")):
        if f.stem.isdigit():
            rows = [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
            out[int(f.stem)] = {r["index"]: bool(r["correct"]) for r in rows}
    return out


def paired_change(before: dict[int, bool], after: dict[int, bool]) -> tuple[float, float]:
    """Change in accuracy from `before` to `after` on the prompts both graded, in points, and its
    standard error paired over those prompts (the sd of the per-prompt differences / sqrt(n))."""
    keys = sorted(before.keys() & after.keys())
    d = [int(after[k]) - int(before[k]) for k in keys]
    n = len(d)
    if n == 0:
        return 0.0, float("nan")
    m = sum(d) / n
    if n == 1:
        return 100.0 * m, float("nan")
    var = sum((x - m) ** 2 for x in d) / (n - 1)
    return 100.0 * m, 100.0 * math.sqrt(var / n)


SPARK_BLOCKS = "▁▂▃▄▅▆▇█"


def sparkline(values: list[float], lo: float | None = None, hi: float | None = None) -> str:
    """One block per value, from ▁ at `lo` to █ at `hi` (default: the values' min and max); a
    non-finite value is a space. All values equal (and no range given) draw a flat ▄ line."""
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return " " * len(values)
    lo = min(finite) if lo is None else lo
    hi = max(finite) if hi is None else hi
    top = len(SPARK_BLOCKS) - 1
    out = []
    for v in values:
        if not math.isfinite(v):
            out.append(" ")
        elif hi <= lo:
            out.append(SPARK_BLOCKS[top // 2])
        else:
            out.append(SPARK_BLOCKS[round(top * min(max((v - lo) / (hi - lo), 0.0), 1.0))])
    return "".join(out)


def reward_curve(run: RunSummary) -> str:
    """The run's mean training reward per step as a text sparkline, scaled over [0, 1] when the
    rewards lie in it (so two runs' lines compare), plus the means of the first and last quarter."""
    pts = [(x["step"], x["rollout/reward_mean"]) for x in run.rows if "rollout/reward_mean" in x]
    if not pts:
        return f"{run.name}: no rewards logged"
    values = [v for _, v in pts]
    finite = [v for v in values if math.isfinite(v)] or [0.0]
    lo, hi = min(0.0, min(finite)), max(1.0, max(finite))
    q = max(1, len(values) // 4)
    return (
        f"{run.name}: steps {pts[0][0]}–{pts[-1][0]}  {sparkline(values, lo, hi)}  (scale {lo:g}…{hi:g}; "
        f"mean reward first {q} steps {mean(values[:q]):.3f}, last {q} steps {mean(values[-q:]):.3f})"
    )


def plot(runs: list[RunSummary], out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    charts = [
        (
            "step_time.png",
            "step time (s)",
            lambda r: [(x["step"], x["perf/step_time"]) for x in r.rows if "perf/step_time" in x],
            "step",
        ),
        (
            "reward.png",
            "mean reward",
            lambda r: [(x["step"], x["rollout/reward_mean"]) for x in r.rows if "rollout/reward_mean" in x],
            "step",
        ),
        ("accuracy_vs_wall_clock.png", "held-out accuracy", _accuracy_vs_wall, "wall clock (s)"),
    ]
    for fname, ylabel, series, xlabel in charts:
        fig, ax = plt.subplots(figsize=(6, 4))
        for r in runs:
            pts = series(r)
            if pts:
                ax.plot(*zip(*pts), marker="o", markersize=3, label=f"{r.name} ({r.mode})")
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(out_dir / fname, dpi=110)
        plt.close(fig)
        paths.append(out_dir / fname)
    return paths


def _accuracy_vs_wall(r: RunSummary) -> list[tuple[float, float]]:
    wall = {x["step"]: x.get("perf/wall_clock", 0.0) for x in r.rows if "perf/wall_clock" in x}
    return [(wall.get(e["step"], 0.0), e["eval/accuracy"]) for e in r.evals]


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="vime report",
        description="Speed and accuracy tables of runs side by side (first run = speedup reference), plus PNG plots.",
    )
    p.add_argument("runs", nargs="+", help="run directories (runs/<name>)")
    p.add_argument("--plots", default=None, help="where to write PNG plots (default: <first run>/../report)")
    p.add_argument("--no-plots", action="store_true", help="tables only")
    a = p.parse_args(argv)
    out = None if a.no_plots else Path(a.plots) if a.plots else Path(a.runs[0]).parent / "report"
    runs = [summarize(r) for r in a.runs]
    if out is not None:
        _writable(out)
    print("speed\n" + speed_table(runs) + "\n")
    print("accuracy\n" + accuracy_table(runs) + "\n")
    per_set = eval_set_table(runs)
    if per_set:
        print("accuracy per eval set\n" + per_set + "\n")
    print("training reward per step\n" + "\n".join(reward_curve(r) for r in runs))
    if out is not None:
        paths = plot(runs, out)
        print("\nplots: " + ", ".join(str(p) for p in paths))
    return 0


def _writable(out: Path) -> None:
    """The plots' directory made, before any table is printed: one that cannot be was a traceback."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        (out / ".vime-probe").touch()
        (out / ".vime-probe").unlink()
    except OSError as e:
        raise VimeError(
            f"--plots {out}: cannot write there ({e.strerror or e}): pick a directory you can write to, or pass --no-plots"
        ) from None
