"""Several held-out sets in one run: each set is evaluated with a copy of the run's settings
carrying its overrides (`args_for`), so every part of evaluation (data keys, chat template,
sampling, a custom generate function reading `args.eval_*`) sees that set's values without
knowing there are several. The sets themselves are read at validation (vime/config/eval_sets.py).

Metrics: one set logs what a run always logged (`eval/accuracy`, ...); with several, each set's
go under `eval/<name>/`, and `eval/accuracy`, `eval/correct`, `eval/total` and `eval/time` are
of all the sets' samples together, so everything that reads them (`vime report`, bench/) reads
a run of several sets too.
"""

from __future__ import annotations

import copy
import re
from typing import Any

from vime.plugin_args import PluginArgs

__all__ = ["METADATA_KEY", "args_for", "grading_line", "set_accuracies", "summary"]

# a set's key merged into every sample's metadata (slime's inject_metadata), so rewards and
# generate functions see them; vime/config/eval_sets.py reads it from a set, `args_for` skips it
METADATA_KEY = "metadata_overrides"

_ACCURACY_RE = re.compile(r"^eval/([^/]+)/accuracy$")


def args_for(args: Any, eval_set: dict[str, Any]) -> Any:
    """A shallow copy of the run's settings with the set's overrides (the live runtime shared);
    a plug-in's `args` stays one (`PluginArgs.with_settings`), so a custom generate's eval calls
    each write into a view of their own, as in training."""
    overrides = {f: copy.deepcopy(v) for f, v in eval_set.items() if f not in ("name", "path", METADATA_KEY)}
    if isinstance(args, PluginArgs):
        return args.with_settings(**overrides)
    a = copy.copy(args)
    a.runtime = args.runtime  # a copy drops it (Config.__getstate__ keeps live objects out of pickles)
    for field, value in overrides.items():
        setattr(a, field, value)
    return a


def set_accuracies(metrics: dict[str, Any]) -> dict[str, float]:
    """{set name: accuracy} of a metrics row of several sets ({} for one set)."""
    out = {}
    for key, value in metrics.items():
        m = _ACCURACY_RE.match(key)
        if m:
            out[m.group(1)] = value
    return out


def summary(metrics: dict[str, Any]) -> str:
    """The eval part of the progress line: `0.450`, or `0.450 (aime 0.300 gsm8k 0.600)` with several sets."""
    per_set = set_accuracies(metrics)
    text = f"{metrics['eval/accuracy']:.3f}"
    if per_set:
        text += " (" + " ".join(f"{name} {acc:.3f}" for name, acc in per_set.items()) + ")"
    return text


def grading_line(cfg: Any) -> str | None:
    """The start-up line naming the rule that grades each held-out set, and where it comes from
    (`EvalConfig.rule`): `eval graded by deepscaler's rule (the run's --rm-type)`, or with several
    sets `eval graded by: aime deepscaler (its rm_type), gsm8k math (--eval-rm-type)`. None: no set."""
    sets = cfg.eval.eval_sets
    if not sets:
        return None
    rm_type, parts = cfg.rollout.rm_type, []
    for eval_set in sets:
        rule = args_for(cfg, eval_set).eval.rule(rm_type)
        if "eval_rm_type" in eval_set:
            why = "its rm_type" if len(sets) > 1 else "the set's rm_type"
        elif cfg.eval.eval_rm_type:
            why = "--eval-rm-type"
        elif cfg.rollout.custom_rm_path:
            why = "--custom-rm-path scores training only; --eval-rm-type picks eval's rule"
        elif rule == rm_type:
            why = "the run's --rm-type"
        else:
            why = f"--rm-type {rm_type} is no rule of answers; --eval-rm-type picks one"
        parts.append((eval_set["name"], rule, why))
    own = " (a reward the custom generate sets counts first)" if cfg.rollout.custom_generate_function_path else ""
    if len(parts) == 1:
        _, rule, why = parts[0]
        return f"eval graded by {rule}'s rule ({why}){own}"
    return "eval graded by: " + ", ".join(f"{name} {rule} ({why})" for name, rule, why in parts) + own
