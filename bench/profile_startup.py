"""Where the demo's start-up goes on a GPU, finer than the run log's `start-up` line (issue 48).

Two parts, each in fresh processes so that what a cache holds is what a new run finds:

1. `--probe`, twice (the first run on a fresh machine is cold, the second warm): the demo's
   trainer (SmolLM2-135M, the demo's GPU settings) built with its compile warm-up timed size by
   size and pass by pass (scoring forward, training forward, backward), the graphs Dynamo made
   and `torch._dynamo.utils.compile_times()` (where compile time went: tracing, AOTAutograd,
   Inductor, cache loads).
2. One whole run (`bench/real_ab.py --preset demo --arms sync --steps 1`), caches warm: its
   `start-up` line and its engine's log lines.

    PYTHONPATH=. python3 bench/profile_startup.py --out /tmp/startup
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


def probe(out: Path, max_tokens: int | None) -> dict:
    """The demo's trainer built once, its warm-up timed (this process only)."""
    import torch
    import torch._dynamo.utils as dynamo_utils
    from demo import demo_config, demo_data, demo_settings

    from vime.config import parse_args
    from vime.models import load_tokenizer, resolve_model
    from vime.trainer import actor as actor_mod
    from vime.trainer.distributed import launch_actor
    from vime.trainer.packing import PAD_BUCKETS, pack

    rows: list[dict] = []
    device = "cuda:0" if torch.cuda.is_available() else "cpu"  # CPU: a smoke test of this script

    def sync() -> None:
        if device != "cpu":
            sync()

    def timed_warm_up(self: actor_mod.Actor) -> None:  # the same loop as Actor._warm_up, timed
        for size in range(self._bucket, self._bucket * PAD_BUCKETS + 1, self._bucket):
            mb = pack([[self.pad_token_id] * 2], [1], [], self.device, size, self.pad_token_id)
            row = {"size": size}
            for name, grad in (("score", False), ("train_fwd", True)):
                graphs = dynamo_utils.counters["stats"]["unique_graphs"]
                sync()
                t0 = time.perf_counter()
                self.scorer.train(grad)
                with torch.set_grad_enabled(grad):
                    out_ = self._forward(self.scorer, mb, with_entropy=grad)
                sync()
                row[name] = round(time.perf_counter() - t0, 3)
                row[name + "_graphs"] = dynamo_utils.counters["stats"]["unique_graphs"] - graphs
            t0 = time.perf_counter()
            (out_[0].sum() + out_[1].sum()).backward()
            sync()
            row["backward"] = round(time.perf_counter() - t0, 3)
            rows.append(row)
        self.optimizer.zero_grad(set_to_none=True)

    actor_mod.Actor._warm_up = timed_warm_up
    s = demo_settings(True)
    model_dir = resolve_model("smollm2")
    train, test = demo_data(out / "data")
    if max_tokens:
        s["max_tokens"] = max_tokens
    config = demo_config(s, model_dir, train, test)
    cfg = parse_args([], **config, compile=True, runs_dir=str(out / "runs"), run_name="probe")
    t0 = time.perf_counter()
    launch_actor(cfg, model_dir, device, load_tokenizer(model_dir))
    total = time.perf_counter() - t0
    return {
        "actor_s": round(total, 2),
        "warm_up_s": round(sum(r["score"] + r["train_fwd"] + r["backward"] for r in rows), 2),
        "graphs": dynamo_utils.counters["stats"]["unique_graphs"],
        "sizes": rows,
        "compile_times": dynamo_utils.compile_times(repr="str", aggregate=True),
    }


def whole_run(out: Path) -> dict:
    """One real sync run of one step; its start-up line and its engine's log."""
    runs = out / "ab"
    cmd = [sys.executable, "bench/real_ab.py", "--preset", "demo", "--arms", "sync", "--seeds", "9"]
    cmd += ["--steps", "1", "--eval-limit", "8", "--out", str(runs)]
    t0 = time.perf_counter()
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
    logs = sorted(runs.rglob("log.txt"))
    text = logs[-1].read_text() if logs else ""
    engine = sorted(runs.rglob("engine0.log"))
    found = {
        "wall_s": round(wall, 1),
        "startup": re.findall(r"start-up .*", text),
        "compiled": re.findall(r"compiled the trainer .*", text),
        "engine_log": engine[-1].read_text().splitlines()[:40] if engine else [],
    }
    return found


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("/tmp/startup"))
    p.add_argument("--probe", action="store_true", help="(internal) one timed trainer build, JSON on stdout")
    p.add_argument("--no-run", action="store_true", help="probes only, no whole run")
    p.add_argument("--max-tokens", type=int, default=None, help="the trainer's token budget (default: the demo's)")
    a = p.parse_args()
    if a.probe:
        print("PROBE " + json.dumps(probe(a.out, a.max_tokens)), flush=True)
        return
    a.out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "TORCH_LOGS": "recompiles"}
    for label in ("first (cold on a fresh machine)", "second (warm)"):
        t0 = time.perf_counter()
        r = subprocess.run(
            [
                sys.executable,
                __file__,
                "--probe",
                "--out",
                str(a.out),
                *(["--max-tokens", str(a.max_tokens)] if a.max_tokens else []),
            ],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
        )
        wall = time.perf_counter() - t0
        recompiles = [ln for ln in r.stderr.splitlines() if "triggered by" in ln or "- " in ln and "__recompiles" in ln]
        line = next((ln for ln in r.stdout.splitlines() if ln.startswith("PROBE ")), None)
        print(f"\n## probe {label}: process wall {wall:.1f} s, exit {r.returncode}")
        if line is None:
            print(r.stdout[-3000:], r.stderr[-5000:])
            continue
        d = json.loads(line[6:])
        print(f"Actor() {d['actor_s']} s, warm-up {d['warm_up_s']} s, graphs {d['graphs']}")
        print("| size | score s | graphs | train fwd s | graphs | backward s |\n|---:|---:|---:|---:|---:|---:|")
        for r_ in d["sizes"]:
            print(
                f"| {r_['size']} | {r_['score']} | {r_['score_graphs']} | {r_['train_fwd']} | {r_['train_fwd_graphs']} | {r_['backward']} |"
            )
        print("recompile reasons:\n" + "\n".join(recompiles[:30]))
        print("compile_times:\n" + d["compile_times"][:4000])
    if not a.no_run:
        d = whole_run(a.out)
        print(f"\n## whole run, warm: wall {d['wall_s']} s")
        print("\n".join(d["startup"] + d["compiled"]))
        print("engine log:\n" + "\n".join(d["engine_log"]))


if __name__ == "__main__":
    main()
