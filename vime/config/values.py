"""Reading a value as its flag does, from the command line or from YAML (`coerce`), and reading
a YAML file of settings (`load_yaml`): what parse_args, --config, --custom-config-path and
--eval-config share."""

from __future__ import annotations

import difflib
import json
import types
import typing
from collections.abc import Collection
from pathlib import Path
from typing import Any

import yaml

from vime.config.schema import FIELDS, FLAGS, HINTS
from vime.errors import ConfigError


def base_type(tp: Any) -> Any:
    """`int | None` → int; keeps list/dict/bool/str/float."""
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0]
    return tp


def takes_none(tp: Any) -> bool:
    """Whether a field of this type may be None (`int | None`): YAML's null is its "not set"."""
    is_union = isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union
    return tp is Any or (is_union and type(None) in typing.get_args(tp))


def coerce(name: str, value: Any) -> Any:
    """Turn a YAML or CLI value into the field's type, or raise a one-line ConfigError."""
    tp = base_type(HINTS[name])
    flag = "--" + name.replace("_", "-")
    sep = FIELDS[name].metadata["sep"]
    if value is None:
        if not takes_none(HINTS[name]):  # `lr: null` reached the checks as None and raised a TypeError there
            raise ConfigError(
                f"{flag}: null is no value for it: give {_KINDS.get(tp, tp.__name__)}, or leave the key out for its "
                f"default ({FIELDS[name].default!r})"
            )
        return None
    try:
        # YAML hands over typed values, the command line strings: a YAML value is taken only where
        # its string would be (`rollout_batch_size: 4.7` used to become 4, `save: true` "True")
        if isinstance(value, bool) and tp is not bool:
            raise ValueError(value)
        if tp is int and isinstance(value, float) and not value.is_integer():
            raise ValueError(value)
        if tp is str and not isinstance(value, (str, int)):
            raise ValueError(value)
        if tp is bool:
            if isinstance(value, bool):
                return value
            if str(value).lower() in ("1", "true", "yes", "on"):
                return True
            if str(value).lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(value)
        if tp is list and isinstance(value, list) and FIELDS[name].metadata["nargs"]:
            if len(value) != 1:  # several values on the command line (or a YAML list): each one item
                return [_maybe_int(v) if isinstance(v, str) and sep else v for v in value]
            value = value[0]  # one value: a JSON list, a comma-separated list or one item
        if tp in (dict, list):
            if isinstance(value, tp):
                return value
            if isinstance(value, (dict, list)):  # `rollout_stop: {a: 1}` became the stop string "{'a': 1}"
                raise ValueError(value)
            text = str(value).strip()
            if tp is list and text and not text.startswith("["):
                if sep is None:
                    return [text]
                return [_maybe_int(v.strip()) for v in text.split(sep) if v.strip()]
            parsed = json.loads(text) if text else tp()
            if not isinstance(parsed, tp):
                raise ValueError(value)
            return parsed
        return tp(value)
    except (ValueError, TypeError, json.JSONDecodeError):
        raise ConfigError(f"{flag}: cannot read {value!r} as {_KINDS.get(tp, tp.__name__)}") from None


_KINDS = {
    dict: "a JSON object",
    list: "a JSON list or comma-separated values",
    int: "a whole number",
    float: "a number",
    bool: "true or false",
    str: "text (quote it in a YAML file)",
}


def _maybe_int(s: str) -> Any:
    try:
        return int(s)
    except ValueError:
        return s


class UniqueKeyLoader(yaml.SafeLoader):
    """safe_load, except that a key given twice in one mapping is an error: YAML lets the last one
    win, and a run file with `lr` twice trained with whichever came second, unsaid."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if isinstance(key, str) and key in seen:
                raise ConfigError(f"'{key}' is given twice (lines {seen[key]} and {line}): keep one")
            if isinstance(key, str):
                seen[key] = line
        return super().construct_mapping(node, deep)


def load_yaml(
    path: str | Path,
    extras: dict[str, Any] | None = None,
    what: str = "config file",
    foreign: Collection[str] = (),
) -> dict[str, Any]:
    """The settings of a YAML file, each read as its flag is. `extras` (--custom-config-path):
    where keys that are no vime setting go, instead of being refused; `what` names the file's
    kind in errors; `foreign`: the names of the run's dialect's flags (slime's: vime/compat/),
    kept apart in `slime_flags`."""
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"{what} {p} not found")
    try:
        data = yaml.load(p.read_text(encoding="utf-8"), Loader=UniqueKeyLoader) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{what} {p} is not valid YAML: {str(e).splitlines()[0]}") from None
    except ConfigError as e:
        raise ConfigError(f"{what} {p}: {e}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{what} {p} is not UTF-8 text ({e.reason} at byte {e.start}): save it as UTF-8") from None
    except OSError as e:
        raise ConfigError(f"{what} {p} cannot be read ({e.strerror or e})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{what} {p} must hold a mapping of flag names to values")
    out: dict[str, Any] = {"slime_flags": {}, "vllm_args": {}}
    given: dict[str, Any] = {}
    for key, value in data.items():
        name = str(key).replace("-", "_")
        if name in given:  # rollout-batch-size and rollout_batch_size: one flag
            raise ConfigError(f"{what} {p}: '{given[name]}' and '{key}' are one flag: keep one")
        given[name] = key
        if name in ("slime_flags", "vllm_args") and isinstance(value, dict):  # as a run's config.yaml records them
            out[name].update(value)
            continue
        if name in foreign:
            out["slime_flags"][name] = value
            continue
        if name.startswith("vllm_"):
            out["vllm_args"][str(key)[len("vllm-") :]] = value
            continue
        if FIELDS.get(name) is not None and name not in FLAGS:
            if extras is not None:
                raise ConfigError(f"{what} {p}: '{key}' is derived by vime, not a setting: remove it")
            continue  # a derived value of a run's config.yaml: derived again
        if name not in FIELDS and extras is not None:
            extras[str(key)] = value
            continue
        if name not in FIELDS:
            close = difflib.get_close_matches(name, list(FIELDS), n=1)
            hint = f" (did you mean {close[0].replace('_', '-')}?)" if close else ""
            raise ConfigError(f"{what} {p}: unknown key '{key}'{hint}")
        if value is None and extras is not None and not takes_none(HINTS[name]):
            continue  # --custom-config-path's null: slime's "not set" (mis.yaml's rs_lower_bound: null)
        out[name] = coerce(name, value)
    return {k: v for k, v in out.items() if v != {} or k not in ("slime_flags", "vllm_args")}
