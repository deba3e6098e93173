"""Where a fully-async step's time goes on one shared GPU: the trainer's host threads, the GIL,
the engine (issue 65).

Runs the `lists` preset of bench/real_ab.py (SmolLM2-135M-Instruct, one GPU; no evals) once per
variant, each a fresh run alone on the device, and measures inside the trainer's process with a
probe (bench/probe/sitecustomize.py): for every train step, its wall time and the CPU seconds of
each thread of the process meanwhile. On the variants marked for it, py-spy samples the trainer
(which thread holds the GIL, and where every thread is) and the engine for a few steps.

Variants (--variants, comma-separated):
* sync, fully-async: the two arms at their defaults;
* sync-hog: sync with a thread in the trainer that runs pure Python 1 ms out of every 4 (no GPU
  work, no HTTP): how much a train step slows when another thread wants the GIL;
* fully-async-si: fully-async with sys.setswitchinterval(0.0002) in the trainer (CPython's default
  is 5 ms: how long a thread that wants the GIL waits before the holder is asked to drop it);
* any other name: `name=arm[:flag flag ...]` runs that arm with those flags (e.g.
  `fa-proc=fully-async:--rollout-process`).

Prints, per variant, the step's parts (steps after --skip), and per thread the CPU seconds during a
train step; then the py-spy summaries. Writes everything to --out (profile.md, the raw samples).

    PYTHONPATH=.:/tmp/site python3 bench/profile_async.py --out $OUT            # GPU, SmolLM2
    PYTHONPATH=. python3 bench/profile_async.py --model tiny --steps 4 --skip 1  # CPU smoke test
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "examples"), str(ROOT / "bench")]

from demo import demo_config  # noqa: E402
from real_ab import settings, write_data  # noqa: E402

from vime.models import resolve_model  # noqa: E402
from vime.modes import MODES  # noqa: E402

PROBE_DIR = ROOT / "bench" / "probe"
BUILTIN = {
    "sync": ("sync", {}, []),
    "fully-async": ("fully-async", {}, []),
    "sync-hog": ("sync", {"hog": [1, 3]}, []),
    "fully-async-si": ("fully-async", {"switch_interval": 0.0002}, []),
}


def variant(spec: str) -> tuple[str, str, dict, list[str]]:
    """(name, arm, probe settings, extra flags) of one --variants item."""
    if spec in BUILTIN:
        return (spec, *BUILTIN[spec])
    name, eq, rest = spec.partition("=")
    arm, _, flags = rest.partition(":")
    if not eq or arm not in MODES:
        raise SystemExit(
            f"--variants {spec!r}: a built-in ({', '.join(BUILTIN)}) or name=arm[:flags], arm one of {', '.join(MODES)}"
        )
    return name, arm, {}, flags.split()


def children(pid: int) -> list[int]:
    """Every descendant of pid (from /proc)."""
    kids: dict[int, list[int]] = collections.defaultdict(list)
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                kids[ppid].append(int(d))
            except (OSError, IndexError, ValueError):
                continue
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out += kids[p]
        todo += kids[p]
    return out


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def steps_logged(path: Path) -> int:
    if not path.exists():
        return 0
    return sum(1 for line in path.read_text().splitlines() if '"perf/step_time"' in line)


def spy(pid: int, seconds: float, out: Path, gil: bool) -> subprocess.Popen | None:
    exe = shutil.which("py-spy") or next((p for p in ("/tmp/site/bin/py-spy",) if os.path.exists(p)), None)
    if exe is None:
        print("[profile] py-spy not found: no samples", flush=True)
        return None
    cmd = [exe, "record", "--pid", str(pid), "--duration", str(int(seconds)), "--rate", "200", "--format", "raw"]
    cmd += ["--threads", "--nonblocking", "-o", str(out)] + (["--gil"] if gil else [])
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(str(out) + ".err", "w"))


def run_variant(
    name: str, arm: str, probe: dict, flags: list[str], cfg_path: Path, out: Path, steps: int, a: argparse.Namespace
) -> Path:
    run_dir = out / "runs" / name
    if run_dir.exists():
        shutil.rmtree(run_dir)
    probe_file = out / f"probe-{name}.jsonl"
    probe_file.unlink(missing_ok=True)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(PROBE_DIR), str(ROOT), env.get("PYTHONPATH", "")])
    env["VIME_PROBE"] = json.dumps({"out": str(probe_file), **probe})
    cmd = [sys.executable, "-m", "vime.cli", *MODES[arm].arm, "--config", str(cfg_path), "--run-name", name]
    cmd += ["--runs-dir", str(out / "runs"), "--seed", str(a.seed), "--rollout-seed", str(a.seed), *flags]
    print(f"[profile] {name}: {' '.join(cmd[3:])}", flush=True)
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    spies: list[subprocess.Popen] = []
    if name in a.pyspy.split(","):
        metrics = run_dir / "metrics.jsonl"
        while proc.poll() is None and steps_logged(metrics) < a.spy_from:
            time.sleep(0.1)
        if proc.poll() is None:
            engines = [p for p in children(proc.pid) if "vime.engine.server" in cmdline(p)]
            spies = [
                spy(proc.pid, a.spy_seconds, out / f"spy-{name}-trainer-gil.txt", gil=True),
                spy(proc.pid, a.spy_seconds, out / f"spy-{name}-trainer.txt", gil=False),
                *[spy(e, a.spy_seconds, out / f"spy-{name}-engine{i}.txt", gil=False) for i, e in enumerate(engines)],
            ]
            spies = [s for s in spies if s is not None]
            print(
                f"[profile] {name}: py-spy on the trainer ({proc.pid}) and {len(engines)} engine(s) for {a.spy_seconds} s from step {a.spy_from}",
                flush=True,
            )
    code = proc.wait(a.timeout)
    for s in spies:
        s.wait(30)
    if code != 0:
        raise SystemExit(f"[profile] {name} failed with exit code {code}: see {run_dir}/log.txt")
    print(f"[profile] {name}: {time.perf_counter() - t0:.0f} s", flush=True)
    return run_dir


def step_parts(run_dir: Path, skip: int) -> dict[str, float]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    rows = [r for r in rows if "perf/step_time" in r][skip:]
    keys = ("step_time", "train_wait_time", "train_time", "update_weights_time", "push_wait_time", "other_time")
    out = {k: statistics.mean(r.get(f"perf/{k}", 0.0) for r in rows) for k in keys}
    out["steps"] = len(rows)
    out["response_len"] = statistics.mean(r.get("rollout/response_len_mean", float("nan")) for r in rows)
    return out


def probe_parts(path: Path, skip: int) -> dict[str, Any]:
    """Mean wall time of a train step and each thread's mean CPU and runqueue seconds during one."""
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()][skip:] if path.exists() else []
    if not rows:
        return {"wall": float("nan"), "cpu": {}}
    names = {n for r in rows for n in r["cpu"]}
    cpu = {n: statistics.mean(r["cpu"].get(n, [0, 0])[0] for r in rows) for n in names}
    wait = {n: statistics.mean(r["cpu"].get(n, [0, 0])[1] for r in rows) for n in names}
    return {"wall": statistics.mean(r["wall"] for r in rows), "cpu": cpu, "runq": wait, "n": len(rows)}


