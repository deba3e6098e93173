"""The placement's settings, `cfg.placement`: each declared once here, below the config (which reads
the backends' table), with its type, default and flag help (vime/setting.py). Where trainer and
engines run, how many engines, how they are reached and probed, how weights are pushed to them,
and the `--vllm-NAME` flags of the vLLM servers vime starts (`vllm_args`). Plain data: the config
imports it without torch."""

from __future__ import annotations

from dataclasses import dataclass

from vime.backends import BACKENDS, TRANSPORTS
from vime.launchers import LAUNCHER_ROWS, launcher_help
from vime.setting import PASSTHROUGH, Component, setting


@dataclass
class PlacementConfig(Component):
    # --- placement and engines ---
    colocate: bool = setting(
        False, "trainer and engine share devices (engine releases memory while training)", group="placement"
    )
    actor_num_nodes: int = setting(1, "trainer nodes", group="placement")
    actor_num_gpus_per_node: int = setting(1, "trainer GPUs per node", group="placement")
    rollout_num_gpus: int | None = setting(None, "GPUs for rollout engines (default: 1 engine)", group="placement")
    rollout_num_gpus_per_engine: int = setting(1, "GPUs per engine (vLLM's tensor parallel size)", group="placement")
    rollout_num_engines: int | None = setting(
        None,
        "engines to launch (default: --rollout-num-gpus / --rollout-num-gpus-per-engine on GPUs, 1 on CPU)",
        group="placement",
    )
    rollout_backend: str = setting(
        "vime",
        "rollout engine: " + "; ".join(f"{b.name}, {b.what}" for b in BACKENDS.values()),
        tuple(BACKENDS),
        group="placement",
    )
    rollout_engine_urls: list = setting(
        [], "use running engines at these URLs instead of launching (JSON list or comma-separated)", group="placement"
    )
    device: str = setting("auto", "trainer device: auto, cpu, cuda", ("auto", "cpu", "cuda"), group="placement")
    launcher: str = setting("auto", launcher_help(), ("auto", *LAUNCHER_ROWS), group="placement")
    engine_max_num_seqs: int = setting(256, "max sequences the engine runs at once", group="placement")
    engine_num_kv_blocks: int | None = setting(
        None, "KV-cache blocks per engine (default: engine's choice)", group="placement"
    )
    engine_kv_cache_memory_fraction: float | None = setting(
        None,
        "GPU: the share of the memory free once an engine's weights are loaded that its KV cache takes "
        "(default: 0.5; --engine-num-kv-blocks, where given, sizes it instead)",
        group="placement",
    )
    engine_quantization: str | None = setting(
        None,
        "opt-in: fp8 runs the built-in engines' layer projections in FP8 (weights quantized per channel when they "
        "arrive, activations per token; embeddings, lm_head and the trainer stay in the model dtype): fewer weight bytes "
        "a decode step, though not yet faster on an H200 (bench/RESULTS.md); the engines sample from a slightly different "
        "policy than the trainer scores, so pair "
        "it with an off-policy correction such as --use-tis; GPUs need compute capability 8.9+ (Ada, Hopper)",
        ("fp8",),
        group="placement",
    )
    gpu_sharing: str = setting(
        "time-slice",
        "how a trainer and the engines it launches on its GPU share it: time-slice, by turns (the driver's default); mps, "
        "their kernels side by side through CUDA MPS (a daemon of the run's own, stopped at its end, or the one already "
        "running; where MPS cannot start, one line says why and the run goes on time-sliced). On one H100, fully-async "
        "stepped in 0.63 s time-sliced and 0.75 s under MPS (generation slowed more than training gained: bench/RESULTS.md)",
        ("time-slice", "mps"),
        group="placement",
    )
    mps_trainer_sm_percent: int = setting(
        100,
        "under MPS, the share of the GPU's SMs the trainer may use (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE)",
        group="placement",
    )
    mps_engine_sm_percent: int = setting(
        100, "under MPS, the share of the GPU's SMs each built-in engine may use", group="placement"
    )
    update_weights_interval: int = setting(1, "push weights to the engines every K steps", group="placement")
    weight_transport: str = setting(
        "auto",
        "how weights reach engines; auto picks per engine: cuda_ipc on the trainer's GPU, nccl on another GPU, shm for a CPU engine here, gloo otherwise",
        TRANSPORTS,
        group="placement",
    )
    update_weight_buffer_size: int = setting(
        512 * 1024**2, "bytes per bucket when weights are gathered and broadcast", group="placement"
    )
    update_weights_timeout: float = setting(
        120.0,
        "seconds a weight push, or joining the weight group, may take before the run stops with the engine's URL",
        group="placement",
    )
    rollout_health_check_interval: float = setting(
        10.0,
        "seconds between /health probes of an engine while requests wait on it; 0: no probes (a request then waits up to its own 600 s timeout)",
        group="placement",
    )
    rollout_health_check_timeout: float = setting(
        30.0,
        "seconds a probe waits: an engine silent this long is gone, its requests go to the other engines (it is restarted if the run launched it), or the run stops in one line when none is left; also the most an engine may take to answer a pause, continue or abort, past which it is gone too",
        group="placement",
    )
    check_weight_push: bool = setting(
        True,
        "after every push, compare a checksum of each weight the engines got with the trainer's; a mismatch stops the run",
        group="placement",
    )
    update_weights_master_address: str | None = setting(
        None,
        "an address of the trainer's machine that engines on other hosts can reach (nccl/gloo rendezvous); default: loopback, which suffices while every engine runs here",
        group="placement",
    )
    actor_num_procs: int = setting(
        1, "CPU only: trainer processes (gloo), to run multi-rank training without GPUs", group="placement"
    )
    api_key: str | None = setting(
        None,
        "token of engines given by --rollout-engine-urls that were started with --api-key (sent as Authorization: Bearer; default $VIME_API_KEY); engines vime starts get a fresh one per run",
        group="placement",
    )
    # --- pass-through: collected by parse_args from flags vime has no field for ---
    vllm_args: dict = setting(
        {},
        "every --vllm-NAME VALUE flag as {NAME: VALUE} (True for a bare switch): the arguments of the vLLM servers vime starts",
        group=PASSTHROUGH,
    )
