"""Where a run's launched engines and trainer ranks 1..N-1 run (--launcher): one `Launcher` per
row of `vime/launchers.py` (`LAUNCHER_ROWS`, plain data the config reads: the flag's choices and
what each launcher refuses).

A launcher places a backend's engines (each backend row names its placement for each launcher:
`place` here, `ray_place` as Ray actors) and says how trainer ranks beyond rank 0 start; rank 0
is always the run's own process. A new launcher is one file holding a class of this protocol
plus one row of `LAUNCHER_ROWS`; `launcher_for` resolves `--launcher auto`.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from vime.launchers import LAUNCHER_ROWS

if TYPE_CHECKING:
    from vime.backends import Backend
    from vime.backends.placement import Placement
    from vime.backends.settings import PlacementConfig
    from vime.trainer.distributed import RankStarter


class Launcher(Protocol):
    name: str  # --launcher's value

    def chosen_by_auto(self, settings: PlacementConfig) -> bool:
        """Whether --launcher auto means this launcher for this run."""
        ...

    def place_engines(
        self, backend: Backend, settings: PlacementConfig, model_dir: str, run_dir: Path, seed: int
    ) -> Placement:
        """The run's engines launched (or those given by URL checked): where they are and how weights
        reach them. `seed`: --rollout-seed (engine i is seeded with it + i)."""
        ...

    def rank_starter(self) -> RankStarter | None:
        """What starts trainer ranks 1..N-1 (`launch_actor`'s `start_ranks`); None: processes on this machine."""
        ...


def _made(path: str) -> Launcher:
    module, name = path.split(":")
    return getattr(importlib.import_module(module), name)()


LAUNCHERS: dict[str, Launcher] = {name: _made(row.cls) for name, row in LAUNCHER_ROWS.items()}


def launcher_for(settings: PlacementConfig) -> Launcher:
    """--launcher's row (`settings`: the placement component's, `cfg.placement`)."""
    if settings.launcher in LAUNCHERS:
        return LAUNCHERS[settings.launcher]
    # auto: the first row whose `chosen_by_auto` says yes; the last row, local, always does
    return next(launcher for launcher in LAUNCHERS.values() if launcher.chosen_by_auto(settings))
