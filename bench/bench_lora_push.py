"""LoRA weight push: adapters alone against the merged model, into the built-in engine, as a run pushes.

Per shape (random weights, bf16 engine), one process: the trainer a run builds (`launch_actor`,
FSDP2 on one rank, float32 master weights) with LoRA on every linear layer, the engine a real
server. Timed side by side, alternating, each push checked (`WeightPusher.check`):

* `merged`: every weight, the adapters merged in (what vLLM engines get; what every engine got
  before adapter-only pushes);
* `adapters`: `lora_A` and the scaled `lora_B` of each layer, merged by the engine into its copy
  of the base (`vime/engine/core/lora.py`); the base itself went once, before.

Correctness in the same run: after each kind of push the engine's greedy tokens for a few
prompts, scored by the trainer's LoRA model, give the engine's own log-probs back within bf16
rounding, and the two kinds give the same tokens. On one GPU the engine shares it and the push
goes by CUDA IPC; with two, by NCCL to the second GPU.

    PYTHONPATH=. python3 bench/bench_lora_push.py                                  # 0.6B and 4B, rank 32
    PYTHONPATH=. python3 bench/bench_lora_push.py --device cpu --tiny              # smoke test (gloo)
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.bench_trainer import make_model  # noqa: E402
from bench.shapes import SHAPES, TINY  # noqa: E402
from vime.backends.builtin.launch import launch_engine  # noqa: E402
from vime.backends.client import EngineClient  # noqa: E402
from vime.config import Config  # noqa: E402
from vime.rollout.types import Sample  # noqa: E402
from vime.trainer.distributed import launch_actor  # noqa: E402
from vime.transport.group import apply_gpu_safe_env  # noqa: E402
from vime.transport.push import WeightPusher  # noqa: E402

PROMPTS = [[40, 41, 42], [50, 60, 70, 80, 90], list(range(10, 33))]


def greedy(url: str, n: int = 16) -> list[tuple[list[int], list[float]]]:
    client = EngineClient(url)

    async def main():
        try:
            params = {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True}
            return [await client.generate(p, params) for p in PROMPTS]
        finally:
            await client.close()

    return [(o["output_ids"], o["meta_info"]["output_token_logprobs"]) for o in asyncio.run(main())]


def gap(actor, outs: list[tuple[list[int], list[float]]]) -> float:
    """Largest |trainer log-prob − engine log-prob| over the engine's greedy tokens."""
    samples = [
        Sample(index=i, tokens=p + t, response_length=len(t)) for i, (p, (t, _)) in enumerate(zip(PROMPTS, outs))
    ]
    mine = actor.compute_log_probs(samples)
    return max(float((m.float().cpu() - torch.tensor(lp)).abs().max()) for m, (_, lp) in zip(mine, outs))


