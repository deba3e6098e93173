"""Packed causal attention kernels side by side on one GPU, forward and forward + backward.

The trainer's packed attention (`vime.trainer.packing`) ran torch's varlen FlashAttention-2 until
the profile of issue 16 put 27% of a step in it (bench/RESULTS.md). This times the kernels torch
ships for the same packed row, on micro-batches of a GRPO batch drawn as `bench/bench_trainer.py` draws its own
(Qwen3-0.6B heads: 16 query heads, 8 key/value heads, head dim 128), and checks each one's
output and gradients against float32 attention per sequence:

* `flash`: `torch.nn.attention.varlen.varlen_attn` (FlashAttention-2, GQA in the kernel);
* `fa4`: FlashAttention-4 through vime's ops (`vime.trainer.flash4`, `--attention-kernel fa4`;
  the optional flash-attn-4 package, carried to a GPU machine by bench/fa4_prep.sh);
* `cudnn`: `aten._cudnn_attention_forward` with cumulative sequence lengths (cuDNN's ragged
  SDPA), keys and values with their own 8 heads;
* `cudnn-expanded`: the same with keys and values repeated to 16 heads first.

`cudnn` is not in the default variants: in torch 2.11 it fails with an illegal memory access,
which poisons the CUDA context, so it can only run alone (`--variants cudnn`).

Run: PYTHONPATH=. python3 bench/bench_attention.py
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

sys.path.insert(0, str(Path(__file__).parent))
from bench_trainer import make_batch  # noqa: E402

from vime.trainer import flash4  # noqa: E402
from vime.trainer.packing import _VARLEN, plan_packed_micro_batches  # noqa: E402

Attend = Callable[[Tensor, Tensor, Tensor, Tensor, int], Tensor]


def flash(q: Tensor, k: Tensor, v: Tensor, cu: Tensor, max_len: int) -> Tensor:
    from torch.nn.attention.varlen import varlen_attn

    return varlen_attn(q, k, v, cu, cu, max_len, max_len, **_VARLEN)


def fa4(q: Tensor, k: Tensor, v: Tensor, cu: Tensor, max_len: int) -> Tensor:
    return flash4.fa4_varlen(q, k, v, cu, max_len, q.shape[-1] ** -0.5)[0]


def cudnn(q: Tensor, k: Tensor, v: Tensor, cu: Tensor, max_len: int) -> Tensor:
    return torch.ops.aten._cudnn_attention_forward(q, k, v, None, cu, cu, max_len, max_len, True, 0.0, True)[0]


def cudnn_expanded(q: Tensor, k: Tensor, v: Tensor, cu: Tensor, max_len: int) -> Tensor:
    groups = q.shape[1] // k.shape[1]
    return cudnn(q, k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1), cu, max_len)


def time_ms(fn: Callable[[], object], iters: int) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def time_kernel(fn: Attend, inputs: tuple, grad: Tensor, iters: int) -> tuple[float, float]:
    """(forward ms, forward + backward ms) of one kernel on one micro-batch."""
    q, k, v = inputs[:3]
    with torch.no_grad():
        fwd = time_ms(lambda: fn(*inputs), iters)
    both = time_ms(lambda: torch.autograd.grad(fn(*inputs), (q, k, v), grad), iters)
    return fwd, both


def attention_flops(lengths: list[int], heads: int, dim: int) -> float:
    """Causal forward FLOPs: two GEMMs over the lower triangle of each sequence."""
    return sum(4 * heads * dim * n * (n + 1) / 2 for n in lengths)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--budget", type=int, default=16384, help="micro-batch token budget")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--variants", default="flash,fa4", help="comma-separated: flash, fa4, cudnn, cudnn-expanded")
    a = ap.parse_args()
    torch.manual_seed(0)
    dev = torch.device("cuda")
    samples, _ = make_batch(64, 1000, (100, 500), (100, 2000), 0)
    lengths = [len(s.tokens) for s in samples]
    plan = plan_packed_micro_batches(lengths, a.budget)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}")
    print(f"{len(lengths)} sequences, {sum(lengths)} tokens, {len(plan)} micro-batches of <= {a.budget}")
    fns: dict[str, Attend] = {"flash": flash, "fa4": fa4, "cudnn": cudnn, "cudnn-expanded": cudnn_expanded}
    totals: dict[str, list[float]] = {v: [0.0, 0.0] for v in a.variants.split(",")}
    errors: dict[str, float] = dict.fromkeys(totals, 0.0)
    failed: dict[str, str] = {}
    flops = 0.0
    for bin_ in plan:
        lens = [lengths[i] for i in bin_]
        flops += attention_flops(lens, 16, 128)
        t = sum(lens)
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=dev)
        q = torch.randn(t, 16, 128, device=dev, dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(t, 8, 128, device=dev, dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn(t, 8, 128, device=dev, dtype=torch.bfloat16, requires_grad=True)
        g = torch.randn(t, 16, 128, device=dev, dtype=torch.bfloat16)
        qf, kf, vf = (x.detach().float().requires_grad_() for x in (q, k, v))
        ref = flash4.reference(qf, kf, vf, cu)
        ref_grads = torch.autograd.grad(ref, (qf, kf, vf), g.float())
        for name in totals:
            if name in failed:
                continue
            fn = fns[name]
            try:
                out = fn(q, k, v, cu, max(lens))
                grads = torch.autograd.grad(out, (q, k, v), g)
            except (RuntimeError, NotImplementedError, ImportError, AssertionError) as e:  # FA4 asserts its arguments
                failed[name] = str(e).splitlines()[0][:160]
                continue
            err = max(flash4.relative_error(x, r) for x, r in zip((out, *grads), (ref, *ref_grads)))
            errors[name] = max(errors[name], err)
            fwd, both = time_kernel(fn, (q, k, v, cu, max(lens)), g, a.iters)
            totals[name][0] += fwd
            totals[name][1] += both
    print("\n| kernel | forward ms | fwd + bwd ms | fwd TFLOP/s | fwd+bwd TFLOP/s | max rel. error vs fp32 |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, (fwd, both) in totals.items():
        if name in failed:
            print(f"| {name} | failed: {failed[name]} | | | | |")
            continue
        print(
            f"| {name} | {fwd:.2f} | {both:.2f} | {flops / fwd / 1e9:.0f} | {3.5 * flops / both / 1e9:.0f} | {errors[name]:.1e} |"
        )
    print("\n(fwd + bwd FLOPs counted as 3.5x the forward's: the backward recomputes the scores once.)")


if __name__ == "__main__":
    main()
