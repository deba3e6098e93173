"""The module names slime's and vllm-project/vime's plug-ins import, answered with vime's modules.

* `slime.X` is `vime.X`, where slime is not installed. vllm-project/vime (vLLM's vime) began as
  slime and renamed its package; some of its example files still import the old names
  (search-r1's `from slime.rollout.vllm_rollout import GenerateState`, `slime.utils.types`).
  It stands aside when a real `slime` package is importable: a machine with slime keeps it.
* vllm-project/vime's own paths whose modules live in vime/compat/ (`MOVED`):
  `vime.rollout.vllm_rollout` (its rollout module and plug-in helpers), slime's
  `vime.rollout.sglang_rollout` (`slime.rollout.sglang_rollout`: its default rollout module), `vime.utils.*`
  (with slime's newer `slime.utils.core.*` and `slime.utils.network.*` names of the same modules),
  `vime.rollout.rm_hub`, `vime.backends.megatron_utils`, `vime.rollout.base_types` (what rollout
  functions return), `vime.rollout.filter_hub` (dynamic-sampling filters and their types),
  `vime.rollout.sample_hooks` (slime's per-sample hooks) and `vime.rollout.data_source` (its
  data source names).

`install()` puts one finder on `sys.meta_path` that answers such a name with the same module
object as its target, so a class imported under either name is one class. A name vime lacks fails
as an import of that name, which plugins.py reports in one line (`explain`).

Where it is installed: vime's entry points call `install()` in every process of a run, and the
`vime-slime.pth` file the package ships (pyproject.toml) calls it at every interpreter start-up
where vime is installed, so `python run_simple.py` or `python -c "import slime.utils.types"`
works outside vime's entry points too. Whether `slime.*` is ours is decided at the first import
of `slime`, not at start-up (a slime another .pth puts on the path or behind a finder of its own
still wins), and nothing is imported for it before then: start-up pays for this module alone
(stdlib modules the interpreter already holds; no importlib.abc).
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import sys
from types import ModuleType

ALIAS, TARGET = "slime", "vime"
MOVED = {
    "vime.rollout.vllm_rollout": "vime.compat.vllm_rollout",
    "vime.rollout.sglang_rollout": "vime.compat.sglang_rollout",
    # slime's newer layout sorts its helpers into subpackages (`slime.utils.core.types`,
    # `.core.misc`, `.core.async_utils`, `slime.utils.network.http_utils`): the same modules
    "vime.utils.core": "vime.compat.utils",
    "vime.utils.network": "vime.compat.utils",
    "vime.utils": "vime.compat.utils",
    "vime.rollout.rm_hub": "vime.compat.rm_hub",
    "vime.backends.megatron_utils": "vime.compat.megatron_utils",
    "vime.rollout.base_types": "vime.compat.base_types",
    "vime.rollout.filter_hub": "vime.compat.filter_hub",
    "vime.rollout.sample_hooks": "vime.compat.sample_hooks",
    "vime.rollout.data_source": "vime.compat.data_source",
}


class _Loader:
    """Hands the import system vime's module for a slime name; its own attributes stay vime's (a
    loader by protocol: create_module and exec_module)."""

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


class _Aliases:
    """The finder (by protocol: find_spec). `slime`: whether `slime.*` is ours to answer, settled
    at the first import of `slime` (None until then)."""

    def __init__(self) -> None:
        self.slime: bool | None = None

    def find_spec(
        self, fullname: str, path: object = None, target_path: object = None
    ) -> importlib.machinery.ModuleSpec | None:
        top = fullname.partition(".")[0]
        if top == ALIAS and not self._answers_slime(fullname):
            return None
        name = target(fullname, top == ALIAS)
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

    def _answers_slime(self, fullname: str) -> bool:
        if fullname != ALIAS:  # a submodule: ours where `slime` itself is vime
            module = sys.modules.get(ALIAS)
            return module is not None and module.__name__ == TARGET
        if self.slime is None:
            self.slime = (
                False  # while the other finders are asked: one that asks the import system back finds none here
            )
            self.slime = _real_slime(self) is None
        return self.slime


def _real_slime(ours: object) -> importlib.machinery.ModuleSpec | None:
    """A slime package another finder of this process would import (a path entry, an editable
    install's finder). A `slime/` folder without __init__ (a clone's parent) is no slime."""
    for finder in sys.meta_path:
        if finder is ours or not hasattr(finder, "find_spec"):
            continue
        try:
            spec = finder.find_spec(ALIAS, None)
        except (ImportError, ValueError):
            continue
        if spec is not None and spec.origin is not None and spec.loader is not None:
            return spec
    return None


def install() -> None:
    """Answer the aliases' imports with vime's modules (`slime.*` unless a real slime is
    importable, decided at its first import); once per process. Called by vime's entry points and
    by the `vime-slime.pth` file at start-up."""
    if any(isinstance(f, _Aliases) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _Aliases())


def installed_slime() -> str | None:
    """Where a real slime package is, when it stands in for the alias (`slime.*` is then slime's,
    not vime's); None where the alias answers."""
    module = sys.modules.get(ALIAS)
    if module is not None:
        return None if module.__name__ == TARGET else getattr(module, "__file__", None) or repr(module)
    ours = next((f for f in sys.meta_path if isinstance(f, _Aliases)), None)
    real = _real_slime(ours)
    return real.origin if real is not None else None
