"""`from vime.utils.misc import load_function`: a dotted path to the function it names."""

from __future__ import annotations

from collections.abc import Callable

from vime.plugins import load_function as _load


def load_function(path: str) -> Callable:
    """`pkg.module.func` (or `pkg.module:func`) imported; a path that does not load is one line
    (ConfigError) naming it, as vime's own flags report theirs."""
    return _load(path, "load_function")


__all__ = ["load_function"]
