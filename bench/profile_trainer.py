"""Where a train step's time goes: a per-category GPU profile of vime's trainer (issue 16).

The batch and model are bench_trainer.py's (Qwen3-0.6B shape, or `--shape qwen3-4b`; 64
GRPO-shaped sequences, ~90k tokens). For each variant (eager, compiled) one fwd + bwd + optimizer step is traced with the
torch profiler after a warm-up, and each GPU kernel is put in one category:

* LM head + log-probs: every kernel inside the chunked head's forward or backward (split
  into its GEMMs and the rest: float32 log-softmax, exp, gather, scatter, and the policy
  loss's per-token arithmetic, which runs inside the head when its gradient is taken there);
* optimizer + clip: every kernel inside the gradient-norm clip and AdamW step;
* elsewhere by kernel name: GEMM, attention, fused Triton (what compile makes of norms, RoPE,
  SwiGLU), copies/casts (incl. FSDP's all-gather copy-in/out), other elementwise/reductions;
* idle: wall time of the step when no kernel runs (host gaps: Python, launches, syncs).

Prints a markdown table per variant, then tokens/s and MFU from untraced timed steps.

    PYTHONPATH=. python3 bench/profile_trainer.py
    PYTHONPATH=. python3 bench/profile_trainer.py --device cpu --tiny   # smoke test of the script
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch._dynamo.utils
import torch._inductor.config

from bench.bench_trainer import make_batch, make_model, pct
from bench.shapes import SHAPES, TINY, add_shape_args
from vime.algorithms import objective as loss_mod
from vime.config import Config
from vime.errors import ConfigError
from vime.trainer import logprobs
from vime.trainer import micro_batches as micro_batches_mod
from vime.trainer import step_loss as step_loss_mod
from vime.trainer.optimizer_step import OptimizerStep
from vime.trainer.packing import packed_attention_backend
from vime.trainer.perf import mfu, train_flops

GEMM_NAMES = ("gemm", "cutlass", "nvjet", "xmma", "cublas", "splitk", "gemv", "matmul")
ATTN_NAMES = ("flash", "fmha", "attn")
COPY_NAMES = ("copy", "cast", "chunk_cat", "split_with_sizes", "cat_", "catarray", "memcpy")


@contextlib.contextmanager
def annotated_head() -> Iterator[None]:
    """Mark the chunked LM head's forward and backward as ranges the trace shows on the GPU
    (patched on the autograd Functions' classes, which autograd reads at call time): the
    log-probs path and the one that takes the loss's gradient in the forward."""
    saved = [(cls, cls.forward, cls.backward) for cls in (logprobs._ChunkedLogProbs, logprobs._ChunkedLoss)]

    def ranged(fn: Callable[..., Any]) -> Any:
        def run(ctx: Any, *a: Any) -> Any:
            with torch.profiler.record_function("vime/lm_head"):
                return fn(ctx, *a)

        return staticmethod(run)

    for cls, fwd, bwd in saved:
        cls.forward, cls.backward = ranged(fwd), ranged(bwd)
    try:
        yield
    finally:
        for cls, fwd, bwd in saved:
            cls.forward, cls.backward = staticmethod(fwd), staticmethod(bwd)


@contextlib.contextmanager
def annotated_host_work() -> Iterator[None]:
    """Name the trainer's host-side work per micro-batch (packing, moving loss inputs, the loss)
    and the optimizer's clip and step as ranges, so GPU idle time can be put down to them
    (`idle_by_host_op`) and the optimizer's kernels counted as such (`categorize`)."""
    saved = {(micro_batches_mod, "pack"): micro_batches_mod.pack, (step_loss_mod, "to_device"): step_loss_mod.to_device}
    policy_term = loss_mod.Objective.policy_term  # looked up on the class at each call
    clip_and_step = OptimizerStep.clip_and_step

    def optimizer(self: Any, *a: Any, **k: Any) -> Any:
        with torch.profiler.record_function("vime/optimizer"):
            return clip_and_step(self, *a, **k)

    def wrap(name: str, fn: Callable) -> Callable:
        def inner(*a: Any, **k: Any) -> Any:
            with torch.profiler.record_function(f"vime/host/{name}"):
                return fn(*a, **k)

        return inner

    for (module, n), fn in saved.items():
        setattr(module, n, wrap(n, fn))
    loss_mod.Objective.policy_term = wrap("policy_term", policy_term)
    OptimizerStep.clip_and_step = optimizer
    try:
        yield
    finally:
        for (module, n), fn in saved.items():
            setattr(module, n, fn)
        loss_mod.Objective.policy_term = policy_term
        OptimizerStep.clip_and_step = clip_and_step


def torch_accumulate(scorer: Any) -> None:
    """FSDP2's own float32 += bfloat16 gradient accumulation back on every parameter, in place of
    the trainer's Triton add (`vime.trainer.model.vectorize_grad_accumulation`): the instance
    attribute goes, the class's method shows again."""
    from vime.trainer.model import fsdp_params

    for param in fsdp_params(scorer):
        param.__dict__.pop("accumulate_unsharded_grad_if_needed", None)


def gpu_events(trace: dict) -> list[dict]:
    """The trace's kernels, memcpys and memsets."""
    return [e for e in trace["traceEvents"] if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e]


def is_copy(event: dict) -> bool:
    """A memcpy or memset, or a copy/cast kernel by its name; not inductor's fused kernels, whose
    norm kernels carry `_to_copy` in their names."""
    name = event["name"].lower()
    return event.get("cat") != "kernel" or (not name.startswith("triton") and any(s in name for s in COPY_NAMES))


def categorize(trace: dict, wall_us: float) -> dict[str, float]:
    """Microseconds per category from a Chrome trace of one step."""
    events = trace["traceEvents"]
    ranges: dict[str, list[tuple[float, float]]] = {}
    for e in events:
        if e.get("cat") == "gpu_user_annotation" and e.get("name", "").startswith("vime/"):
            ranges.setdefault(e["name"], []).append((e["ts"], e["ts"] + e["dur"]))
    kernels = gpu_events(trace)

    def inside(name: str, t: float) -> bool:
        return any(a <= t <= b for a, b in ranges.get(name, ()))

    out: dict[str, float] = {}
    for k in kernels:
        name, mid = k["name"].lower(), k["ts"] + k["dur"] / 2
        attention = any(s in name for s in ATTN_NAMES)  # before GEMM: flash kernels' names hold "cutlass"
        gemm = not attention and any(s in name for s in GEMM_NAMES)
        if inside("vime/lm_head", mid):
            cat = "LM head + log-probs: GEMM" if gemm else "LM head + log-probs: other"
        elif inside("vime/optimizer", mid):
            cat = "optimizer + clip"
        elif attention:
            cat = "attention"
        elif gemm:
            cat = "GEMM (decoder)"
        elif is_copy(k):
            cat = "copies / casts / memset"
        elif name.startswith("triton"):
            cat = "fused Triton (norm, RoPE, SwiGLU, ...)"
        else:
            cat = "other elementwise / reductions"
        out[cat] = out.get(cat, 0.0) + k["dur"]
    spans = sorted((k["ts"], k["ts"] + k["dur"]) for k in kernels)
    busy, end = 0.0, float("-inf")
    for a, b in spans:  # union of kernel intervals
        if b > end:
            busy += b - max(a, end)
            end = b
    out["idle (no kernel running)"] = max(0.0, wall_us - busy)
    return out


def idle_by_host_op(trace: dict, top: int = 8) -> list[tuple[str, float]]:
    """GPU gaps between kernels, summed by what the host was doing at the gap's middle (the
    innermost CPU op of any thread: the backward runs on autograd's own thread): the GPU idles
    there because that op is slow to launch the next kernel, or waits on the GPU itself. Gaps
    before the first kernel and after the last are reported as such."""
    events = trace["traceEvents"]
    kernels = sorted((e["ts"], e["ts"] + e["dur"]) for e in gpu_events(trace))
    ops = sorted(
        (e["ts"], e["ts"] + e["dur"], e["name"][:70])
        for e in events
        if e.get("cat") in ("cpu_op", "python_function", "user_annotation") and "dur" in e
    )
    if not ops or not kernels:
        return []
    gaps, end = [], kernels[0][1]
    for a, b in kernels:
        if a > end + 20:  # gaps under 20 us are launch latency, not a stall
            gaps.append((end, a))
        end = max(end, b)
    out = {
        "(before the first kernel)": max(0.0, kernels[0][0] - ops[0][0]),
        "(after the last kernel)": max(0.0, max(o[1] for o in ops) - end),
    }
    active: list[tuple[float, float, str]] = []  # ops open at the current gap, all threads
    i = 0
    for a, b in gaps:  # in time order: a sweep over the ops sorted by start
        mid = (a + b) / 2
        while i < len(ops) and ops[i][0] <= mid:
            active.append(ops[i])
            i += 1
        active = [o for o in active if o[1] >= mid]
        name = min(active, key=lambda o: o[1] - o[0])[2] if active else "(no host op)"
        out[name] = out.get(name, 0.0) + (b - a)
    return sorted(out.items(), key=lambda kv: -kv[1])[:top]


def launched_by(trace: dict, names: set[str], depth: int = 3) -> dict[str, float]:
    """Microseconds of the kernels named `names`, by the host ops that launched them (the
    innermost `depth` ops around the launch, outer first): to tell, say, which code path issues
    a device-to-device memcpy. A kernel shares its "External id" with the op that launched it."""
    events = trace["traceEvents"]
    ops = [e for e in events if e.get("cat") in ("cpu_op", "user_annotation", "python_function") and "dur" in e]
    by_id = {
        e["args"]["External id"]: e for e in ops if e.get("cat") == "cpu_op" and "External id" in e.get("args", {})
    }
    out: dict[str, float] = {}
    for k in gpu_events(trace):
        if k["name"][:70] not in names:
            continue
        op = by_id.get(k.get("args", {}).get("External id"))
        if op is None:
            chain = "(unknown)"
        else:
            around = [
                e
                for e in ops
                if e["tid"] == op["tid"] and e["ts"] <= op["ts"] and op["ts"] + op["dur"] <= e["ts"] + e["dur"]
            ]
            around.sort(key=lambda e: -e["dur"])
            chain = " > ".join(e["name"][:40] for e in around[-depth:])
        out[chain] = out.get(chain, 0.0) + k["dur"]
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


KERNEL_FLAGS = {"fa4", "fa2", "sdpa"}  # --attention-kernel; without one, auto
_last_kernel = ["auto"]  # the last variant's, whose compiled layers must not serve another kernel
VARIANT_FLAGS = {
    "nopad",
    "fullpad",
    "compiledhead",
    "syncall",
    "gradafter",
    "torchaccum",
    "cdt",
    "scoredold",
} | KERNEL_FLAGS


def step_fn(local: Any, samples: list, adv: list[float], old: list[torch.Tensor]) -> Callable[[], None]:
    """One optimizer step as `train_step` takes it (without its log-prob passes)."""
    return lambda: local.optimizer_step.run(samples, torch.tensor(adv), old, None)


@dataclass
class Setup:
    """What the variants of one call share: the options, the batch and the model on disk."""

    a: argparse.Namespace
    device: torch.device
    shape: dict[str, Any]
    model_dir: Path
    samples: list
    adv: list[float]
    old: list[torch.Tensor]
    budget: int
    prompt: tuple[int, int]
    response: tuple[int, int]
    flops: float
    tmp: Path


def run_variant(st: Setup, variant: str) -> tuple[str, float, float, float]:
    """Build one variant's trainer, time its steps (and trace one unless --no-trace), close it;
    returns (variant, tokens/s, MFU, peak GiB)."""
    from vime.trainer.distributed import launch_actor

    a, device, shape, samples, adv, old, budget = st.a, st.device, st.shape, st.samples, st.adv, st.old, st.budget
    model_dir, prompt, response, flops, tmp = st.model_dir, st.prompt, st.response, st.flops, st.tmp
    n, tokens = len(samples), sum(len(s.tokens) for s in samples)
    head = logprobs._fused
    spec, *flags = variant.split("/")
    spec, _, mb_budget = spec.partition(":")
    kind, _, chunk = spec.partition("@")
    args = Config(
        logprob_chunk_size=int(chunk or 1024),
        lr=1e-6,
        clip_grad=1.0,
        max_tokens_per_gpu=int(mb_budget or budget),
        global_batch_size=n,
        rollout_temperature=1.0,
        seed=0,
        actor_num_nodes=1,
        actor_num_gpus_per_node=1,
        gradient_checkpointing=False,
        compile=kind == "compile",
        attention_kernel=next(iter(KERNEL_FLAGS.intersection(flags)), "auto"),
    )
    tuned = "cdt" in flags
    if tuned != torch._inductor.config.coordinate_descent_tuning or args.attention_kernel != _last_kernel[0]:
        torch._dynamo.reset()  # the layers' compiled code would be reused across the switch
        torch._inductor.config.coordinate_descent_tuning = tuned
        _last_kernel[0] = args.attention_kernel
    t0 = time.perf_counter()
    actor = launch_actor(args, model_dir, a.device)
    try:
        local = getattr(actor, "local", actor)
        local.ready()  # one rank compiles on a thread of its own; the step below is called directly
        print(
            f"{variant}: trainer built in {time.perf_counter() - t0:.1f} s (with --compile: its warm-up compile); "
            f"attention {packed_attention_backend(local.model, local.ranks.device, torch.bfloat16)}"
        )
        if "fullpad" in flags:  # every micro-batch padded to the whole budget (before buckets)
            local.batches.pad_to = local.batches.max_tokens
        if "nopad" in flags:  # compiled layers fed micro-batches of their own lengths, as before padding
            local.batches.pad_to = None
        if "compiledhead" in flags:  # the LM head's chunk math compiled by torch.compile (before Triton)
            kernels = (torch.compile(logprobs._stats, dynamic=True), torch.compile(logprobs._grad_logits, dynamic=True))
            logprobs._fused = lambda device, kernels=kernels: kernels
        if "syncall" in flags:
            local.optimizer_step.defer_grad_sync = False
        if "gradafter" in flags:
            local.optimizer_step.grad_in_forward = False
        if "torchaccum" in flags:
            torch_accumulate(local.policy.scorer)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        step = step_fn(
            local, samples, adv, [o.cpu() for o in actor.compute_log_probs(samples)] if "scoredold" in flags else old
        )
        t0 = time.perf_counter()
        step()  # warm-up (and compile)
        step()
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        sync()
        print(f"{variant}: warm-up {time.perf_counter() - t0:.1f} s", flush=True)
        times = []
        for _ in range(a.steps):
            t0 = time.perf_counter()
            step()
            sync()
            times.append(time.perf_counter() - t0)
        seconds = statistics.median(times)
        if kind == "compile":  # a step of other lengths must reuse the compiled graphs
            before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
            for seed, count in ((1, n), (2, n), (3, 4)):  # the last: 4 short sequences, one small micro-batch
                other, other_adv = make_batch(
                    count, shape["vocab_size"], prompt, response if count == n else (10, 50), seed
                )
                step_fn(local, other, other_adv, [torch.full((s.response_length,), -1.0) for s in other])()
            print(
                f"compile: graphs compiled by 3 steps of other lengths (one of a single short micro-batch) after warm-up: {torch._dynamo.utils.counters['stats']['unique_graphs'] - before}",
                flush=True,
            )
        peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
        row = (variant, tokens / seconds, mfu(flops, seconds, 1) if device.type == "cuda" else float("nan"), peak)
        if a.no_trace:
            print(f"{variant}: untraced median step {seconds * 1e3:.0f} ms", flush=True)
        else:
            activities = [torch.profiler.ProfilerActivity.CPU] + (
                [torch.profiler.ProfilerActivity.CUDA] if device.type == "cuda" else []
            )
            with annotated_head(), annotated_host_work(), torch.profiler.profile(activities=activities) as prof:
                t0 = time.perf_counter()
                step()
                sync()
                wall_us = (time.perf_counter() - t0) * 1e6
            path = Path(a.trace_dir or tmp) / f"trace-{variant.replace('/', '-')}.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            prof.export_chrome_trace(str(path))
            trace = json.loads(path.read_text())
            cats = categorize(trace, wall_us)
            print(
                f"\n{variant}: traced step {wall_us / 1e3:.0f} ms (untraced median {seconds * 1e3:.0f} ms)\n\n| category | ms | share of traced wall |\n|---|---:|---:|"
            )
            for cat, us in sorted(cats.items(), key=lambda kv: -kv[1]):
                print(f"| {cat} | {us / 1e3:.1f} | {us / wall_us:.1%} |")
            copies: dict[str, float] = {}
            for e in filter(is_copy, gpu_events(trace)):
                copies[e["name"][:70]] = copies.get(e["name"][:70], 0.0) + e["dur"]
            print(
                "\ncopies by kernel (ms): "
                + "; ".join(f"{k} {us / 1e3:.1f}" for k, us in sorted(copies.items(), key=lambda kv: -kv[1])[:8])
            )
            top_copies = {k for k, _ in sorted(copies.items(), key=lambda kv: -kv[1])[:4]}
            for chain, us in list(launched_by(trace, top_copies).items())[:10]:
                print(f"  {us / 1e3:.1f} ms launched by {chain}")
            gaps = idle_by_host_op(trace)
            if gaps:
                print("\nGPU idle by host op (ms): " + "; ".join(f"{k} {us / 1e3:.1f}" for k, us in gaps), flush=True)
            top = sorted(
                ((e.key, e.self_device_time_total) for e in prof.key_averages() if e.self_device_time_total > 0),
                key=lambda kv: -kv[1],
            )[:12]
            if top:
                print(
                    "\ntop kernels/ops by self GPU time (ms): " + "; ".join(f"{k[:60]} {t / 1e3:.1f}" for k, t in top),
                    flush=True,
                )
        return row
    finally:
        logprobs._fused = head
        actor.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_shape_args(ap)
    ap.add_argument(
        "--variants",
        default="eager,compile",
        help="comma-separated: eager or compile, each optionally followed by @<log-prob chunk size>, "
        ":<micro-batch token budget>, /nopad (compiled layers fed micro-batches of their own lengths) and "
        "/fullpad (compiled, every micro-batch padded to the whole budget), "
        "/compiledhead (the LM head's chunk math compiled by torch.compile, not Triton), "
        "/syncall (one rank reduces gradients after every micro-batch, as several ranks do), "
        "/gradafter (log-probs first, the loss's gradient after: the head recomputes its logits in the backward), "
        "/torchaccum (FSDP2's own float32 += bfloat16 gradient accumulation, not the trainer's Triton add), "
        "/cdt (inductor's coordinate-descent tuning of its Triton kernels' block sizes, compiled afresh), "
        "/scoredold (the old log-probs the model's own, as bench_trainer.py's and a real step's: the "
        "ratio starts at 1; without it every old log-prob is -1, so the ratio is tiny and the clip zeroes "
        "the gradient of every token of negative advantage), "
        "/fa4, /fa2 or /sdpa (the trainer's --attention-kernel; default auto), "
        "e.g. compile@4096:32768/nopad",
    )
    ap.add_argument(
        "--max-tokens-per-gpu", type=int, default=None, help="micro-batch token budget (default 16384; 512 with --tiny)"
    )
    ap.add_argument("--vocab", type=int, default=None, help="vocabulary size (default the shape's: 151,936)")
    ap.add_argument("--samples", type=int, default=None, help="sequences in the batch (default 64; 8 with --tiny)")
    ap.add_argument("--steps", type=int, default=3, help="untraced timed steps per variant")
    ap.add_argument("--trace-dir", default=None, help="also keep each variant's Chrome trace here")
    ap.add_argument("--no-trace", action="store_true", help="time the steps only (no traced step, no categories)")
    a = ap.parse_args()
    for variant in a.variants.split(","):
        spec, *flags = variant.split("/")
        unknown = sorted(set(flags) - VARIANT_FLAGS)
        if spec.partition(":")[0].partition("@")[0] not in ("eager", "compile") or unknown:
            ap.error(
                f"--variants: {variant!r} is not eager or compile[@chunk][:budget] followed by /flags of {sorted(VARIANT_FLAGS)}"
            )
    device = torch.device(a.device)
    shape = dict(TINY if a.tiny else SHAPES[a.shape])
    if a.vocab:
        shape["vocab_size"] = a.vocab
    n, budget = (8, a.max_tokens_per_gpu or 512) if a.tiny else (64, a.max_tokens_per_gpu or 16384)
    n = a.samples or n
    prompt, response = ((10, 50), (10, 200)) if a.tiny else ((100, 500), (100, 2000))
    samples, adv = make_batch(n, shape["vocab_size"], prompt, response, 0)
    lengths = [len(s.tokens) for s in samples]
    tokens = sum(lengths)
    print(
        f"device {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}, torch {torch.__version__}; {n} sequences, {tokens} tokens, budget {budget}",
        flush=True,
    )

    from transformers import AutoConfig

    tmp = Path(tempfile.mkdtemp(prefix="vime-profile-"))
    model_dir = make_model(tmp / "model", shape)
    flops = train_flops(
        AutoConfig.from_pretrained(model_dir), lengths, [s.response_length for s in samples], forwards=0
    )
    old = [torch.full((s.response_length,), -1.0) for s in samples]
    setup = Setup(a, device, shape, model_dir, samples, adv, old, budget, prompt, response, flops, tmp)
    summary: list[tuple[str, float, float, float]] = []
    for variant in a.variants.split(","):
        try:
            summary.append(run_variant(setup, variant))
        except torch.OutOfMemoryError as e:  # a budget too large for the GPU: say so, go on with the others
            peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
            print(f"{variant}: out of GPU memory at {peak:.1f} GiB ({str(e).splitlines()[0][:160]})", flush=True)
            summary.append((variant, float("nan"), float("nan"), peak))
        except ConfigError as e:  # e.g. /fa4 where flash-attn-4 is not installed
            print(f"{variant}: {e}", flush=True)
            summary.append((variant, float("nan"), float("nan"), float("nan")))
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the variant's trainer went with run_variant's frame
    print(f"\nvocabulary {shape['vocab_size']:,}\n\n| variant | tokens/s | MFU | peak GiB |\n|---|---:|---:|---:|")
    for name, tps, m, peak in summary:
        print(f"| {name} | {tps:,.0f} | {pct(m)} | {peak:.1f} |")


if __name__ == "__main__":
    main()
