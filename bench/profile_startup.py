"""Where the demo's start-up goes on a GPU, finer than the run log's `start-up` line (issue 48).

Two parts, each in fresh processes so that what a cache holds is what a new run finds:

1. `--probe`, twice (the first run on a fresh machine is cold, the second warm): the demo's
   trainer (SmolLM2-135M's shape, random weights; the demo's GPU settings) built, and its
   compile warm-up timed size by size and pass by pass (a scoring forward; a training forward
   and backward), the graphs Dynamo made
   and `torch._dynamo.utils.compile_times()` (where compile time went: tracing, AOTAutograd,
   Inductor, cache loads).
2. Whole runs (`bench/real_ab.py --preset lists --arms sync --steps 1`: the demo's model and
   settings on a task graded exactly, as the demo's `math` grader needs math-verify) of each
   `--trees` tree, alternately: the seconds from the command to the end of step 1, the run's
   `start-up` line and its engine's log lines. Needs the GGUF (bench/device_prep.sh).

    PYTHONPATH=. python3 bench/profile_startup.py --out /tmp/startup --trees .old/d4a5187,.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "examples")]

from bench.shapes import SMOLLM2_135M  # noqa: E402


def smollm2_shaped(out: Path, device: str) -> Path:
    """Random weights of SmolLM2-135M's shape and a two-token tokenizer, as an HF directory."""
    import torch
    from tokenizers import Tokenizer, models
    from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

    if (out / "config.json").exists():
        return out
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(LlamaConfig(**SMOLLM2_135M), dtype=torch.bfloat16)
    model.save_pretrained(out)
    tok = Tokenizer(models.WordLevel({"<pad>": 0, "<eos>": 1}, unk_token="<pad>"))
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>").save_pretrained(out)
    return out


def probe(out: Path, max_tokens: int | None) -> dict:
    """The demo's trainer built once, its warm-up timed (this process only)."""
    import torch
    import torch._dynamo.utils as dynamo_utils
    from demo import demo_config, demo_data, demo_settings

    from vime.config import parse_args
    from vime.models import load_tokenizer
    from vime.trainer.distributed import launch_actor
    from vime.trainer.warm_up import CompileWarmUp

    rows: list[dict] = []
    device = "cuda:0" if torch.cuda.is_available() else "cpu"  # CPU: a smoke test of this script
    step = CompileWarmUp._step

    def timed_step(self: CompileWarmUp, size: int, scoring: bool) -> None:
        graphs = dynamo_utils.counters["stats"]["unique_graphs"]
        if device != "cpu":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        step(self, size, scoring)
        if device != "cpu":
            torch.cuda.synchronize()
        rows.append(
            {
                "size": size,
                "pass": "score" if scoring else "train",
                "s": round(time.perf_counter() - t0, 3),
                "graphs": dynamo_utils.counters["stats"]["unique_graphs"] - graphs,
            }
        )

    CompileWarmUp._step = timed_step
    s = demo_settings(True)
    model_dir = smollm2_shaped(out / "model", device)
    train, test = demo_data(out / "data")
    if max_tokens:
        s["max_tokens"] = max_tokens
    config = demo_config(s, model_dir, train, test)
    cfg = parse_args([], **config, compile=True, runs_dir=str(out / "runs"), run_name="probe")
    t0 = time.perf_counter()
    actor = launch_actor(cfg, model_dir, device, load_tokenizer(model_dir))
    built = time.perf_counter() - t0
    actor.ready()
    return {
        "actor_s": round(built, 2),
        "ready_s": round(time.perf_counter() - t0, 2),
        "warm_up_s": round(sum(r["s"] for r in rows), 2),
        "graphs": dynamo_utils.counters["stats"]["unique_graphs"],
        "sizes": rows,
        "compile_times": dynamo_utils.compile_times(repr="str", aggregate=True),
    }