def thread_of(stack: str) -> str:
    """py-spy's --threads puts `thread (TID): NAME` first in every stack."""
    first = stack.split(";", 1)[0]
    return first.split(": ", 1)[1] if ": " in first else first[:40]


def spy_summary(path: Path, seconds: float, top: int = 12) -> str:
    """Share of sampling ticks per thread, and each thread's leaf functions by samples."""
    if not path.exists() or not path.read_text().strip():
        err = Path(str(path) + ".err")
        return f"(no samples in {path.name}: {err.read_text().strip()[-300:] if err.exists() else ''})"
    per_thread: collections.Counter = collections.Counter()
    leaves: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for line in path.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if not n.isdigit():
            continue
        t = thread_of(stack)
        per_thread[t] += int(n)
        frames = stack.split(";")
        # the innermost Python frame, and the vime frame nearest it (what called into the library)
        vime = next((f for f in reversed(frames) if "/vime/" in f), "")
        leaves[t][f"{frames[-1][:90]}  <-  {vime[:70]}"] += int(n)
    ticks = 200 * seconds
    lines = [f"{path.name}: {sum(per_thread.values())} samples over ~{ticks:.0f} ticks"]
    for t, n in per_thread.most_common():
        lines.append(f"  {t}: {n} samples ({100 * n / ticks:.0f}% of ticks)")
        for leaf, m in leaves[t].most_common(top):
            lines.append(f"      {100 * m / ticks:5.1f}%  {leaf}")
    return "\n".join(lines)


