"""Prompt data: loading JSONL/Parquet, and the data source that hands out prompt groups.

The data source is the only place that knows the data position (epoch, offset) and the
prompts taken out but not trained on (re-queued groups, and groups still out with a rollout),
so it is also what a checkpoint must save for a resumed run to continue on exactly the next prompt.
"""

from __future__ import annotations

import dataclasses
import json
import random
import re
import threading
from collections import deque
from pathlib import Path
from typing import Any

from vime.errors import VimeError
from vime.rollout.tools import load_tools
from vime.rollout.types import MULTI_TURN_STATE, Sample, Status

_SLICE_RE = re.compile(r"^(?P<path>.+)@\[(?P<a>[^\]:]*):(?P<b>[^\]:]*)\]$")
JSON_SUFFIXES = (".jsonl", ".json")


class DataError(VimeError, ValueError):
    """Unusable prompt data; the one-line message names the file (and row or line) and the fix."""


# ---------------------------------------------------------------- loading


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


def _check_input(value: Any, where: str, key: str) -> str | list[dict[str, Any]]:
    if isinstance(value, str):
        if not value.strip():  # it would reach the engine as a prompt of no tokens, mid-run
            raise DataError(f"{where}: '{key}' is empty: every row needs a prompt")
        return value
    if isinstance(value, list) and value and all(isinstance(m, dict) and "role" in m and "content" in m for m in value):
        return [dict(m) for m in value]
    raise DataError(
        f"{where}: '{key}' must be a string or a list of chat messages [{{role, content}}], got {type(value).__name__}"
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
    `label_key` None: the rows carry no label (SFT's conversations hold their answers).
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
            "label": _gsm8k_label(label, where, label_key) if label_format == "gsm8k" else _label_text(label),
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


# ---------------------------------------------------------------- tokenizing


class PromptRenderer:
    """Turns a row's input into (prompt text, prompt token ids), the same way for train and eval."""

    def __init__(self, args, tokenizer, source: str) -> None:
        self.tokenizer = tokenizer
        self.use_template = bool(args.apply_chat_template)
        self.template_kwargs = dict(args.apply_chat_template_kwargs or {})
        # --tools: their schemas for the chat template, unless a row brings its own (--tool-key)
        self.tools = [t.schema() for t in load_tools(list(args.tools)).values()] if args.tools else None
        if self.use_template and not getattr(tokenizer, "chat_template", None):
            raise DataError(
                f"--apply-chat-template is set but the tokenizer of {source} has no chat template: drop the flag or use an instruct model"
            )

    def render(
        self, prompt: str | list[dict[str, Any]], where: str, tools: list[dict[str, Any]] | None = None
    ) -> tuple[str, list[int]]:
        """`tools` (a row's --tool-key schemas) go to the chat template as `tools=`; plain text
        without a template has nowhere to put them (they still reach rewards in the metadata)."""
        if not self.use_template:
            if not isinstance(prompt, str):
                raise DataError(
                    f"{where}: the input is a list of chat messages; pass --apply-chat-template to render it"
                )
            # no template: plain text, so the tokenizer adds its usual BOS where it has one
            return prompt, list(self.tokenizer.encode(prompt, add_special_tokens=True))
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        # render to text, then encode: transformers 5 returns a BatchEncoding for tokenize=True,
        # and the template already holds any BOS, so no special tokens are added again
        kwargs = dict(self.template_kwargs, tools=tools) if tools is not None else self.template_kwargs
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
        return text, list(self.tokenizer.encode(text, add_special_tokens=False))

    def render_row(self, row: dict[str, Any], where: str) -> tuple[str, list[int]]:
        return self.render(row["input"], where, row.get("tools", self.tools))


def prompt_limit(args) -> tuple[int, str] | None:
    """(the most tokens a training prompt may have, the flag that says so) under
    --rollout-max-prompt-len and --rollout-max-context-len (a prompt must leave room for one
    response token), or None when neither is given. Longer prompts are left out, as slime
    filters its data, whatever --skip-overlong-prompts says."""
    limits = []
    if args.rollout_max_prompt_len is not None:
        limits.append((int(args.rollout_max_prompt_len), "--rollout-max-prompt-len"))
    if args.rollout_max_context_len is not None:
        limits.append((int(args.rollout_max_context_len) - 1, "--rollout-max-context-len"))
    return min(limits) if limits else None


def fit_prompts(
    rows: list[dict[str, Any]],
    renderer: PromptRenderer,
    source: str,
    max_prompt_len: int,
    skip: bool,
    limit: tuple[int, str] | None = None,
) -> tuple[list[dict[str, Any]], int]:
    """(the rows whose prompt fits, how many did not). A prompt of `max_prompt_len` tokens or
    fewer leaves room for a response. Every row is rendered now, so a long or malformed prompt
    fails at start-up, not when its turn comes hours in. Without `skip`, the first prompt that
    does not fit is a DataError naming its row. A prompt longer than `limit` (`prompt_limit`:
    the flag's own bound) is always left out, and counted."""
    kept = []
    for i, row in enumerate(rows):
        n = len(renderer.render_row(row, f"{source} row {i}")[1])
        if limit is not None and n > limit[0]:
            continue
        if n <= max_prompt_len:
            kept.append(row)
        elif not skip:
            raise DataError(
                f"{source} row {i}: the prompt is {n} tokens, the model takes at most {max_prompt_len} before its answer: "
                "shorten or remove it, or pass --skip-overlong-prompts"
            )
    if not kept:
        if limit is not None and limit[0] < max_prompt_len:
            raise DataError(
                f"{source}: every prompt is longer than {limit[0]} tokens, the most {limit[1]} leaves: raise {limit[1]} or use shorter prompts"
            )
        raise DataError(
            f"{source}: every prompt is longer than {max_prompt_len} tokens, the most the model takes before its answer: shorten them or use a model of a longer context"
        )
    return kept, len(rows) - len(kept)


def _label_grader(args) -> str | None:
    """What grades the training rows against their labels, if anything: the built-in rewards but
    reasoning_gym (its scorer reads the row's metadata); not a reward or rollout of one's own."""
    from vime.modes import DEFAULT_ROLLOUT_FN, FULLY_ASYNC_FN
    from vime.rollout.rewards import MODULE_RM_TYPES

    if args.custom_rm_path or args.rm_type in MODULE_RM_TYPES:
        return None
    if args.rollout_function_path not in (DEFAULT_ROLLOUT_FN, FULLY_ASYNC_FN):
        return None
    return f"--rm-type {args.rm_type}"


def load_eval_samples(
    args, tokenizer, path: str | Path, limit: int | None = None, max_prompt_len: int | None = None
) -> list[Sample]:
    """The first `limit` rows of an eval set as tokenized Samples (index = group_index = row);
    prompts longer than `max_prompt_len` refused or, with --skip-overlong-prompts, left out.
    Prompt and answer are read at --eval-input-key / --eval-label-key (default: the train keys)."""
    rows = load_prompts(
        path,
        args.eval_input_key or args.input_key,
        args.eval_label_key or args.label_key,
        args.metadata_key,
        args.label_format,
        args.tool_key,
        grader="eval",
    )
    renderer = PromptRenderer(args, tokenizer, str(path))
    if max_prompt_len is not None:
        rows, _ = fit_prompts(rows, renderer, str(path), max_prompt_len, args.skip_overlong_prompts)
    samples = []
    for i, row in enumerate(rows[:limit]):
        text, ids = renderer.render_row(row, f"{path} row {i}")
        samples.append(
            Sample(index=i, group_index=i, prompt=text, label=row["label"], tokens=ids, metadata=dict(row["metadata"]))
        )
    return samples


# ---------------------------------------------------------------- the data source


def _sample_to_dict(s: Sample) -> dict[str, Any]:
    d = dataclasses.asdict(s)
    d["status"] = s.status.value  # plain values only: checkpoints load with weights_only
    return d


def _sample_from_dict(d: dict[str, Any]) -> Sample:
    return Sample(**{**d, "status": Status(d["status"])})


def _fresh(s: Sample) -> Sample:
    """The sample as it was before generation: prompt tokens only, nothing sampled or scored."""
    return dataclasses.replace(
        s,
        tokens=list(s.tokens[: s.prompt_length]),
        response_length=0,
        response="",
        loss_mask=None,
        rollout_log_probs=None,
        weight_versions=None,
        temperature=None,
        reward=None,
        reward_error=None,
        reward_extras={},
        status=Status.PENDING,
        # a conversation's state goes with its response: regenerated, it starts at turn one
        metadata={k: v for k, v in s.metadata.items() if k != MULTI_TURN_STATE},
    )


class DataSource:
    """Hands out groups of `n_samples_per_prompt` fresh samples, epoch after epoch.

    Re-queued groups (aborted or too stale to train on) go out first, oldest first, so no
    prompt is skipped. With `--rollout-shuffle` every epoch has its own order, seeded by
    `rollout_seed + epoch`, so the order is reproducible and a resumed run can rebuild it.

    A group handed out stays *outstanding* until the trainer marks it trained
    (`mark_trained`) or a rollout hands it back (`add_samples`). In async modes a checkpoint
    is taken while groups are queued, in flight or waiting in a pending generate; they are
    already past the saved position, so `state_dict` saves them as re-queued and a resumed run
    generates them again first instead of skipping them.

    The train thread (mark_trained, state_dict) and a rollout thread (get_samples,
    add_samples) share one instance, so every method that reads or changes the position holds
    one lock.
    """

    def __init__(self, args, tokenizer, max_prompt_len: int | None = None) -> None:
        self.args = args
        # left out by --skip-overlong-prompts, --rollout-max-prompt-len or --rollout-max-context-len (fit_prompts)
        self.skipped_prompts = 0
        self.skipped_note: str | None = None  # one line saying which and why, for the run's log
        self.rows = self._load(tokenizer, max_prompt_len)
        self.n_per_prompt = int(args.n_samples_per_prompt)
        self.epoch = 0
        self.offset = 0  # position in this epoch's order
        self.next_index = 0  # Sample.index of the next fresh sample
        self.next_group = 0  # Sample.group_index of the next fresh group
        self.requeued: deque[list[Sample]] = deque()
        # group_index → the group as handed out (own copies: the rollout mutates the originals),
        # in hand-out order
        self.outstanding: dict[int, list[Sample]] = {}
        self._lock = threading.RLock()
        self._order = self._epoch_order(0)

    def _load(self, tokenizer, max_prompt_len: int | None) -> list[dict[str, Any]]:
        """The prompt rows, every one checked and rendered now (`fit_prompts`), so a bad row fails
        at start-up; a subclass that hands out other samples reads its rows its own way."""
        args = self.args
        rows = load_prompts(
            args.prompt_data,
            args.input_key,
            args.label_key,
            args.metadata_key,
            args.label_format,
            args.tool_key,
            grader=_label_grader(args),
        )
        self.renderer = PromptRenderer(args, tokenizer, str(args.prompt_data))
        limit = prompt_limit(args)
        if max_prompt_len is not None or limit is not None:
            bound = max_prompt_len if max_prompt_len is not None else limit[0]
            total = len(rows)
            rows, self.skipped_prompts = fit_prompts(
                rows, self.renderer, str(args.prompt_data), bound, args.skip_overlong_prompts, limit
            )
            if self.skipped_prompts:
                most, flag = limit if limit is not None and limit[0] <= bound else (bound, "--skip-overlong-prompts")
                self.skipped_note = (
                    f"{flag}: left out {self.skipped_prompts} of {total} prompts of {args.prompt_data} "
                    f"longer than {most} tokens (rollout/skipped_prompts)"
                )
        self.renderer.render_row(rows[0], f"{args.prompt_data} row 0")  # a bad template fails now, not mid-run
        return rows

    def __len__(self) -> int:
        return len(self.rows)  # rows never change after __init__: no lock needed

    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(range(len(self.rows)))
        if self.args.rollout_shuffle:
            random.Random(self.args.rollout_seed + epoch).shuffle(order)
        return order

    def _next_row(self) -> int:
        if self.offset >= len(self._order):
            self.epoch += 1
            self.offset = 0
            self._order = self._epoch_order(self.epoch)
        row = self._order[self.offset]
        self.offset += 1
        return row

    def _new_group(self) -> list[Sample]:
        row_index = self._next_row()
        row = self.rows[row_index]
        text, ids = self.renderer.render_row(row, f"{self.args.prompt_data} row {row_index}")
        group = [
            Sample(
                index=self.next_index + k,
                group_index=self.next_group,
                prompt=text,
                label=row["label"],
                tokens=list(ids),
                metadata=dict(row["metadata"]),
            )
            for k in range(self.n_per_prompt)
        ]
        self.next_index += self.n_per_prompt
        self.next_group += 1
        return group

    def get_samples(self, n_groups: int) -> list[list[Sample]]:
        """n_groups groups: re-queued ones first (FIFO), then the next prompts in order.
        Each stays outstanding until `mark_trained` or `add_samples`."""
        with self._lock:
            groups = []
            while len(groups) < n_groups and self.requeued:
                groups.append(self.requeued.popleft())
            while len(groups) < n_groups:
                groups.append(self._new_group())
            for g in groups:
                self.outstanding[g[0].group_index] = [_fresh(s) for s in g]
            return groups

    def add_samples(self, groups: list[list[Sample]]) -> None:
        """Re-queue groups to be generated again from their prompts (response dropped)."""
        with self._lock:
            for g in groups:
                self.outstanding.pop(g[0].group_index, None)
                self.requeued.append([_fresh(s) for s in g])

    def mark_trained(self, groups: list[list[Sample]]) -> None:
        """The trainer took an optimizer step on these groups, or dynamic sampling dropped them
        (vime.rollout.filters): a checkpoint no longer saves them, and they are not generated
        again. Groups that did not come from this data source are ignored."""
        with self._lock:
            for g in groups:
                self.outstanding.pop(g[0].group_index, None)

    def state_dict(self) -> dict[str, Any]:
        """Position and the groups to generate again on resume: the outstanding groups (fresh,
        in hand-out order), then the re-queued ones. Outstanding groups are folded into
        `requeued`, so the keys are the same as before they were tracked and older checkpoints
        still load. The live object is not modified: a run goes on after saving."""
        with self._lock:
            pending = [*self.outstanding.values(), *self.requeued]
            return {
                "epoch": self.epoch,
                "offset": self.offset,
                "next_index": self.next_index,
                "next_group": self.next_group,
                "requeued": [[_sample_to_dict(s) for s in g] for g in pending],
            }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        with self._lock:
            self.epoch = int(state["epoch"])
            self.offset = int(state["offset"])
            self.next_index = int(state["next_index"])
            self.next_group = int(state["next_group"])
            self.requeued = deque([_sample_from_dict(d) for d in g] for g in state["requeued"])
            self.outstanding = {}
            self._order = self._epoch_order(self.epoch)
