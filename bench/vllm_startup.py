"""How long a vLLM server on CPU takes to start, per start-up flag set, with a fresh and a warm
compile cache (issues 44 and 48): vLLM compiles the model at every start unless told not to,
and on CPU its compile cache did not load ("Compiling model again due to a load failure").

    .venv-vllm/bin/python bench/vllm_startup.py [--model mid|smollm2|DIR] [--rounds 1]   # bench/RESULTS.md

Each server starts the way a run starts it (`launch_vllm`: vime's flags, the KV cache sized, its
OpenMP threads on one core, returning once /health answers and one token came back), then generates
a fixed greedy load (`--requests` prompts of 16 tokens, `--tokens` new tokens each, at once).
Variants (see VARIANTS) alternate start by start: every variant's cold start (an empty
VLLM_CACHE_ROOT and TORCHINDUCTOR_CACHE_DIR of its own), then every variant's warm start (the same
directories again), so drift of a shared machine hits all alike. Columns: `start`, launch_vllm's
wall time, and `start CPU` the CPU seconds the server's processes used for it (on a shared machine
the steadier figure); `gen`, the load's wall and CPU seconds; `compile`, what the server's log says
of its compile (its engine's set-up seconds, where the compile happens, and whether a cached compile
failed to load); `same`, whether its greedy tokens equal the
eager server's, and `dlp`, the largest gap between its log-probs and the eager server's (float32: a
compiled graph sums in another order, so a gap of ~1e-5 is expected, tokens should not move).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from vime.backends.vllm.client import VLLMClient  # noqa: E402
from vime.backends.vllm.launch import launch_vllm  # noqa: E402

# name -> (--vllm-NAME flags, environment), each spelled out (vime's CPU default is `eager`, and
# it starts compiled servers with VLLM_USE_AOT_COMPILE=0 unless the variable is set). `aot`:
# vLLM's own default on CPU, its compile mode turned into one Dynamo trace compiled by Inductor,
# cached through PyTorch's AOT-compile path (VLLM_USE_AOT_COMPILE, on by default from torch 2.10).
# `no-aot`: the same compile, cached by vLLM's older path and Inductor's FX-graph cache instead.
# `dynamo-eager`: the Dynamo trace run by the eager backend (vLLM's own CPU CI setting,
# VLLM_CPU_CI_ENV). `eager`: no torch.compile at all.
VARIANTS: dict[str, tuple[dict, dict[str, str]]] = {
    "aot": ({"enforce-eager": False}, {"VLLM_USE_AOT_COMPILE": "1"}),
    "no-aot": ({"enforce-eager": False}, {"VLLM_USE_AOT_COMPILE": "0"}),
    "dynamo-eager": ({"enforce-eager": False}, {"VLLM_USE_AOT_COMPILE": "0", "VLLM_CPU_CI_ENV": "1"}),
    "eager": ({"enforce-eager": True}, {}),
}
# The tests' server model (tests/unit/backends/test_vllm_server.py's MID_MODEL): a random ~17M-parameter Qwen3.
MID = dict(
    arch="qwen3",
    hidden_size=512,
    num_layers=8,
    num_heads=16,
    num_kv_heads=4,
    head_dim=32,
    intermediate_size=1024,
    max_position_embeddings=2048,
)


def model_dir(name: str, work: Path) -> Path:
    from vime.models import make_tiny_model, resolve_model

    if name == "mid":
        return make_tiny_model(work / "mid", seed=0, **MID)
    return Path(resolve_model(name))


def group_cpu_seconds(pgid: int) -> float:
    """CPU seconds the server's process group has used (its live members, and the children they
    have reaped): on a shared machine this moves far less with the load than the wall time."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:  # field 5 of stat, the process group
            total += sum(int(f) for f in fields[11:15])  # utime, stime, cutime, cstime
    return total / tick


def cache_state(log: Path) -> str:
    """What the server's log says of its compile: the seconds of its engine's set-up (profile, KV
    cache, warm-up: where the compile happens), and whether a cached compile failed to load."""
    text = log.read_text(errors="replace")
    init = re.search(r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+) s", text)
    return (f"init {float(init[1]):.0f} s" if init else "init ?") + (
        "; cache load failed" if "due to a load failure" in text else ""
    )


