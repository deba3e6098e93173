"""Weight push into an engine on another GPU, as the train loop sees it: pause → push → continue.

The trainer is what a run uses (`launch_actor`: FSDP2 on one rank, float32 master weights); the
engine is a real server on the second GPU; the pusher is the run's (`WeightPusher`, nccl: the
weights cast to the engine's bfloat16 and broadcast in flat buckets). Beside it, the floors of
moving those bytes between the two GPUs, measured in the same run: a bucketed NCCL broadcast
between two bare processes, and a peer-to-peer copy. Pushes are timed on an idle engine and on
one generating at full load (256 long requests), where the pause also waits for the step in
progress. First, pushes with the proof of arrival (`WeightPusher.check`: the engine's checksums
of what it holds against the trainer's) on and off, alternating, for its cost. On a machine with
one GPU the engine shares it and the push goes by CUDA IPC (no floors then).

    PYTHONPATH=. python3 bench/bench_push.py                            # nvidia-h200-x2 (one GPU: CUDA IPC)
    PYTHONPATH=. python3 bench/bench_push.py --device cpu --tiny         # smoke test (gloo)
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.bench_ab import QWEN3_06B, TINY  # noqa: E402
from vime.backends.builtin.launch import launch_engine  # noqa: E402
from vime.backends.client import EngineClient  # noqa: E402
from vime.config import Config  # noqa: E402
from vime.models import make_tiny_model  # noqa: E402
from vime.trainer.distributed import launch_actor  # noqa: E402
from vime.transport.group import apply_gpu_safe_env  # noqa: E402
from vime.transport.push import WeightPusher  # noqa: E402

GiB = 2**30


def _broadcast_floor_worker(rank: int, nbytes: int, bucket: int, iters: int, port: int, out) -> None:
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    sizes = [min(bucket, nbytes - off) // 2 for off in range(0, nbytes, bucket)]
    bufs = [torch.randn(n, device="cuda").to(torch.bfloat16) for n in sizes]
    times = []
    for i in range(iters + 3):
        dist.barrier()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for b in bufs:
            dist.broadcast(b, src=0)
        torch.cuda.synchronize()
        if i >= 3:
            times.append(time.perf_counter() - t0)
    if rank == 0:
        out.put(statistics.median(times))
    dist.destroy_process_group()


def nccl_broadcast_floor(nbytes: int, bucket: int, iters: int = 20) -> float:
    """Median seconds of a bucketed bf16 broadcast of `nbytes` from GPU 0 to GPU 1, two bare processes."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_broadcast_floor_worker, args=(r, nbytes, bucket, iters, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    result = out.get(timeout=300)
    for p in procs:
        p.join(60)
    return result


def p2p_copy_floor(nbytes: int, src: str, dst: str, iters: int = 20) -> float:
    a = torch.randn(nbytes // 2, device=src).to(torch.bfloat16)
    b = torch.empty_like(a, device=dst)
    times = []
    for i in range(iters + 3):
        torch.cuda.synchronize(src)
        torch.cuda.synchronize(dst)
        t0 = time.perf_counter()
        b.copy_(a)
        torch.cuda.synchronize(dst)
        torch.cuda.synchronize(src)
        if i >= 3:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


class Load:
    """Keeps the engine generating (n requests of `length` tokens in flight, refilled) until stopped."""

    def __init__(self, url: str, n: int, length: int) -> None:
        self.url, self.n, self.length = url, n, length
        self.stop = threading.Event()
        self.tokens = 0
        self.thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)

    async def _main(self) -> None:
        client = EngineClient(self.url)
        params = {"max_new_tokens": self.length, "temperature": 1.0, "ignore_eos": True}

        async def worker(i: int) -> None:
            while not self.stop.is_set():
                out = await client.generate([5 + i % 50] * 64, params)
                self.tokens += len(out["output_ids"])

        await asyncio.gather(*(worker(i) for i in range(self.n)))
        await client.close()


def timed_pushes(
    actor, client: EngineClient, pusher: WeightPusher, n: int, first_version: int
) -> list[dict[str, float]]:
    rows = []
    for i in range(n):
        t0 = time.perf_counter()
        client.pause_generation("in_place")
        t1 = time.perf_counter()
        m = pusher.push(actor.named_weights(), first_version + i)
        t2 = time.perf_counter()
        client.continue_generation()
        t3 = time.perf_counter()
        rows.append(
            {
                "pause": t1 - t0,
                "push": t2 - t1,
                "continue": t3 - t2,
                "total": t3 - t0,
                "buckets": m.get("perf/update_weights_buckets", 0),
                "check": m.get("perf/update_weights_check_time", 0.0),
                "bytes": m["perf/update_weights_bytes"],
            }
        )
        time.sleep(0.05)
    return rows


