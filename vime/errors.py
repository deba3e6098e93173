"""The base of every error vime reports as one line (`vime` prints it and exits 2).

Each part raises its own subclass (ConfigError, DataError, EngineError, ...), each also a
subclass of the builtin error it used to be, so callers catching ValueError or RuntimeError
keep working. Anything not a VimeError is a bug, and `vime` shows its traceback.
"""

from __future__ import annotations


class VimeError(Exception):
    """A user's mistake or an outside failure vime can name, in one line with what to do."""


class ConfigError(VimeError, ValueError):
    """Inconsistent or invalid settings; the message is one line saying what to change. Here,
    not in vime.config, so the plug-in loader (which the objectives use, and the config reads
    the objectives' tables) does not import the config."""


class EngineError(VimeError, RuntimeError):
    """An engine that cannot be reached or that refused a request; one line naming its URL. Here,
    not in the engine client, so the weight transports below the backends can raise it too."""
