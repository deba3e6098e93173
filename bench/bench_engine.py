"""Rollout-engine throughput, side by side in one process: the vime engine (in process, no HTTP)
against HF transformers' generate (default cache; static cache + torch.compile) and its
continuous batching; and the vime engine with FP8 projections (`--arms vime,vime_fp8`, issue 48).

    PYTHONPATH=. python3 bench/bench_engine.py                  # the H200 run in bench/RESULTS.md
    PYTHONPATH=. python3 bench/bench_engine.py --device cpu --tiny   # smoke test, seconds
    PYTHONPATH=. python3 bench/bench_engine.py --shape qwen3-4b --arms vime,vime_fp8   # bf16 vs FP8 rollouts
    PYTHONPATH=. python3 bench/bench_engine.py --shape qwen3-30b-a3b-4l   # Qwen3-30B-A3B cut to 4 layers (MoE)

Workload (issue 6): a Qwen3-0.6B-shaped model (`--shape qwen3-4b`: the 4B one) with random bf16
weights (`--dtype float32` tells rounding from a bug in the correctness check), 256 requests with prompt
and output lengths uniform in 100-1024 (seeded), random token ids, EOS ignored. The HF arms are
far slower, so they run a stated subset with outputs capped. Before timing, the engine's greedy
output is compared with HF `generate` and its log-probs with a teacher-forced HF forward (for
the fp8 arm that is the trainer-vs-engine gap: the trainer scores in the model dtype, as HF).
The decode floor is the bytes a step must read (weights + KV) over the copy bandwidth; the fp8
arm's weights count 1 byte per parameter of the quantized projections plus their float32 scales.
Details (per-step log, every number) go to --out; the markdown table is printed last.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import tempfile
import time
import traceback
from pathlib import Path

import numpy as np
import torch

from bench.shapes import MOE_SHAPES, SHAPES, hf_config, pick

# the vime engine's arms, their labels in the table
VIME_ARMS = {"vime": "vime (graphs + Triton)", "vime_fp8": "vime, FP8 projections (graphs + Triton)"}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="tiny model (of --shape's family) and workload (smoke test)")
    p.add_argument("--shape", choices=[*SHAPES, *MOE_SHAPES], default="qwen3-0.6b", help="model shape (random weights)")
    p.add_argument(
        "--dtype",
        choices=["bfloat16", "float32"],
        help="engine and HF dtype (default: bfloat16 on a GPU, float32 on CPU); float32 tells precision from a bug",
    )
    p.add_argument("--num-requests", type=int, default=None, help="default 256 (tiny: 16)")
    p.add_argument("--temperature", type=float, default=1.0, help="vime sampling temperature (RL rollouts sample)")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument(
        "--hf-requests", type=int, default=64, help="subset (= batch) for HF generate with its default cache"
    )
    p.add_argument("--hf-cb-requests", type=int, default=32, help="subset for HF continuous batching (the slowest arm)")
    p.add_argument(
        "--hf-compile-requests", type=int, default=256, help="subset (= batch) for HF static cache + compile"
    )
    p.add_argument("--hf-max-new", type=int, default=256, help="output cap for the HF arms")
    p.add_argument("--arms", default="vime,hf,hf_compile,hf_cb", help="of vime, vime_fp8, hf, hf_compile, hf_cb")
    p.add_argument("--check-prompts", type=int, default=8)
    p.add_argument("--check-tokens", type=int, default=64)
    p.add_argument("--time-budget", type=float, default=330.0, help="seconds; arms not started by then are skipped")
    p.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    unknown = set(args.arms.split(",")) - {*VIME_ARMS, "hf", "hf_compile", "hf_cb"}
    if unknown:
        p.error(
            f"--arms: unknown {', '.join(sorted(unknown))}; give some of {', '.join([*VIME_ARMS, 'hf', 'hf_compile', 'hf_cb'])}"
        )
    return args


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_gib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


def mapped_gib(engine) -> float:
    """Device memory the engine maps itself (weights and KV pools, with CUDA VMM), which torch's
    allocator statistics leave out."""
    buffers = [engine.kv_cache.buffer, engine.packed.buffer if engine.packed is not None else None]
    buffers.append(engine.fp8.buffer if engine.fp8 is not None else None)  # the fp8 copies (vime_fp8)
    return sum(b.reserved for b in buffers if b is not None) / 2**30


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def copy_bandwidth(device: torch.device) -> float:
    """Device-to-device copy rate, bytes read + written per second (the decode floor's ceiling)."""
    if device.type != "cuda":
        return float("nan")
    x = torch.empty(2**30, dtype=torch.uint8, device=device).random_()
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        y.copy_(x)
    end.record()
    sync(device)
    return 2 * 20 * x.numel() / (start.elapsed_time(end) / 1e3)


def make_model(shape: dict, device: torch.device, dtype: torch.dtype, seed: int, out_dir: Path):
    """Random HF model of the given shape (Qwen3 or Qwen3-MoE), written to out_dir; returns the HF model
    (kept for the HF arms)."""
    from transformers import AutoModelForCausalLM

    cfg = hf_config(shape, bos_token_id=None, eos_token_id=None, pad_token_id=0)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    model.eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    model.save_pretrained(out_dir)
    return model


def workload(n: int, lo: int, hi: int, vocab: int, seed: int) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]
    return prompts, [rng.randint(lo, hi) for _ in range(n)]


