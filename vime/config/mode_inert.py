"""vime's own flags that this run's mode leaves nothing to do, for start-up's "no effect" line
(`preflight.startup_notes`, beside `checks_train.inert_flags`): named, not refused, since a run
script carries its flags from run to run (slime's scripts set eval flags whether or not they
evaluate) and runs as it is; a flag silently without effect would read as one that worked.

By what the run does: evaluation's flags without evaluation, the fully-async worker's in a run
without it, the engines' flags where vime
starts no engine of that kind.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from vime.config.components import EvalConfig
from vime.config.schema import Settings, default_of
from vime.modes import FULLY_ASYNC_FN
from vime.setting import DERIVED

# evaluation's flags: every EvalConfig setting but the one that turns evaluation on
EVAL_ONLY = tuple(
    f.name for f in dataclasses.fields(EvalConfig) if f.metadata["group"] != DERIVED and f.name != "eval_interval"
)
# what only the built-in engines vime starts read
BUILTIN_ENGINE_ONLY = ("engine_kv_cache_memory_fraction",)
# settings that, not given, take another's value (Config.validate): that value is no flag given
FILLED_FROM = {"eval_max_response_len": "rollout_max_response_len"}


def mode_inert_flags(c: Settings) -> list[str]:
    """Each flag given away from its default that this run leaves unread, with why."""
    out = []
    if not c.eval_interval or c.debug_train_only:
        why = "--debug-train-only evaluates nothing" if c.debug_train_only else "no evaluation without --eval-interval"
        out += _given(c, EVAL_ONLY, why)
    if c.rollout_function_path != FULLY_ASYNC_FN:
        out += _given(
            c, ("rollout_concurrency",), f"only the fully-async worker keeps groups in flight; this run is {c.mode}"
        )
    if c.rollout_engine_urls:
        out += _given(
            c, ("engine_max_num_seqs", *BUILTIN_ENGINE_ONLY), "vime starts no engine with --rollout-engine-urls"
        )
    elif c.rollout_backend != "vime":
        out += _given(
            c,
            BUILTIN_ENGINE_ONLY,
            f"the built-in engine's; --rollout-backend {c.rollout_backend} engines take their own",
        )
    return out


def _given(c: Any, names: tuple[str, ...], why: str) -> list[str]:
    out = []
    for name in names:
        value = getattr(c, name)
        if value == default_of(name) or (name in FILLED_FROM and value == getattr(c, FILLED_FROM[name])):
            continue
        shown = (
            ""
            if value is True
            else " "
            + (
                " ".join(map(str, value))
                if isinstance(value, list)
                else json.dumps(value)
                if isinstance(value, dict)
                else str(value)
            )
        )
        out.append(f"--{name.replace('_', '-')}{shown} ({why})")
    return out
