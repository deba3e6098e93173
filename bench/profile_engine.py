"""Where a decode step's time goes (issue 30): host phases against device time, per step, on
bench_engine.py's workload, then the decode graph's time against its bandwidth floor per batch
size, then the kernels of one forward.

    PYTHONPATH=. python3 bench/profile_engine.py                      # 0.6B shape, one GPU
    PYTHONPATH=. python3 bench/profile_engine.py --device cpu --tiny  # smoke test

A step: the host schedules, stages the inputs, launches the graph and the sampler, starts the
copy of the tokens to the host, waits for the step before it (overlapped, the default) or for
this one (`--disable-overlap-schedule`), then books the tokens. Both ways run, one after the
other, on the same model and workload. Device time is measured with CUDA events from the
first upload to the sampler's end: one at a time, `wall - device` is the time the GPU sat idle
waiting for the host; overlapped, the device's share of the wall clock says how much of that
is left.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

from bench.bench_engine import copy_bandwidth, gpu_decode_step_ms, make_model, stage_decode, workload
from bench.shapes import SHAPES, TINY

PHASES = ("schedule", "prepare", "sample", "download", "wait", "book")


CUR: dict = {}  # the current step's phase times and CUDA events


def timed(name: str, fn):
    def wrapped(*a, **k):
        t = time.perf_counter()
        if name in ("prepare", "download") and torch.cuda.is_available():
            CUR[name + "_event"] = torch.cuda.Event(enable_timing=True)
            CUR[name + "_event"].record()
        out = fn(*a, **k)
        CUR[name] = CUR.get(name, 0.0) + time.perf_counter() - t
        return out

    return wrapped


def instrument_modules() -> None:
    """The module-level parts of a step (once per process)."""
    import vime.engine.core.runner as runner_mod

    runner_mod.sample = timed("sample", runner_mod.sample)
    result = runner_mod.Launched.result
    runner_mod.Launched.result = lambda self: timed("wait", lambda: result(self))()


def instrument(engine) -> tuple[list[dict], callable]:
    """Wrap the engine's parts of a step with timers; returns the per-step records and `step()`."""
    r, records = engine.runner, []
    engine.scheduler.schedule = timed("schedule", engine.scheduler.schedule)
    r._decode = timed("prepare", r._decode)
    r._eager = timed("prepare", r._eager)
    r._download = timed("download", r._download)

    def step():
        CUR.clear()
        t = time.perf_counter()
        done = engine.step()
        wall = time.perf_counter() - t
        s = r.last_step
        rec = {"kind": s.kind, "num_seqs": s.num_seqs, "ctx": s.context_tokens, "wall": wall}
        rec.update({k: CUR.get(k, 0.0) for k in PHASES[:-1]})
        rec["book"] = wall - sum(rec[k] for k in PHASES[:-1])
        rec["events"] = (CUR.get("prepare_event"), CUR.get("download_event"))
        records.append(rec)
        return done

    return records, step


def profile_run(engine, a, prompts, max_new, weight_bytes: int, kv_tok: int, bw: float, overlap: bool) -> list[str]:
    """The workload once, timed step by step; prints the per-step table and returns the summary row."""
    from vime.engine.core.sampler import SamplingParams

    cuda = engine.device.type == "cuda"
    records, step = instrument(engine)

    def run(ps, ms) -> float:
        for i, (pr, m) in enumerate(zip(ps, ms)):
            engine.add_request(str(i), pr, SamplingParams(max_new_tokens=m, temperature=a.temperature, ignore_eos=True))
        t = time.perf_counter()
        while engine.has_work():
            step()
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - t

    run([x[:50] for x in prompts[:8]], [20] * 8)  # warm-up: the eager path's kernels compile
    records.clear()
    wall = run(prompts, max_new)
    for rec in records:
        e0, e1 = rec.pop("events")
        rec["device"] = e0.elapsed_time(e1) / 1e3 if e0 is not None and e1 is not None else float("nan")
        rec["floor"] = (weight_bytes + rec["ctx"] * kv_tok) / bw
    n_out = sum(max_new)
    mode = "overlapped" if overlap else "one at a time"
    print(
        f"\n{mode}: {len(prompts)} requests, {n_out} output tokens in {wall:.2f} s: {n_out / wall:,.0f} tok/s, {len(records)} steps\n"
    )
    groups: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for rec in records:
        groups[(rec["kind"], bucket(rec["num_seqs"]) if rec["kind"] != "eager" else "all")].append(rec)
    cols = ("wall", *PHASES, "device", "floor")
    print(
        "| step kind | batch | steps | total s | "
        + " | ".join(f"{c} ms" for c in cols)
        + " | device/wall | floor/wall |"
    )
    print("|---|---|---:|---:|" + "---:|" * (len(cols) + 2))
    for (kind, b), rs in sorted(groups.items()):
        # a step that only books (nothing left to launch) has no device time
        m = {c: 1e3 * statistics.fmean([x[c] for x in rs if x[c] == x[c]] or [float("nan")]) for c in cols}
        print(
            f"| {kind} | {b} | {len(rs)} | {sum(x['wall'] for x in rs):.2f} | "
            + " | ".join(f"{m[c]:.3f}" for c in cols)
            + f" | {m['device'] / m['wall']:.0%} | {m['floor'] / m['wall']:.0%} |"
        )
    dec = [x for x in records if x["kind"] != "eager"] or records
    w, d, f = (sum(x[c] for x in dec if x[c] == x[c]) for c in ("wall", "device", "floor"))
    print(
        f"\ndecode steps: wall {w:.2f} s, device {d:.2f} s ({d / w:.0%}), floor {f:.2f} s ({f / w:.0%} of wall, "
        f"{f / d:.0%} of device); host-only time {w - d:.2f} s = {1e3 * (w - d) / len(dec):.2f} ms a step"
    )
    return [mode, f"{n_out / wall:,.0f}", f"{1e3 * w / len(dec):.2f}", f"{f / w:.0%}", f"{d / w:.0%}"]


