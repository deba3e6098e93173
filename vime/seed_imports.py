"""`slime.*` imports in plug-ins load vime's modules of the same path, where slime is not installed.

The seed system (vLLM's vime) began as slime and renamed its package; some of its example files
still import the old names (search-r1's `from slime.rollout.vllm_rollout import GenerateState`,
`slime.utils.http_utils`, `slime.utils.types`). Those names are the seed's plug-in API, which vime
has under `vime.*` (docs/plugin-compat.md). `install()` puts a finder on `sys.meta_path` that
answers `slime.X` with the module `vime.X`, the same module object, so a class imported under
either name is one class. It stands aside when a real `slime` package is importable: a
machine with slime installed keeps it. A `slime.X` that vime lacks fails as an import of that
name, which plugins.py reports in one line.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from types import ModuleType

ALIAS, TARGET = "slime", "vime"


class _Loader(importlib.abc.Loader):
    """Hands the import system vime's module for a slime name; its own attributes stay vime's."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.own_spec: importlib.machinery.ModuleSpec | None = None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = importlib.import_module(self.target)
        self.own_spec = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        # the import system has just set the alias's spec on the module: vime's stays its spec
        module.__spec__ = self.own_spec


class _SlimeAlias(importlib.abc.MetaPathFinder):
    def find_spec(
        self, fullname: str, path: object = None, target: object = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != ALIAS and not fullname.startswith(ALIAS + "."):
            return None
        vime_name = TARGET + fullname[len(ALIAS) :]
        try:
            found = importlib.util.find_spec(vime_name)
        except ModuleNotFoundError:  # its parent is no package of vime's
            return None
        if found is None:
            return None
        return importlib.machinery.ModuleSpec(
            fullname, _Loader(vime_name), is_package=found.submodule_search_locations is not None
        )


def install() -> None:
    """Answer `slime.*` imports with vime's modules, unless a real slime is installed (once)."""
    if any(isinstance(f, _SlimeAlias) for f in sys.meta_path) or ALIAS in sys.modules:
        return
    real = importlib.machinery.PathFinder.find_spec(ALIAS)
    if real is not None and real.origin is not None:  # a `slime/` folder without __init__ (a clone's parent) is none
        return
    sys.meta_path.insert(0, _SlimeAlias())


def installed_slime() -> str | None:
    """Where a real slime package is, when it stands in for the alias (`slime.*` is then slime's,
    not vime's); None where the alias answers."""
    if any(isinstance(f, _SlimeAlias) for f in sys.meta_path):
        return None
    module = sys.modules.get(ALIAS)
    if module is not None:
        return getattr(module, "__file__", None) or repr(module)
    real = importlib.machinery.PathFinder.find_spec(ALIAS)
    return real.origin if real is not None else None
