"""`--launcher local`: engines as processes on this machine (each backend's `place`), trainer
ranks spawned here by `launch_actor` itself (or started by torchrun)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vime.backends import Backend
    from vime.backends.placement import Placement
    from vime.backends.settings import PlacementConfig


class LocalLauncher:
    name = "local"

    def chosen_by_auto(self, settings: PlacementConfig) -> bool:
        return True  # the last row of the table: what auto means when no other launcher claims the run

    def place_engines(
        self, backend: Backend, settings: PlacementConfig, model_dir: str, run_dir: Path, seed: int
    ) -> Placement:
        return backend.load(backend.place)(settings, model_dir, run_dir, seed)

    def rank_starter(self) -> None:
        return None
