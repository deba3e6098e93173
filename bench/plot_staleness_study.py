"""bench/figures/staleness_study.png from the results.json files of staleness_study.py and real_ab.py.

Left: held-out accuracy at every eval of each study run (and of the quiet real_ab runs, dotted).
Middle: the change in held-out accuracy of every cell at lr 2e-5, each seed a dot, by the
staleness the cell allowed. Right: how far the weights had moved since a trained token was drawn
(mean squared log-ratio of the trainer's and the engine's log-probs), by the token's staleness,
fully-async at two lrs.

    python3 bench/plot_staleness_study.py bench/data/issue45/study_results.json bench/data/issue45/ab_results.json
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BUCKETS = ("0", "1", "2", "3", "4+")
STYLE = {
    "sync / lr1e-5": ("C0", "-"),
    "sync / lr2e-5": ("C0", "--"),
    "fully-async / keep-lr1e-5": ("C1", "-"),
    "fully-async / keep-lr2e-5": ("C1", "--"),
    "decoupled / K2-tis-lr1e-5": ("C2", "-"),
    "fully-async / abort-lr1e-5": ("C3", "-"),
}

# the lr 2e-5 cells, by the staleness they allow (the middle panel), and their short names
LR2_CELLS = {
    "sync / lr2e-5": "sync",
    "decoupled / K1-tis-lr2e-5": "K≤1 tis",
    "decoupled / K2-tis-lr2e-5": "K≤2 tis",
    "fully-async / abort-lr2e-5": "fully-async abort",
    "decoupled / K4-tis-lr2e-5": "K≤4 tis",
    "decoupled / K4-decoupled-ppo-lr2e-5": "K≤4 decoupled-ppo",
    "decoupled / K4-m2po-lr2e-5": "K≤4 m2po",
    "fully-async / keep-lr2e-5": "fully-async keep",
    "fully-async / resume-lr2e-5": "fully-async resume",
}


def main(study_path: str, ab_path: str, out: str = str(ROOT / "bench/figures/staleness_study.png")) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    study, quiet = json.loads(Path(study_path).read_text()), json.loads(Path(ab_path).read_text())
    fig, (ax, cx, bx) = plt.subplots(1, 3, figsize=(18, 4.8))
    for label, (color, line) in STYLE.items():
        runs = [r for key, r in sorted(study.items()) if key.split("|")[0] == label]
        for i, r in enumerate(runs):
            xs, ys = zip(*r["by_step"])
            name = f"{label} (40 steps, sharing the GPU)" if i == 0 else None
            ax.plot(xs, [100 * y for y in ys], color=color, ls=line, marker="o", ms=2.5, alpha=0.85, label=name)
    for key, r in quiet.items():
        arm, seed = key.split("|")
        xs, ys = zip(*r["by_step"])
        color = "C0" if arm == "sync" else "C1"
        ax.plot(
            xs,
            [100 * y for y in ys],
            color=color,
            ls=":",
            marker="s",
            ms=2.5,
            label=f"{arm} default, seed {seed} (50 steps, alone)",
        )
    ax.set(xlabel="training step", ylabel="held-out greedy accuracy (%)", title="lists preset, SmolLM2-135M, one H200")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6.5)
    lr2 = [label for label in LR2_CELLS if any(key.split("|")[0] == label for key in study)]
    for i, label in enumerate(lr2):
        changes = [r["change"] for key, r in study.items() if key.split("|")[0] == label]
        cx.bar(i, statistics.mean(changes), color="C0" if label.startswith("sync") else "C1", alpha=0.6)
        cx.plot([i] * len(changes), changes, "k.", ms=5)
    cx.set_xticks(range(len(lr2)), [LR2_CELLS[x] for x in lr2], rotation=35, ha="right", fontsize=7)
    cx.set(ylabel="held-out change after 40 steps (points)")
    cx.set_title("lr 2e-5: mean of 3 seeds (bars), each seed (dots)", fontsize=9)
    cx.grid(alpha=0.3, axis="y")
    for label, color, offset in (("fully-async / keep-lr1e-5", "C1", -0.2), ("fully-async / keep-lr2e-5", "C3", 0.2)):
        runs = [r for key, r in study.items() if key.split("|")[0] == label]
        if label.endswith("lr1e-5"):  # the quiet fully-async runs are at the preset's lr, 1e-5
            runs += [r for key, r in quiet.items() if key.startswith("fully-async")]
        means = [statistics.mean(r["stale"][b]["log_ratio_sq"] for r in runs if b in r["stale"]) for b in BUCKETS]
        bx.bar(
            [i + offset for i in range(len(BUCKETS))],
            means,
            width=0.4,
            color=color,
            label=f"{label} ({len(runs)} runs)",
        )
    bx.set_xticks(range(len(BUCKETS)), BUCKETS)
    bx.set(
        xlabel="staleness of the trained token (optimizer steps)",
        ylabel="mean (log π_old − log π_rollout)²",
        yscale="log",
    )
    bx.set_title("how far the weights moved since the token was drawn", fontsize=9)
    bx.grid(alpha=0.3, axis="y")
    bx.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(out)


if __name__ == "__main__":
    main(*sys.argv[1:])
