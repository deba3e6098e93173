"""Devices → trainer and engine processes, and how weights travel between them.

The trainer runs in this process (its other ranks are spawned by it or started by torchrun);
engines are launched as subprocesses, or reached by URL with --rollout-engine-urls. Each
engine's weight transport follows from where it sits, as its `/get_model_info` reports it
(host, device, GPU UUID), so engines given by URL are placed as well as launched ones:

| engine                              | transport |
|-------------------------------------|-----------|
| on the trainer's GPU                | cuda_ipc (no copy on the trainer) |
| on another GPU, this host or another| nccl (flat-bucket broadcast; another host needs --update-weights-master-address) |
| on CPU, trainer on CPU, this host   | shm (one safetensors file in /dev/shm) |
| on CPU otherwise                    | gloo (the same broadcast over TCP) |
"""

from __future__ import annotations

import logging
import secrets
import socket
from dataclasses import dataclass, field
from pathlib import Path

import torch

from vime.config import ConfigError
from vime.engine.client import EngineClient
from vime.engine.launch import EngineProcess, launch_engine
from vime.engine.weight_sync import apply_gpu_safe_env

log = logging.getLogger("vime")


@dataclass
class Placement:
    trainer_device: str
    engine_devices: list[str]
    urls: list[str]
    transports: list[str]  # one per engine
    master_address: str = "127.0.0.1"  # where engines reach the trainer's weight-group rendezvous
    engines: list[EngineProcess] = field(default_factory=list)
    api_key: str | None = None  # what the engines' clients send (launched engines get a fresh one)

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


def choose_transports(args, trainer: str, infos: list[dict]) -> list[str]:
    """One transport per engine, from where it runs (see the module docstring); an explicit
    --weight-transport applies to all, checked against where they are."""
    here = socket.gethostname()
    trainer_uuid = (
        str(torch.cuda.get_device_properties(torch.device(trainer)).uuid) if trainer.startswith("cuda") else None
    )
    out = []
    for info in infos:
        local = info.get("hostname") == here
        on_gpu = str(info.get("device", "cpu")).startswith("cuda")
        same_gpu = trainer_uuid is not None and info.get("device_uuid") == trainer_uuid and local
        if args.weight_transport != "auto":
            t = args.weight_transport
            if t == "nccl" and (trainer == "cpu" or not on_gpu or same_gpu):
                where = (
                    "the trainer runs on CPU"
                    if trainer == "cpu"
                    else f"engine at {info['url']} runs on {'the trainer GPU' if same_gpu else info.get('device')}"
                )
                raise ConfigError(
                    f"--weight-transport nccl needs trainer and engine on different GPUs ({where}): leave --weight-transport at auto"
                )
            if t == "cuda_ipc" and not same_gpu:
                raise ConfigError(
                    f"--weight-transport cuda_ipc needs the engine on the trainer's GPU (engine at {info['url']} runs on {info.get('device')}): leave --weight-transport at auto"
                )
            if t == "shm" and not local:
                raise ConfigError(
                    f"--weight-transport shm needs the engine on this host (engine at {info['url']} runs on {info.get('hostname')}): use gloo, nccl or disk"
                )
            out.append(t)
        elif same_gpu:
            out.append("cuda_ipc")
        elif on_gpu and trainer != "cpu":
            out.append("nccl")
        elif not on_gpu and trainer == "cpu" and local:
            out.append("shm")
        else:
            out.append("gloo")
    return out


def master_address(args, infos: list[dict], transports: list[str]) -> str:
    """The address engines dial for the weight-group rendezvous: loopback while they all run
    here, else --update-weights-master-address (a one-line error names the engine when unset)."""
    remote = [
        i for i, t in zip(infos, transports) if t in ("nccl", "gloo") and i.get("hostname") != socket.gethostname()
    ]
    if not remote:
        return args.update_weights_master_address or "127.0.0.1"
    if not args.update_weights_master_address:
        i = remote[0]
        raise ConfigError(
            f"engine at {i['url']} runs on host {i.get('hostname')}: give --update-weights-master-address, an address of this machine that host can reach"
        )
    return args.update_weights_master_address


def place(args, model_dir: Path, run_dir: Path) -> Placement:
    apply_gpu_safe_env()  # NVLink multicast off here and in every process started from here
    if args.rollout_backend == "vllm":
        from vime.engine.vllm import place_vllm

        return place_vllm(args, model_dir, run_dir)
    trainer = trainer_device(args)
    api_key = args.api_key
    if args.rollout_engine_urls:
        urls, devices, engines = list(args.rollout_engine_urls), [], []
    else:
        # engines we start answer only to this run, whatever else can reach 127.0.0.1
        api_key = api_key or secrets.token_urlsafe(24)
        devices = engine_devices(args, trainer)
        dtype = "float32" if trainer == "cpu" else "bfloat16"
        engines = []
        try:
            for i, dev in enumerate(devices):
                extra = ["--max-num-seqs", str(args.engine_max_num_seqs), "--seed", str(args.rollout_seed + i)]
                if args.engine_num_kv_blocks:
                    extra += ["--num-kv-blocks", str(args.engine_num_kv_blocks)]
                log_path = fresh_path(run_dir / f"engine{i}.log")
                log.info("starting engine %d on %s (log: %s)", i, dev, log_path)
                engines.append(
                    launch_engine(
                        str(model_dir), device=dev, dtype=dtype, extra_args=extra, log_path=log_path, api_key=api_key
                    )
                )
        except BaseException:
            for e in engines:
                e.shutdown()
            raise
        urls = [e.url for e in engines]
    try:
        # an unreachable engine fails now, with its URL, not mid-run
        infos = [{**EngineClient(u, timeout=30, api_key=api_key).model_info(), "url": u} for u in urls]
        transports = choose_transports(args, trainer, infos)
        address = master_address(args, infos, transports)
    except BaseException:
        for e in engines:
            e.shutdown()
        raise
    for u, t in zip(urls, transports):
        log.info("engine %s: weights by %s", u, t)
    return Placement(trainer, devices, urls, transports, address, engines, api_key)


def fresh_path(path: Path) -> Path:
    """`path`, or `name.1.ext`, `name.2.ext`, ... if taken: a resumed run keeps the logs of the
    run it resumes."""
    k = 0
    candidate = path
    while candidate.exists():
        k += 1
        candidate = path.with_name(f"{path.stem}.{k}{path.suffix}")
    return candidate