async def load(client: VLLMClient, requests: int, tokens: int) -> list[tuple[list[int], list[float]]]:
    params = {"max_new_tokens": tokens, "temperature": 0.0, "ignore_eos": True}
    try:
        outs = await asyncio.gather(
            *(client.generate([10 + i + j for j in range(16)], params) for i in range(requests))
        )
    finally:
        await client.close()
    return [(o["output_ids"], o["meta_info"]["output_token_logprobs"]) for o in outs]


def one_start(model: Path, name: str, cache: Path, log: Path, args) -> dict:
    flags, env = VARIANTS[name]
    saved = {k: os.environ.get(k) for k in (*env, "VLLM_CACHE_ROOT", "TORCHINDUCTOR_CACHE_DIR")}
    os.environ.update(env, VLLM_CACHE_ROOT=str(cache / "vllm"), TORCHINDUCTOR_CACHE_DIR=str(cache / "inductor"))
    try:
        t0 = time.perf_counter()
        server = launch_vllm(str(model), max_num_seqs=32, log_path=log, vllm_args=dict(flags), cpu_cores=args.core)
        start = time.perf_counter() - t0
        cpu = group_cpu_seconds(server.proc.pid)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    try:
        t0, c0 = time.perf_counter(), group_cpu_seconds(server.proc.pid)
        outs = asyncio.run(load(VLLMClient(server.url, api_key=server.api_key), args.requests, args.tokens))
        gen, gen_cpu = time.perf_counter() - t0, group_cpu_seconds(server.proc.pid) - c0
    finally:
        server.shutdown()
    return {"start": start, "cpu": cpu, "gen": gen, "gen_cpu": gen_cpu, "cache": cache_state(log), "outs": outs}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="mid", help="mid (the tests' server model), smollm2, or an HF directory")
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated, of: " + ", ".join(VARIANTS))
    p.add_argument("--rounds", type=int, default=1, help="cold+warm pairs per variant")
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--core", default=str((os.cpu_count() or 2) - 1), help="the server's OpenMP cores")
    p.add_argument("--work", default=None, help="where caches, logs and the model go (default: a temp dir)")
    args = p.parse_args()
    names = args.variants.split(",")
    work = Path(args.work or tempfile.mkdtemp(prefix="vllm-startup-"))
    model = model_dir(args.model, work)
    rows: list[tuple[str, int, str, dict]] = []
    for r in range(args.rounds):
        for phase in ("cold", "warm"):
            for name in names:
                cache = work / f"cache-{name}-{r}"
                res = one_start(model, name, cache, work / f"{name}-{r}-{phase}.log", args)
                rows.append((name, r, phase, res))
                print(
                    f"{name:13s} round {r} {phase}: start {res['start']:6.1f} s  cpu {res['cpu']:6.1f} s  gen {res['gen']:5.2f} s, {res['gen_cpu']:5.2f} CPU s  compile {res['cache']}",
                    flush=True,
                )
    ref = next((res["outs"] for name, _, _, res in rows if name == "eager"), rows[0][3]["outs"])
    cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    cpu_name = next((line.split(":", 1)[1].strip() for line in cpu.splitlines() if line.startswith("Model name")), "?")
    print(f"\n{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC; {platform.node()}; {cpu_name}, {os.cpu_count()} cores; "
          f"model {args.model}; server on core(s) {args.core}; load {args.requests} x {args.tokens} greedy tokens")  # fmt: skip
    print(
        "| variant | round | cache dir | start (s) | start CPU (s) | gen (s) | gen CPU (s) | compile | same tokens as eager | max dlp vs eager |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, r, phase, res in rows:
        same = all(a[0] == b[0] for a, b in zip(res["outs"], ref))
        dlp = max(abs(x - y) for a, b in zip(res["outs"], ref) for x, y in zip(a[1], b[1]))
        print(
            f"| {name} | {r} | {phase} | {res['start']:.1f} | {res['cpu']:.1f} | {res['gen']:.2f} | {res['gen_cpu']:.2f} | {res['cache']} | {'yes' if same else 'NO'} | {dlp:.1e} |"
        )


if __name__ == "__main__":
    main()