def gpu_sampler(out: Path, stop: threading.Event) -> None:
    """nvidia-smi's utilization every 200 ms, when there is one."""
    if shutil.which("nvidia-smi") is None:
        return
    with open(out, "w") as f:
        proc = subprocess.Popen(
            [
                "nvidia-smi",
                "--query-gpu=timestamp,utilization.gpu,utilization.memory",
                "--format=csv,noheader",
                "-lms",
                "200",
            ],
            stdout=f,
        )
        stop.wait()
        proc.terminate()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variants", default="sync,fully-async,sync-hog,fully-async-si")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--skip", type=int, default=4, help="first steps left out of the means (compile, warm-up)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--pyspy", default="fully-async", help="variants py-spy samples (comma-separated)")
    p.add_argument("--spy-from", type=int, default=8, help="py-spy starts once this many steps are logged")
    p.add_argument("--spy-seconds", type=float, default=5.0)
    p.add_argument("--timeout", type=float, default=400.0)
    p.add_argument("--out", default="/tmp/vime-profile-async")
    p.add_argument("--arm-args", default="", help="extra flags for every run")
    a = p.parse_args()
    import torch

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    gpu = torch.cuda.is_available()
    s = settings("lists", gpu)
    s["steps"] = a.steps
    train, test = write_data("lists", out)
    cfg = demo_config(s, resolve_model(a.model), train, test)
    for k in ("eval_interval", "eval_prompt_data", "eval_limit"):
        cfg.pop(k)
    cfg.update(device="cuda" if gpu else "cpu", use_tensorboard=False, quiet=True, rm_type="exact")
    cfg_path = out / "profile.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    specs = [variant(v.strip()) for v in a.variants.split(",") if v.strip()]
    report = [f"lists preset, {'GPU' if gpu else 'CPU'}, {s}; seed {a.seed}; means over steps {a.skip + 1}-{a.steps}\n"]
    table = [
        "| variant | step | wait | train | push | push wait | other | probe: train wall | main CPU | autograd CPU | rollout-loop CPU | other threads CPU | resp len |",
        "|---|" + "---:|" * 12,
    ]
    for name, arm, probe, flags in specs:
        stop = threading.Event()
        sampler = threading.Thread(target=gpu_sampler, args=(out / f"gpu-{name}.csv", stop), daemon=True)
        sampler.start()
        run_dir = run_variant(name, arm, probe, flags + a.arm_args.split(), cfg_path, out, a.steps, a)
        stop.set()
        st = step_parts(run_dir, a.skip)
        pr = probe_parts(out / f"probe-{name}.jsonl", a.skip)
        cpu = dict(pr["cpu"])
        main_cpu = cpu.pop("MainThread", 0.0)
        auto = sum(v for k, v in list(cpu.items()) if "autograd" in k)
        loop = cpu.pop("vime-rollout-loop", 0.0)
        rest = sum(v for k, v in cpu.items() if "autograd" not in k)
        table.append(
            f"| {name} | {st['step_time']:.3f} | {st['train_wait_time']:.3f} | {st['train_time']:.3f} | {st['update_weights_time']:.3f} | "
            f"{st['push_wait_time']:.3f} | {st['other_time']:.3f} | {pr['wall']:.3f} | {main_cpu:.3f} | {auto:.3f} | {loop:.3f} | {rest:.3f} | {st['response_len']:.0f} |"
        )
        threads = sorted(pr["cpu"].items(), key=lambda kv: -kv[1])[:10]
        report.append(
            f"{name}: CPU s per train step by thread (runqueue wait s): "
            + ", ".join(f"{k} {v:.3f} ({pr['runq'][k]:.3f})" for k, v in threads)
        )
        for f in sorted(out.glob(f"spy-{name}-*.txt")):
            report.append(spy_summary(f, a.spy_seconds))
            with open(f, "rb") as src, gzip.open(str(f) + ".gz", "wb") as dst:
                shutil.copyfileobj(src, dst)
    text = "\n".join(report) + "\n\n" + "\n".join(table) + "\n"
    (out / "profile.md").write_text(text)
    print("\n" + text, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
