"""Issue 32's open question: should the engine apply pushed LoRA adapters by merging them into
its weights (what it does) or by a LoRA forward (x Wᵀ + (x Aᵀ) Bᵀ on every adapted layer)?

Merging costs once per push (one [out, r] × [r, in] product per adapted weight, float32, then a
copy) and nothing per token. A LoRA forward costs nothing per push and two skinny GEMMs per
adapted layer in every decode step. This bench measures both on the engine's own model:

* the decode graph's time at several batch sizes, plain (= merged) and with a LoRA forward on
  every linear layer of every decoder layer (q/k/v fused: one adapter of rank 3r; gate/up: 2r);
* the merge of every adapted weight (`vime.engine.core.lora.merge`, as a push does).

Then it prints how many decode steps between two pushes make the LoRA forward cost more than the
merge: below that, a LoRA forward would be cheaper.

    PYTHONPATH=. python3 bench/bench_lora_forward.py                     # 0.6B shape, one GPU
    PYTHONPATH=. python3 bench/bench_lora_forward.py --shape qwen3-4b
    PYTHONPATH=. python3 bench/bench_lora_forward.py --device cpu --tiny  # smoke test
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench.bench_engine import copy_bandwidth, gpu_decode_step_ms, make_model
from bench.shapes import SHAPES, TINY
from vime.engine.core.lora import merge
from vime.engine.core.model import Linear


class LoRALinear(Linear):
    """The engine's Linear with a LoRA forward: the adapter's two products beside the weight's."""

    lora_a: torch.Tensor  # [r, in]
    lora_b: torch.Tensor  # [out, r], alpha / r folded in

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + (x @ self.lora_a.t()) @ self.lora_b.t()


def adapted(model) -> list[tuple[Linear, int]]:
    """Every linear layer of the decoder layers, with its adapter's rank multiple (fused ones
    hold one adapter per projection they fuse)."""
    out = []
    for name, m in model.named_modules():
        if isinstance(m, Linear) and ".layers." in f".{name}":
            out.append((m, 3 if name.endswith("qkv_proj") else 2 if name.endswith("gate_up_proj") else 1))
    return out


def add_lora_forward(model, rank: int) -> None:
    for m, k in adapted(model):
        out_f, in_f = m.weight.shape
        m.__class__ = LoRALinear
        m.lora_a = torch.randn(k * rank, in_f, dtype=m.weight.dtype, device=m.weight.device) * 0.01
        m.lora_b = torch.randn(out_f, k * rank, dtype=m.weight.dtype, device=m.weight.device) * 0.01


def merge_ms(model, rank: int, repeats: int = 3) -> float:
    """One push's merges: every adapted weight set to base + B A (float32, rounded once)."""
    pairs = []
    for m, k in adapted(model):
        out_f, in_f = m.weight.shape
        dev, dt = m.weight.device, m.weight.dtype
        pairs.append(
            (
                m.weight,
                torch.randn(k * rank, in_f, device=dev, dtype=dt),
                torch.randn(out_f, k * rank, device=dev, dtype=dt),
            )
        )
    base = [w.detach().clone() for w, _, _ in pairs]
    times = []
    for _ in range(repeats):
        sync(model)
        t = time.perf_counter()
        with torch.no_grad():
            for (w, a, b), b0 in zip(pairs, base):
                w.copy_(merge(b0, a, b))
        sync(model)
        times.append(time.perf_counter() - t)
    with torch.no_grad():
        for (w, _, _), b0 in zip(pairs, base):
            w.copy_(b0)
    return 1e3 * statistics.median(times)


def sync(model) -> None:
    if next(model.parameters()).device.type == "cuda":
        torch.cuda.synchronize()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--shape", choices=list(SHAPES), default="qwen3-0.6b")
    p.add_argument("--rank", type=int, default=32)
    p.add_argument("--context", type=int, default=512, help="cached tokens per sequence in the timed steps")
    p.add_argument("--batches", default="1,16,64,256")
    a = p.parse_args()
    device = torch.device(a.device)
    cuda = device.type == "cuda"
    shape = TINY if a.tiny else SHAPES[a.shape]
    dtype_name = "bfloat16" if cuda else "float32"
    batches = [int(x) for x in a.batches.split(",")]

    from vime.engine.core.engine import EngineConfig, LLMEngine
    from vime.engine.core.sampler import SamplingParams

    with tempfile.TemporaryDirectory() as tmp:
        hf = make_model(shape, device, getattr(torch, dtype_name), 0, Path(tmp))
        del hf
        engine = LLMEngine(
            EngineConfig(
                tmp, device=str(device), dtype=dtype_name, max_num_seqs=max(batches), max_model_len=a.context + 64
            )
        )

    def step_ms(b: int) -> float:
        """The decode graph's device time on a GPU; elsewhere (no graphs), the mean wall time of
        engine steps after the prefill, b sequences at the given context."""
        if cuda:
            return gpu_decode_step_ms(engine, b, a.context)[0]
        for i in range(b):
            engine.add_request(f"{b}-{i}", [1 + i] * a.context, SamplingParams(max_new_tokens=4, ignore_eos=True))
        engine.step()  # the prefill
        times = []
        while engine.has_work():
            t = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t)
        return 1e3 * statistics.fmean(times)

    step_ms(batches[0])  # warm-up: the first steps compile and allocate
    plain = {b: step_ms(b) for b in batches}
    push = merge_ms(engine.model, a.rank)
    add_lora_forward(engine.model, a.rank)
    if cuda:  # the graphs captured at start hold the plain forward
        engine.runner.drop_graphs()
        engine.runner.capture()
    lora = {b: step_ms(b) for b in batches}
    print(
        f"\n{torch.cuda.get_device_name(device) if cuda else 'cpu'}"
        + (f", copy bandwidth {copy_bandwidth(device) / 1e12:.2f} TB/s" if cuda else "")
    )
    print(f"{'tiny' if a.tiny else a.shape}, rank {a.rank}, context {a.context}; one push's merges: {push:.2f} ms\n")
    print(
        "| batch | decode step, merged (ms) | with a LoRA forward (ms) | added per step (ms) | steps per push at which the merge is cheaper |"
    )
    print("|---:|---:|---:|---:|---:|")
    for b in batches:
        extra = lora[b] - plain[b]
        even = f"{push / extra:,.0f}" if extra > 0 else "- (no added cost measured)"
        print(f"| {b} | {plain[b]:.3f} | {lora[b]:.3f} | {extra:.3f} | {even} |")


if __name__ == "__main__":
    main()
