"""The sync / one-step-off / fully-async / decoupled A/B, with the trainer and the engine on
their own GPUs when there are two (the founding experiment's layout), or sharing one.

Trainer on cuda:0; the engine on cuda:1 when two GPUs are visible (weights by NCCL, which the
placement picks from where the engine runs), else on cuda:0 beside the trainer (CUDA IPC). The
model is a Qwen3-0.6B shape with random weights; response lengths follow the seeded long-tailed
mix of `bench/longtail_generate.py` (EOS ignored), identical in every arm. The engine is started
once; before each arm its weights are reset to the initial ones (version 0), so every arm starts
from the same policy. Each arm is a fresh `vime train` / `vime train-async` process (vime.ab).

Arm `sync-colocated` (two GPUs) is the fair baseline for a disaggregated A/B: sync training with
the trainer on both GPUs (FSDP2, 2 ranks) and one engine on each GPU, time-shared, so no GPU
idles while the other works.

Arm `sync-release` is sync with `--colocate`: the engine gives its GPU memory back (weights to
host memory, KV pool unmapped) for every train step and takes it again before the push, which
is what a colocated run pays per step.

Also measured: the engine's throughput at full load (many long requests at once), which gives
the bound of an async step, max(train + push, generation of one step's tokens at full load).

    PYTHONPATH=. python3 bench/bench_ab.py --arms sync,one-step-off,fully-async,decoupled,sync-colocated   # nvidia-h200-x2
    PYTHONPATH=. python3 bench/bench_ab.py                   # one H200 (engine beside the trainer)
    PYTHONPATH=. python3 bench/bench_ab.py --shape qwen3-4b  # the founding experiment's model shape on one H200

At the 4B shape the trainer (64 GB of float32 weights, gradients and Adam state) and the engine
share one GPU only with less room each: activations recomputed (--gradient-checkpointing) and a
KV pool of 4,000 blocks (64k tokens, 9.4 GB) instead of 12,000.
    PYTHONPATH=. python3 bench/bench_ab.py --device cpu --tiny --steps 3   # smoke test
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.shapes import SHAPES, tiny_model_kwargs  # noqa: E402
from vime.ab import run_arm  # noqa: E402
from vime.backends.builtin.launch import launch_engine  # noqa: E402
from vime.backends.client import EngineClient  # noqa: E402
from vime.cli import guarded  # noqa: E402
from vime.datagen import write_dataset  # noqa: E402
from vime.errors import VimeError  # noqa: E402
from vime.metrics import mean  # noqa: E402
from vime.models import make_tiny_model  # noqa: E402
from vime.report import speed_table, summarize  # noqa: E402

TINY = dict(
    hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128, max_position_embeddings=2048
)


async def full_load_tok_s(url: str, n: int, length: int) -> float:
    """Output tokens/s with n requests of `length` tokens in flight at once (no tail)."""
    client = EngineClient(url)
    params = {"max_new_tokens": length, "temperature": 1.0, "ignore_eos": True}
    t0 = time.perf_counter()
    outs = await asyncio.gather(*(client.generate([5 + i % 50] * 64, params) for i in range(n)))
    elapsed = time.perf_counter() - t0
    await client.close()
    return sum(len(o["output_ids"]) for o in outs) / elapsed


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--device",
        default="auto",
        help="the engine's device: auto = cuda:1 when two GPUs are visible, else cuda:0; or cpu",
    )
    p.add_argument("--tiny", action="store_true", help="tiny model (CPU smoke test)")
    p.add_argument(
        "--shape", choices=list(SHAPES), default="qwen3-0.6b", help="model shape, random weights (the benches' shapes)"
    )
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--arms", default="sync,one-step-off,fully-async,decoupled")
    p.add_argument("--arm-timeout", type=float, default=150.0, help="seconds before an arm is given up")
    p.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="trainer with or without --compile (default: vime's, on when the trainer is on CUDA)",
    )
    p.add_argument("--out", default=os.environ.get("OUT", "/tmp/vime-ab"))
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(f"/tmp/vime-ab-work-{'tiny' if a.tiny else a.shape}")  # one model per shape
    t0 = time.perf_counter()
    model = work / "model"
    if not (model / "config.json").exists():
        make_tiny_model(model, arch="qwen3", seed=0, **(TINY if a.tiny else tiny_model_kwargs(SHAPES[a.shape])))
    train, _ = write_dataset("gsm_symbolic", work / "data", n_train=2000, n_test=20, seed=0)
    print(f"[ab] model and data ready in {time.perf_counter() - t0:.0f} s", flush=True)

    big = not a.tiny
    four_b = big and a.shape == "qwen3-4b"
    kv_blocks = 4000 if four_b else 12000 if big else 2000
    import torch

    gpus = torch.cuda.device_count()
    device = a.device if a.device != "auto" else ("cuda:1" if gpus >= 2 else "cuda:0")
    arms = [x for x in a.arms.split(",") if x]
    if "sync-colocated" in arms and gpus < 2:
        print("[ab] sync-colocated needs two GPUs: left out", flush=True)
        arms.remove("sync-colocated")
    engine_args = ["--num-kv-blocks", str(kv_blocks), "--max-num-seqs", "256"]
    engine = launch_engine(str(model), device=device, extra_args=engine_args, log_path=out / "engine.log")
    second = None  # the colocated arm's engine on the trainer's GPU
    try:
        if "sync-colocated" in arms:
            second = launch_engine(
                str(model), device="cuda:0", extra_args=engine_args, log_path=out / "engine-colocated.log"
            )
        n_full, len_full = (256, 512) if big else (32, 64)
        full = asyncio.run(full_load_tok_s(engine.url, n_full, len_full))
        print(f"[ab] engine at full load: {full:,.0f} output tok/s ({n_full} × {len_full} tokens)", flush=True)
        cfg = {
            "hf_checkpoint": str(model),
            "prompt_data": str(train),
            "rollout_batch_size": 16 if big else 4,
            "n_samples_per_prompt": 8 if big else 4,
            "rollout_max_response_len": 1024 if big else 64,
            "rollout_temperature": 1.0,
            "custom_generate_function_path": "bench.longtail_generate.generate",
            "custom_rm_path": "bench.longtail_generate.zero_reward",
            "num_rollout": a.steps,
            "lr": 1e-6,
            "max_tokens_per_gpu": 16384 if big else 4096,
            "rollout_engine_urls": [engine.url],
            "use_tensorboard": False,
            "rollout_seed": 7,
            "seed": 7,
            "compile": a.compile,
            "gradient_checkpointing": four_b,
        }
        cfg_path = work / "ab.yaml"
        cfg_path.write_text(yaml.safe_dump(cfg))
        runs = out / "runs"
        dirs = []
        stamp = time.strftime("%H%M%S")
        for arm in arms:
            for e in (engine, second):
                if e is not None:
                    EngineClient(e.url).update_weights_from_disk(str(model), 0)  # every arm starts from version 0
            extra: list[str] = []
            if arm == "sync-colocated":  # trainer ranks on both GPUs, an engine beside each
                extra = ["--actor-num-gpus-per-node", "2", "--rollout-engine-urls", f"{second.url},{engine.url}"]
            if arm == "sync-release":
                extra = ["--colocate"]
            try:
                d = run_arm(
                    arm.removesuffix("-colocated").removesuffix("-release"),
                    str(cfg_path),
                    f"{stamp}-{arm}",
                    str(runs),
                    extra,
                    staleness=2,
                    timeout=a.arm_timeout,
                )
            except VimeError as e:  # a failed or timed-out arm: the others still run
                print(f"[ab] {e}", flush=True)
                continue
            dirs.append(d)
            (out / f"{d.name}.metrics.jsonl").write_text((d / "metrics.jsonl").read_text())
    finally:
        engine.shutdown()
        if second is not None:
            second.shutdown()

    summaries = [summarize(d) for d in dirs]

    def steady(s) -> list[dict]:
        return [r for r in s.rows if "perf/step_time" in r][1:] or [r for r in s.rows if "perf/step_time" in r]

    def arm_of(s) -> str:
        return s.name.split("-", 1)[1]  # run names are <stamp>-<arm>

    # On one GPU, trainer and engine mostly take turns, so a step costs about the sum of its
    # parts back to back: training alone (the sync arm's train time) + push + generation at full
    # load. Not a hard bound: each part's wall time includes host gaps the other process can
    # fill. With the engine on its own GPU the bound is the max.
    alone = next((mean([r["perf/train_time"] for r in steady(s)]) for s in summaries if arm_of(s) == "sync"), None)
    lines = [
        "| arm | steady step time (s) | train + push (s) | one step's tokens at full load (s) | bound (s) | step / bound | no-overlap sum (s) | step / sum | response tokens / step |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    steady_step = {}
    for s in summaries:
        steps = steady(s)
        tokens = mean([r["rollout/response_len_mean"] * r["rollout/num_samples"] for r in steps])
        push = mean([r.get("perf/update_weights_time", 0.0) for r in steps])
        train_push = mean([r["perf/train_time"] for r in steps]) + push
        gen = tokens / full
        bound = max(train_push, gen)
        step = steady_step[arm_of(s)] = mean([r["perf/step_time"] for r in steps])
        total = f"{alone + push + gen:.2f} | {step / (alone + push + gen):.2f}" if alone is not None else "- | -"
        lines.append(
            f"| {arm_of(s)} | {step:.2f} | {train_push:.2f} | {gen:.2f} | {bound:.2f} | {step / bound:.2f} | {total} | {tokens:,.0f} |"
        )
    refs = [r for r in ("sync", "sync-colocated") if r in steady_step]
    speed = [
        "| arm | steady step (s) | wait share, steady | " + " | ".join(f"speedup over {r}" for r in refs) + " |",
        "|---|---:|---:|" + "---:|" * len(refs),
    ]
    for s in summaries:
        steps = steady(s)
        share = sum(r["perf/train_wait_time"] for r in steps) / sum(r["perf/step_time"] for r in steps)
        step = steady_step[arm_of(s)]
        speed.append(
            f"| {arm_of(s)} | {step:.2f} | {100 * share:.1f}% | "
            + " | ".join(f"{steady_step[r] / step:.2f}×" for r in refs)
            + " |"
        )
    where = f"trainer {'cuda:0' if gpus else 'cpu'}, engine {device}" + (
        ", colocated arm: 2 trainer ranks + an engine on each GPU" if second is not None else ""
    )
    report = f"{where}\n\nspeed (all steps; first arm = speedup reference)\n" + speed_table(summaries)
    report += "\n\nsteady steps (2..N)\n" + "\n".join(speed) + "\n\nbound (steps 2..N)\n" + "\n".join(lines)
    report += f"\n\nengine at full load: {full:,.0f} output tok/s; total bench time {time.perf_counter() - t0:.0f} s"
    out.mkdir(parents=True, exist_ok=True)
    (out / "ab.md").write_text(report + "\n")
    print("\n" + report)
    return 0


if __name__ == "__main__":
    # SIGTERM unwinds as Ctrl-C does (exit 143): the running arm's process group and the engines
    # are stopped on the way out
    sys.exit(guarded(lambda _: main(), []))
