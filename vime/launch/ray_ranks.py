"""Trainer ranks 1..N-1 as Ray actors (`--launcher ray`): the Ray cluster places them.

Rank 0 stays the job's driver, where the run's loop is (`DistributedActor`); the other ranks are
`TrainerRank` actors, one bundle each of a placement group (`{"CPU": 1}`, plus `{"GPU": 1}` on
CUDA), packed onto as few nodes as the cluster allows. Each actor joins the trainer's process
group at the driver's node address and then serves rank 0's calls exactly as a rank that
`torch.multiprocessing` started does (`distributed._serve`), so FSDP2, the loss and the pushes
are the same code whoever started the ranks. A rank's output goes to `trainer<rank>.log` in
the run directory (Ray would keep it in its own session logs).

Watching them: `DistributedActor` asks its ranks what it asks a process (`is_alive`, `join`,
`terminate`, `kill`); `RayRank` answers from the actor's long-running `serve` call, so a rank
that died, or whose node was lost, turns the next collective's error into one line naming the
rank and its node. Ray does not restart them: the run stops, resumable from its last checkpoint
(`--load`).

On GPUs, give the driver its GPU in Ray's books (`ray job submit --entrypoint-num-gpus 1`), or
Ray may place a rank or an engine on the GPU rank 0 already uses.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

from vime.config import Config
from vime.trainer.distributed import TrainerRankError, _init, _serve
from vime.transport.group import GPU_SAFE_ENV

log = logging.getLogger("vime")


class TrainerRank:
    """The Ray actor (made remote in `start_ray_ranks`): one trainer rank."""

    def where(self) -> dict[str, Any]:
        import ray

        return {"node": socket.gethostname(), "ip": ray.util.get_node_ip_address(), "pid": os.getpid()}

    def serve(
        self, rank: int, world: int, init_method: str, args: Config, model_dir: str, device: str, log_path: str
    ) -> None:
        """Join the trainer's group and serve rank 0 until it says close (the actor's whole life)."""
        out = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(out, 1)
        os.dup2(out, 2)
        _init(rank, world, init_method, device, 0)  # Ray shows the actor its own GPU as device 0
        _serve(args, model_dir, "cuda:0" if device.startswith("cuda") else "cpu")


class RayRank:
    """One rank's actor, watched as `DistributedActor` watches a rank's process."""

    def __init__(self, rank: int, actor: Any, served: Any, info: dict[str, Any]) -> None:
        self.rank = rank
        self.actor = actor
        self.served = served  # the `serve` call's result: ready once the rank ended
        self.node: str = info["node"]
        self.ip: str = info["ip"]

    def is_alive(self) -> bool:
        import ray

        ready, _ = ray.wait([self.served], timeout=0)
        return not ready

    def ended_how(self) -> str:
        """Why the rank ended, for `TrainerRankError`'s line."""
        import ray

        try:
            ray.get(self.served, timeout=5)
        except ray.exceptions.RayActorError:
            return f"its Ray actor died on node {self.node} ({self.ip}), or the node was lost"
        except ray.exceptions.RayTaskError as e:
            return f"it failed on node {self.node}: {' '.join(str(e.cause).split())[:200]}"
        except ray.exceptions.GetTimeoutError:
            return f"it is still running on node {self.node}"
        return f"it returned on node {self.node}"

    def join(self, timeout: float | None = None) -> None:
        import ray

        ray.wait([self.served], timeout=30.0 if timeout is None else timeout)  # a killed actor's end comes in seconds

    def terminate(self) -> None:
        import ray

        ray.kill(self.actor, no_restart=True)

    kill = terminate


def start_ray_ranks(
    args: Config, world: int, model_dir: str, device: str, log_dir: Path | None
) -> tuple[list[RayRank], str, Callable[[], None]]:
    """Ranks 1..world-1 as actors in a placement group; returns them, the `init_method` rank 0
    joins with, and what removes the group once the ranks are done (`launch_actor`'s
    `start_ranks` under --launcher ray)."""
    from ray.util.placement_group import remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from vime.backends.ray_cluster import READY_S, ROOT, join_cluster, reserve

    ray = join_cluster()
    gpus = 1 if device.startswith("cuda") else 0
    bundle = {"CPU": 1.0, **({"GPU": 1.0} if gpus else {})}
    group = reserve(
        bundle,
        world - 1,
        f"vime-trainer-{secrets.token_hex(3)}",
        "trainer rank(s)",
        "add nodes or lower --actor-num-nodes / --actor-num-gpus-per-node",
    )
    ip = ray.util.get_node_ip_address()
    with socket.socket() as s:  # a port free on this node, where the others dial rank 0
        s.bind((ip, 0))
        init_method = f"tcp://{ip}:{s.getsockname()[1]}"
    env = {"PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p), **GPU_SAFE_ENV}
    # never restarted: a rank holds a shard of the weights and optimizer state that a new process
    # would not have
    remote = ray.remote(num_cpus=1, num_gpus=gpus, max_restarts=0)(TrainerRank)
    logs = log_dir if log_dir is not None else Path(os.getcwd())
    actors = [
        remote.options(
            scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=rank - 1),
            runtime_env={"env_vars": env},
            name=f"vime-trainer{rank}-{secrets.token_hex(3)}",
        ).remote()
        for rank in range(1, world)
    ]
    ranks = []
    try:
        infos = ray.get([a.where.remote() for a in actors], timeout=READY_S)  # all starting at once
        for rank, (actor, info) in enumerate(zip(actors, infos), start=1):
            log_path = logs / f"trainer{rank}.log"
            served = actor.serve.remote(rank, world, init_method, args, str(model_dir), device, str(log_path))
            log.info("trainer rank %d: Ray actor on node %s (%s), log %s", rank, info["node"], info["ip"], log_path)
            ranks.append(RayRank(rank, actor, served, info))
    except BaseException as e:
        for actor in actors:
            ray.kill(actor, no_restart=True)
        remove_placement_group(group)
        if isinstance(e, ray.exceptions.RayError):
            cause = getattr(e, "cause", None) or e
            raise TrainerRankError(
                f"trainer ranks did not start in their Ray actors: {' '.join(str(cause).split())[:300]}"
            ) from None
        raise
    return ranks, init_method, lambda: remove_placement_group(group)
