"""Can a Triton matmul beat cuBLAS on a decode step's projections (issue 48)? Each projection of
the model, at decode batch sizes, timed as one CUDA graph over the model's layers (each layer its
own weights, so nothing comes from L2), three ways:

* before: what the engine runs, cuBLAS after the separate Triton kernel that feeds it (residual
  add + RMSNorm for `qkv` and `gate_up`, SiLU-mul for `down`);
* prologue: one Triton kernel with that work folded into its loads (each program normalizes
  whole rows itself), the output columns split over programs;
* split-K: a Triton kernel whose programs also split the input features and write float32
  partial sums (SiLU-mul folded in for `down`; the norm cannot be, it needs whole rows). The
  partial sums would be added by the kernel after it (the next residual add + RMSNorm), so that
  cost is printed apart (`reduce`).

The two Triton ways are timed over block configurations (and split counts), each checked against
PyTorch first; the best is shown. Then the sum over a forward's projections.

    PYTHONPATH=. python3 bench/bench_decode_matmul.py                          # 0.6B shape, one GPU
    TRITON_INTERPRET=1 PYTHONPATH=. python3 bench/bench_decode_matmul.py --device cpu --tiny  # smoke test
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from bench.shapes import SHAPES, TINY

PLAIN, NORM, SILU = 0, 1, 2  # the prologue: x as it is, rmsnorm(x + residual), silu(gate) * up


@triton.jit
def _matmul_kernel(
    x_ptr,
    res_ptr,
    res_out_ptr,
    nw_ptr,
    w_ptr,
    out_ptr,
    M,
    N,
    K,
    K_SPLIT,
    eps,
    MODE: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
):
    """out[s] = prologue(x)[:, ks] @ w[:, ks].T over split s's input features ks. NORM needs whole
    rows (one split); it writes x + residual to res_out once, as the kernel it replaces does. A
    bf16 `out` gets the product rounded, a float32 one the partial sums."""
    pid, s = tl.program_id(0), tl.program_id(1)
    rows, cols = tl.arange(0, BM), pid * BN + tl.arange(0, BN)
    rmask, cmask = rows < M, cols < N
    dt = w_ptr.dtype.element_ty
    x_stride = 2 * K if MODE == 2 else K
    if MODE == 1:  # each row's sum of squares, from the residual sum
        ss = tl.zeros([BM], dtype=tl.float32)
        for k0 in range(0, K, BK):
            ks = k0 + tl.arange(0, BK)
            m = rmask[:, None] & (ks < K)[None, :]
            off = rows[:, None] * K + ks[None, :]
            h = tl.load(x_ptr + off, mask=m, other=0.0).to(tl.float32)
            h = (h + tl.load(res_ptr + off, mask=m, other=0.0).to(tl.float32)).to(dt)
            if pid == 0:
                tl.store(res_out_ptr + off, h, mask=m)
            ss += tl.sum(h.to(tl.float32) * h.to(tl.float32), axis=1)
        rstd = tl.rsqrt(ss / K + eps)
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    end = tl.minimum((s + 1) * K_SPLIT, K)
    for k0 in range(s * K_SPLIT, end, BK):
        ks = k0 + tl.arange(0, BK)
        kmask = ks < end
        m = rmask[:, None] & kmask[None, :]
        off = rows[:, None] * x_stride + ks[None, :]
        a = tl.load(x_ptr + off, mask=m, other=0.0)
        if MODE == 1:
            a = (a.to(tl.float32) + tl.load(res_ptr + off, mask=m, other=0.0).to(tl.float32)).to(dt)
            a = (a.to(tl.float32) * rstd[:, None]).to(dt)
            a = (tl.load(nw_ptr + ks, mask=kmask, other=0.0).to(tl.float32)[None, :] * a.to(tl.float32)).to(dt)
        if MODE == 2:
            g = a.to(tl.float32)
            u = tl.load(x_ptr + off + K, mask=m, other=0.0).to(tl.float32)
            a = ((g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32) * u).to(dt)
        w = tl.load(w_ptr + cols[:, None] * K + ks[None, :], mask=cmask[:, None] & kmask[None, :], other=0.0)
        acc = tl.dot(a, tl.trans(w), acc)
    out = out_ptr + (s * M + rows[:, None]) * N + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=rmask[:, None] & cmask[None, :])


@triton.jit
def _reduce_kernel(part_ptr, out_ptr, M, N, S: tl.constexpr, BLOCK: tl.constexpr):
    """out = the S partial sums added in order, rounded once (what the next kernel would do)."""
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in tl.static_range(S):
        acc += tl.load(part_ptr + (s * M + row) * N + cols, mask=cols < N, other=0.0)
    tl.store(out_ptr + row * N + cols, acc.to(out_ptr.dtype.element_ty), mask=cols < N)


def matmul(x, w, out, mode: int, cfg: tuple, res=None, res_out=None, nw=None, eps: float = 1e-6) -> torch.Tensor:
    """One launch of _matmul_kernel; cfg = (splits, BN, BK, num_warps, num_stages)."""
    splits, bn, bk, warps, stages = cfg
    m, (n, k) = x.shape[0], w.shape
    per = triton.cdiv(triton.cdiv(k, splits), bk) * bk  # whole BK blocks per split
    bm = max(16, 1 << (m - 1).bit_length())
    _matmul_kernel[(triton.cdiv(n, bn), triton.cdiv(k, per))](
        x, res if res is not None else x, res_out if res_out is not None else x, nw if nw is not None else x, w, out,
        m, n, k, per, eps, MODE=mode, BM=bm, BN=bn, BK=bk, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out


def reduce(part: torch.Tensor, out: torch.Tensor, splits: int) -> torch.Tensor:
    m, n = out.shape
    _reduce_kernel[(m,)](part, out, m, n, S=splits, BLOCK=1 << (n - 1).bit_length())
    return out


def best_of(
    fns: Callable[[tuple], list[Callable[[], object]]], check: Callable[[tuple], None], configs: list, device
) -> tuple[float, tuple]:
    """(µs, config) of the fastest config, each checked first; a config whose blocks need more
    shared memory than the GPU has (large rows at many stages) is skipped."""
    best = (float("inf"), configs[0])
    for cfg in configs:
        try:
            check(cfg)
        except OutOfResources:
            continue
        best = min(best, (graph_us(fns(cfg), device), cfg), key=lambda r: r[0])
    return best


def time_op(name: str, m: int, n: int, k: int, mode: int, layers: int, configs: list, device, dtype) -> dict:
    """The op's three ways at m rows (µs), the best configs, and the reduce's µs."""
    from vime.engine.core import kernels

    def rand(*size: int) -> torch.Tensor:
        return (torch.randn(*size, device=device) / size[-1] ** 0.5).to(dtype)

    ws = [rand(n, k) for _ in range(layers)]
    x, res, nw = rand(m, 2 * k if mode == SILU else k), rand(m, k), (1 + 0.1 * torch.randn(k, device=device)).to(dtype)
    out, res_out = torch.empty(m, n, device=device, dtype=dtype), torch.empty(m, k, device=device, dtype=dtype)
    part = torch.empty(8, m, n, device=device, dtype=torch.float32)
    eps = 1e-6
    if mode == NORM:
        before = [lambda w=w: F.linear(kernels.add_rmsnorm(x, res.clone(), nw, eps)[0], w) for w in ws]
        h = (res.float() + x.float()).to(dtype).float()
        normed = (nw.float() * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(dtype).float()).to(dtype)
        ref = F.linear(normed, ws[0]).float()
    elif mode == SILU:
        before = [lambda w=w: F.linear(kernels.silu_and_mul(x), w) for w in ws]
        ref = F.linear(F.silu(x[:, :k].float()).to(dtype) * x[:, k:], ws[0]).float()
    else:
        before = [lambda w=w: F.linear(x, w) for w in ws]
        ref = F.linear(x, ws[0]).float()
    if mode == NORM:  # the clone above keeps the residual from growing; time it to subtract
        clones = graph_us([lambda: res.clone() for _ in ws], device)

    def close(got: torch.Tensor, cfg: tuple) -> None:
        err = float((got.float() - ref).abs().max() / ref.abs().max())
        assert err < 2e-2, (name, m, cfg, err)

    def run_prologue(cfg: tuple, w: torch.Tensor) -> torch.Tensor:
        return matmul(x, w, out, mode, cfg, res, res_out, nw, eps)

    def run_split(cfg: tuple, w: torch.Tensor) -> torch.Tensor:
        return matmul(x, w, part, mode if mode == SILU else PLAIN, cfg)

    one_split = [c for c in configs if c[0] == 1]
    t_pro, c_pro = best_of(
        lambda c: [lambda w=w: run_prologue(c, w) for w in ws],
        lambda c: close(run_prologue(c, ws[0]), c),
        one_split,
        device,
    )
    r = {
        "before": graph_us(before, device) - (clones if mode == NORM else 0.0),
        "prologue": t_pro,
        "prologue_cfg": c_pro,
    }
    if mode != NORM:  # split-K: the same product, added up as the next kernel would
        t_split, c_split = best_of(
            lambda c: [lambda w=w: run_split(c, w) for w in ws],
            lambda c: close(reduce(run_split(c, ws[0]), out, splits_used(k, c)), c),
            configs,
            device,
        )
        used = splits_used(k, c_split)
        r.update(split=t_split, split_cfg=c_split, reduce=graph_us([lambda: reduce(part, out, used)] * layers, device))
    return r


def splits_used(k: int, cfg: tuple) -> int:
    """The splits a config makes of k input features (each a whole number of BK blocks)."""
    return triton.cdiv(k, triton.cdiv(triton.cdiv(k, cfg[0]), cfg[2]) * cfg[2])


def graph_us(fns: list[Callable[[], object]], device: torch.device, replays: int = 20) -> float:
    """Median µs of one call, the calls run back to back as one CUDA graph (eagerly on CPU)."""
    for fn in fns:
        fn()  # compiles; cuBLAS picks its kernel
    if device.type != "cuda":
        t0 = time.perf_counter()
        for fn in fns:
            fn()
        return (time.perf_counter() - t0) * 1e6 / len(fns)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in fns:
            fn()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(fns))
    return statistics.median(times[3:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="a tiny shape (smoke test; on CPU with TRITON_INTERPRET=1)")
    ap.add_argument("--shape", choices=list(SHAPES), default="qwen3-0.6b")
    ap.add_argument("--rows", default="1,16,64", help="comma-separated batch sizes")
    a = ap.parse_args()
    device = torch.device(a.device)
    # float32 on CPU: the interpreter multiplies bfloat16's raw bits in tl.dot (tests/unit/engine/triton_interpreter.py)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shape = dict(TINY if a.tiny else SHAPES[a.shape])
    layers = 2 if a.tiny else shape["num_hidden_layers"]
    h, inter = shape["hidden_size"], shape["intermediate_size"]
    q = shape["num_attention_heads"] * shape["head_dim"]
    qkv = q + 2 * shape["num_key_value_heads"] * shape["head_dim"]
    configs = [
        (s, bn, bk, w, st)
        for s, bn, bk, (w, st) in itertools.product((1, 2, 4, 8), (16, 32), (64, 128), ((4, 3), (4, 4)))
    ]
    if a.tiny:
        configs = configs[::7]
    bw = 4.26e12 if device.type == "cuda" else 1e11  # bench_engine's copy bandwidth on the H200s
    print(f"{torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}, torch {torch.__version__}", flush=True)
    print(
        "\n| op | rows | before: cuBLAS + kernel (µs) | prologue (µs) | split-K (µs) | + reduce (µs) | weight floor (µs) "
        "| before / best Triton | configs: prologue; split-K (splits, BN, BK, warps, stages) |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---|")
    totals: dict[int, list[float]] = {}
    for m in (int(r) for r in a.rows.split(",")):
        for name, n, k, mode in (
            ("qkv", qkv, h, NORM),
            ("o", h, q, PLAIN),
            ("gate_up", 2 * inter, h, NORM),
            ("down", h, inter, SILU),
        ):
            r = time_op(name, m, n, k, mode, layers, configs, device, dtype)
            floor = n * k * dtype.itemsize / bw * 1e6
            best = min(r["prologue"], r.get("split", float("inf")))
            t = totals.setdefault(m, [0.0, 0.0, 0.0])
            t[0], t[1], t[2] = t[0] + r["before"], t[1] + best, t[2] + floor
            split = f"{r['split']:.2f} | {r['reduce']:.2f}" if "split" in r else "- | -"
            print(
                f"| {name} | {m} | {r['before']:.2f} | {r['prologue']:.2f} | {split} | {floor:.2f} | "
                f"{r['before'] / best:.2f}x | {r['prologue_cfg']}; {r.get('split_cfg', '-')} |",
                flush=True,
            )
    print("\nA layer's four projections, summed (the best Triton way of each, reduce not counted):\n")
    print("| rows | before (µs) | best Triton (µs) | floor (µs) |\n|---:|---:|---:|---:|")
    for m, (b, best, floor) in totals.items():
        print(f"| {m} | {b:.1f} | {best:.1f} | {floor:.1f} |")


if __name__ == "__main__":
    main()
