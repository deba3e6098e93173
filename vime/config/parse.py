"""The command line: a parser generated from the settings (a field's type, default and help are
written once) and `parse_args`: flags > --config YAML > defaults, then validation. The flags of
another framework a run script may carry (slime's: vime/compat/) come with a `Dialect` the entry
point hands in (vime/dialect.py); `--vllm-NAME` flags are collected for the vLLM servers."""

from __future__ import annotations

import argparse
from typing import Any

from vime.config.core import Config
from vime.config.schema import FIELDS, FLAGS, HINTS, default_of
from vime.config.values import base_type, coerce, load_yaml
from vime.dialect import PLAIN, Dialect


def build_parser(prog: str = "train.py", description: str = "", dialect: Dialect = PLAIN) -> argparse.ArgumentParser:
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
    dialect.add_arguments(parser)
    parser.add_argument(
        "--vllm-NAME",
        dest="_vllm_help",
        metavar="VALUE",
        default=argparse.SUPPRESS,
        help="any vLLM engine argument (e.g. --vllm-gpu-memory-utilization 0.5), passed to the vLLM servers vime starts",
    )
    return parser


def _literal(help_text: str) -> str:
    """argparse formats help with `%`: a bare one (a percentage, a default holding one) would
    print a dict of the parser's fields in the middle of the text."""
    return help_text.replace("%", "%%")


def parse_args(
    argv: list[str] | None = None,
    prog: str = "train.py",
    description: str = "",
    entry: str = "sync",
    dialect: Dialect | None = None,
    **overrides: Any,
) -> Config:
    """Flags > --config YAML > dataclass defaults; then validate(entry).

    The `dialect`'s flags (slime's and Megatron's, vime/compat/, its `--sglang-*` family too) land in
    `slime_flags`, `--vllm-*` flags in `vllm_args`; every other flag vime does not know is named in one error (exit 2), each
    with what the dialect knows of it. The config keeps the dialect (`cfg.dialect`)."""
    dialect = dialect or PLAIN
    parser = build_parser(prog, description, dialect)
    parsed, rest = parser.parse_known_args(argv)
    vllm_args, unknown = split_vllm_args(rest)
    taken, unknown = dialect.take_flags(unknown)
    message = dialect.unknown_flags_error(unknown, [o for a in parser._actions for o in a.option_strings])
    if message:  # every flag at once, each with what it is in the dialect: no edit-and-rerun round per flag
        parser.exit(2, f"{parser.prog}: error: {message}\n")
    ns = vars(parsed)
    ns.pop("_vllm_help", None)  # the help line of --vllm-NAME; given literally, argparse took it
    values: dict[str, Any] = {}
    if ns.get("config"):
        values.update(load_yaml(ns.pop("config"), foreign=dialect.flags))
    ns.pop("config", None)
    foreign = {k: ns.pop(k) for k in list(ns) if k in dialect.flags}
    values["slime_flags"] = {**values.get("slime_flags", {}), **taken, **foreign}
    values["vllm_args"] = {**values.get("vllm_args", {}), **vllm_args}
    values.update({k: coerce(k, v) for k, v in ns.items()})
    values.update(overrides)
    dialect.translate(values)
    return Config(**values, dialect=dialect if dialect is not PLAIN else None).validate(entry)


def split_vllm_args(rest: list[str]) -> tuple[dict[str, Any], list[str]]:
    """`--vllm-NAME [VALUE ...]` tokens of what argparse did not know, as {NAME: value}; the
    tokens that are not such a flag come back for argparse's own error."""
    return split_family(rest, "--vllm-")


def split_family(rest: list[str], prefix: str) -> tuple[dict[str, Any], list[str]]:
    """The `PREFIXNAME [VALUE ...]` tokens of `rest` (a family of flags passed through whole:
    vLLM's, a dialect's), as {NAME: value} (a switch: True; several values: a list); the others,
    as they came."""
    out: dict[str, Any] = {}
    unknown: list[str] = []
    i = 0
    while i < len(rest):
        tok = rest[i]
        if not tok.startswith(prefix) or tok == prefix:
            unknown.append(tok)
            i += 1
            continue
        name, eq, inline = tok[len(prefix) :].partition("=")
        values = [inline] if eq else []
        i += 1
        while not eq and i < len(rest) and not rest[i].startswith("--"):
            values.append(rest[i])
            i += 1
        out[name] = True if not values else values[0] if len(values) == 1 else values
    return out, unknown
