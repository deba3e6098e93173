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

Each backend's `place` (`vime/backends/<name>/place.py`) launches its engines and ends in
`placed`; what they share is here. They read the placement component's settings, `cfg.placement`
(`PlacementConfig`, vime/backends/settings.py). The launchers (vime/launch/) call each backend's
`place` or `ray_place`.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from vime.backends.settings import PlacementConfig
from vime.errors import ConfigError
from vime.transport import cuda_ipc

log = logging.getLogger("vime")

# in the run directory: the trainer holds its memory (or the run has none), so an engine on its GPU
# may size its KV cache from what is free (Backend.starts_beside_trainer)
TRAINER_READY = "trainer-ready"


class LaunchedEngine(Protocol):
    """An engine a placement started, as it holds it: each backend's launcher returns one (a local
    process, or a Ray actor behind it)."""

    url: str

    def shutdown(self) -> None: ...


@dataclass
class Placement:
    trainer_device: str
    engine_devices: list[str]
    urls: list[str]
    transports: list[str]  # one per engine
    master_address: str = "127.0.0.1"  # where engines reach the trainer's weight-group rendezvous
    engines: list[LaunchedEngine] = field(default_factory=list)
    api_key: str | None = None  # what the engines' clients send (launched engines get a fresh one)
    launch_one: Callable[[int], Any] | None = None  # starts engine i on its device (launched engines only)
    # after the engines: what else the placement holds (a Ray placement group)
    release: Callable[[], None] | None = None
    closed: bool = False

    def relaunch(self, i: int) -> str:
        """Engine i started again on its device, its old process ended first; returns its URL
        (RolloutRuntime restarts engines that died with it)."""
        if self.closed or self.launch_one is None:
            raise RuntimeError("the run launched no engines or has ended")
        self.engines[i].shutdown()
        new = self.launch_one(i)
        if self.closed:  # the run ended while the engine started
            new.shutdown()
            raise RuntimeError("the run ended while the engine started")
        self.engines[i] = new
        self.urls[i] = new.url
        return new.url

    def shutdown(self) -> None:
        self.closed = True
        for e in self.engines:
            e.shutdown()
        self.engines.clear()
        if self.release is not None:
            release, self.release = self.release, None
            release()


