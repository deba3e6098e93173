"""Several held-out sets in one run, read at validation: slime's `--eval-prompt-data NAME PATH
NAME PATH ...` and `--eval-config` YAML (`resolve`, which `Config.validate` calls).

The sets become `Config.eval_sets`: one dict per set with its name, its path and the settings it
overrides, as the Config fields they override (`eval_temperature`, `eval_limit`, ...);
vime/eval_sets.py evaluates a set with a copy of the run's settings carrying them.

slime's eval YAML (its `slime/utils/eval_config.py`) is `eval: {defaults: {...}, datasets:
[...]}` (or the same mapping at the root; `datasets` a list of mappings with a `name`, or a
mapping of name to settings). A set's own key wins over `defaults`, which wins over the flags.
Keys of slime's format that vime has no counterpart for, unknown keys and bad values are each
one line naming the file, the set and the key: a setting read wrongly would change what the
accuracy means without a sign.
"""

from __future__ import annotations

import difflib
import math
import re
from pathlib import Path
from typing import Any

import yaml

from vime.config.values import UniqueKeyLoader, coerce
from vime.errors import ConfigError
from vime.eval_sets import METADATA_KEY

# slime's per-set key -> the Config field it overrides for that set
KEYS: dict[str, str] = {
    "limit": "eval_limit",  # vime's: slime's format has no per-set limit
    "n_samples_per_eval_prompt": "n_samples_per_eval_prompt",
    "temperature": "eval_temperature",
    "top_p": "eval_top_p",
    "top_k": "eval_top_k",
    "max_response_len": "eval_max_response_len",
    "rm_type": "eval_rm_type",
    "input_key": "eval_input_key",
    "label_key": "eval_label_key",
    "tool_key": "tool_key",
    "metadata_key": "metadata_key",
    "apply_chat_template": "apply_chat_template",
    "apply_chat_template_kwargs": "apply_chat_template_kwargs",
    "stop": "rollout_stop",
    "stop_token_ids": "rollout_stop_token_ids",
}
# slime's eval rm types that vime does not grade, and why: said in the refusal
RM_TYPES_NOT_IN_VIME: dict[str, str] = {
    "ifbench": "IFBench's instruction checkers, which slime clones from GitHub at run time; vime does not have them",
    "f1": "token-overlap F1 of a short answer; vime's rules grade one answer right or wrong",
    "remote_rm": "eval grades by rule only; --rm-type remote_rm scores training samples",
    "random": "a coin flip, for slime's tests",
}
# keys of slime's format that vime has no counterpart for: refused, never ignored
NOT_IN_VIME: dict[str, str] = {
    "custom_rm_path": "vime grades eval by rm type rules only (rm_type)",
    "custom_generate_function_path": "eval uses the run's --custom-generate-function-path",
    "multimodal_keys": "vime trains text models only",
    "min_new_tokens": "vime's engines have no minimum length",
    "repetition_penalty": "vime's eval samples without a repetition penalty",
    "skip_special_tokens": "responses are always decoded without special tokens",
    "no_stop_trim": "a stop string is always kept in the response",
    "app_service": "eval generates on the run's engines",
    "eval_task_timeout": "eval has no per-sample timeout",
    "min_eval_samples": "every sample of a set is evaluated (limit bounds them)",
    "eval_early_stop_remaining": "eval has no early stop",
    "eval_early_stop_idle_timeout": "eval has no early stop",
    "message_processor": "no per-set message processors",
    "reward_model": "no per-set reward models",
    "remote_environment": "no per-set environments",
}
# each overridable number's bound, checked per set as the flags' are (a NaN fails every one)
_BOUNDS: dict[str, tuple[Any, str]] = {
    "limit": (lambda v: v >= 1, "give at least 1"),
    "n_samples_per_eval_prompt": (lambda v: v >= 1, "give at least 1"),
    "temperature": (lambda v: v >= 0, "must be >= 0 (0 = greedy)"),
    "top_p": (lambda v: 0 < v <= 1, "must be in (0, 1]"),
    "top_k": (lambda v: v >= -1, "must be -1 or 0 (off) or a positive count"),
    "max_response_len": (lambda v: v >= 1, "give at least 1"),
}
_NAME_RE = re.compile(r"[A-Za-z0-9_.+-]+")  # a metric path segment: no '/', no spaces


