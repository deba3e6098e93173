"""The launchers, one row each: what `--launcher` may name, and what each refuses of the settings.

A launcher (`vime/launch/launcher.py`'s `Launcher`: `local.py`, `ray.py`) places a run's engines
and its trainer ranks 1..N-1. Its row here is plain data, like a backend's (`vime.backends`), so
`vime.config` reads the flag's choices, its help and the checks a launcher asks for without
importing `vime.launch`, which sits above the config (it assembles runs from it);
`vime.launch.launcher.LAUNCHERS` makes each row's `Launcher`, in the same order. A new launcher
is one file holding its class and one row here. `--launcher auto` takes the first row whose
launcher's `chosen_by_auto` says yes; the last row, local, always does.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class LauncherRow:
    name: str  # --launcher's value
    what: str  # for --help
    cls: str  # "module:Class": the Launcher
    auto: str  # for --help: when --launcher auto picks it
    # what the launcher cannot do, each refused at validation in one line naming it as `shown`:
    launches_only: bool = False  # engines given by --rollout-engine-urls
    colocates: bool = True  # --colocate (engines on the trainer's GPUs)
    needs: str | None = None  # a package it imports, and how to install it
    install: str = ""
    shown: str = ""  # the launcher's name in those lines


LAUNCHER_ROWS: dict[str, LauncherRow] = {
    row.name: row
    for row in [
        LauncherRow(
            "ray",
            "actors the Ray cluster places, one placement-group bundle each, on any of its nodes; the cluster of "
            "RAY_ADDRESS, or the job's",
            cls="vime.launch.ray:RayLauncher",
            auto="inside a Ray job whose cluster has more than one node (when the engines can be placed there)",
            launches_only=True,
            colocates=False,
            needs="ray",
            install="pip install ray (or make install-ray)",
            shown="Ray",
        ),
        LauncherRow("local", "processes on this machine", cls="vime.launch.local:LocalLauncher", auto="else"),
    ]
}


def launcher_checks(c: Any) -> list[tuple[bool, str]]:
    """The (bad, message) checks of `--launcher NAME` on the settings `c` (the placement component's
    `launcher`, `rollout_engine_urls`, `colocate`); none for auto, which picks a launcher that can."""
    row = LAUNCHER_ROWS.get(c.launcher)
    if row is None:
        return []
    return [
        (
            row.launches_only and bool(c.rollout_engine_urls),
            f"--launcher {row.name} launches engines, --rollout-engine-urls uses running ones: give one of the two",
        ),
        (
            not row.colocates and c.colocate,
            f"--colocate puts the engines on the trainer's GPUs, which {row.shown} does not place: use --launcher local",
        ),
        (
            # checked here, or the first use of the package (placing the engines, after the trainer loaded) was a traceback
            row.needs is not None and importlib.util.find_spec(row.needs) is None,
            f"--launcher {row.name} needs {row.needs} in this environment: {row.install}, or use --launcher local",
        ),
    ]


def launcher_help() -> str:
    """--launcher's help, from the rows."""
    rows = list(LAUNCHER_ROWS.values())
    return (
        "where launched engines and trainer ranks 1..N-1 run: "
        + " or ".join(f"{r.name} ({r.what})" for r in rows)
        + ". Trainer rank 0 is the run's own process either way. auto: "
        + ", ".join(f"{r.name} {r.auto}" if r.auto != "else" else f"else {r.name}" for r in rows)
    )
