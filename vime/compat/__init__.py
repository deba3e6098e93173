"""Everything shaped by slime and by vllm-project/vime (vLLM's vime, built on slime: the project
this vime started from): their flags, the module names and helpers their plug-ins import, the
router their custom generate functions post to. The core never imports this package
(tests/unit/test_layout.py checks it); the entry points (vime/cli.py) hand it to the core as a
`vime.dialect.Dialect`: `SLIME` (dialect.py). Use `vime.compat.parse_args` where a script's flags
may be slime's.

slime's and Megatron's flags that vime keeps no setting of its own for:

Users bring run scripts written for slime (and for vllm-project/vime, built on it): a `MODEL_ARGS`
block of Megatron's model-shape flags, Megatron's parallel sizes, recompute and kernel switches.
vime trains the HF checkpoint itself with FSDP2, so none of these is a setting here, and none may
be dropped silently either. Each is one row of `FLAGS` that says what vime does with it:

  shape     checked against the checkpoint (config.json, weight names) before anything starts;
            a contradiction is a one-line error naming both values
  parallel  Megatron's model-parallel sizes: vime shards over every actor GPU with FSDP2 instead,
            said in one start-up line; what cannot be honoured is refused
  recompute becomes vime's activation checkpointing
  same      what vime always does: listed once at start-up
  inert     no effect in vime: listed once at start-up, with the reason
  zero      accepted at 0 (what vime does), refused otherwise with the reason

`--vllm-NAME VALUE` flags are collected apart (`Config.vllm_args`): arguments of the vLLM servers
vime starts, listed as having no effect with the built-in engine. docs/slime-flags.md is the
table of every flag of vllm-project/vime's scripts and what vime does with it.

By job: `flags.py` and `absent_flags.py` the tables (`FLAGS`, and `ABSENT`: slime's flags vime does not accept),
`parse.py` the command line (the flags' arguments, the error naming every unknown flag),
`startup.py` what is refused and said of them at start-up, `model.py` the check of the shape flags
and parallel sizes against the checkpoint; `imports.py` the plug-ins' module names,
`vllm_rollout_helpers.py` and `vllm_rollout.py` vllm-project/vime's helpers, `router.py` (with
`answer_log.py`) the route to the engines, `utils/`, `rm_hub/`, `megatron_utils/` its modules of
those paths.
"""

from __future__ import annotations

import importlib

# Names imported on first use (PEP 562): the package itself imports nothing (not even typing), so
# the `slime.*` finder a fresh interpreter installs from vime's .pth file (imports.py) costs no
# aiohttp, torch or typing at start-up
_EXPORTS = {
    **dict.fromkeys(("SLIME", "Slime"), "vime.compat.dialect"),
    **dict.fromkeys(("ABSENT", "ABSENT_DOC", "absent"), "vime.compat.absent_flags"),
    **dict.fromkeys(("FLAGS", "Flag"), "vime.compat.flags"),
    **dict.fromkeys(
        (
            "check_model",
            "fsdp_bytes_per_gpu",
            "memory_refusal",
            "model_facts",
            "parameter_count",
            "shape_contradictions",
            "weight_names",
        ),
        "vime.compat.model",
    ),
    **dict.fromkeys(("add_arguments", "translate", "unknown_flags_error"), "vime.compat.parse"),
    **dict.fromkeys(("checks", "notes"), "vime.compat.startup"),
}

__all__ = [*_EXPORTS, "parse_args"]


def __getattr__(name: str) -> object:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def parse_args(argv: list[str] | None = None, **kwargs: object) -> object:
    """`vime.config.parse_args` in slime's dialect: what a run script's flags mean on vime (the
    run's `Config`)."""
    from vime.compat.dialect import SLIME
    from vime.config import parse_args as parse

    SLIME.install()
    return parse(argv, dialect=SLIME, **kwargs)
