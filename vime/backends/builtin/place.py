"""The built-in engine's placements: its engines launched here (`place`) or as Ray actors
(`place_ray`), each ended by the helpers every backend shares (`vime/backends/placement.py`,
`vime/backends/ray_actors.py`)."""

from __future__ import annotations

import logging
import secrets
from pathlib import Path
from typing import TYPE_CHECKING

from vime.backends.builtin.launch import EngineProcess, launch_engine
from vime.backends.client import EngineClient
from vime.backends.placement import (
    TRAINER_READY,
    Placement,
    engine_devices,
    fresh_path,
    launch_all,
    placed,
    shares_trainer_gpu,
    trainer_device,
)
from vime.backends.ray_actors import place_actors
from vime.transport.group import apply_gpu_safe_env

if TYPE_CHECKING:
    from vime.backends.settings import PlacementConfig

log = logging.getLogger("vime")


def place(settings: PlacementConfig, model_dir: Path, run_dir: Path, seed: int) -> Placement:
    """The built-in engine's placement (its row in `vime/backends/__init__.py`): launch one engine per device
    (or check the ones at --rollout-engine-urls) and pick how weights reach each."""
    apply_gpu_safe_env()  # NVLink multicast off here and in every process started from here
    trainer = trainer_device(settings)
    api_key = settings.api_key
    if settings.rollout_engine_urls:
        urls, devices, engines = list(settings.rollout_engine_urls), [], []
        launch_one = None
    else:
        # engines we start answer only to this run, whatever else can reach 127.0.0.1
        api_key = api_key or secrets.token_urlsafe(24)
        devices = engine_devices(settings, trainer)
        dtype = "float32" if trainer == "cpu" else "bfloat16"

        def launch_one(i: int) -> EngineProcess:  # type: ignore[no-redef]
            # one on a trainer's GPU sizes its KV cache after the trainer holds its memory (assemble)
            gate = run_dir / TRAINER_READY if shares_trainer_gpu(devices[i], settings) else None
            log_path = fresh_path(run_dir / f"engine{i}.log")  # a restarted engine keeps its earlier log
            log.info("starting engine %d on %s (log: %s)", i, devices[i], log_path)
            return launch_engine(
                str(model_dir),
                device=devices[i],
                dtype=dtype,
                extra_args=engine_args(settings, i, seed),
                log_path=log_path,
                api_key=api_key,
                gate=gate,
                sm_percent=settings.mps_engine_sm_percent,
            )

        engines = launch_all(launch_one, len(devices))
        urls = [e.url for e in engines]

    def facts(url: str) -> dict:
        return EngineClient(url, timeout=30, api_key=api_key).model_info()

    return placed(settings, trainer, devices, urls, engines, api_key, launch_one, facts, "engine")


def engine_args(settings: PlacementConfig, i: int, seed: int) -> list[str]:
    """The server flags of engine i (`vime/engine/server.py`) from the run's --engine-* settings;
    `seed`: --rollout-seed, engine i's is seed + i."""
    extra = ["--max-num-seqs", str(settings.engine_max_num_seqs), "--seed", str(seed + i)]
    if settings.engine_num_kv_blocks:
        extra += ["--num-kv-blocks", str(settings.engine_num_kv_blocks)]
    if settings.engine_kv_cache_memory_fraction is not None:
        extra += ["--kv-cache-memory-fraction", str(settings.engine_kv_cache_memory_fraction)]
    if settings.engine_quantization:
        extra += ["--quantization", settings.engine_quantization]
    return extra


def place_ray(settings: PlacementConfig, model_dir: Path, run_dir: Path, seed: int) -> Placement:
    """The built-in engine's placement on a Ray cluster (its row in `vime/backends/__init__.py`)."""
    dtype = "float32" if trainer_device(settings) == "cpu" else "bfloat16"

    def engine_kwargs(i: int, device: str) -> dict:
        return dict(model_path=str(model_dir), device=device, dtype=dtype, extra_args=engine_args(settings, i, seed))

    def facts(url: str, api_key: str) -> dict:
        return EngineClient(url, timeout=30, api_key=api_key).model_info()

    return place_actors(settings, run_dir, "vime.backends.builtin.launch:launch_engine", engine_kwargs, facts, "engine")
