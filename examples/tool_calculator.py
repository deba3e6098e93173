"""A model learns to use a tool: SmolLM2-135M-Instruct, a calculator, and products it cannot work
out in its head (`python examples/tool_calculator.py`; offline, like `make demo`).

The task is a two-digit number times a three-digit one ("What is 27 * 682?"). Each prompt says how
to call the calculator (`<tool_call>{"name": "calculator", ...}</tool_call>`) and shows one worked
conversation on another kind of question (a sum of three numbers). The untrained model calls the
calculator in about half its samples, but mostly with the example's sum or a garbled expression
rather than the asked product, and from its head it is nearly always wrong. With `--tools
calculator` (vime's built-in multi-turn generate) a sample that calls the calculator with the
right product reads the answer and can copy it into its last turn. The reward grades that last
turn only (1 right, 0 wrong; nothing for calling the tool), so what the model learns about the
tool, it learns from the answers the tool led to.

1. convert SmolLM2's GGUF to an HF directory (once, cached) and write the prompts: 1000 to train
   on, 200 held out (no pair of factors in both);
2. greedy eval of the untrained model → GRPO (Dr. GRPO's loss; sync, or `--mode`) → greedy eval;
3. print held-out accuracy, the share of samples that called the calculator and the share whose
   first call computed the asked product, before and after, with the accuracy change's standard
   error paired over the prompts, and the training reward and tool-call rate per step.

Uses a GPU when one is visible (bigger batches, more steps); the numbers it printed there are in
bench/RESULTS.md. On 2 CPU cores it is the same run, smaller.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")  # as in examples/demo.py: one math thread per process
os.environ.setdefault("MKL_NUM_THREADS", "1")

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from demo import demo_config  # noqa: E402  (examples/demo.py, beside this script)

from vime.config import parse_args  # noqa: E402
from vime.loops import train  # noqa: E402
from vime.models import resolve_model  # noqa: E402
from vime.modes import MODES  # noqa: E402
from vime.report import eval_results, paired_change, sparkline  # noqa: E402
from vime.rollout.tools.calls import calculate  # noqa: E402
from vime.rollout.tools.multi_turn import CALL_END, parse_call  # noqa: E402

N_TRAIN, N_TEST = 1000, 200
QUESTION = "What is {}? Give the final answer after 'Answer:'."
# Without the worked conversation the model hardly ever calls the tool (2-4% of samples at
# temperature 1, none with the right product: HF generate, 48 samples per prompt wording), and
# groups that are all wrong teach nothing. With it: 54% call, 10% with the right product.
SHOT = [
    {"role": "system", "content": 'You have a calculator tool. To use it, write <tool_call>{"name": "calculator", '
     '"arguments": {"expression": "..."}}</tool_call> and wait for the result.'},
    {"role": "user", "content": QUESTION.format("23 + 47 + 310")},
    {"role": "assistant", "content": '<tool_call>{"name": "calculator", "arguments": {"expression": "23 + 47 + 310"}}</tool_call>'},
    {"role": "tool", "content": "380"},
    {"role": "assistant", "content": "Answer: 380"},
]  # fmt: skip
CPU = dict(steps=4, batch=4, n=8, response_len=64, eval_limit=50, max_tokens=2048, lr=3e-5, temperature=1.0)
GPU = dict(steps=60, batch=32, n=8, response_len=96, eval_limit=N_TEST, max_tokens=32768, lr=2e-5, temperature=1.0)


def write_data(out_dir: Path, seed: int = 0) -> tuple[Path, Path]:
    """train.jsonl and test.jsonl: a two-digit times a three-digit number, no pair in both."""
    rng = random.Random(seed)
    pairs: list[tuple[int, int]] = []
    seen: set[tuple[int, int]] = set()
    while len(pairs) < N_TRAIN + N_TEST:
        pair = rng.randint(10, 99), rng.randint(100, 999)
        if pair not in seen:
            seen.add(pair)
            pairs.append(pair)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = out_dir / "train.jsonl", out_dir / "test.jsonl"
    for path, part in zip(paths, (pairs[:N_TRAIN], pairs[N_TRAIN:])):
        rows = (
            {"input": [*SHOT, {"role": "user", "content": QUESTION.format(f"{a} * {b}")}], "label": str(a * b)}
            for a, b in part
        )
        path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return paths


def config(s: dict[str, Any], model_dir: Path, train_data: Path, test_data: Path) -> dict[str, Any]:
    """The demo's settings as config keys (the same keys, sized here), with the calculator."""
    return {**demo_config(s, model_dir, train_data, test_data), "tools": ["calculator"], "max_turns": 3}