# ---- vime --------------------------------------------------------------------------------


def run_engine(
    engine, prompts: list[list[int]], max_new: list[int], temperature: float, log: list | None = None
) -> list:
    """All requests at once; steps until done. Returns the outputs in request order."""
    from vime.engine.core.sampler import SamplingParams

    for i, (p, m) in enumerate(zip(prompts, max_new)):
        engine.add_request(str(i), p, SamplingParams(max_new_tokens=m, temperature=temperature, ignore_eos=True))
    outs = {}
    while engine.has_work():
        t0 = time.perf_counter()
        done = engine.step()
        if log is not None:
            s = engine.runner.last_step
            log.append((s.kind, s.num_seqs, s.context_tokens, time.perf_counter() - t0))
        outs.update((o.rid, o.outputs[0]) for o in done)
    return [outs[str(i)] for i in range(len(prompts))]


def check_against_hf(engine, hf, prompts: list[list[int]], n_new: int, device: torch.device) -> dict:
    """Greedy tokens vs HF generate (batch 1, its default cache) and greedy log-probs vs a
    teacher-forced HF forward over the engine's own output."""
    outs = run_engine(engine, prompts, [n_new] * len(prompts), 0.0)
    first_diff, lp_diffs = [], []
    for p, o in zip(prompts, outs):
        ids = torch.tensor([p], device=device)
        with torch.no_grad():
            ref = hf.generate(
                ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n_new, min_new_tokens=n_new
            )[0, len(p) :].tolist()
            logits = hf(torch.tensor([p + o.output_ids], device=device)).logits[0, len(p) - 1 : -1].float()
        lp = torch.log_softmax(logits, -1).gather(1, torch.tensor(o.output_ids, device=device)[:, None])[:, 0].cpu()
        lp_diffs.append((lp - torch.tensor(o.logprobs)).abs())
        first_diff.append(next((i for i, (a, b) in enumerate(zip(o.output_ids, ref)) if a != b), n_new))
    diffs = torch.cat(lp_diffs)
    return {
        "prompts": len(prompts),
        "new_tokens": n_new,
        "exact_matches": sum(d == n_new for d in first_diff),
        "first_divergence": first_diff,
        "matched_prefix_rate": sum(first_diff) / (n_new * len(prompts)),
        "logprob_max_abs_diff": diffs.max().item(),
        "logprob_mean_abs_diff": diffs.mean().item(),
    }


