"""Dotted paths to user code (`--rollout-function-path`, `--custom-generate-function-path`,
`--custom-rm-path`, the dynamic sampling filter, the custom advantage, loss and TIS hooks),
loaded one way with one kind of error, and called so that a fault in one is one line naming it.

A plug-in is user code running deep inside a run: its traceback names vime's frames, not the
flag that brought it in, and a wrong answer surfaces later still, as a shape error somewhere
in the trainer. `Plugin` keeps the flag and the path with the function, so whatever goes
wrong in a call (it raised, or answered something vime cannot use) is a `PluginError` saying
which plug-in, on what (the sample or group) and, through `at_step`, in which step.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import importlib
import inspect
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from vime.errors import ConfigError, VimeError
from vime.setting import Component

# vime's on-policy distillation functions (slime's paths of them, `slime.rollout.on_policy_distillation.*`,
# are made these by the slime dialect: vime/compat/)
OPD_REWARD = "vime.rollout.on_policy_distillation.reward_func"
OPD_POST_PROCESS = "vime.rollout.on_policy_distillation.post_process_rewards"


def vime_path(path: str) -> str:
    """`path` as vime compares it: `module:func` spelled `module.func`."""
    return path.replace(":", ".")


class PluginError(VimeError, ValueError):
    """A plug-in that raised, or answered what vime cannot use, in its start-up check or in a
    run: its flag and dotted path, what happened (a raised exception's type and message) and
    on what. `when` ("step 3", or the start-up check) is set by whoever knows it (`at_step`),
    which the call itself often does not. A ValueError, as the shape checks it took over from
    were; not a RuntimeError, which a sharded trainer takes for a sign that a rank has ended
    (`DistributedActor._together`) and would report as that rank's end if one had."""

    def __init__(self, message: str, when: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.when = when

    def __str__(self) -> str:
        return self.message if self.when is None else f"{self.when}: {self.message}"


class SettingWriteError(AttributeError):
    """A plug-in wrote or deleted one of the run's settings on its `args`. An AttributeError (the
    error a frozen attribute raises), not a VimeError, so the call that raised it is named: a
    plug-in's call turns it into a PluginError naming the plug-in, a reward's counts as its error."""

    def __init__(self, name: str) -> None:
        super().__init__(
            f"args.{name}: a setting of the run, read-only in a plug-in (the run's settings are fixed once it "
            "starts): keep your own state under a name vime does not use, or change a copy (copy.deepcopy(args))"
        )


class _ReadOnlyNames(dict):
    """`vars(args)` of a SettingsView: its names as a dict to read; a write to it is refused as a
    write to `args` is, naming the setting (a plain dict would take it and change nothing)."""

    def _refuse(self, key: Any = None, *_: Any, **names: Any) -> Any:
        if isinstance(key, dict):  # update({...})
            key = next(iter(key), None)
        raise SettingWriteError(str(next((x for x in (key, *names, *self) if x is not None), "")))

    __setitem__ = __delitem__ = pop = setdefault = update = _refuse

    def popitem(self) -> Any:
        return self._refuse()

    def clear(self) -> None:
        self._refuse()


class _SealedClass(type):
    """The view's class refuses class attributes: `type(args).lr = 5.0` would otherwise answer
    `args.lr` (a class attribute is found before `__getattr__`) for every view of every run, vime's
    own rollout's included."""

    def __setattr__(cls, name: str, value: Any) -> None:
        raise SettingWriteError(name)

    def __delattr__(cls, name: str) -> None:
        raise SettingWriteError(name)


def _detached(value: Any) -> Any:
    """A setting as a plug-in is handed it: a list, dict or set a copy, a component's view
    (`args.rollout`) a copy whose containers are copies. They were the very objects vime's rollout
    reads: a reward's `args.rollout_stop.append("+")` or `object.__setattr__(args.rollout,
    "rollout_max_response_len", 1)` changed how the run samples from the next call on."""
    if isinstance(value, Component):
        clone = object.__new__(type(value))
        clone.__dict__.update({k: _detached(v) for k, v in vars(value).items()})
        return clone
    if isinstance(value, (list, dict, set)):
        return copy.deepcopy(value)
    return value


class SettingsView(metaclass=_SealedClass):
    """The run's settings as a plug-in is handed them (slime's `args`): every setting, derived
    value and --custom-config-path attribute readable, none writable or deletable (a write or
    `del` is a SettingWriteError naming it). A plug-in that changed `args.lr` used to train the
    run at its value, `del args.lr` at the class default. The view holds slots only: `vars(args)`
    is a copy of its names that refuses writes too. A name that is no setting is the plug-in's own
    to set, read and delete
    (vllm-project/vime's tau-bench keeps its config there); it changes nothing vime reads. A copy
    (`copy.copy`, `copy.deepcopy`) is a writable config of its own, the plug-in's names on it;
    pickled, a view is its settings."""

    __slots__ = ("_config", "_own")

    def __init__(self, config: Any, own: dict[str, Any] | None = None) -> None:
        object.__setattr__(self, "_config", config)
        object.__setattr__(self, "_own", {} if own is None else own)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):  # `vars(args)` would be the config's own __dict__
            raise AttributeError(name)
        own = self._own
        if name in own:
            return own[name]
        return _detached(getattr(self._config, name))

    def __setattr__(self, name: str, value: Any) -> None:
        if hasattr(self._config, name):
            raise SettingWriteError(name)
        self._own[name] = value

    def __delattr__(self, name: str) -> None:
        if name in self._own:
            del self._own[name]
        elif hasattr(self._config, name):
            raise SettingWriteError(name)
        else:
            raise AttributeError(name)

    @property
    def __dict__(self) -> dict[str, Any]:  # type: ignore[override]
        return _ReadOnlyNames(self._names())

    def _names(self) -> dict[str, Any]:
        """Every name the view answers, with its value."""
        config = {k: _detached(v) for k, v in vars(self._config).items() if not k.startswith("_")}
        return {**config, **self._own}

    def __copy__(self) -> Any:
        return self._copied(copy.copy(self._config), dict(self._own))

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        return self._copied(copy.deepcopy(self._config, memo), copy.deepcopy(self._own, memo))

    def __reduce__(self) -> tuple[Any, ...]:
        return copy.copy, (self._config,)

    @staticmethod
    def _copied(config: Any, names: dict[str, Any]) -> Any:
        """A copy of the settings to change, with the names the plug-in set."""
        for name, value in names.items():
            setattr(config, name, value)
        return config


def read_only(args: Any) -> Any:
    """`args` as a plug-in gets it: a view already (a run's `PluginArgs`) as it is, else a view of it."""
    return args if isinstance(args, SettingsView) else SettingsView(args)


@contextlib.contextmanager
def at(when: str) -> Iterator[None]:
    """A PluginError raised in the block says `when` it happened (the innermost `at` wins)."""
    try:
        yield
    except PluginError as e:
        if e.when is None:
            e.when = when
        raise


def at_step(step: int) -> contextlib.AbstractContextManager[None]:
    """`at` a step of the run (1-based, as the metrics rows count them)."""
    return at(f"step {step}")


def first_line(e: BaseException) -> str:
    """An exception's message on one line, short enough for the line it goes into."""
    text = " ".join(str(e).split())
    return text if len(text) <= 300 else text[:297] + "..."


@dataclass(frozen=True)
class Plugin:
    """A loaded plug-in with the flag and dotted path that name it. Calling it calls the
    function; an exception from inside (other than vime's own one-line errors, e.g. an engine's
    from vime code it calls) comes out as a PluginError that keeps the exception's type and
    message, and the exception itself as its cause (`VIME_DEBUG=1` shows its traceback)."""

    fn: Callable[..., Any]
    flag: str
    path: str

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.call("", *args, **kwargs)

    def call(self, where: str, /, *args: Any, **kwargs: Any) -> Any:
        """The call, `where` naming what it was on ("on group 3") in an error."""
        try:
            return self.fn(*args, **kwargs)
        except VimeError:
            raise
        except Exception as e:
            raise self.raised(e, where) from e

    async def acall(self, where: str, /, *args: Any, **kwargs: Any) -> Any:
        """`call` of an async plug-in."""
        try:
            return await self.fn(*args, **kwargs)
        except VimeError:
            raise
        except Exception as e:
            raise self.raised(e, where) from e

    def raised(self, e: BaseException, where: str = "") -> PluginError:
        return self.error(f"raised {type(e).__name__}: {first_line(e)} (VIME_DEBUG=1 shows its traceback)", where)

    def error(self, what: str, where: str = "") -> PluginError:
        """'<flag> <path> [where] <what>' as a PluginError."""
        return PluginError(f"{self.flag} {self.path}{' ' + where if where else ''} {what}")

    def takes_keyword(self, name: str) -> bool:
        """Whether the function can be called with the keyword `name` (a parameter of that name,
        or **kwargs): an optional argument vime passes only to those that take it."""
        try:
            params = inspect.signature(self.fn).parameters.values()
        except (TypeError, ValueError):  # a builtin without a signature
            return False
        return any((p.name == name and p.kind != p.POSITIONAL_ONLY) or p.kind == p.VAR_KEYWORD for p in params)

    def check_call(self, signature: str, *args: Any, **kwargs: Any) -> None:
        """Refuse a function that cannot be called the way vime calls it, before it is called."""
        try:
            sig = inspect.signature(self.fn)
        except (TypeError, ValueError):  # a builtin without a signature: its call will tell
            return
        try:
            sig.bind(*args, **kwargs)
        except TypeError as e:
            raise self.error(f"cannot be called as {signature} ({e})") from None


def as_plugin(fn: Callable[..., Any], flag: str) -> Plugin:
    """`fn` as a Plugin; a plain function given in code (tests, a library user) is named by its
    module and name."""
    if isinstance(fn, Plugin):
        return fn
    inner = fn.func if isinstance(fn, functools.partial) else fn
    name = getattr(inner, "__qualname__", type(inner).__qualname__)
    return Plugin(fn, flag, f"{getattr(inner, '__module__', '?')}.{name}")


def load_plugin(
    path: str, flag: str, error: type[VimeError] = ConfigError, signature: str = "a function", shown: str | None = None
) -> Plugin:
    """`load_function` as a Plugin, named by `shown` (the path as the user wrote it) or `path`."""
    return Plugin(load_function(path, flag, error, signature), flag, shown or path)


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
        why = next((w for explain in IMPORT_EXPLAINERS if (w := explain(e)) is not None), None)
        if why is not None:  # a dialect's (vime/compat/: slime's) word on a name of its plug-ins
            raise error(f"{flag} '{path}' {why}") from None
        lacked = _vime_name_lacked(e)
        if lacked is not None:
            raise error(f"{flag} '{path}' imports {lacked}, which vime does not have") from None
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


# What a run's dialect (vime/dialect.py) says of an import its plug-ins' names failed on: filled
# by its `install()` (slime's: vime/compat/), so this module never imports it
IMPORT_EXPLAINERS: list[Callable[[BaseException], str | None]] = []


def _vime_name_lacked(e: BaseException) -> str | None:
    """The `vime.*` module or name an import failed on ("vime.trainer.nope", "Nope from
    vime.rollout.generate"), or None when the failure is elsewhere."""
    if not isinstance(e, ImportError) or not e.name or e.name.split(".")[0] != "vime":
        return None
    if isinstance(e, ModuleNotFoundError):
        return e.name
    text = str(e)
    return f"{text.split(chr(39))[1]} from {e.name}" if text.startswith("cannot import name") else None
