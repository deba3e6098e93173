"""The `args` every plug-in and rollout function of a run is handed (slime's rollout signatures
pass only `args`): the read-only view of the run's settings every plug-in gets
(`vime.plugins.SettingsView`: a write or `del` of a setting raises, a name that is no setting is
the plug-in's own), and the run's live objects: `runtime` (the engines' clients, the tokenizer, the
rewards: `vime.rollout.runtime.runtime_of`) and whatever the run's dialect serves its plug-ins
(`vime/dialect.py`: slime's router address, say).
"""

from __future__ import annotations

import copy
from typing import Any

from vime.dialect import PluginServices, dialect_of
from vime.plugins import SettingsView, SettingWriteError


class PluginArgs(SettingsView):
    """A copy (`copy.copy(args)` / `copy.deepcopy(args)`) is a Config of its own to change, still
    holding the live objects. A custom generate gets `for_call()`'s view instead, which takes any
    write for that one call: vllm-project/vime's multi-agent generate stores its tokenizer, sampling
    params and agent settings on `args` on every call before copying it."""

    __slots__ = ("_live", "_mine", "_services")

    def __init__(
        self,
        config: Any,
        runtime: Any,
        services: PluginServices | None = None,
        *,
        live: dict[str, Any] | None = None,
        own: dict[str, Any] | None = None,
        mine: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(config, own)
        if live is None:
            live = {"runtime": runtime, **dialect_of(config).plugin_names, **(services.live if services else {})}
        object.__setattr__(self, "_live", live)
        object.__setattr__(self, "_mine", mine)
        object.__setattr__(self, "_services", services)

    def for_call(self) -> PluginArgs:
        """A view of the same settings, live objects and plug-in names whose writes land in a dict
        of its own, dropped when the call ends, so one call's values never reach another's or the
        run's."""
        return PluginArgs(self._config, None, self._services, live=self._live, own=self._own, mine={})

    def with_settings(self, **changes: Any) -> PluginArgs:
        """The same live objects and plug-in names over a copy of the settings with `changes` (an
        eval set's overrides), so eval's generate calls get their per-call views as training's do."""
        config = copy.copy(self._config)
        for name, value in changes.items():
            setattr(config, name, value)
        return PluginArgs(config, None, self._services, live=self._live, own=self._own)

    def restore(self, samples: list[Any]) -> None:
        """After a custom generate: what its samples lost through the dialect's services (the
        log-probs of an answer a vllm-project/vime plug-in rebuilt by hand), put back."""
        if self._services is not None:
            self._services.restore(samples)

    def __getattr__(self, name: str) -> Any:
        mine = self._mine
        if mine is not None and name in mine:
            return mine[name]
        live = self._live
        if name in live:
            return live[name]
        return super().__getattr__(name)

    def __setattr__(self, name: str, value: Any) -> None:
        if self._mine is not None:
            self._mine[name] = value
        elif name in self._live:
            raise SettingWriteError(name)
        else:
            super().__setattr__(name, value)

    def __delattr__(self, name: str) -> None:
        if self._mine is not None and name in self._mine:
            del self._mine[name]
        elif name in self._live:
            raise SettingWriteError(name)
        else:
            super().__delattr__(name)

    def _names(self) -> dict[str, Any]:
        return {**super()._names(), **self._live, **(self._mine or {})}

    def __copy__(self) -> Any:
        return self._copied(copy.copy(self._config), {**self._live, **self._own, **(self._mine or {})})

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        plugins = copy.deepcopy({**self._own, **(self._mine or {})}, memo)
        return self._copied(copy.deepcopy(self._config, memo), {**self._live, **plugins})
