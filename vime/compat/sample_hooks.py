"""`from slime.rollout.sample_hooks import apply_rollout_sample_hooks, set_current_rollout_id`:
slime's per-sample hooks, for a rollout or generate of one's own written after slime's
`generate_and_rm`, which runs them on each generated sample before its reward.

The hooks are `args.rollout_sample_hook_path`'s `module.function`s, each
`hook(args, sample, *, rollout_id=None, evaluation=False, ...) -> Sample | None` (sync or async;
a Sample replaces the one given, None keeps it), each given only the keywords it takes. A list of
samples (a group, or a generate's several) keeps its shape. Where no hook is named the value comes
back as it was, as slime's: vime refuses `--rollout-sample-hook-path` on its command line (its own
loop runs no hooks; a custom generate wrapping the run's is vime's way), so only a plug-in that
names its hooks on its args has any.
"""

from __future__ import annotations

import inspect
from typing import Any

from vime.compat.utils.misc import load_function
from vime.rollout.types import Sample

_current_rollout_id: int | None = None


def set_current_rollout_id(rollout_id: int | None) -> None:
    """The rollout the hooks are told of where a caller names none (slime's rollout manager sets it
    before each rollout; a rollout function of one's own sets it from its `rollout_id`)."""
    global _current_rollout_id
    _current_rollout_id = rollout_id


def _taken(hook: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    params = inspect.signature(hook).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return kwargs
    names = {p.name for p in params}
    return {k: v for k, v in kwargs.items() if k in names}


async def _hooked(args: Any, sample: Sample, paths: list[str], kwargs: dict[str, Any]) -> Sample:
    for path in paths:
        hook = load_function(path)
        out = hook(args, sample, **_taken(hook, kwargs))
        if inspect.isawaitable(out):
            out = await out
        if out is None:
            continue
        if not isinstance(out, Sample):
            raise TypeError(f"rollout sample hook {path!r} returned {type(out).__name__}, not a Sample or None")
        sample = out
    return sample


async def apply_rollout_sample_hooks(args: Any, value: Sample | list[Any], **kwargs: Any) -> Sample | list[Any]:
    """Every Sample in `value` (a Sample or nested lists of them) through the hooks, in order."""
    paths = list(getattr(args, "rollout_sample_hook_path", None) or [])
    if not paths:
        return value
    kwargs.setdefault("rollout_id", _current_rollout_id)
    if isinstance(value, Sample):
        return await _hooked(args, value, paths, kwargs)
    if isinstance(value, list):
        return [await apply_rollout_sample_hooks(args, item, **kwargs) for item in value]
    raise TypeError(f"rollout sample hooks take a Sample or a list of them, not {type(value).__name__}")
