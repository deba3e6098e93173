"""How a setting is declared: a dataclass field whose metadata also makes its flag (help,
choices, argparse group, nargs), so a setting's type, default and help are written once."""

from __future__ import annotations

from dataclasses import field
from typing import Any

DERIVED, RUNTIME, PASSTHROUGH = "derived", "runtime", "passthrough"  # field groups that are not flags


def setting(
    default: Any,
    help: str,
    choices: tuple | None = None,
    group: str = "",
    nargs: str | None = None,
    sep: str | None = ",",
) -> Any:
    """A field and its flag. `nargs="+"`: the flag takes several values, as slime's does; `sep`:
    a single value of a list flag is split on it (None: kept whole)."""
    meta = {"help": help, "choices": choices, "group": group, "nargs": nargs, "sep": sep}
    if isinstance(default, (dict, list)):
        return field(default_factory=lambda d=default: type(d)(d), metadata=meta)
    return field(default=default, metadata=meta)
