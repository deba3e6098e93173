"""Weight push into a vLLM server, the two ways vime has on CPU, side by side: `disk` (a
safetensors directory the server loads) and a collective broadcast (`gloo`, the code NCCL runs on
GPUs) through vime's worker extension.

    .venv-vllm/bin/python bench/bench_vllm_push.py [--reps 5]          # bench/RESULTS.md

One vLLM server (`launch_vllm`, float32 on CPU, eager) of SmolLM2-135M-Instruct
(`vime.models.resolve_model("smollm2")`); the weights pushed are the trainer's: that model's
`named_parameters()` in float32 (the tied embedding once). Pushers are the run's
(`WeightPusher`): disk into the system temp dir (`--tmp-dir` to change), gloo in 512 MiB flat
buckets after one `connect("cpu")`. After one untimed warm-up push each, `--reps` rounds alternate
disk, gloo, disk with checksums, gloo with checksums, so drift of the machine hits all alike. The
push time is the pusher's own `perf/update_weights_push_time` (send, the server's load, its
prefix-cache flush and version stamp); with `check` on, the pusher also checksums what it sends
(inside the push time) and then compares the server's checksums (`perf/update_weights_check_time`,
the check column). The table is printed last.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.bench_cpu_engines import cpu_name  # noqa: E402
from vime.transport.group import apply_gpu_safe_env  # noqa: E402

apply_gpu_safe_env()  # multicast off (NCCL_NVLS_ENABLE=0 ...), before torch or vLLM start anything

import torch  # noqa: E402

from vime.backends.vllm.client import VLLMClient  # noqa: E402
from vime.backends.vllm.launch import launch_vllm  # noqa: E402
from vime.models import resolve_model  # noqa: E402
from vime.transport.push import WeightPusher  # noqa: E402

# (row name, transport, checksums on)
VARIANTS = [
    ("disk", "disk", False),
    ("gloo", "gloo", False),
    ("disk + check", "disk", True),
    ("gloo + check", "gloo", True),
]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--reps", type=int, default=5, help="timed pushes per variant (after one warm-up push each)")
    p.add_argument(
        "--tmp-dir", default=None, help="where the disk pusher writes (default: the system temp dir, as a run)"
    )
    p.add_argument(
        "--out", default=str(Path(tempfile.gettempdir()) / "vime-bench-vllm-push"), help="the server's log goes here"
    )
    return p.parse_args()


def mem_gib() -> float:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return float("nan")


def fs_type(path: str) -> str:
    r = subprocess.run(["df", "--output=fstype", path], capture_output=True, text=True)
    lines = r.stdout.split()
    return lines[-1] if r.returncode == 0 and lines else "?"


def omp_cores() -> str:
    """The cores launch_vllm pins a CPU server's OpenMP threads to when not told (its rule)."""
    n = os.cpu_count() or 2
    return str(n - 1) if n <= 2 else f"{n // 2}-{n - 1}"