def tool_use(run_dir: Path, step: int) -> tuple[float, float]:
    """Of the held-out samples at `step`: the share that called the calculator, and the share
    whose first call computed the asked product (the right expression, not only any call)."""
    rows = [json.loads(line) for line in (run_dir / "eval" / f"{step}.jsonl").read_text().splitlines()]
    called = [r for r in rows if r["tools"]["tool_calls"] > 0]
    return len(called) / len(rows), sum(_first_call_value(r["response"]) == r["label"] for r in called) / len(rows)


def _first_call_value(response: str) -> str | None:
    name, arguments = parse_call(response[: response.find(CALL_END) + len(CALL_END)]) or (None, None)
    if name != "calculator" or not isinstance(arguments, dict):
        return None
    try:
        return calculate(arguments)
    except Exception:  # any failure of the call: it did not compute the product
        return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--seed", type=int, help="the trainer's and the sampling's seed (--seed, --rollout-seed); default vime's"
    )
    p.add_argument(
        "--mode",
        choices=list(MODES),
        default="sync",
        help="training mode, as in `vime bench ab` (decoupled: staleness 1)",
    )
    p.add_argument("--steps", type=int, help="training steps (default: 4 on CPU, 60 on a GPU)")
    p.add_argument("--eval-limit", type=int, help="held-out prompts evaluated (default: 50 on CPU, 200 on a GPU)")
    opts = p.parse_args(argv)
    t0 = time.perf_counter()
    gpu = torch.cuda.is_available()
    s = dict(GPU if gpu else CPU)
    s.update({k: v for k, v in (("steps", opts.steps), ("eval_limit", opts.eval_limit)) if v is not None})
    runs = ROOT / "runs"
    print(f"[tools] device: {'cuda' if gpu else 'cpu'}; settings: {s}", flush=True)
    model_dir = resolve_model("smollm2")
    train_data, test_data = write_data(runs / "tool-calculator-data")
    seed = "" if opts.seed is None else f"-seed{opts.seed}"
    name = time.strftime(f"tool-calculator-{opts.mode}{seed}-%Y%m%d-%H%M%S")
    seeds = {} if opts.seed is None else {"seed": opts.seed, "rollout_seed": opts.seed}
    arm = MODES[opts.mode].arm  # the entry (train / train-async) and its flags
    args = parse_args(
        [w.replace("{staleness}", "1") for w in arm[1:]],
        entry="async" if arm[0] == "train-async" else "sync",
        **config(s, model_dir, train_data, test_data),
        **seeds,
        runs_dir=str(runs),
        run_name=name,
    )
    run_dir = train(args)
    last = s["steps"]
    evals = eval_results(run_dir)
    acc = {k: 100 * sum(evals[k].values()) / len(evals[k]) for k in (0, last)}
    use = {k: tool_use(run_dir, k) for k in (0, last)}
    change, se = paired_change(evals[0], evals[last])
    print(f"\n[tools] {opts.mode}: held-out greedy, {len(evals[0])} prompts, before → after {last} steps")
    print("| | accuracy | called the calculator | its first call computes the asked product |")
    print("|---|---:|---:|---:|")
    for k, label in ((0, "before"), (last, "after")):
        print(f"| {label} | {acc[k]:.1f}% | {100 * use[k][0]:.1f}% | {100 * use[k][1]:.1f}% |")
    print(f"[tools] accuracy change {change:+.1f} points ± {se:.1f} (standard error, paired over the prompts)")
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in steps if "rollout/tool_call_rate" in r]
    print("[tools] per step, training samples (▁ = 0, █ = 1):")
    print("  reward          " + sparkline([r["rollout/reward_mean"] for r in steps], 0.0, 1.0))
    print("  tool-call rate  " + sparkline([r["rollout/tool_call_rate"] for r in steps], 0.0, 1.0))
    print(f"[tools] run directory: {run_dir}   total wall time: {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