def resolve(cfg: Any) -> list[dict[str, Any]]:
    """The run's held-out sets from --eval-config or --eval-prompt-data: [{"name", "path",
    **overridden fields}]; [] when it has none. Raises a one-line ConfigError."""
    if isinstance(cfg.eval_prompt_data, str):  # a Config built in Python with one path
        cfg.eval_prompt_data = [cfg.eval_prompt_data]
    if cfg.eval_config is not None and cfg.eval_prompt_data:
        raise ConfigError("--eval-config and --eval-prompt-data both name the held-out sets: give one")
    if cfg.eval_config is not None:
        sets, where = _read_config(Path(cfg.eval_config)), f"--eval-config {cfg.eval_config}"
    elif cfg.eval_prompt_data:
        sets, where = _pairs(cfg.eval_prompt_data, cfg.eval_name), "--eval-prompt-data"
    else:
        return []
    names = [s["name"] for s in sets]
    twice = sorted({n for n in names if n is not None and names.count(n) > 1})
    if twice:
        raise ConfigError(f"{where}: the set name {twice[0]} is given twice: name each set once")
    return sets


def _pairs(values: list[str], lone_name: str | None) -> list[dict[str, Any]]:
    """slime's `--eval-prompt-data`: PATH, or NAME PATH pairs."""
    if len(values) == 1:
        return [{"name": _name(lone_name, "--eval-name") if lone_name else None, "path": values[0]}]
    if lone_name is not None:
        raise ConfigError(
            "--eval-name names a lone --eval-prompt-data PATH, and NAME PATH pairs name their sets: drop --eval-name"
        )
    if len(values) % 2:
        raise ConfigError(
            f"--eval-prompt-data {' '.join(values)}: give PATH, or NAME PATH pairs ({len(values)} values is not pairs)"
        )
    return [{"name": _name(values[i], "--eval-prompt-data"), "path": values[i + 1]} for i in range(0, len(values), 2)]


def _name(name: Any, where: str) -> str:
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
        raise ConfigError(
            f"{where}: the set name {name!r} cannot be a metric name (eval/<name>/accuracy): use letters, digits, _ . + -"
        )
    return name


def _read_config(path: Path) -> list[dict[str, Any]]:
    where = f"--eval-config {path}"
    if not path.is_file():
        raise ConfigError(f"{where}: no such file")
    try:
        data = yaml.load(path.read_text(encoding="utf-8"), Loader=UniqueKeyLoader)
    except yaml.YAMLError as e:
        raise ConfigError(f"{where} is not valid YAML: {str(e).splitlines()[0]}") from None
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None
    except (UnicodeDecodeError, OSError) as e:
        raise ConfigError(f"{where} cannot be read as UTF-8 text ({e})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{where} must hold a mapping: eval: {{defaults: ..., datasets: [...]}}")
    body = data.get("eval", data)
    _only(data, {"eval"} if "eval" in data else {"defaults", "datasets"}, where)
    if not isinstance(body, dict):
        raise ConfigError(f"{where}: eval must be a mapping of defaults and datasets")
    _only(body, {"defaults", "datasets"}, f"{where}: eval")
    defaults = body.get("defaults") or {}
    if not isinstance(defaults, dict):
        raise ConfigError(f"{where}: eval.defaults must be a mapping of settings")
    defaults = {str(k): v for k, v in defaults.items()}
    _check_keys(defaults, f"{where}: eval.defaults", allow=())
    raw = body.get("datasets")
    if isinstance(raw, dict):  # name -> settings
        raw = [
            {"name": name, **(settings or {})} if isinstance(settings, dict) or settings is None else settings
            for name, settings in raw.items()
        ]
    if not isinstance(raw, list) or not raw:
        raise ConfigError(f"{where} defines no sets: list them under eval.datasets (each with a name and a path)")
    out = []
    for i, entry in enumerate(raw):
        if not isinstance(entry, dict):
            raise ConfigError(f"{where}: eval.datasets[{i}] must be a mapping with a name and a path")
        entry = {str(k): v for k, v in entry.items()}
        if "name" not in entry:
            raise ConfigError(
                f"{where}: eval.datasets[{i}] has no name: every set needs one (its metrics are eval/<name>/...)"
            )
        name = _name(entry["name"], f"{where}: eval.datasets[{i}]")
        here = f"{where}: set {name}"
        _check_keys(entry, here, allow=("name", "path"))
        if not isinstance(entry.get("path"), str) or not entry["path"]:
            raise ConfigError(f"{here} has no path: give the file of its prompts")
        out.append({"name": name, "path": entry["path"], **_settings({**defaults, **entry}, here)})
    return out


