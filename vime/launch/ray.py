"""`--launcher ray` (`RayLauncher`, made from its row of `vime/launchers.py`): a backend's engines
placed by a Ray cluster as actors (each backend's `ray_place`, through
`vime/backends/ray_actors.py`), and trainer ranks 1..N-1 as actors too (`ray_ranks.py`); joining
the cluster and reserving room in it is `vime/backends/ray_cluster.py`'s. `resolve_launcher` says
what `--launcher auto` means for a run.

The trainer's rank 0 stays in this process (the job's driver); its other ranks are Ray actors
of their own placement group (`vime/launch/ray_ranks.py`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path

from vime.backends import BACKENDS
from vime.backends.placement import Placement, trainer_device
from vime.backends.ray_cluster import join_cluster
from vime.backends.settings import PlacementConfig

log = logging.getLogger("vime")


def resolve_launcher(settings: PlacementConfig) -> str:
    """What `--launcher auto` means for this run: ray inside a Ray job whose cluster has more
    than one node, so a multi-node `ray job submit` places engines and trainer ranks on its
    nodes; local otherwise (one machine keeps vime's own GPU layout, which Ray's books do not
    know: rank 0 holds a GPU they count as free), and where Ray cannot place the engines
    (engines given by URL, --colocate)."""
    from importlib.util import find_spec

    in_job = os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR") is not None
    if not (in_job and not settings.rollout_engine_urls and not settings.colocate and find_spec("ray") is not None):
        return "local"
    ray = join_cluster()
    nodes = sum(1 for n in ray.nodes() if n["Alive"])
    if nodes < 2:
        ray.shutdown()
        return "local"
    if trainer_device(settings) != "cpu" and "CUDA_VISIBLE_DEVICES" not in os.environ:
        # Ray sets it for a job that reserved its GPU (--entrypoint-num-gpus); without that,
        # rank 0's GPU is one Ray's books count as free, for a rank or an engine to land on
        log.info(
            "a Ray job on a cluster of %d nodes, but its driver holds no GPU in Ray's books: --launcher stays local "
            "(submit with --entrypoint-num-gpus 1 for Ray to place engines and trainer ranks on its nodes)",
            nodes,
        )
        ray.shutdown()
        return "local"
    log.info(
        "a Ray job on a cluster of %d nodes: --launcher ray (engines and trainer ranks as Ray actors; "
        "--launcher local keeps them on this machine)",
        nodes,
    )
    return "ray"


class RayLauncher:
    """`--launcher ray`: engines as Ray actors (each backend's `ray_place`, ending in
    `place_actors`), trainer ranks 1..N-1 as Ray actors (`ray_ranks.start_ray_ranks`)."""

    name = "ray"

    def chosen_by_auto(self, settings: PlacementConfig) -> bool:
        """Not for a backend whose row has no Ray placement (`ray_place`), else as `resolve_launcher` says."""
        return BACKENDS[settings.rollout_backend].ray_place is not None and resolve_launcher(settings) == self.name

    def place_engines(self, backend, settings: PlacementConfig, model_dir: str, run_dir: Path, seed: int) -> Placement:
        return backend.load(backend.ray_place)(settings, model_dir, run_dir, seed)

    def rank_starter(self) -> Callable:
        from vime.launch.ray_ranks import start_ray_ranks  # imports the trainer

        return start_ray_ranks
