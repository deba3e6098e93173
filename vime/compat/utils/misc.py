"""`from vime.utils.misc import load_function` (and slime's `slime.utils.misc`): a dotted path to
the function it names, and `exec_command`, which slime's Python launchers run their shell steps with."""

from __future__ import annotations

import subprocess
from collections.abc import Callable

from vime.compat.utils.external_utils.downloads import download_command
from vime.plugins import load_function as _load


def load_function(path: str) -> Callable:
    """`pkg.module.func` (or `pkg.module:func`) imported; a path that does not load is one line
    (ConfigError) naming it, as vime's own flags report theirs."""
    return _load(path, "load_function")


def exec_command(cmd: str, capture_output: bool = False) -> str | None:
    """slime's: `cmd` run by bash, echoed first, a failure raised (CalledProcessError); the output
    returned when captured. One `hf download REPO --local-dir DIR` is vime's (downloads.py): a DIR
    with files is used as it is, and offline the launcher stops in one line naming DIR."""
    print(f"EXEC: {cmd}", flush=True)
    if download_command(cmd):
        return "" if capture_output else None
    try:
        result = subprocess.run(["bash", "-c", cmd], check=True, capture_output=capture_output, text=capture_output)
    except subprocess.CalledProcessError as e:
        if capture_output:
            print(f"{e.stdout=} {e.stderr=}")
        raise
    return result.stdout if capture_output else None


__all__ = ["exec_command", "load_function"]
