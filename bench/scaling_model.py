"""Step time of a GRPO step for N rollout engines and M trainer GPUs, from measured numbers.

A model, not a measurement (issue 29, docs/scaling.md): it takes vime's measured one-GPU figures
(bench/RESULTS.md) and a few interconnect figures that are hardware specifications, not
measurements (marked ASSUMED below), and prints, for the founding experiment's Qwen3-4B run
scaled up, where each part of the step goes and which one stops scaling first.

Parts of a step (seconds):
  generate  the step's output tokens over N engines at their full-load rate (throughput bound);
            a sync step also waits for its longest response, decoded token by token (the tail
            bound: more engines do not make one sequence decode faster)
  schedule  the driver's HTTP requests (one per sample) at its request rate (ASSUMED rate)
  train     the step's tokens over M GPUs at the measured per-GPU rate, plus FSDP's exposed
            communication (ASSUMED bandwidths and overlap)
  push      the weights gathered to one rank, then broadcast (NCCL's pipelined ring) to N
            engines: bytes over the slowest link, plus a latency per hop
Sync step = max(throughput, tail) + schedule + train + push. A fully-async step in steady state
= max(throughput + schedule, train + push): generation overlaps training, and a slow sample
lands in a later batch instead of holding this one (vime's continuous worker).

    PYTHONPATH=. python3 bench/scaling_model.py                       # the founding experiment's 4B run, 8 → 1024 GPUs
    PYTHONPATH=. python3 bench/scaling_model.py --model 0.6b --lora-fraction 0.02
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

# ---- measured on one H200 (bench/RESULTS.md; the section named after each) ----------------------
MEASURED = {
    # "Qwen3-4B shape on one H200" (2026-12-02): bench_engine 256 requests, in/out 100-1024
    "4b": dict(
        params=4.02e9,
        engine_tok_s=11_014,  # output tok/s at full load
        tail_step_s=0.0102,  # mean decode step of that run: an upper bound for a lone sequence (--tail-step-ms)
        trainer_tok_s=18_906,  # train_step + compile, 1 GPU, 48.0% MFU
    ),
    # "Engine throughput" / "The trainer at 40-42% MFU" sections
    "0.6b": dict(params=0.6e9, engine_tok_s=20_868, tail_step_s=0.0060, trainer_tok_s=100_050),
}
PUSH_LOCAL_BYTES_S = 1.19e9 / 0.0247  # "Trainer and engine on their own GPUs": 0.6B bf16, NCCL, 24.7 ms
# ---- ASSUMED: specifications, not measured here (one GPU is all this project has had) -----------
NODE_GPUS = 8
INTER_NODE_BYTES_S = 50e9  # one 400 Gb/s NIC per GPU
HOP_LATENCY_S = 20e-6  # NCCL per-hop latency across nodes
FSDP_EXPOSED = 0.2  # share of FSDP's all-gather / reduce-scatter time not hidden behind compute
REQUESTS_PER_S = 5_000  # one Python driver process issuing /generate requests (aiohttp)


@dataclass(frozen=True)
class Workload:
    """One step of the founding experiment's run (examples/fully_async/run-qwen3-4b-fully_async.sh):
    32 prompts × 8 samples, responses up to 8192 tokens; `scale` multiplies the prompts per step (a
    bigger cluster trains a bigger batch, or it idles)."""

    prompts: int = 32
    samples: int = 8
    prompt_len: int = 300
    mean_response: int = 2_000
    max_response: int = 8_192

    @property
    def sequences(self) -> int:
        return self.prompts * self.samples

    @property
    def out_tokens(self) -> int:
        return self.sequences * self.mean_response

    @property
    def tokens(self) -> int:
        return self.sequences * (self.prompt_len + self.mean_response)


def step_parts(w: Workload, m: dict, engines: int, trainers: int, push_fraction: float) -> dict[str, float]:
    throughput = w.out_tokens / (engines * m["engine_tok_s"])
    tail = w.max_response * m["tail_step_s"]
    schedule = w.sequences / REQUESTS_PER_S
    weight_bytes = 2 * m["params"]  # bf16 on the wire and in FSDP's gathers
    compute = w.tokens / (trainers * m["trainer_tok_s"])
    link = PUSH_LOCAL_BYTES_S if trainers <= NODE_GPUS else INTER_NODE_BYTES_S
    # per step: all-gather forward, all-gather backward, reduce-scatter gradients, each moving
    # (M-1)/M of the weights through every GPU's link
    fsdp = 0.0 if trainers == 1 else FSDP_EXPOSED * 3 * weight_bytes * (trainers - 1) / trainers / link
    train = compute + fsdp
    hops = engines  # a ring through every engine: latency per member, bandwidth once
    push_link = PUSH_LOCAL_BYTES_S if engines + trainers <= NODE_GPUS else INTER_NODE_BYTES_S
    gather = weight_bytes * push_fraction / PUSH_LOCAL_BYTES_S  # the shards to the sending rank
    push = gather + weight_bytes * push_fraction / push_link + hops * HOP_LATENCY_S
    sync = max(throughput, tail) + schedule + train + push
    async_ = max(throughput + schedule, train + push)
    return dict(throughput=throughput, tail=tail, schedule=schedule, train=train, push=push, sync=sync, async_=async_)


def bottleneck(parts: dict[str, float]) -> str:
    """What sets the fully-async step."""
    if parts["throughput"] + parts["schedule"] >= parts["train"] + parts["push"]:
        return "driver requests" if parts["schedule"] > parts["throughput"] else "engine throughput"
    return "push" if parts["push"] > parts["train"] else "trainer"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=sorted(MEASURED), default="4b")
    p.add_argument(
        "--gpus", default="8,64,256,1024", help="total GPUs, split 3:1 between engines and trainers (comma-separated)"
    )
    p.add_argument(
        "--tail-step-ms", type=float, default=None, help="decode step of a lone sequence (default: the measured mean)"
    )
    p.add_argument(
        "--lora-fraction",
        type=float,
        default=1.0,
        help="share of the weights each push carries (e.g. 0.02 for adapter-only LoRA pushes)",
    )
    a = p.parse_args()
    m = dict(MEASURED[a.model])
    if a.tail_step_ms is not None:
        m["tail_step_s"] = a.tail_step_ms / 1e3
    print(f"Qwen3-{a.model.upper()} shape; measured: {m}; ASSUMED: {NODE_GPUS} GPUs a node, "
          f"{INTER_NODE_BYTES_S / 1e9:.0f} GB/s between nodes, {REQUESTS_PER_S} requests/s a driver, "
          f"{FSDP_EXPOSED:.0%} of FSDP traffic exposed")  # fmt: skip
    print(
        "\n| GPUs (engines + trainers) | prompts/step | generate: throughput / tail (s) | schedule (s) | train (s) "
        "| push (s) | sync step (s) | fully-async step (s) | async / sync | samples/s (async) | fully-async stops on |"
        "\n|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"
    )
    for total in (int(x) for x in a.gpus.split(",")):
        trainers = max(1, total // 4)
        engines = total - trainers
        w = Workload(prompts=32 * max(1, total // 8))  # the batch grows with the cluster
        parts = step_parts(w, m, engines, trainers, push_fraction=a.lora_fraction)
        print(
            f"| {total} ({engines} + {trainers}) | {w.prompts} | {parts['throughput']:.1f} / {parts['tail']:.1f} "
            f"| {parts['schedule']:.2f} | {parts['train']:.1f} | {parts['push']:.2f} | {parts['sync']:.1f} "
            f"| {parts['async_']:.1f} | {parts['async_'] / parts['sync']:.2f} | {w.sequences / parts['async_']:.0f} "
            f"| {bottleneck(parts)} |"
        )


if __name__ == "__main__":
    main()