def _only(mapping: dict, allowed: set[str], where: str) -> None:
    extra = [str(k) for k in mapping if k not in allowed]
    if extra:
        raise ConfigError(f"{where}: unknown key '{extra[0]}' (this level holds only {', '.join(sorted(allowed))})")


def _check_keys(entry: dict[str, Any], where: str, allow: tuple[str, ...]) -> None:
    known = [*KEYS, METADATA_KEY, *allow]
    for key, value in entry.items():
        if key in NOT_IN_VIME:
            raise ConfigError(
                f"{where}: slime's key '{key}' has no counterpart in vime ({NOT_IN_VIME[key]}): remove it"
            )
        if key not in known:
            close = difflib.get_close_matches(key, known, n=1)
            hint = f" (did you mean {close[0]}?)" if close else f" (known: {', '.join(known)})"
            raise ConfigError(f"{where}: unknown key '{key}'{hint}")
        if isinstance(value, str) and "${" in value:
            raise ConfigError(
                f"{where}: {key} {value!r} is an OmegaConf interpolation, which vime does not expand: write the value out"
            )


def _settings(entry: dict[str, Any], where: str) -> dict[str, Any]:
    """The set's keys as the fields they override, each read as its flag is, then bounded."""
    from vime.rollout.rewards.grading import BUILTIN_RM_TYPES

    out: dict[str, Any] = {}
    for key, value in entry.items():
        if key in ("name", "path") or value is None:
            continue
        if key == METADATA_KEY:
            if not isinstance(value, dict):
                raise ConfigError(f"{where}: {METADATA_KEY} must be a mapping (merged into each sample's metadata)")
            out[METADATA_KEY] = value
            continue
        field = KEYS[key]
        try:
            value = coerce(field, value)
        except ConfigError as e:  # "--eval-top-p: cannot read 'x' as a number": said with the YAML key
            raise ConfigError(f"{where}: {key}:{str(e).split(':', 1)[1]}") from None
        check = _BOUNDS.get(key)
        if check is not None and not (math.isfinite(value) and check[0](value)):
            raise ConfigError(f"{where}: {key} {value} {check[1]}")
        # as the flags' (checks_common.py): the engine refused a set's 'x' at its first request, mid-run
        if key == "stop_token_ids" and any(type(t) is not int or t < 0 for t in value):
            raise ConfigError(f"{where}: stop_token_ids {value}: every id must be a whole number >= 0")
        if key == "stop" and any(not isinstance(s, str) or not s for s in value):
            raise ConfigError(f"{where}: stop {value}: every stop string must be non-empty text")
        if key == "rm_type" and value not in BUILTIN_RM_TYPES:
            why = f" ({RM_TYPES_NOT_IN_VIME[value]})" if value in RM_TYPES_NOT_IN_VIME else ""
            raise ConfigError(f"{where}: rm_type {value!r}{why}: use one of {', '.join(BUILTIN_RM_TYPES)}")
        out[field] = value
    return out
