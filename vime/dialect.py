"""Another framework's surface a run may be written in: its flags that vime keeps no setting for,
the module names its plug-ins import, and the services those plug-ins call.

vime/compat/ is slime's and vllm-project/vime's (`vime.compat.SLIME`). The core asks for it only
through this protocol and never imports it: the entry points (vime/cli.py) hand it to
`vime.config.parse_args`, which keeps it on the config (`cfg.dialect`), and every later stage
asks `dialect_of(cfg)`. Without one, a run speaks vime's own flags only (`PLAIN`).
"""

from __future__ import annotations

import argparse
import difflib
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any, Protocol


class PluginServices(Protocol):
    """What a dialect runs for the plug-ins of one run (slime's: the router its custom generate
    functions post to), started by the run and stopped with it."""

    live: dict[str, Any]  # names plug-ins read on their `args` (the router's address, say)

    def restore(self, samples: list[Any]) -> None:
        """After a custom generate: what its samples lost on the way (their log-probs), put back."""

    def stop(self) -> None: ...


class Dialect(Protocol):
    name: str
    plugin_names: dict[str, Any]  # names every plug-in's `args` has besides the settings (slime's router address)

    @property
    def flags(self) -> Collection[str]:
        """Its flags' names (as settings: `tensor_model_parallel_size`), kept in `cfg.slime_flags`."""
        ...

    def add_arguments(self, parser: argparse.ArgumentParser) -> None: ...

    def unknown_flags_error(self, unknown: list[str], known: list[str]) -> str | None:
        """One message naming every flag of `unknown` neither vime nor the dialect knows (None: none)."""
        ...

    def translate(self, values: dict[str, Any]) -> None:
        """Its flags into vime's settings, in place, where vime has one (a flag given wins), and its
        plug-in paths into the ones vime loads."""
        ...

    def checks(self, cfg: Any) -> list[tuple[bool, str]]:
        """What `Config.validate` refuses of its flags: (condition, one-line error)."""
        ...

    def notes(self, cfg: Any) -> tuple[list[str], list[str]]:
        """Start-up lines saying what vime does with each of its flags given, and those of them
        with no effect (which join vime's own on one line)."""
        ...

    def check_model(
        self, cfg: Any, model_dir: Path, read_config: Callable[[Path], dict], gpu_bytes: int | None
    ) -> list[str]:
        """Refusals of its flags against the checkpoint (a model shape that contradicts it, say)."""
        ...

    def install(self) -> None:
        """Make the names its plug-ins import importable in this process (idempotent)."""

    def explain_import_error(self, e: ImportError) -> str | None:
        """Why a plug-in's import failed, where the dialect knows (a name it lacks), else None."""
        ...

    def plugin_services(self, cfg: Any, runtime: Any) -> PluginServices | None:
        """The services this run's plug-ins need (None: none), started."""
        ...

    def close_run(self) -> None:
        """At the end of a run: what its plug-ins left open (client sessions, say)."""


class Plain:
    """vime's own flags only: nothing foreign is taken, nothing is translated or served."""

    name = "vime"
    flags: frozenset[str] = frozenset()
    plugin_names: dict[str, Any] = {}  # noqa: RUF012 (read only)

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        return None

    def unknown_flags_error(self, unknown: list[str], known: list[str]) -> str | None:
        lines = []
        for tok in unknown:
            if tok.startswith("--"):
                close = difflib.get_close_matches(tok.split("=", 1)[0], known, n=1)
                lines.append(f"  {tok}: not a vime flag" + (f" (did you mean {close[0]}?)" if close else ""))
        return f"unrecognized arguments: {' '.join(unknown)}:\n" + "\n".join(lines) if unknown else None

    def translate(self, values: dict[str, Any]) -> None:
        return None

    def checks(self, cfg: Any) -> list[tuple[bool, str]]:
        return []

    def notes(self, cfg: Any) -> tuple[list[str], list[str]]:
        return [], []

    def check_model(
        self, cfg: Any, model_dir: Path, read_config: Callable[[Path], dict], gpu_bytes: int | None
    ) -> list[str]:
        return []

    def install(self) -> None:
        return None

    def explain_import_error(self, e: ImportError) -> str | None:
        return None

    def plugin_services(self, cfg: Any, runtime: Any) -> PluginServices | None:
        return None

    def close_run(self) -> None:
        return None


PLAIN = Plain()


def dialect_of(cfg: Any) -> Dialect:
    """The dialect a config was parsed in (`PLAIN` for one built without)."""
    return getattr(cfg, "dialect", None) or PLAIN
