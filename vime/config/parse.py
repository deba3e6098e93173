"""The command line: a parser generated from the settings (a field's type, default and help are
written once) and `parse_args`: flags > --config YAML > defaults, then validation."""

from __future__ import annotations

import argparse
from typing import Any

from vime import compat
from vime.config.core import Config
from vime.config.schema import FIELDS, FLAGS, HINTS, default_of
from vime.config.values import base_type, coerce, load_yaml


def build_parser(prog: str = "train.py", description: str = "") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--config", help="YAML file of settings (keys as flag names, with - or _); flags override it")
    groups: dict[str, argparse._ArgumentGroup] = {}
    for name in FLAGS:
        f = FIELDS[name]
        g = f.metadata["group"]
        grp = groups.setdefault(g, parser.add_argument_group(g))
        flag = "--" + name.replace("_", "-")
        tp = base_type(HINTS[name])
        default = default_of(name)
        if tp is bool:
            grp.add_argument(
                flag,
                action=argparse.BooleanOptionalAction,
                default=argparse.SUPPRESS,
                help=_literal(f.metadata["help"]) + f" (default: {'auto' if default is None else default})",
            )
        else:
            grp.add_argument(
                flag,
                default=argparse.SUPPRESS,
                metavar=tp.__name__.upper(),
                choices=f.metadata["choices"],
                nargs=f.metadata["nargs"],
                help=_literal(f.metadata["help"]) + _literal(f" (default: {default})"),
            )
    compat.add_arguments(parser)
    return parser


def _literal(help_text: str) -> str:
    """argparse formats help with `%`: a bare one (a percentage, a default holding one) would
    print a dict of the parser's fields in the middle of the text."""
    return help_text.replace("%", "%%")


def parse_args(
    argv: list[str] | None = None, prog: str = "train.py", description: str = "", entry: str = "sync", **overrides: Any
) -> Config:
    """Flags > --config YAML > dataclass defaults; then validate(entry).

    slime's and Megatron's flags (vime/compat/) land in `slime_flags`, `--vllm-*` flags in
    `vllm_args`; every other flag vime does not know is named in one error (exit 2), each with
    what it is in slime (`compat.ABSENT`)."""
    parser = build_parser(prog, description)
    parsed, rest = parser.parse_known_args(argv)
    vllm_args, unknown = compat.split_vllm_args(rest)
    message = compat.unknown_flags_error(unknown, [o for a in parser._actions for o in a.option_strings])
    if message:  # every flag at once, each with what it is in slime: no edit-and-rerun round per flag
        parser.exit(2, f"{parser.prog}: error: {message}\n")
    ns = vars(parsed)
    ns.pop("_vllm_help", None)  # the help line of --vllm-NAME; given literally, argparse took it
    values: dict[str, Any] = {}
    if ns.get("config"):
        values.update(load_yaml(ns.pop("config")))
    ns.pop("config", None)
    foreign = {k: ns.pop(k) for k in list(ns) if k in compat.FLAGS}
    values["slime_flags"] = {**values.get("slime_flags", {}), **foreign}
    values["vllm_args"] = {**values.get("vllm_args", {}), **vllm_args}
    values.update({k: coerce(k, v) for k, v in ns.items()})
    values.update(overrides)
    compat.translate(values)
    return Config(**values).validate(entry)
