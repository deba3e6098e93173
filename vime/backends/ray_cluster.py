"""Joining the Ray cluster and reserving room in it, for the engines (`ray_actors.py`) and the
trainer ranks (`vime/launch/ray_ranks.py`) that `--launcher ray` places there."""

from __future__ import annotations

import logging
import os
import socket
from pathlib import Path
from typing import Any

from vime.errors import ConfigError

READY_S = 120.0  # for the cluster to make room for the engines' or ranks' bundles
ROOT = str(Path(__file__).resolve().parents[2])  # this vime, for the actors' imports


def join_cluster() -> Any:
    """This process joins its Ray cluster: the job's, or RAY_ADDRESS's, or a local one started
    with `ray start --head`. A one-line error when there is none."""
    try:
        import ray
    except ImportError:
        raise ConfigError(
            "--launcher ray needs ray in this environment: pip install ray (or make install-ray)"
        ) from None
    if not ray.is_initialized():
        address = os.environ.get("RAY_ADDRESS") or "auto"
        try:
            if ":" in address and "://" not in address:  # host:port: Ray would retry it for minutes
                host, port = address.rsplit(":", 1)
                socket.create_connection((host, int(port)), timeout=5).close()
            ray.init(address=address, logging_level=logging.WARNING, log_to_driver=False)
        except (ConnectionError, OSError) as e:
            raise ConfigError(
                f"--launcher ray found no Ray cluster to join at {address} ({' '.join(str(e).split())[:160]}): "
                "start one with `ray start --head`, or set RAY_ADDRESS"
            ) from None
    return ray


def reserve(bundle: dict[str, float], n: int, name: str, what: str, remedy: str) -> Any:
    """A placement group of `n` such bundles packed onto as few nodes as fit, once the cluster has
    made room for it; a one-line error naming the cluster's resources when it has none within
    READY_S (`what`: the bundles' use, `remedy`: what to lower)."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    group = placement_group([bundle] * n, strategy="PACK", name=name)
    try:
        ray.get(group.ready(), timeout=READY_S)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(group)
        raise ConfigError(
            f"the Ray cluster has no room for {n} {what} of {bundle} within {READY_S:g} s (it has "
            f"{ray.cluster_resources()}): {remedy}"
        ) from None
    return group