def bucket(b: int) -> str:
    for lo, hi in ((1, 15), (16, 63), (64, 191), (192, 10**9)):
        if lo <= b <= hi:
            return f"{lo}-{hi if hi < 10**9 else ''}"
    return "?"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--shape", choices=list(SHAPES), default="qwen3-0.6b")
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    device = torch.device(a.device)
    cuda = device.type == "cuda"
    shape = TINY if a.tiny else SHAPES[a.shape]
    lo, hi = (10, 40) if a.tiny else (100, 1024)
    n_req = min(a.num_requests, 16) if a.tiny else a.num_requests
    max_seqs = min(a.max_num_seqs, n_req)
    dtype_name = "bfloat16" if cuda else "float32"
    prompts, max_new = workload(n_req, lo, hi, shape["vocab_size"], a.seed)
    bw = copy_bandwidth(device) if cuda else 1e11
    kv_tok = 2 * shape["num_hidden_layers"] * shape["num_key_value_heads"] * shape["head_dim"] * (2 if cuda else 4)

    from vime.engine.core.engine import EngineConfig, LLMEngine

    print(f"\n{torch.cuda.get_device_name(device) if cuda else 'cpu'}; copy bandwidth {bw / 1e12:.2f} TB/s")
    instrument_modules()
    with tempfile.TemporaryDirectory() as tmp:
        hf = make_model(shape, device, getattr(torch, dtype_name), a.seed, Path(tmp))
        weight_bytes = sum(x.numel() * x.element_size() for x in hf.parameters())
        del hf
        summary = []
        for overlap in (False, True):
            engine = None  # the previous mode's engine goes before this one takes its share of memory
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
            engine = LLMEngine(
                EngineConfig(
                    tmp,
                    device=str(device),
                    dtype=dtype_name,
                    max_num_seqs=max_seqs,
                    max_num_batched_tokens=a.max_num_batched_tokens,
                    max_model_len=2 * hi + 64,
                    seed=a.seed,
                    overlap=overlap,
                )
            )
            summary.append(profile_run(engine, a, prompts, max_new, weight_bytes, kv_tok, bw, overlap))
    print("\n| steps | output tok/s | decode step ms (mean) | floor / decode step | device share of decode wall |")
    print("|---|---:|---:|---:|---:|")
    for row in summary:
        print("| " + " | ".join(row) + " |")
    print(
        f"overlapped / one at a time: {float(summary[1][1].replace(',', '')) / float(summary[0][1].replace(',', '')):.3f}x tok/s"
    )

    if not cuda or not engine.runner.graphs:
        return
    # ---- the graph alone, per batch size ----
    print("\n| batch | context | graph ms | sampler ms | floor ms | floor/graph |")
    print("|---:|---:|---:|---:|---:|---:|")
    for ctx in (512, 1536):
        for b in engine.runner.batch_sizes:
            g, s = gpu_decode_step_ms(engine, b, ctx)
            fl = 1e3 * (weight_bytes + b * ctx * kv_tok) / bw
            print(f"| {b} | {ctx} | {g:.3f} | {s:.3f} | {fl:.3f} | {fl / g:.0%} |")

    # ---- kernels of one eager decode forward ----
    from torch.profiler import ProfilerActivity, profile

    for b, ctx in ((max_seqs, 813), (16, 1536)):
        stage_decode(engine, b, ctx)
        with torch.inference_mode():
            for _ in range(3):
                engine.runner._decode_forward(b)
            torch.cuda.synchronize()
            iters = 5
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(iters):
                    engine.runner._decode_forward(b)
                torch.cuda.synchronize()
        evts = [
            e
            for e in prof.key_averages()
            if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA or "kernel" in e.key.lower()
        ]
        total = sum(getattr(e, "self_device_time_total", 0) for e in evts) / iters
        print(f"\nkernels of one eager decode forward, B={b}, context {ctx}: {total / 1e3:.3f} ms of kernel time")
        print("| kernel | calls | us | share |")
        print("|---|---:|---:|---:|")
        for e in sorted(evts, key=lambda e: -getattr(e, "self_device_time_total", 0))[:14]:
            t = getattr(e, "self_device_time_total", 0) / iters
            print(f"| {e.key[:70]} | {e.count // iters} | {t:.1f} | {t / total:.0%} |")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
