"""The module names slime's and vllm-project/vime's plug-ins import, answered with vime's modules.

* `slime.X` is `vime.X`, where slime is not installed. vllm-project/vime (vLLM's vime) began as
  slime and renamed its package; some of its example files still import the old names
  (search-r1's `from slime.rollout.vllm_rollout import GenerateState`, `slime.utils.types`).
  It stands aside when a real `slime` package is importable: a machine with slime keeps it.
* vllm-project/vime's own paths whose modules live in vime/compat/ (`MOVED`):
  `vime.rollout.vllm_rollout` (its rollout module and plug-in helpers), `vime.utils.*`,
  `vime.rollout.rm_hub`, `vime.backends.megatron_utils`.

`install()` puts one finder on `sys.meta_path` that answers such a name with the same module
object as its target, so a class imported under either name is one class. A name vime lacks fails
as an import of that name, which plugins.py reports in one line (`explain`).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from types import ModuleType

ALIAS, TARGET = "slime", "vime"
MOVED = {
    "vime.rollout.vllm_rollout": "vime.compat.vllm_rollout",
    "vime.utils": "vime.compat.utils",
    "vime.rollout.rm_hub": "vime.compat.rm_hub",
    "vime.backends.megatron_utils": "vime.compat.megatron_utils",
}


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


def target(name: str, slime: bool = True) -> str | None:
    """The vime module a plug-in's module name stands for (None: no alias of ours); `slime`: whether
    `slime.*` is ours to answer."""
    out = name
    if slime and (name == ALIAS or name.startswith(ALIAS + ".")):
        out = TARGET + name[len(ALIAS) :]
    for old, new in MOVED.items():
        if out == old or out.startswith(old + "."):
            out = new + out[len(old) :]
    return out if out != name else None


class _Aliases(importlib.abc.MetaPathFinder):
    def __init__(self, slime: bool) -> None:
        self.slime = slime

    def find_spec(
        self, fullname: str, path: object = None, target_path: object = None
    ) -> importlib.machinery.ModuleSpec | None:
        name = target(fullname, self.slime)
        if name is None:
            return None
        try:
            found = importlib.util.find_spec(name)
        except ModuleNotFoundError:  # its parent is no package of vime's
            return None
        if found is None:
            return None
        return importlib.machinery.ModuleSpec(
            fullname, _Loader(name), is_package=found.submodule_search_locations is not None
        )


def install() -> None:
    """Answer the aliases' imports with vime's modules (`slime.*` unless a real slime is installed);
    once per process."""
    if any(isinstance(f, _Aliases) for f in sys.meta_path):
        return
    real = importlib.machinery.PathFinder.find_spec(ALIAS)
    # a `slime/` folder without __init__ (a clone's parent) is no slime
    slime = ALIAS not in sys.modules and (real is None or real.origin is None)
    sys.meta_path.insert(0, _Aliases(slime))


def installed_slime() -> str | None:
    """Where a real slime package is, when it stands in for the alias (`slime.*` is then slime's,
    not vime's); None where the alias answers."""
    if any(isinstance(f, _Aliases) and f.slime for f in sys.meta_path):
        return None
    module = sys.modules.get(ALIAS)
    if module is not None:
        return getattr(module, "__file__", None) or repr(module)
    real = importlib.machinery.PathFinder.find_spec(ALIAS)
    return real.origin if real is not None else None
