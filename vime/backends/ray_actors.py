"""A backend's engines as Ray actors (`--launcher ray`): what every backend's `ray_place`
(`vime/backends/builtin/place.py`, `vime.backends.vllm.place.place_vllm_ray`) shares.

Each engine gets one bundle of a placement group (`{"CPU": 1}`, plus its GPUs,
--rollout-num-gpus-per-engine, when the trainer runs on GPUs), packed onto as few nodes as the
cluster allows. In its bundle an actor, `EngineHost`, starts the engine server on its node with
the backend's launcher (`launch_engine` for the built-in engine, `launch_vllm` for vLLM),
listening on every address of the node, its log at the run's `engine<i>.log`, and answers with
the URL other nodes reach it at. `place_actors` is the part every backend shares; each backend's
`place_ray` gives it its launcher, arguments and facts. From there the run treats it as any
launched engine: the weight transport follows from where the engine reports it runs
(`placement.choose_transports`: gloo or nccl to another host, whose rendezvous address is this
node's IP unless --update-weights-master-address says otherwise), and an engine that dies is
started again by the runtime (`Placement.relaunch`), here as a new actor in the same bundle,
then re-synced by the next push.

The server watches its actor (`--parent-pid`): a killed actor, or a lost node, takes the engine
with it, and the run sees that as an engine failure, named by its node's address.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

from vime.backends.placement import Placement, fresh_path, launch_all, placed, trainer_device
from vime.backends.ray_cluster import ROOT, join_cluster, reserve
from vime.backends.settings import PlacementConfig
from vime.errors import EngineError
from vime.transport.group import apply_gpu_safe_env

log = logging.getLogger("vime")


class EngineHost:
    """The Ray actor (made remote in `place_actors`): one engine server on its node."""

    def start(self, launcher: str, kwargs: dict) -> dict:
        """Start the server with `launcher` ("module:function", returning an object with `url`
        and `shutdown()`), listening on every address of the node."""
        import importlib

        import ray

        module, name = launcher.split(":")
        self.proc = getattr(importlib.import_module(module), name)(host="0.0.0.0", **kwargs)
        ip = ray.util.get_node_ip_address()
        port = self.proc.url.rsplit(":", 1)[1]
        return {"url": f"http://{ip}:{port}", "node": socket.gethostname(), "ip": ip}

    def stop(self) -> None:
        self.proc.shutdown()


class RayEngine:
    """A launched engine as the Placement holds it (`url`, `shutdown`): its actor behind it."""

    def __init__(self, actor: Any, info: dict) -> None:
        self.actor = actor
        self.url: str = info["url"]
        self.node: str = info["node"]

    def shutdown(self) -> None:
        import ray

        try:
            ray.get(self.actor.stop.remote(), timeout=15)
        except Exception as e:  # an actor already gone (killed, its node lost) has nothing to stop
            log.debug("stopping the engine actor at %s: %s", self.url, e)
        ray.kill(self.actor, no_restart=True)


def place_actors(
    settings: PlacementConfig,
    run_dir: Path,
    launcher: str,
    engine_kwargs: Callable[[int, str], dict],
    facts: Callable[[str, str], dict],
    label: str,
    substitute: dict[str, str] | None = None,
) -> Placement:
    """Engines as Ray actors: a placement group of one bundle per engine, an `EngineHost` actor
    in each (all started at once) running `launcher(host=..., api_key=..., log_path=...,
    **engine_kwargs(i, device))`, then what every placement ends with (`placed`: each engine's
    `facts(url, api_key)`, its transport, `substitute`d where the backend lacks one, and the
    rendezvous address)."""
    ray = join_cluster()  # first: without ray it says so in one line
    from ray.util.placement_group import remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    apply_gpu_safe_env()
    trainer = trainer_device(settings)
    gpus = 0 if trainer == "cpu" else settings.rollout_num_gpus_per_engine
    n = settings.rollout_num_engines or (max(1, (settings.rollout_num_gpus or gpus) // gpus) if gpus else 1)
    bundle = {"CPU": 1.0, **({"GPU": float(gpus)} if gpus else {})}
    group = reserve(bundle, n, f"vime-engines-{run_dir.name}", "engine(s)", "add nodes or lower --rollout-num-engines")
    # Ray's own restarts off: one path restarts engines, the runtime's, which also re-syncs them
    host = ray.remote(num_cpus=1, num_gpus=gpus, max_restarts=0)(EngineHost)
    env = {"PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)}
    api_key = settings.api_key or secrets.token_urlsafe(24)  # engines on other nodes listen on every address
    # Ray shows the actor its GPUs as devices 0..gpus-1 (CUDA_VISIBLE_DEVICES)
    device = f"cuda:{','.join(map(str, range(gpus)))}" if gpus else "cpu"

    def launch_one(i: int) -> RayEngine:
        log_path = fresh_path(run_dir / f"engine{i}.log")
        kwargs = dict(engine_kwargs(i, device), api_key=api_key, log_path=str(log_path))
        actor = host.options(
            scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=i),
            runtime_env={"env_vars": env},
            name=f"vime-engine{i}-{secrets.token_hex(3)}",
        ).remote()
        try:
            info = ray.get(actor.start.remote(launcher, kwargs))
        except ray.exceptions.RayError as e:
            ray.kill(actor, no_restart=True)
            cause = getattr(e, "cause", None) or e
            raise EngineError(
                f"{label} {i} did not start in its Ray actor: {' '.join(str(cause).split())[:400]}"
            ) from None
        log.info(
            "%s %d: Ray actor on node %s (%s), %s, log %s", label, i, info["node"], info["ip"], info["url"], log_path
        )
        return RayEngine(actor, info)

    try:
        engines = launch_all(launch_one, n)
    except BaseException:
        remove_placement_group(group)
        raise
    try:
        devices = [f"{e.node}:{device}" for e in engines]  # node: device in its actor
        placement = placed(
            settings,
            trainer,
            devices,
            [e.url for e in engines],
            engines,
            api_key,
            launch_one,
            lambda url: facts(url, api_key),
            label,
            substitute,
            own_address=ray.util.get_node_ip_address(),  # engines on other nodes dial this one
        )
    except BaseException:
        remove_placement_group(group)
        raise
    placement.release = lambda: remove_placement_group(group)
    return placement
