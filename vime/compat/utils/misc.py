"""`from vime.utils.misc import load_function` (and slime's `slime.utils.misc`): a dotted path to
the function it names, `exec_command`, which slime's Python launchers run their shell steps with,
and `SingletonMeta`, which rollout modules copied from slime's sglang_rollout import for their
state class."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from typing import Any, ClassVar

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


class SingletonMeta(type):
    """slime's metaclass of one instance per class: the first call's arguments build it, later
    calls get it back (`clear_instances` forgets them all)."""

    _instances: ClassVar[dict[type, Any]] = {}

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        if cls not in SingletonMeta._instances:
            SingletonMeta._instances[cls] = super().__call__(*args, **kwargs)
        return SingletonMeta._instances[cls]

    def clear_instances(cls) -> None:
        SingletonMeta._instances.clear()


__all__ = ["SingletonMeta", "exec_command", "load_function"]