def whole_run(tree: Path, out: Path) -> dict:
    """One real sync run of one step of `tree`'s vime (another tree: one `git archive` of it):
    the seconds from the command to the end of step 1 (its metrics row), and the log's lines."""
    runs = out.resolve()
    cmd = [sys.executable, "bench/real_ab.py", "--preset", "lists", "--arms", "sync", "--seeds", "9"]
    cmd += ["--steps", "1", "--eval-limit", "8", "--out", str(runs)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree), os.environ.get("PYTHONPATH", "")])}
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=tree, env=env, stdout=subprocess.DEVNULL)
    step1 = None
    while proc.poll() is None:
        if step1 is None and any('"step": 1' in m.read_text() for m in runs.rglob("metrics.jsonl")):
            step1 = time.perf_counter() - t0
        time.sleep(0.05)
    logs = sorted(runs.rglob("log.txt"))
    text = logs[-1].read_text() if logs else ""
    engine = sorted(runs.rglob("engine0.log"))
    wanted = r"(start-up .*|compiled the trainer .*|the trainer waited .*)"
    return {
        "exit": proc.returncode,
        "step1_end_s": None if step1 is None else round(step1, 1),
        "lines": re.findall(wanted, text),
        "engine_log": [  # its start's lines: the phases, the wait for the trainer, the graphs
            ln
            for ln in (engine[-1].read_text().splitlines() if engine else [])
            if "INFO" in ln and any(k in ln for k in ("start-up ", "waited ", "captured ", "engine: "))
        ],
    }


def print_probe(label: str, r: subprocess.CompletedProcess, wall: float) -> None:
    recompiles = [ln.split("[__recompiles]")[-1] for ln in r.stderr.splitlines() if "[__recompiles]" in ln]
    line = next((ln for ln in r.stdout.splitlines() if ln.startswith("PROBE ")), None)
    print(f"\n## probe {label}: process wall {wall:.1f} s, exit {r.returncode}")
    if line is None:
        print(r.stdout[-3000:], r.stderr[-5000:])
        return
    d = json.loads(line[6:])
    print(
        f"trainer built {d['actor_s']} s, ready {d['ready_s']} s, warm-up steps {d['warm_up_s']} s, graphs {d['graphs']}"
    )
    print("| size | pass | s | new graphs |\n|---:|---|---:|---:|")
    for row in d["sizes"]:
        print(f"| {row['size']} | {row['pass']} | {row['s']} | {row['graphs']} |")
    print("recompile reasons:\n" + "\n".join(recompiles[:40]))
    print("compile_times:\n" + d["compile_times"][:3000])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("/tmp/startup"))
    p.add_argument("--probe", action="store_true", help="(internal) one timed trainer build, JSON on stdout")
    p.add_argument("--probes", type=int, default=2, help="timed trainer builds (the first on a fresh machine is cold)")
    p.add_argument(
        "--trees",
        default="",
        help="comma-separated source trees whose whole run to time, alternately (e.g. .old/REV,.); none: no run",
    )
    p.add_argument("--passes", type=int, default=2, help="whole runs of each tree")
    p.add_argument("--max-tokens", type=int, default=None, help="the trainer's token budget (default: the demo's)")
    a = p.parse_args()
    if a.probe:
        print("PROBE " + json.dumps(probe(a.out, a.max_tokens)), flush=True)
        return
    a.out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "TORCH_LOGS": "recompiles"}
    budget = ["--max-tokens", str(a.max_tokens)] if a.max_tokens else []
    for i in range(a.probes):
        t0 = time.perf_counter()
        cmd = [sys.executable, __file__, "--probe", "--out", str(a.out), *budget]
        r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        print_probe(f"{i + 1} ({'cold on a fresh machine' if i == 0 else 'warm'})", r, time.perf_counter() - t0)
    table = []
    for n in range(a.passes):
        for tree in [Path(t).resolve() for t in a.trees.split(",") if t]:
            d = whole_run(tree, a.out / f"run-{tree.name}-{n}")
            print(
                f"\n## whole run of {tree}, pass {n + 1}: exit {d['exit']}, step 1 ended {d['step1_end_s']} s after the command"
            )
            print("\n".join(d["lines"]) + "\nengine log:\n" + "\n".join(d["engine_log"]))
            startup = next((ln for ln in d["lines"] if ln.startswith("start-up")), "")
            table.append((tree.name, n + 1, startup.split(" s before")[0].removeprefix("start-up "), d["step1_end_s"]))
    if table:
        print("\n| tree | pass | start-up before step 1 (s) | command → end of step 1 (s) |\n|---|---:|---:|---:|")
        for row in table:
            print("| " + " | ".join(str(x) for x in row) + " |")


if __name__ == "__main__":
    main()
