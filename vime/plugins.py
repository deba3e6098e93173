"""Dotted paths to user code (`--rollout-function-path`, `--custom-generate-function-path`,
`--custom-rm-path`), loaded one way with one kind of error."""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable

from vime.config import ConfigError
from vime.errors import VimeError


def load_function(
    path: str,
    flag: str,
    error: type[VimeError] = ConfigError,
    signature: str = "a function",
    also: tuple[type, ...] = (),
) -> Callable:
    """Import `pkg.module:func` or `pkg.module.func`; a failure is one line of `error` naming the
    flag. The working directory is importable, so a file next to where the user runs vime works.
    An object of a type in `also` is taken too (--tools: a Tool itself, not only a function making one)."""
    module_name, sep, attr = path.partition(":")
    if not sep:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise error(f"{flag} '{path}': give module.path:func or module.path.func")
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except SyntaxError as e:  # the module's own code, not the path: say where
        raise error(f"{flag} '{path}': {e.filename}:{e.lineno}: {e.msg} (fix the module)") from None
    except (ImportError, AttributeError) as e:
        raise error(
            f"{flag} '{path}' cannot be loaded ({type(e).__name__}: {e}): check the module is importable and defines '{attr}'"
        ) from None
    except Exception as e:  # the module raised while it was imported
        first = str(e).splitlines()[0] if str(e) else ""
        raise error(
            f"{flag} '{path}': importing {module_name} raised {type(e).__name__}: {first} (fix the module)"
        ) from None
    if not callable(fn) and not isinstance(fn, also):
        raise error(f"{flag} '{path}' is not callable: it must be {signature}")
    return fn
