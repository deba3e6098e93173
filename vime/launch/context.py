"""What an assembled run holds: its frozen config and its live objects (`assemble` builds it).

The config is settings only, and fixed; everything a run starts or opens is here, and closed
here: engines and their clients, the rollout runtime, the trainer, the weight pusher, the
plug-in services of its dialect, the data source and rewards. Plug-ins reach the live ones
through `args` (a `PluginArgs`), as slime's did through its mutated namespace.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vime.dialect import dialect_of
from vime.rollout import async_loop

if TYPE_CHECKING:
    from vime.backends import Backend
    from vime.backends.placement import Placement
    from vime.config import Config
    from vime.dialect import PluginServices
    from vime.launch.launcher import Launcher
    from vime.launch.mps import Mps
    from vime.plugin_args import PluginArgs
    from vime.rollout.data.source import DataSource
    from vime.rollout.rewards import Rewards
    from vime.rollout.runtime import RolloutRuntime
    from vime.startup import StartupClock
    from vime.trainer.actor import Actor
    from vime.trainer.distributed import DistributedActor
    from vime.transport.push import WeightPusher

log = logging.getLogger("vime")


@dataclass
class RunContext:
    """One run's (or one `vime eval`'s) live objects. Fields left None are not part of this kind
    of run: evaluation has no trainer, data source or rewards; --debug-rollout-only no trainer;
    --debug-train-only no engine."""

    cfg: Config  # frozen
    run_dir: Path
    tokenizer: Any
    backend: Backend
    launcher: Launcher
    placement: Placement | None = None
    runtime: RolloutRuntime | None = None
    args: PluginArgs | None = None  # what plug-ins and rollout functions are handed
    actor: Actor | DistributedActor | None = None  # the trainer; DistributedActor on rank 0 of several
    pusher: WeightPusher | None = None
    services: PluginServices | None = None  # what the run's dialect serves its plug-ins (slime's router)
    data_source: DataSource | None = None
    rewards: Rewards | None = None  # its grading pool starts with the first sample
    rollout_fn: Callable[..., Any] | None = None
    custom_advantages: Callable[..., Any] | None = None  # --custom-advantage-function-path
    startup: StartupClock | None = None  # the phases before step 1, logged by the run
    mps: Mps | None = None  # --gpu-sharing mps: the run's MPS daemon, stopped after everything else

    def close(self) -> None:
        """Each part closed even if an earlier one fails, so no engine or rank outlives the run:
        the fully-async worker first (it stops generating), the engines last."""
        steps: list[Callable[[], object]] = []
        if self.services is not None:
            steps.append(self.services.stop)
        if self.runtime is not None:
            steps.append(self.runtime.close)
        if self.pusher is not None:
            steps.append(self.pusher.close)
        steps.append(async_loop.cancel_all)
        steps.append(dialect_of(self.cfg).close_run)  # what its plug-ins left open
        if self.rewards is not None:
            steps.append(self.rewards.close)
        if "vime.rollout.tools.workers" in sys.modules:  # a user's tools ran in worker processes
            steps.append(_close_tool_workers)
        if self.actor is not None:
            steps.append(self.actor.close)
        if self.placement is not None:
            steps.append(self.placement.shutdown)
        if self.mps is not None:  # its clients are gone by now
            steps.append(self.mps.close)
        for step in steps:
            try:
                step()
            except Exception:
                log.exception("while closing the run (%s)", getattr(step, "__qualname__", step))


def _close_tool_workers() -> None:
    from vime.rollout.tools.workers import close_all

    close_all()
