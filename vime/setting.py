"""How a setting is declared: once, as a field of its component's settings class, whose metadata
also makes its flag (help, choices, argparse group, nargs), its line in config.yaml and in
`--help`.

Each component declares its settings where it lives, in a `Component` dataclass:
`RolloutConfig` (vime/rollout/settings.py), `AlgorithmConfig` (vime/algorithms/settings.py),
`PlacementConfig` (vime/backends/settings.py), `TrainerConfig`, `EvalConfig` and `OutputConfig`
(vime/config/components.py). The run's flat `Config` is all of them at once (vime/config/schema.py:
the flat names slime's flags and plug-ins use); vime's own code reads a value as
`cfg.<component>.<name>`: a view of that component's fields, made from the flat config
(`Component.view_of`) and frozen.
"""

from __future__ import annotations

import dataclasses
from dataclasses import field
from typing import Any, TypeVar

DERIVED, RUNTIME, PASSTHROUGH = "derived", "runtime", "passthrough"  # field groups that are not flags

C = TypeVar("C", bound="Component")


def setting(
    default: Any,
    help: str,
    choices: tuple | None = None,
    group: str = "",
    nargs: str | None = None,
    sep: str | None = ",",
) -> Any:
    """A field and its flag. `nargs="+"`: the flag takes several values, as slime's does; `sep`:
    a single value of a list flag is split on it (None: kept whole). `group` DERIVED: a value
    validation or start-up sets (no flag; config.yaml records it)."""
    meta = {"help": help, "choices": choices, "group": group, "nargs": nargs, "sep": sep}
    if isinstance(default, (dict, list)):
        return field(default_factory=lambda d=default: type(d)(d), metadata=meta)
    return field(default=default, metadata=meta)


class Component:
    """A component's settings (a dataclass of `setting` fields). Its views are frozen: what a
    component reads of the run cannot be changed under it (a write raises, as the run's frozen
    config does)."""

    @classmethod
    def view_of(cls: type[C], cfg: Any) -> C:
        """The component's own fields read from the run's flat config, frozen."""
        view = object.__new__(cls)
        view.__dict__.update({f.name: getattr(cfg, f.name) for f in dataclasses.fields(cls)})
        view.__dict__["_frozen"] = True
        return view

    def __setattr__(self, name: str, value: Any) -> None:
        if "_frozen" in self.__dict__:
            raise dataclasses.FrozenInstanceError(
                f"{type(self).__name__}.{name}: a component's settings are read-only; a changed setting goes "
                "into a copy of the run's config (Config.derived)"
            )
        object.__setattr__(self, name, value)

    def __delattr__(self, name: str) -> None:
        if "_frozen" in self.__dict__:
            raise dataclasses.FrozenInstanceError(f"{type(self).__name__}.{name}: a component's settings are read-only")
        object.__delattr__(self, name)
