"""Prompt rows into prompt tokens: the chat template (`PromptRenderer`), the length bounds
(`prompt_limit`, `fit_prompts`), and an eval set's rows as tokenized Samples.

Train and eval render through the same class, so a prompt is the same tokens in both.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from vime.rollout.data.rows import DataError, load_prompts
from vime.rollout.tools.calls import load_tools
from vime.rollout.types import Sample

if TYPE_CHECKING:
    from vime.rollout.settings import RolloutConfig


class PromptRenderer:
    """Turns a row's input into (prompt text, prompt token ids), the same way for train and eval."""

    def __init__(self, rollout: RolloutConfig, tokenizer, source: str) -> None:
        self.tokenizer = tokenizer
        self.use_template = bool(rollout.apply_chat_template)
        self.template_kwargs = dict(rollout.apply_chat_template_kwargs or {})
        # --tools: their schemas for the chat template, unless a row brings its own (--tool-key)
        self.tools = (
            [t.schema() for t in load_tools(list(rollout.tools), rollout.unsafe_python_tool).values()]
            if rollout.tools
            else None
        )
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


def prompt_limit(rollout: RolloutConfig) -> tuple[int, str] | None:
    """(the most tokens a training prompt may have, the flag that says so) under
    --rollout-max-prompt-len and --rollout-max-context-len (a prompt must leave room for one
    response token), or None when neither is given. Longer prompts are left out, as slime
    filters its data, whatever --skip-overlong-prompts says."""
    limits = []
    if rollout.rollout_max_prompt_len is not None:
        limits.append((int(rollout.rollout_max_prompt_len), "--rollout-max-prompt-len"))
    if rollout.rollout_max_context_len is not None:
        limits.append((int(rollout.rollout_max_context_len) - 1, "--rollout-max-context-len"))
    return min(limits) if limits else None


def fit_prompts(
    rows: list[dict[str, Any]],
    renderer: PromptRenderer,
    source: str,
    max_prompt_len: int,
    skip: bool,
    limit: tuple[int, str] | None = None,
) -> tuple[list[dict[str, Any]], int, int]:
    """(the rows whose prompt fits, how many did not, the longest kept prompt's tokens). A
    prompt of `max_prompt_len` tokens or fewer leaves room for a response. Every row is rendered now, so a long or malformed prompt
    fails at start-up, not when its turn comes hours in. Without `skip`, the first prompt that
    does not fit is a DataError naming its row. A prompt longer than `limit` (`prompt_limit`:
    the flag's own bound) is always left out, and counted."""
    kept, longest = [], 0
    for i, row in enumerate(rows):
        n = len(renderer.render_row(row, f"{source} row {i}")[1])
        if limit is not None and n > limit[0]:
            continue
        if n <= max_prompt_len:
            kept.append(row)
            longest = max(longest, n)
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
    return kept, len(rows) - len(kept), longest


def load_eval_samples(
    args, tokenizer, path: str | Path, limit: int | None = None, max_prompt_len: int | None = None
) -> list[Sample]:
    """The first `limit` rows of an eval set as tokenized Samples (index = group_index = row);
    prompts longer than `max_prompt_len` refused or, with --skip-overlong-prompts, left out.
    `args`: one set's settings (`eval_sets.args_for`). Prompt and answer are read at
    --eval-input-key / --eval-label-key of its eval room (default: the train keys); the rest as
    the rollout room reads its prompts. Every row needs a label, which eval grades against,
    except with --custom-generate-function-path: its samples may come back with their reward
    set (tau-bench's), which is their score, and a row it leaves unscored without a label is
    refused when it is graded (vime.eval.grade_sample), since nothing knows which rows those are
    before the generate runs."""
    rollout, evaluation = args.rollout, args.eval
    grader = None if rollout.custom_generate_function_path else "eval"
    rows = load_prompts(
        path,
        evaluation.eval_input_key or rollout.input_key,
        evaluation.eval_label_key or rollout.label_key,
        rollout.metadata_key,
        rollout.label_format,
        rollout.tool_key,
        grader=grader,
    )
    check_choice_labels(rows, path, evaluation.rule(rollout.rm_type), labels_optional=grader is None)
    renderer = PromptRenderer(rollout, tokenizer, str(path))
    if max_prompt_len is not None:
        rows, _, _ = fit_prompts(rows, renderer, str(path), max_prompt_len, rollout.skip_overlong_prompts)
    samples = []
    for i, row in enumerate(rows[:limit]):
        text, ids = renderer.render_row(row, f"{path} row {i}")
        samples.append(
            Sample(index=i, group_index=i, prompt=text, label=row["label"], tokens=ids, metadata=dict(row["metadata"]))
        )
    return samples


# ---------------------------------------------------------------- the data source


def check_choice_labels(
    rows: list[dict[str, Any]], path: str | Path, rm_type: str | None, labels_optional: bool = False
) -> None:
    """A multiple-choice set's labels must each name an option: one that does not (the option's
    text, say) would grade every answer wrong, silently. `labels_optional`: a row without one is
    for a custom generate to score (refused later if it does not)."""
    from vime.rollout.rewards.grading import BUILTIN_RM_TYPES, choice_label

    rule = BUILTIN_RM_TYPES.get(rm_type) if rm_type is not None else None
    if rule is None or not rule.choice:
        return
    for i, row in enumerate(rows):
        if labels_optional and row["label"] is None:
            continue
        if choice_label(row["label"]) is None:
            raise DataError(
                f"{path} row {i}: label {row['label']!r} is not an option letter (A-J) or a 0-based option index, "
                f"which rm_type {rm_type} compares the response's letter with: give the letter"
            )
