"""Prompt rows from JSONL/JSON/Parquet files: `path@[a:b]` slices, dotted keys, labels in
`--label-format`, metadata and per-row tools, each row checked as it is read.

Apart from the data source because eval sets and SFT data read their rows the same way; every
problem is a `DataError`, one line naming the file, the row and the fix (`vime data` and the
reasoning-gym tasks raise it too).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from vime.errors import VimeError

_SLICE_RE = re.compile(r"^(?P<path>.+)@\[(?P<a>[^\]:]*):(?P<b>[^\]:]*)\]$")
JSON_SUFFIXES = (".jsonl", ".json")


class DataError(VimeError, ValueError):
    """Unusable prompt data; the one-line message names the file (and row or line) and the fix."""


def _split_spec(spec: str) -> tuple[Path, slice]:
    """`path@[a:b]` -> (path, slice(a, b)); a plain path -> (path, slice(None))."""
    spec = str(spec)
    if "@[" not in spec:
        return Path(spec), slice(None)
    m = _SLICE_RE.match(spec)
    bounds = None
    if m:
        try:
            bounds = [int(x) if x.strip() else None for x in (m["a"], m["b"])]
        except ValueError:
            bounds = None
    if bounds is None:
        raise DataError(
            f"bad row slice in '{spec}': write path@[start:end] with integer bounds, e.g. data.jsonl@[0:1000] or data.jsonl@[-100:]"
        )
    return Path(m["path"]), slice(*bounds)


def _read_json_rows(path: Path) -> list[tuple[int, Any]]:
    """(line number, parsed value) per non-blank line; a `.json` holding one array also works."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        line = path.read_bytes()[: e.start].count(b"\n") + 1
        raise DataError(
            f"{path}: not UTF-8 text (byte {e.start}, line {line}: {e.reason}); re-encode the file as UTF-8"
        ) from None
    if path.suffix == ".json" and text.lstrip().startswith("["):
        try:
            return [(0, row) for row in json.loads(text)]
        except json.JSONDecodeError as e:
            raise DataError(
                f"{path}: malformed JSON at line {e.lineno} ({e.msg}); fix the file or write one object per line (.jsonl)"
            ) from None
    rows = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rows.append((lineno, json.loads(line)))
        except json.JSONDecodeError as e:
            raise DataError(
                f"{path}: malformed JSON on line {lineno} ({e.msg}); each line must be one JSON object"
            ) from None
    return rows


def _read_rows(path: Path) -> list[tuple[int, Any]]:
    if not path.exists():
        raise DataError(
            f"prompt data file {path} not found: check --prompt-data / --eval-prompt-data (make one with `vime data`)"
        )
    if path.is_dir():
        raise DataError(f"prompt data {path} is a directory: point at a .jsonl or .parquet file inside it")
    suffix = path.suffix.lower()
    if suffix in JSON_SUFFIXES:
        return _read_json_rows(path)
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            return [(0, row) for row in pq.read_table(path).to_pylist()]
        except Exception as e:  # pyarrow raises several types for a damaged file
            raise DataError(f"{path}: cannot read Parquet ({type(e).__name__}: {e})") from None
    raise DataError(
        f"prompt data {path}: unknown extension '{path.suffix}'; use .jsonl, .json (JSON lines) or .parquet"
    )


def _where(path: Path, row: int, lineno: int) -> str:
    return f"{path} row {row}" + (f" (line {lineno})" if lineno else "")


def _text(value: Any, where: str, key: str) -> Any:
    """`value` as it is, unless it is text holding a lone surrogate (JSON's "\\ud800" without its
    pair): no encoding writes one, and the tokenizer raised a TypeError on it, mid-run."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            raise DataError(
                f"{where}: '{key}' holds {value[e.start]!r} at character {e.start}, half of a surrogate pair, which is "
                "no text: fix the row (a JSON \\ud800-style escape without its other half)"
            ) from None
    return value


def _check_input(value: Any, where: str, key: str) -> str | list[dict[str, Any]]:
    if isinstance(value, int) and not isinstance(value, bool):  # a task's number (tau-bench's `index`)
        return str(value)
    if isinstance(value, str):
        if not value.strip():  # it would reach the engine as a prompt of no tokens, mid-run
            raise DataError(f"{where}: '{key}' is empty: every row needs a prompt")
        return _text(value, where, key)
    if isinstance(value, list) and not value:
        raise DataError(
            f"{where}: '{key}' is an empty list of messages: every row needs a prompt (a conversation of at least one)"
        )
    if isinstance(value, list) and all(isinstance(m, dict) and "role" in m and "content" in m for m in value):
        return [{**m, "content": _text(m["content"], where, f"{key}[{i}].content")} for i, m in enumerate(value)]
    if isinstance(value, list):  # "got list" hid which message of the conversation is wrong
        i, bad = next(
            (i, m) for i, m in enumerate(value) if not (isinstance(m, dict) and "role" in m and "content" in m)
        )
        got = f"a dict of keys {', '.join(map(str, bad)) or 'none'}" if isinstance(bad, dict) else type(bad).__name__
        raise DataError(f"{where}: '{key}'[{i}] must be a chat message {{role, content}}, got {got}")
    raise DataError(
        f"{where}: '{key}' must be a string, an integer or a list of chat messages [{{role, content}}], "
        f"got {type(value).__name__}"
    )


def _check_metadata(value: Any, where: str, key: str) -> dict[str, Any]:
    if value is None:
        return {}
    if isinstance(value, str):  # Parquet writers often store nested dicts as JSON text
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            pass
    if not isinstance(value, dict):
        raise DataError(
            f"{where}: '{key}' must be a dict (or JSON text of one), got {type(value).__name__}; set --metadata-key to another column"
        )
    return value


def _check_tools(value: Any, where: str, key: str) -> list[dict[str, Any]]:
    if isinstance(value, str):  # Parquet writers often store nested lists as JSON text
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            pass
    if not isinstance(value, list) or not all(isinstance(t, dict) for t in value):
        got = type(value).__name__ if not isinstance(value, list) else "a list with items that are not objects"
        raise DataError(
            f"{where}: '{key}' must be a list of OpenAI-style tool schemas (JSON objects), got {got}; fix the row or set --tool-key"
        )
    return [dict(t) for t in value]


def _label_text(value: Any) -> str | dict[str, Any] | list[Any] | None:
    """Numbers become text, the form graders compare (42 and "42" are the same label); a dict or
    a list stays as it is, for the custom reward that reads it (search-r1's
    `sample.label["ground_truth"]`): as JSON text, every such reward failed and scored 0."""
    if value is None or isinstance(value, (str, dict, list)):
        return value
    return json.dumps(value)


def _lookup(row: dict[str, Any], key: str) -> tuple[bool, Any]:
    """(found, value) of `row[key]`. A dotted key that is not a column reads nested dicts, e.g.
    `reward_model.ground_truth` (the original DAPO-Math-17k layout)."""
    if key in row:
        return True, row[key]
    value: Any = row
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            return False, None
        value = value[part]
    return True, value


def _gsm8k_label(value: Any, where: str, key: str) -> str:
    """GSM8K's `answer` is a worked solution ending in `#### 72`; the label is what follows."""
    _, sep, tail = str(value).rpartition("####")
    if not sep or not tail.strip():
        raise DataError(
            f"{where}: '{key}' does not end in '#### <answer>', which --label-format gsm8k reads; drop the flag if the labels are plain answers"
        )
    return tail.strip().replace(",", "")


