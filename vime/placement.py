"""Devices → trainer and engine processes, and how weights travel between them.

One machine only for now: the trainer runs in this process, engines are launched as
subprocesses (or reached by URL with --rollout-engine-urls). The weight transport follows from
where the two sides sit: shared memory on CPU, CUDA IPC on one GPU, disk otherwise.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch

from vime.config import ConfigError
from vime.engine.client import EngineClient
from vime.engine.server import EngineProcess, launch_engine

log = logging.getLogger("vime")


@dataclass
class Placement:
    trainer_device: str
    engine_devices: list[str]
    urls: list[str]
    transport: str
    engines: list[EngineProcess] = field(default_factory=list)

    def shutdown(self) -> None:
        for e in self.engines:
            e.shutdown()
        self.engines.clear()


def trainer_device(args) -> str:
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda but no CUDA device is visible: use --device cpu or auto")
    if args.device == "auto":
        return "cuda:0" if torch.cuda.is_available() else "cpu"
    return "cuda:0" if args.device == "cuda" else "cpu"


def engine_devices(args, trainer: str) -> list[str]:
    """One device string per engine. Engines take the GPUs after the trainer's when there are
    enough; otherwise they share the trainer's GPU (two processes on one device)."""
    if trainer == "cpu":
        return ["cpu"]
    per_engine = args.rollout_num_gpus_per_engine
    if per_engine != 1:
        raise NotImplementedError("--rollout-num-gpus-per-engine > 1 (tensor parallel engines) is not built yet")
    n_engines = max(1, (args.rollout_num_gpus or 1) // per_engine)
    n_trainer = 0 if args.colocate else args.actor_num_gpus_per_node
    available = torch.cuda.device_count()
    if n_trainer + n_engines <= available:
        return [f"cuda:{n_trainer + i}" for i in range(n_engines)]
    return [f"cuda:{i % available}" for i in range(n_engines)]


def choose_transport(args, trainer: str, engines: list[str]) -> str:
    if args.weight_transport != "auto":
        return args.weight_transport
    if args.rollout_engine_urls:
        return "disk"  # an engine we did not start may be on another machine
    if trainer == "cpu":
        return "shm"
    return "cuda_ipc" if all(e == trainer for e in engines) else "disk"


def place(args, model_dir: Path, run_dir: Path) -> Placement:
    if args.rollout_backend == "vllm":
        from vime.engine.vllm import place_vllm

        return place_vllm(args, model_dir, run_dir)
    trainer = trainer_device(args)
    if args.rollout_engine_urls:
        urls = list(args.rollout_engine_urls)
        for u in urls:
            EngineClient(u).health()  # an unreachable engine fails now, with its URL, not mid-run
        return Placement(trainer, [], urls, choose_transport(args, trainer, []))
    devices = engine_devices(args, trainer)
    dtype = "float32" if trainer == "cpu" else "bfloat16"
    engines = []
    try:
        for i, dev in enumerate(devices):
            extra = ["--max-num-seqs", str(args.engine_max_num_seqs), "--seed", str(args.rollout_seed + i)]
            if args.engine_num_kv_blocks:
                extra += ["--num-kv-blocks", str(args.engine_num_kv_blocks)]
            log.info("starting engine %d on %s (log: %s)", i, dev, run_dir / f"engine{i}.log")
            engines.append(launch_engine(str(model_dir), device=dev, dtype=dtype, extra_args=extra, log_path=run_dir / f"engine{i}.log"))
    except BaseException:
        for e in engines:
            e.shutdown()
        raise
    urls = [e.url for e in engines]
    return Placement(trainer, devices, urls, choose_transport(args, trainer, devices), engines)
