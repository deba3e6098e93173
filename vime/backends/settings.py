"""The placement room's settings, `cfg.placement` (one of the per-room sub-configs of
vime/config/rooms.py): declared here, below the config, because vime/config/ reads the backends'
table (`BACKENDS`) and the placement code (vime/backends/placement.py, each backend's `place`,
the launchers) takes this type. Plain data: the config imports it without torch."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PlacementConfig:
    """Where trainer and engines run, how many engines, how they are reached and probed, and how
    weights are pushed to them. Besides those: `rollout_seed` (engine i is seeded with it + i)
    and `vllm_args` (the `--vllm-NAME` flags of the vLLM servers vime starts)."""

    colocate: bool
    actor_num_nodes: int
    actor_num_gpus_per_node: int
    rollout_num_gpus: int | None
    rollout_num_gpus_per_engine: int
    rollout_num_engines: int | None
    rollout_backend: str
    rollout_engine_urls: list
    device: str
    launcher: str
    engine_max_num_seqs: int
    engine_num_kv_blocks: int | None
    engine_quantization: str | None
    gpu_sharing: str
    mps_trainer_sm_percent: int
    mps_engine_sm_percent: int
    update_weights_interval: int
    weight_transport: str
    update_weight_buffer_size: int
    update_weights_timeout: float
    rollout_health_check_interval: float
    rollout_health_check_timeout: float
    check_weight_push: bool
    update_weights_master_address: str | None
    actor_num_procs: int
    api_key: str | None
    rollout_seed: int
    vllm_args: dict