def run_shape(name: str, shape: dict, a: argparse.Namespace, gpu: bool) -> dict[str, float | str]:
    work = Path(tempfile.mkdtemp(prefix=f"vime-lora-{name}-"))
    model = make_model(work / "model", shape, "cuda" if gpu else "cpu")
    two = gpu and torch.cuda.device_count() > 1
    trainer_dev, engine_dev = ("cuda:0", "cuda:1" if two else "cuda:0") if gpu else ("cpu", "cpu")
    transport = ("nccl" if two else "cuda_ipc") if gpu else "gloo"
    engine = launch_engine(
        str(model),
        device=engine_dev,
        dtype="bfloat16" if gpu else "float32",
        extra_args=["--num-kv-blocks", "256"],
        log_path=work / "engine.log",
        startup_timeout=600,
    )
    try:
        client = EngineClient(engine.url)
        args = Config(
            hf_checkpoint=str(model),
            prompt_data="-",
            num_rollout=1,
            lr=1e-3,
            device="cuda" if gpu else "cpu",
            lora_rank=a.rank,
            lora_alpha=2.0 * a.rank,
            max_tokens_per_gpu=4096,
            global_batch_size=2,
            compile=False,  # the push does not depend on it, and compiling costs ~90 s a shape
        ).validate()
        actor = launch_actor(args, model, trainer_dev)
        # two steps on random tokens, so the adapters are no longer zero
        g = torch.Generator().manual_seed(0)
        batch = [
            Sample(
                index=i, tokens=torch.randint(10, shape["vocab_size"], (64,), generator=g).tolist(), response_length=32
            )
            for i in range(2)
        ]
        for _ in range(2):
            actor.train_step(batch, [1.0, -1.0])
        pusher = WeightPusher([client], transport, timeout=600)
        pusher.connect(trainer_dev)
        t0 = time.perf_counter()
        base = pusher.push(actor.named_weights(merge=False), version=1)
        base_s = time.perf_counter() - t0
        times: dict[str, list[float]] = {"merged": [], "adapters": []}
        nbytes: dict[str, float] = {}
        outs: dict[str, list] = {}
        version = 2
        for _ in range(a.pushes):
            for kind in ("adapters", "merged"):  # adapters first: they merge into the base pushed above
                # a plain push makes its weights the base: the base goes back after each merged one
                stream = actor.named_weights() if kind == "merged" else actor.adapter_weights()
                client.pause_generation("in_place")
                t0 = time.perf_counter()
                m = pusher.push(stream, version)
                times[kind].append(time.perf_counter() - t0)
                client.continue_generation()
                nbytes[kind] = m["perf/update_weights_bytes"]
                version += 1
                if kind not in outs:
                    outs[kind] = greedy(engine.url)
                if kind == "merged":
                    pusher.push(actor.named_weights(merge=False), version)
                    version += 1
        errs = {k: gap(actor, o) for k, o in outs.items()}
        same = [t for t, _ in outs["merged"]] == [t for t, _ in outs["adapters"]]
        actor.close()
    finally:
        engine.shutdown()
    row: dict[str, float | str] = {
        "shape": name,
        "transport": transport,
        "merged_ms": statistics.median(times["merged"]) * 1e3,
        "adapters_ms": statistics.median(times["adapters"]) * 1e3,
        "merged_gb": nbytes["merged"] / 1e9,
        "adapters_mb": nbytes["adapters"] / 1e6,
        "base_s": base_s,
        "base_gb": base["perf/update_weights_bytes"] / 1e9,
        "gap_merged": errs["merged"],
        "gap_adapters": errs["adapters"],
        "same_tokens": str(same),
    }
    print(f"[lora-push] {row}", flush=True)
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--tiny", action="store_true", help="the CPU smoke test's 2-layer model")
    p.add_argument("--shapes", default="qwen3-0.6b,qwen3-4b", help="comma-separated, of bench/shapes.py")
    p.add_argument("--rank", type=int, default=32, help="LoRA rank (alpha = 2 × rank), every linear layer")
    p.add_argument("--pushes", type=int, default=5, help="timed pushes of each kind")
    a = p.parse_args()
    apply_gpu_safe_env()
    gpu = a.device == "cuda"
    print(f"[lora-push] {torch.cuda.get_device_name(0) if gpu else 'cpu'}, torch {torch.__version__}", flush=True)
    shapes = {"tiny": TINY} if a.tiny else {s: SHAPES[s] for s in a.shapes.split(",")}
    rows = [run_shape(n, s, a, gpu) for n, s in shapes.items()]
    print(
        "\n| shape | transport | merged push (ms) | adapter push (ms) | speedup | merged GB | adapters MB | "
        "base push, once (s) | max |log-prob gap| merged / adapters | same greedy tokens |\n|---|---|---:|---:|---:|---:|---:|---:|---|---|"
    )
    for r in rows:
        print(
            f"| {r['shape']} | {r['transport']} | {r['merged_ms']:.1f} | {r['adapters_ms']:.1f} | "
            f"{r['merged_ms'] / r['adapters_ms']:.1f}× | {r['merged_gb']:.2f} | {r['adapters_mb']:.1f} | {r['base_s']:.2f} | "
            f"{r['gap_merged']:.3f} / {r['gap_adapters']:.3f} | {r['same_tokens']} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