def breakdown(actor, pusher: WeightPusher, gpu: bool, n: int = 5) -> None:
    """Where a push's time goes on the trainer: gathering the named tensors, and packing them
    into cast flat buckets (the rest is HTTP, the broadcast and the engine's copy)."""
    from vime.transport.buckets import pack

    def sync() -> None:
        if gpu:
            torch.cuda.synchronize()

    gather, packing = [], []
    for _ in range(n):
        sync()
        t0 = time.perf_counter()
        tensors = list(actor.named_weights())
        sync()
        t1 = time.perf_counter()
        for _ in pack(
            iter(tensors),
            pusher.bucket_bytes,
            torch.bfloat16 if gpu else torch.float32,
            torch.device("cuda:0" if gpu else "cpu"),
        ):
            pass
        sync()
        gather.append(t1 - t0)
        packing.append(time.perf_counter() - t1)
    print(
        f"[push] trainer side: named_weights {statistics.median(gather) * 1e3:.2f} ms, pack {statistics.median(packing) * 1e3:.2f} ms ({len(tensors)} tensors)",
        flush=True,
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--pushes", type=int, default=10)
    a = p.parse_args()
    apply_gpu_safe_env()
    gpu = a.device == "cuda"
    one_gpu = gpu and torch.cuda.device_count() < 2  # engine beside the trainer: CUDA IPC, no NCCL
    work = Path("/tmp/vime-push")
    model = work / ("tiny" if a.tiny else "qwen3-0.6b")
    if not (model / "config.json").exists():
        make_tiny_model(model, arch="qwen3", seed=0, **(TINY if a.tiny else QWEN3_06B))
    trainer_dev, engine_dev = ("cuda:0", "cuda:0" if one_gpu else "cuda:1") if gpu else ("cpu", "cpu")
    print(
        f"[push] {torch.cuda.get_device_name(0) if gpu else 'cpu'} ×{torch.cuda.device_count() if gpu else 1}, torch {torch.__version__}",
        flush=True,
    )

    engine = launch_engine(
        str(model),
        device=engine_dev,
        extra_args=["--num-kv-blocks", "6000" if one_gpu else "12000" if gpu else "2000", "--max-num-seqs", "256"],
        log_path=work / "engine.log",
    )
    try:
        client = EngineClient(engine.url)
        args = Config(hf_checkpoint=str(model), prompt_data="-", num_rollout=1, lr=1e-6, device=a.device).validate()
        actor = launch_actor(args, model, trainer_dev)
        transport = "cuda_ipc" if one_gpu else "nccl" if gpu else "gloo"
        print(f"[push] transport {transport}", flush=True)
        results: dict[str, list[dict[str, float]]] = {}
        # the proof of arrival (engine checksums against the trainer's) on and off, side by side
        pusher = WeightPusher([client], transport, timeout=120)
        timed_pushes(actor, client, pusher, 2, 2000)
        for check in (False, True, False, True):
            pusher.check = check
            name = f"idle, 512 MiB buckets, {'checked' if check else 'unchecked'}"
            results.setdefault(name, []).extend(timed_pushes(actor, client, pusher, a.pushes // 2, 3000))
        for name in [n for n in results if n.endswith("checked")]:
            print_row(name, results[name], gpu)
        pusher.close()
        for bucket_mib in (512, 2048):
            pusher = WeightPusher([client], transport, bucket_bytes=bucket_mib * 2**20, timeout=120, check=False)
            t0 = time.perf_counter()
            pusher.connect(trainer_dev)
            print(f"[push] joined the {transport} weight group in {time.perf_counter() - t0:.2f} s", flush=True)
            timed_pushes(actor, client, pusher, 2, 1000)  # warm-up: allocator, first buckets
            results[f"idle, {bucket_mib} MiB buckets"] = timed_pushes(actor, client, pusher, a.pushes, 1)
            if bucket_mib == 512:
                breakdown(actor, pusher, gpu)
            print_row(f"idle, {bucket_mib} MiB buckets", results[f"idle, {bucket_mib} MiB buckets"], gpu)
            load = Load(engine.url, 256, 1024 if not a.tiny else 64)
            load.thread.start()
            time.sleep(3.0 if gpu else 1.0)  # the batch is full and decoding
            name = f"generating (256 requests), {bucket_mib} MiB buckets"
            results[name] = timed_pushes(actor, client, pusher, a.pushes, 100)
            print_row(name, results[name], gpu)
            load.stop.set()
            client.abort_request(abort_all=True)
            load.thread.join(60)
            pusher.close()
        nbytes = int(results["idle, 512 MiB buckets"][0]["bytes"])
        floors = {}
        if gpu and not one_gpu:
            floors["NCCL broadcast, 512 MiB buckets"] = nccl_broadcast_floor(nbytes, 512 * 2**20)
            floors["peer-to-peer copy"] = p2p_copy_floor(nbytes, "cuda:0", "cuda:1")
        actor.close()
    finally:
        engine.shutdown()

    print(f"\nweights on the wire: {nbytes / 1e9:.3f} GB ({'bfloat16' if gpu else 'float32'})")
    for name, s in floors.items():
        print(f"floor, {name}: {s * 1e3:.2f} ms ({nbytes / s / 1e9:.0f} GB/s)")
    print(
        "\n| case | pushes | pause (ms) | push (ms) | continue (ms) | pause → continue, median (ms) | max (ms) | ms per 1B params | check (ms) |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, rows in results.items():
        print_row(name, rows, gpu)
    return 0


def print_row(name: str, rows: list[dict[str, float]], gpu: bool) -> None:
    params = rows[0]["bytes"] / (2 if gpu else 4)
    med = lambda k: statistics.median(r[k] for r in rows) * 1e3  # noqa: E731
    total = med("total")
    print(
        f"| {name} | {len(rows)} | {med('pause'):.2f} | {med('push'):.2f} | {med('continue'):.2f} | {total:.2f} | {max(r['total'] for r in rows) * 1e3:.2f} | {total / (params / 1e9):.1f} | {med('check'):.2f} |",
        flush=True,
    )


if __name__ == "__main__":
    sys.exit(main())