def launch_all(launch_one: Callable[[int], Any], n: int) -> list[Any]:
    """Engines 0..n-1 started at once (each takes a while to load; none waits for another); if
    any fails, the others are shut down and its error raised."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max(1, n), thread_name_prefix="vime-launch") as pool:
        futures = [pool.submit(launch_one, i) for i in range(n)]
        errors = [f.exception() for f in futures]
    started = [f.result() for f, e in zip(futures, errors) if e is None]
    failed = [e for e in errors if e is not None]
    if failed:
        for e in started:
            e.shutdown()
        raise failed[0]
    return started


# an MPS client's cap on the SMs it may use (vime/launch/mps.py; --mps-*-sm-percent)
MPS_THREADS_ENV = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"


def trainer_device(settings: PlacementConfig) -> str:
    if settings.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda but no CUDA device is visible: use --device cpu or auto")
    if settings.device == "auto":
        return "cuda:0" if torch.cuda.is_available() else "cpu"
    return "cuda:0" if settings.device == "cuda" else "cpu"


def shares_trainer_gpu(device: str, settings: PlacementConfig) -> bool:
    """An engine on `device` ("cuda:N" or "cuda:N,M") shares a GPU with a trainer rank of this
    node (ranks take cuda:0 up to --actor-num-gpus-per-node)."""
    if not device.startswith("cuda"):
        return False
    indices = [int(d) for d in device.removeprefix("cuda:").split(",")] if ":" in device else [0]
    return any(i < settings.actor_num_gpus_per_node for i in indices)


def engine_devices(settings: PlacementConfig, trainer: str) -> list[str]:
    """One device string per engine: "cuda:N", or "cuda:N,M" for an engine of several GPUs
    (--rollout-num-gpus-per-engine, vLLM's tensor parallelism). Engines take the GPUs after the
    trainer's when there are enough; engines of one GPU otherwise share the trainer's GPUs (two
    processes on one device)."""
    if trainer == "cpu":  # no GPUs to count: --rollout-num-engines, else one
        if settings.rollout_num_gpus_per_engine > 1:
            raise ConfigError(
                f"--rollout-num-gpus-per-engine {settings.rollout_num_gpus_per_engine}: tensor-parallel engines need GPUs; use 1 on CPU"
            )
        return ["cpu"] * (settings.rollout_num_engines or 1)
    per_engine = settings.rollout_num_gpus_per_engine
    n_engines = settings.rollout_num_engines or max(1, (settings.rollout_num_gpus or per_engine) // per_engine)
    n_trainer = 0 if settings.colocate else settings.actor_num_gpus_per_node
    available = torch.cuda.device_count()
    if n_trainer + n_engines * per_engine <= available:
        first = n_trainer
    elif per_engine == 1:
        return [f"cuda:{i % available}" for i in range(n_engines)]
    elif n_engines * per_engine <= available:
        first = 0  # tensor-parallel engines on the trainer's GPUs too
    else:
        raise ConfigError(
            f"{n_engines} engine(s) of {per_engine} GPUs need {n_engines * per_engine} GPUs, {available} are here: "
            "lower --rollout-num-gpus or --rollout-num-gpus-per-engine"
        )
    return ["cuda:" + ",".join(str(first + e * per_engine + g) for g in range(per_engine)) for e in range(n_engines)]


def choose_transports(settings: PlacementConfig, trainer: str, infos: list[dict]) -> list[str]:
    """One transport per engine, from where it runs (see the module docstring); an explicit
    --weight-transport applies to all, checked against where they are."""
    here = socket.gethostname()
    trainer_uuid = cuda_ipc.device_uuid(trainer)
    out = []
    for info in infos:
        local = info.get("hostname") == here
        on_gpu = str(info.get("device", "cpu")).startswith("cuda")
        same_gpu = trainer_uuid is not None and info.get("device_uuid") == trainer_uuid and local
        if settings.weight_transport != "auto":
            t = settings.weight_transport
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


def master_address(
    settings: PlacementConfig, infos: list[dict], transports: list[str], own_address: str | None = None
) -> str:
    """The address engines dial for the weight-group rendezvous: --update-weights-master-address,
    else `own_address` (the launcher's: a Ray node's IP), else loopback while the engines all run
    here (a one-line error names an engine elsewhere)."""
    address = settings.update_weights_master_address or own_address
    remote = [
        i for i, t in zip(infos, transports) if t in ("nccl", "gloo") and i.get("hostname") != socket.gethostname()
    ]
    if not remote:
        return address or "127.0.0.1"
    if not address:
        i = remote[0]
        raise ConfigError(
            f"engine at {i['url']} runs on host {i.get('hostname')}: give --update-weights-master-address, an address of this machine that host can reach"
        )
    return address


def placed(
    settings: PlacementConfig,
    trainer: str,
    devices: list[str],
    urls: list[str],
    engines: list[LaunchedEngine],
    api_key: str | None,
    launch_one: Callable[[int], Any] | None,
    facts: Callable[[str], dict],
    label: str,
    substitute: dict[str, str] | None = None,
    own_address: str | None = None,
) -> Placement:
    """The end of every backend's placement: each engine's facts (`facts(url)`; an unreachable
    or wrong engine fails now, with its URL, not mid-run, and the engines launched are shut
    down), its transport by this module's table (`substitute` swaps in a backend's counterpart
    of a transport it lacks) and the rendezvous address (`master_address`)."""
    try:
        infos = [{**facts(u), "url": u} for u in urls]
        transports = [(substitute or {}).get(t, t) for t in choose_transports(settings, trainer, infos)]
        address = master_address(settings, infos, transports, own_address)
    except BaseException:
        for e in engines:
            e.shutdown()
        raise
    for u, t in zip(urls, transports):
        log.info("%s %s: weights by %s", label, u, t)
    return Placement(trainer, devices, urls, transports, address, engines, api_key, launch_one)


def fresh_path(path: Path) -> Path:
    """`path`, or `name.1.ext`, `name.2.ext`, ... if taken: a resumed run keeps the logs of the
    run it resumes. The name is claimed (created empty, exclusively) before it is returned: two
    processes given one directory at once (two `vime eval` of one run name) used to pick the
    same name, both write it, and keep one result."""
    path.parent.mkdir(parents=True, exist_ok=True)
    k = 0
    candidate = path
    while True:
        try:
            os.close(os.open(candidate, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
            return candidate
        except FileExistsError:
            k += 1
            candidate = path.with_name(f"{path.stem}.{k}{path.suffix}")