def loadavg() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def trainer_weights(model_dir: Path) -> list[tuple[str, torch.Tensor]]:
    """What the trainer pushes (Actor.named_weights): each tensor once, the tied one as
    model.embed_tokens.weight."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return [(n, p.detach()) for n, p in model.named_parameters()]


def main() -> None:
    args = parse_args()
    if args.reps < 1:
        raise SystemExit("--reps must be at least 1")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    import vllm

    started = datetime.datetime.now(datetime.UTC)
    load_before = loadavg()
    model_dir = resolve_model(args.model)
    weights = trainer_weights(model_dir)
    nparams = sum(t.numel() for _, t in weights)
    print(f"{model_dir}: {len(weights)} tensors, {nparams / 1e6:.1f}M parameters (float32)", flush=True)

    t0 = time.perf_counter()
    server = launch_vllm(str(model_dir), max_num_seqs=8, vllm_args={"enforce-eager": True}, log_path=out / "vllm.log")
    pushers: dict[str, WeightPusher] = {}
    # per variant, from the pusher's metrics: push (s), check (s), the disk transport's write (s)
    push_s: dict[str, list[float]] = {v: [] for v, _, _ in VARIANTS}
    check_s: dict[str, list[float]] = {v: [] for v, _, _ in VARIANTS}
    write_s: dict[str, list[float]] = {v: [] for v, _, _ in VARIANTS}
    nbytes: dict[str, float] = {}
    try:
        print(f"vLLM server up at {server.url} in {time.perf_counter() - t0:.0f}s (log {server.log_path})", flush=True)
        client = VLLMClient(server.url, api_key=server.api_key)
        pushers["disk"] = WeightPusher([client], transport="disk", tmp_dir=args.tmp_dir, check=False)
        pushers["disk + check"] = WeightPusher([client], transport="disk", tmp_dir=args.tmp_dir, check=True)
        # one weight group per server: the gloo rows share one pusher, its check switched per push
        gloo = pushers["gloo"] = WeightPusher([client], transport="gloo", check=False)
        t1 = time.perf_counter()
        gloo.connect("cpu")
        print(f"gloo weight group formed in {time.perf_counter() - t1:.2f}s", flush=True)

        version = 0
        for rep in range(args.reps + 1):
            for name, transport, check in VARIANTS:
                pusher = gloo if transport == "gloo" else pushers[name]
                pusher.check = check
                version += 1
                t = time.perf_counter()
                m = pusher.push(weights, version=version)
                wall = time.perf_counter() - t
                extra = f", check {m['perf/update_weights_check_time']:.3f}s" if check else ""
                print(
                    f"rep {rep} {name}: push {m['perf/update_weights_push_time']:.3f}s{extra} "
                    f"(wall {wall:.3f}s){' (warm-up)' if rep == 0 else ''}",
                    flush=True,
                )
                if rep == 0:
                    continue
                push_s[name].append(m["perf/update_weights_push_time"])
                if check:
                    check_s[name].append(m["perf/update_weights_check_time"])
                if "perf/update_weights_write_time" in m:
                    write_s[name].append(m["perf/update_weights_write_time"])
                nbytes[name] = m["perf/update_weights_bytes"]
        served = client.model_info()["weight_version"]
        assert served == version, f"the server holds weight version {served}, the last push was {version}"
    finally:
        for p in pushers.values():
            p.close()
        server.shutdown()

    med = {v: statistics.median(push_s[v]) for v in push_s}
    tmp = args.tmp_dir or tempfile.gettempdir()
    cmd = " ".join([os.path.relpath(sys.executable, ROOT) if sys.executable.startswith(str(ROOT)) else sys.executable,
                    "bench/bench_vllm_push.py", *sys.argv[1:]])  # fmt: skip
    print(
        f"\n`{cmd}`, {started:%Y-%m-%d %H:%M} UTC\n"
        f"hardware: {cpu_name()}, nproc {len(os.sched_getaffinity(0))} ({os.cpu_count()} online), {mem_gib():.0f} GiB; "
        f"load average (1/5/15 min) {load_before} before, {loadavg()} after\n"
        f"vLLM {vllm.__version__}, torch {torch.__version__}; server float32 on CPU, eager, "
        f"its OMP threads on core(s) {omp_cores()} (launch_vllm's default), this process unpinned\n"
        f"{model_dir.name}: {nparams / 1e6:.1f}M parameters, "
        f"{len(weights)} tensors; disk writes to {tmp} ({fs_type(tmp)}); gloo buckets of "
        f"{gloo.bucket_bytes // 2**20} MiB; {args.reps} timed pushes per row after one warm-up each, rows interleaved\n"
    )
    print("| transport | push median (s) | min | max | check median (s) | MB per push | MB/s (median) |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, _, check in VARIANTS:
        mb = nbytes[name] / 1e6
        chk = f"{statistics.median(check_s[name]):.3f}" if check else "–"
        print(
            f"| {name} | {med[name]:.3f} | {min(push_s[name]):.3f} | {max(push_s[name]):.3f} | {chk} | {mb:.1f} | "
            f"{mb / med[name]:.0f} |"
        )
    if write_s["disk"]:
        w = statistics.median(write_s["disk"])
        print(f"\ndisk, median: write {w:.3f}s (safetensors save), server load + flush + stamp {med['disk'] - w:.3f}s")
    print(
        f"disk / gloo (median push): {med['disk'] / med['gloo']:.2f}×; with checksums (push + check): "
        f"{(med['disk + check'] + statistics.median(check_s['disk + check'])) / (med['gloo + check'] + statistics.median(check_s['gloo + check'])):.2f}×"
    )


if __name__ == "__main__":
    main()