def load_prompts(
    spec: str | Path,
    input_key: str = "input",
    label_key: str | None = "label",
    metadata_key: str = "metadata",
    label_format: str = "text",
    tool_key: str | None = None,
    grader: str | None = None,
) -> list[dict[str, Any]]:
    """Rows of a JSONL/Parquet file (optionally `path@[a:b]`) as `{"input", "label", "metadata"}`.

    Only the rows inside the slice are checked, so a slice can step around a bad tail.
    `label_format` "gsm8k" keeps only the answer after the label's last `####`.
    With `tool_key` every row must hold a list of tool schemas there: it comes out as
    `"tools"` (for the chat template) and, as slime keeps it, as `metadata["tools"]` (for rewards).
    `grader` names what compares answers with the labels (a built-in reward, or eval): every row
    then needs a label, since one missing would score every sample of its prompt 0, silently.
    `label_key` None: the rows carry no label (SFT's conversations hold their answers); rows
    without the default `label` key have none either when no `grader` needs one.
    """
    path, rows_slice = _split_spec(str(spec))
    raw = _read_rows(path)
    numbered = list(enumerate(raw))[rows_slice]
    if not numbered:
        sliced = (
            ""
            if rows_slice == slice(None)
            else f" after slicing to [{rows_slice.start}:{rows_slice.stop}] of {len(raw)} rows"
        )
        raise DataError(f"prompt data {spec} is empty{sliced}: it needs at least one row")
    out = []
    for row_index, (lineno, row) in numbered:
        where = _where(path, row_index, lineno)
        if not isinstance(row, dict):
            raise DataError(f"{where}: each row must be a JSON object, got {type(row).__name__}")
        values = [None, None]
        for i, (key, flag) in enumerate(((input_key, "--input-key"), (label_key, "--label-key"))):
            if key is None:
                continue
            found, value = _lookup(row, key)
            if not found and i == 1 and key == "label" and grader is None:
                continue  # no label column and nothing grades against one (tau-bench's task indices)
            if not found:
                raise DataError(f"{where} has no key '{key}' (keys: {', '.join(map(str, row)) or 'none'}); set {flag}")
            values[i] = value
        prompt, label = values
        if grader is not None and (label is None or (isinstance(label, str) and not label.strip())):
            raise DataError(
                f"{where}: '{label_key}' is {'null' if label is None else 'empty'}, and {grader} grades against it: "
                "fill it in (or, for a reward that needs no label, give --custom-rm-path)"
            )
        if grader is not None and isinstance(label, (dict, list)) and label_format != "gsm8k":
            raise DataError(
                f"{where}: '{label_key}' is a {type(label).__name__}, and {grader} compares the answer with text: "
                "set --label-key to the field that holds the answer (e.g. reward_model.ground_truth), "
                "or give --custom-rm-path a reward that reads the dict"
            )
        item = {
            "input": _check_input(prompt, where, input_key),
            "label": _text(
                _gsm8k_label(label, where, label_key) if label_format == "gsm8k" else _label_text(label),
                where,
                label_key,
            ),
            "metadata": _check_metadata(_lookup(row, metadata_key)[1], where, metadata_key),
        }
        if tool_key is not None:
            found, tools = _lookup(row, tool_key)
            if not found:
                raise DataError(
                    f"{where} has no key '{tool_key}' (keys: {', '.join(map(str, row)) or 'none'}); set --tool-key"
                )
            item["tools"] = _check_tools(tools, where, tool_key)
            item["metadata"] = {**item["metadata"], "tools": item["tools"]}
        out.append(item)
    return out
