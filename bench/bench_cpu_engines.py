"""The built-in engine and vLLM side by side on this CPU: same model, same requests, interleaved
rounds, one compute thread each.

    make install-vllm && .venv-vllm/bin/python bench/bench_cpu_engines.py        # bench/RESULTS.md

Workload: SmolLM2-135M-Instruct (`vime.models.resolve_model("smollm2")`) in float32 (both
engines; `--dtype bfloat16` runs both in bf16), `--requests` concurrent
requests of seeded random prompt ids (`--prompt-len` tokens), `--output-len` sampled tokens each
(temperature 1, EOS ignored, per-request seeds), sent through each backend's client
(`EngineClient` / `VLLMClient`, HTTP, so both pay the same client cost). Both servers are up for
the whole run; rounds alternate vime, vLLM, vime, … so drift of the machine hits both alike, and
the idle server is pinned to the other core. Output tokens/s per round (first round of each
discarded as warm-up); the table gives the median and the range.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from vime.backends.builtin.launch import launch_engine  # noqa: E402
from vime.backends.client import EngineClient  # noqa: E402
from vime.backends.vllm.client import VLLMClient  # noqa: E402
from vime.backends.vllm.launch import launch_vllm  # noqa: E402
from vime.models import resolve_model  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--rounds", type=int, default=4, help="timed rounds per engine (after one warm-up round each)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="both engines")
    p.add_argument("--engines", default="vime,vllm")
    p.add_argument("--out", default="bench_out")
    return p.parse_args()


def pin(pid: int, core: int) -> None:
    """Pin every thread of a process (and so its future threads) to one core."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), {core})
        except OSError:
            pass  # a thread that ended meanwhile


def pin_tree(pid: int, core: int) -> None:
    """`pin` for a process and all its descendants (vLLM's API server, engine core, worker)."""
    out = subprocess.run(["pgrep", "-g", str(os.getpgid(pid))], capture_output=True, text=True).stdout.split()
    for p in {pid, *map(int, out)}:
        pin(p, core)


def workload(args: argparse.Namespace, vocab: int) -> list[tuple[list[int], dict]]:
    rng = random.Random(0)
    return [
        (
            [rng.randrange(100, vocab) for _ in range(args.prompt_len)],
            {"max_new_tokens": args.output_len, "temperature": 1.0, "ignore_eos": True, "sampling_seed": i},
        )
        for i in range(args.requests)
    ]


async def one_round(client: EngineClient, reqs: list[tuple[list[int], dict]]) -> tuple[float, int]:
    t0 = time.perf_counter()
    outs = await asyncio.gather(*(client.generate(ids, params) for ids, params in reqs))
    elapsed = time.perf_counter() - t0
    await client.close()
    return elapsed, sum(len(o["output_ids"]) for o in outs)


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def main() -> None:
    args = parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = resolve_model(args.model)
    from transformers import AutoConfig

    reqs = workload(args, AutoConfig.from_pretrained(model).vocab_size)
    engines = args.engines.split(",")
    procs, clients = {}, {}
    try:
        # vime on core 0, vLLM on core 1: each has one compute thread and a core of its own
        if "vime" in engines:
            procs["vime"] = launch_engine(
                str(model),
                dtype=args.dtype,
                extra_args=["--num-threads", "1", "--max-num-seqs", str(args.requests)],
                log_path=out / "vime_engine.log",
            )
            pin(procs["vime"].proc.pid, 0)
            clients["vime"] = EngineClient(procs["vime"].url)
        if "vllm" in engines:
            procs["vllm"] = launch_vllm(
                str(model), dtype=args.dtype, cpu_cores="1", max_num_seqs=args.requests, log_path=out / "vllm.log"
            )
            pin_tree(procs["vllm"].proc.pid, 1)
            clients["vllm"] = VLLMClient(procs["vllm"].url)
        rates: dict[str, list[float]] = {e: [] for e in engines}
        for r in range(args.rounds + 1):
            for e in engines:
                elapsed, tokens = asyncio.run(one_round(clients[e], reqs))
                print(
                    f"round {r} {e}: {tokens} tokens in {elapsed:.2f}s = {tokens / elapsed:.1f} tok/s{' (warm-up)' if r == 0 else ''}",
                    flush=True,
                )
                if r:
                    rates[e].append(tokens / elapsed)
    finally:
        for p in procs.values():
            p.shutdown()
    cmd = " ".join([Path(sys.executable).name, "bench/bench_cpu_engines.py", *sys.argv[1:]])
    print(
        f"\n`{cmd}` on {cpu_name()}, {os.cpu_count()} cores; {args.requests} requests × {args.prompt_len} prompt + "
        f"{args.output_len} output tokens, {args.dtype}, one compute thread each, {args.rounds} interleaved rounds\n"
    )
    print("| engine | output tok/s (median) | range | vs vime |")
    print("|---|---|---|---|")
    base = statistics.median(rates["vime"]) if "vime" in rates else None
    for e in engines:
        med = statistics.median(rates[e])
        ratio = f"{med / base:.2f}×" if base else "-"
        print(f"| {e} ({args.dtype}) | {med:.1f} | {min(rates[e]):.1f}–{max(rates[e]):.1f} | {ratio} |")


if __name__ == "__main__":
    main()