def stage_decode(engine, batch: int, context: int) -> None:
    """Fill the runner's device buffers for one decode step of `batch` sequences with `context`
    cached tokens each; any blocks will do, the content is not read back."""
    r = engine.runner
    nb = -(-context // r.block_size)
    blocks = torch.arange(batch * nb) % engine.allocator.num_blocks
    r.h_bt[:batch, :nb] = blocks.view(batch, nb).numpy()
    r._bt_rows[:batch] = [None] * batch
    r.h_ids[:batch] = 1
    r.h_pos[:batch] = context - 1
    r.h_ctx[:batch] = context
    r.h_slot[:batch] = blocks.view(batch, nb)[:, -1].numpy() * r.block_size
    r.h_temp[:batch] = 1.0
    r.h_seed[:batch] = np.arange(batch, dtype=np.int32)
    r._upload(batch)


def gpu_decode_step_ms(engine, batch: int, context: int) -> tuple[float, float]:
    """Median device time of one replayed decode graph (and of the sampler after it) for `batch`
    sequences of `context` cached tokens each."""
    from vime.engine.core.sampler import SamplingParams, sample

    r = engine.runner
    stage_decode(engine, batch, context)
    graph, out = r.graphs[batch]
    params = [SamplingParams(temperature=1.0)] * batch
    times, samp = [], []
    for i in range(25):
        e = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
        e[0].record()
        graph.replay()
        e[1].record()
        sample(out, params, r.d_temp[:batch], r.d_seed[:batch])
        e[2].record()
        torch.cuda.synchronize()
        if i >= 5:
            times.append(e[0].elapsed_time(e[1]))
            samp.append(e[1].elapsed_time(e[2]))
    return statistics.median(times), statistics.median(samp)


def fp8_weight_bytes(hf) -> int:
    """What a decode step of the fp8 engine reads of the weights: the projections `fp8.py`
    quantizes at 1 byte per parameter plus a float32 scale per output channel, everything else
    (embeddings, lm_head, norms, biases) in the model dtype."""
    from vime.engine.core.fp8 import PROJECTIONS
    from vime.engine.core.model import FUSED

    hf_names = {f"{m}.weight" for p in PROJECTIONS for m in FUSED.get(p, (p,))}
    total = 0
    for name, p in hf.named_parameters():  # a tied embedding once
        quantized = ".".join(name.split(".")[-2:]) in hf_names  # e.g. q_proj.weight
        total += p.numel() + 4 * p.shape[0] if quantized else p.numel() * p.element_size()
    return total


def bench_vime(
    args,
    model_dir: Path,
    hf,
    prompts,
    max_new,
    device,
    dtype_name,
    bw,
    weight_bytes,
    kv_bytes_per_token,
    res: dict,
    arm: str = "vime",
) -> None:
    """The vime engine (`arm` vime) or the same with FP8 projections (vime_fp8): correctness
    against HF, the timed workload, a decode graph alone, weight updates, release and resume."""
    from vime.engine.core.engine import EngineConfig, LLMEngine

    reset_peak(device)
    t0 = time.perf_counter()
    engine = LLMEngine(
        EngineConfig(
            str(model_dir),
            device=str(device),
            dtype=dtype_name,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=2 * max(map(len, prompts)) + 64,
            seed=args.seed,
            quantization="fp8" if arm == "vime_fp8" else None,
        )
    )
    sync(device)
    startup = time.perf_counter() - t0
    t0 = time.perf_counter()
    run_engine(engine, [p[:50] for p in prompts[:8]], [20] * 8, args.temperature)  # JIT the eager-path kernels
    warmup = time.perf_counter() - t0
    res[f"{arm}_check"] = check_against_hf(
        engine, hf, [p[:200] for p in prompts[: args.check_prompts]], args.check_tokens, device
    )
    print(f"{arm} correctness vs HF:", json.dumps(res[f"{arm}_check"]), flush=True)

    step_log: list = []
    sync(device)
    t0 = time.perf_counter()
    outs = run_engine(engine, prompts, max_new, args.temperature, step_log)
    sync(device)
    wall = time.perf_counter() - t0
    n_out = sum(len(o.output_ids) for o in outs)
    assert n_out == sum(max_new), "every request must produce exactly its max_new_tokens"
    decode = [s for s in step_log if s[0] in ("graph", "decode")]
    floor = [(weight_bytes + ctx * kv_bytes_per_token) / bw for _, _, ctx, _ in decode]
    full = [(s, f) for s, f in zip(decode, floor) if s[1] == args.max_num_seqs]
    v = {
        "requests": len(prompts),
        "output_tokens": n_out,
        "wall_s": wall,
        "tok_s": n_out / wall,
        "startup_s": startup,
        "graph_capture_s": engine.runner.capture_time,
        "warmup_s": warmup,
        "steps": len(step_log),
        "eager_steps": len(step_log) - len(decode),
        "eager_time_s": sum(s[3] for s in step_log if s[0] == "eager"),
        "decode_time_s": sum(s[3] for s in decode),
        "decode_step_ms_mean": 1e3 * statistics.fmean(s[3] for s in decode) if decode else None,
        "decode_floor_ms_mean": 1e3 * statistics.fmean(floor) if floor else None,
        "full_batch_steps": len(full),
        "full_batch_step_ms": 1e3 * statistics.fmean(s[3] for s, _ in full) if full else None,
        "full_batch_floor_ms": 1e3 * statistics.fmean(f for _, f in full) if full else None,
        "peak_gib": peak_gib(device) + mapped_gib(engine) if device.type == "cuda" else None,
        "kv_cache_gib": engine.kv_cache.k.numel() * 2 * engine.kv_cache.k.element_size() / 2**30,
        "weight_bytes": weight_bytes,
    }
    if device.type == "cuda" and engine.runner.graphs and args.max_num_seqs in engine.runner.graphs:
        ctx = sum(len(p) for p in prompts) // len(prompts) + sum(max_new) // (2 * len(max_new))
        g_ms, s_ms = gpu_decode_step_ms(engine, args.max_num_seqs, ctx)
        v.update(
            {
                "gpu_step_context": ctx,
                "gpu_graph_ms": g_ms,
                "gpu_sampler_ms": s_ms,
                "gpu_step_floor_ms": 1e3 * (weight_bytes + args.max_num_seqs * ctx * kv_bytes_per_token) / bw,
            }
        )
    # Weight update: HF-named tensors on the same GPU (the trainer's copy), copied in place (and
    # with fp8, quantized again).
    state = hf.state_dict()
    times = []
    for _ in range(5):
        sync(device)
        t0 = time.perf_counter()
        engine.update_weights(state.items())
        sync(device)
        times.append(time.perf_counter() - t0)
    v["weight_update_ms"] = 1e3 * statistics.median(times)
    v["weight_update_tensors"] = len(state)
    # Memory release and resume, as a colocated run does every step; twice, since the first
    # release also allocates the pinned host buffer the weights go to.
    v["recaptures"] = engine.packed is None
    for round_ in ("", "_again"):
        sync(device)
        t0 = time.perf_counter()
        engine.release_memory()
        sync(device)
        t1 = time.perf_counter()
        engine.resume_memory()
        sync(device)
        t2 = time.perf_counter()
        v[f"release_s{round_}"], v[f"resume_s{round_}"], v[f"release_resume_s{round_}"] = t1 - t0, t2 - t1, t2 - t0
    res[arm] = v
    with open(Path(args.out) / f"{arm}_steps.csv", "w") as f:
        f.write("kind,num_seqs,context_tokens,step_s\n")
        f.writelines(f"{k},{b},{c},{t:.6f}\n" for k, b, c, t in step_log)
    del engine
    reset_peak(device)


# ---- HF ------------------------------------------------------------------------------------


def bench_hf_generate(hf, prompts, cap: int, device, static: bool) -> dict:
    """One static batch, left-padded; every row generates `cap` tokens (greedy)."""
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    kw = dict(attention_mask=mask, do_sample=False, max_new_tokens=cap, min_new_tokens=cap, pad_token_id=0)
    if static:
        kw["cache_implementation"] = "static"
    reset_peak(device)
    out = {}
    if static:  # the first call compiles (and runs); the second is timed
        t0 = time.perf_counter()
        with torch.no_grad():
            hf.generate(ids, **kw)
        sync(device)
        out["startup_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    with torch.no_grad():
        gen = hf.generate(ids, **kw)
    sync(device)
    wall = time.perf_counter() - t0
    n = (gen.shape[1] - width) * len(prompts)
    out.update(
        {"requests": len(prompts), "output_tokens": n, "wall_s": wall, "tok_s": n / wall, "peak_gib": peak_gib(device)}
    )
    return out


def bench_hf_cb(hf, prompts, cap: int, device) -> dict:
    from transformers import GenerationConfig

    reset_peak(device)
    cfg = GenerationConfig(max_new_tokens=cap, do_sample=False, eos_token_id=-1, pad_token_id=0)
    t0 = time.perf_counter()
    with torch.no_grad():
        results = hf.generate_batch(inputs=prompts, generation_config=cfg)
    sync(device)
    wall = time.perf_counter() - t0
    n = sum(len(r.generated_tokens) for r in results.values())
    return {
        "requests": len(prompts),
        "output_tokens": n,
        "wall_s": wall,
        "tok_s": n / wall,
        "peak_gib": peak_gib(device),
        "note": "wall includes the manager's warm-up",
    }


# ---- main ----------------------------------------------------------------------------------


def fmt(x, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


def table(res: dict, args) -> str:
    rows = [
        "| arm | requests (outputs) | output tok/s | decode step: measured / floor (ms) | peak GiB | start-up (s) |",
        "|---|---|---|---|---|---|",
    ]
    vime = {}
    for arm, label in VIME_ARMS.items():
        v = res.get(arm)
        if v and "error" in v:
            rows.append(f"| {arm} | - | {v['error']} | - | - | - |")
        elif v:
            vime[arm] = v
            step = f"{fmt(v['decode_step_ms_mean'], '.2f')} / {fmt(v['decode_floor_ms_mean'], '.2f')} (mean); B={args.max_num_seqs}: {fmt(v['full_batch_step_ms'], '.2f')} / {fmt(v['full_batch_floor_ms'], '.2f')}"
            rows.append(
                f"| {label} | {v['requests']} ({args.lengths}) | **{v['tok_s']:,.0f}** | {step} | {fmt(v['peak_gib'])} | {v['startup_s']:.1f} (capture {v['graph_capture_s']:.1f}) |"
            )
    names = {
        "hf": "HF generate, default cache, B={n}",
        "hf_compile": "HF generate, static cache + compile, B={n}",
        "hf_cb": "HF continuous batching (generate_batch)",
    }
    for arm, label in names.items():
        r = res.get(arm)
        if r is None:
            continue
        if "error" in r:
            rows.append(f"| {label.format(n='?')} | - | {r['error']} | - | - | - |")
            continue
        rows.append(
            f"| {label.format(n=r['requests'])} | {r['requests']} (all {args.hf_max_new}) | {r['tok_s']:,.0f} | - | {fmt(r.get('peak_gib'))} | {fmt(r.get('startup_s'))} |"
        )
    hf_best = max((res[a]["tok_s"] for a in names if a in res and "tok_s" in res[a]), default=None)
    lines = ["\n".join(rows)]
    for arm, v in vime.items():
        lines.append(f"{arm}:")
        lines += vime_lines(v, res[f"{arm}_check"], hf_best, args)
    if len(vime) == 2:
        v, f = vime["vime"], vime["vime_fp8"]
        lines.append(
            f"FP8 vs {args.dtype_name}: {f['tok_s'] / v['tok_s']:.2f}x tok/s; weights read per decode step "
            f"{f['weight_bytes'] / 2**20:,.1f} vs {v['weight_bytes'] / 2**20:,.1f} MiB; log-prob gap to HF "
            f"(the trainer's scores) max {res['vime_fp8_check']['logprob_max_abs_diff']:.3g} vs "
            f"{res['vime_check']['logprob_max_abs_diff']:.3g}, mean {res['vime_fp8_check']['logprob_mean_abs_diff']:.3g} "
            f"vs {res['vime_check']['logprob_mean_abs_diff']:.3g}"
        )
    return "\n".join(x for x in lines if x)


def vime_lines(v: dict, c: dict, hf_best: float | None, args) -> list[str]:
    """The lines under the table for one vime arm: speed-up, updates and memory, a decode graph
    alone, and the check against HF."""
    lines = [f"vs fastest HF path: {v['tok_s'] / hf_best:.2f}x. " if hf_best else ""]
    lines.append(
        f"weight update (copy_ of {v['weight_update_tensors']} HF-named same-GPU tensors): {v['weight_update_ms']:.1f} ms; "
        f"release + resume{' (incl. re-capture)' if v['recaptures'] else ''}: {v['release_resume_s']:.2f} s "
        f"(release {v['release_s']:.2f} + resume {v['resume_s']:.2f}; again: {v['release_s_again']:.2f} + {v['resume_s_again']:.2f}); "
        f"eager steps {v['eager_steps']} of {v['steps']} "
        f"({v['eager_time_s']:.2f} s of {v['wall_s']:.2f} s)"
    )
    if "gpu_graph_ms" in v:
        lines.append(
            f"one B={args.max_num_seqs} decode graph at context {v['gpu_step_context']}: {v['gpu_graph_ms']:.2f} ms on the GPU (+ sampler {v['gpu_sampler_ms']:.3f} ms) vs floor {v['gpu_step_floor_ms']:.2f} ms"
        )
    lines.append(
        f"correctness ({c['prompts']} prompts x {c['new_tokens']} greedy tokens vs HF generate): exact {c['exact_matches']}/{c['prompts']}, "
        f"matched prefix {100 * c['matched_prefix_rate']:.0f}%, first divergence at {c['first_divergence']}; "
        f"log-prob |diff| vs teacher-forced HF: max {c['logprob_max_abs_diff']:.3g}, mean {c['logprob_mean_abs_diff']:.3g}"
    )
    return lines


def main() -> None:
    args = parse_args()
    device = torch.device(args.device)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    shape = pick(args.shape, args.tiny)
    lo, hi = (10, 40) if args.tiny else (100, 1024)
    args.lengths = f"{lo}-{hi}"
    n_req = args.num_requests or (16 if args.tiny else 256)
    dtype_name = args.dtype_name = args.dtype or ("float32" if device.type == "cpu" else "bfloat16")
    dtype = getattr(torch, dtype_name)
    if args.tiny:
        args.max_num_seqs = min(args.max_num_seqs, n_req)
        args.hf_max_new = min(args.hf_max_new, 32)
    prompts, max_new = workload(n_req, lo, hi, shape["vocab_size"], args.seed)
    import transformers

    res: dict = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "date": time.strftime("%Y-%m-%d"),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "args": vars(args),
    }
    res["copy_bandwidth_TBps"] = bw = copy_bandwidth(device) / 1e12
    bw = bw * 1e12 if bw == bw else 1e11  # NaN on CPU: a nominal 100 GB/s so the floor column is defined
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        hf = make_model(shape, device, dtype, args.seed, Path(tmp))
        res["model_build_s"] = time.perf_counter() - t0
        weight_bytes = sum(p.numel() * p.element_size() for p in hf.parameters())  # tied embedding once
        kv_bytes_per_token = (
            2 * shape["num_hidden_layers"] * shape["num_key_value_heads"] * shape["head_dim"] * dtype.itemsize
        )
        res["weight_bytes"], res["kv_bytes_per_token"] = weight_bytes, kv_bytes_per_token
        res["fp8_weight_bytes"] = fp8_weight_bytes(hf)
        arms = args.arms.split(",")
        for arm in arms:
            if time.perf_counter() - t_start > args.time_budget:
                res[arm] = {"error": "skipped: time budget"}
                continue
            print(f"--- {arm} ({time.perf_counter() - t_start:.0f}s)", flush=True)
            try:
                if arm in VIME_ARMS:
                    bench_vime(
                        args,
                        Path(tmp),
                        hf,
                        prompts,
                        max_new,
                        device,
                        dtype_name,
                        bw,
                        weight_bytes if arm == "vime" else res["fp8_weight_bytes"],
                        kv_bytes_per_token,
                        res,
                        arm,
                    )
                elif arm == "hf":
                    res[arm] = bench_hf_generate(hf, prompts[: args.hf_requests], args.hf_max_new, device, static=False)
                elif arm == "hf_compile":
                    if device.type != "cuda":
                        continue
                    res[arm] = bench_hf_generate(
                        hf, prompts[: args.hf_compile_requests], args.hf_max_new, device, static=True
                    )
                elif arm == "hf_cb":
                    res[arm] = bench_hf_cb(hf, prompts[: args.hf_cb_requests], args.hf_max_new, device)
            except Exception as e:  # an arm that breaks is reported (traceback in the log), not fatal
                traceback.print_exc()
                res[arm] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"}
            print(json.dumps({arm: res.get(arm)}, default=str), flush=True)
            reset_peak(device)
    res["total_s"] = time.perf_counter() - t_start
    (Path(args.out) / "bench_engine.json").write_text(json.dumps(res, indent=1, default=str))
    print(
        f"\n{res['device']}, {res['date']}, torch {res['torch']}, transformers {res['transformers']}; copy bandwidth {res['copy_bandwidth_TBps']:.2f} TB/s; total {res['total_s']:.0f} s"
    )
    print(table(res, args))


if __name__ == "__main__":
    main()
