"""The data source that hands out prompt groups, and what a checkpoint saves of it.

The data source is the only place that knows the data position (epoch, offset) and the
prompts taken out but not trained on (re-queued groups, and groups still out with a rollout),
so it is also what a checkpoint must save for a resumed run to continue on exactly the next prompt.
Reading rows is `prompt_rows.py`, rendering them `prompts.py`.
"""

from __future__ import annotations

import dataclasses
import random
import threading
from collections import deque
from typing import TYPE_CHECKING, Any

from vime.rollout.data.prompts import PromptRenderer, check_choice_labels, fit_prompts, prompt_limit
from vime.rollout.data.rows import load_prompts
from vime.rollout.types import MULTI_TURN_STATE, Sample, Status

if TYPE_CHECKING:
    from vime.rollout.settings import RolloutConfig


def _label_grader(rollout: RolloutConfig) -> str | None:
    """What grades the training rows against their labels, if anything: the built-in rewards but
    reasoning_gym (its scorer reads the row's metadata); not a reward, rollout or generate of
    one's own (a generate may set the reward itself, as vllm-project/vime's tau-bench agent does)."""
    from vime.modes import DEFAULT_ROLLOUT_FN, FULLY_ASYNC_FN
    from vime.rollout.rewards import MODULE_RM_TYPES

    if rollout.custom_rm_path or rollout.rm_type in MODULE_RM_TYPES:
        return None
    if (
        rollout.rollout_function_path not in (DEFAULT_ROLLOUT_FN, FULLY_ASYNC_FN)
        or rollout.custom_generate_function_path
    ):
        return None
    return f"--rm-type {rollout.rm_type}"


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
        generation_start=0,
        temperature=None,
        reward=None,
        reward_error=None,
        reward_extras={},
        reward_result=None,
        teacher_log_probs=None,
        mopd_teacher_log_probs=None,
        rollout_routed_experts=None,
        spec_info=Sample.SpecInfo(),
        prefix_cache_info=Sample.PrefixCacheInfo(),
        remove_sample=False,  # a custom generate's verdict on the response dropped
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

    def __init__(self, rollout: RolloutConfig, tokenizer, max_prompt_len: int | None = None) -> None:
        self.settings = rollout  # the rollout room's settings (`cfg.rollout`)
        # left out by --skip-overlong-prompts, --rollout-max-prompt-len or --rollout-max-context-len (fit_prompts)
        self.skipped_prompts = 0
        self.skipped_note: str | None = None  # one line saying which and why, for the run's log
        # tokens of the longest row kept (a prompt; SFT's whole conversation), where every row was
        # measured (a prompt limit given): preflight's bound on the longest sequence trained on
        self.longest_row: int | None = None
        self.rows = self._load(tokenizer, max_prompt_len)
        self.n_per_prompt = int(rollout.n_samples_per_prompt)
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
        # a rollout function's own notes (slime's `update_metadata`: its rollout_buffer example
        # keeps the groups each rollout finished), saved with the checkpoint
        self.metadata: dict[str, Any] = {}

    def _load(self, tokenizer, max_prompt_len: int | None) -> list[dict[str, Any]]:
        """The prompt rows, every one checked and rendered now (`fit_prompts`), so a bad row fails
        at start-up; a subclass that hands out other samples reads its rows its own way."""
        rollout = self.settings
        rows = load_prompts(
            rollout.prompt_data,
            rollout.input_key,
            rollout.label_key,
            rollout.metadata_key,
            rollout.label_format,
            rollout.tool_key,
            grader=_label_grader(rollout),
        )
        if _label_grader(rollout) is not None:  # a multiple-choice rm type: every label an option
            check_choice_labels(rows, rollout.prompt_data, rollout.rm_type)
        self.renderer = PromptRenderer(rollout, tokenizer, str(rollout.prompt_data))
        limit = prompt_limit(rollout)
        if max_prompt_len is not None or limit is not None:
            bound = max_prompt_len if max_prompt_len is not None else limit[0]
            total = len(rows)
            rows, self.skipped_prompts, self.longest_row = fit_prompts(
                rows, self.renderer, str(rollout.prompt_data), bound, rollout.skip_overlong_prompts, limit
            )
            if self.skipped_prompts:
                most, flag = limit if limit is not None and limit[0] <= bound else (bound, "--skip-overlong-prompts")
                self.skipped_note = (
                    f"{flag}: left out {self.skipped_prompts} of {total} prompts of {rollout.prompt_data} "
                    f"longer than {most} tokens (rollout/skipped_prompts)"
                )
        self.renderer.render_row(rows[0], f"{rollout.prompt_data} row 0")  # a bad template fails now, not mid-run
        return rows

    def __len__(self) -> int:
        return len(self.rows)  # rows never change after __init__: no lock needed

    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(range(len(self.rows)))
        if self.settings.rollout_shuffle:
            random.Random(self.settings.rollout_seed + epoch).shuffle(order)
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
        text, ids = self.renderer.render_row(row, f"{self.settings.prompt_data} row {row_index}")
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
        """Re-queue groups to be generated again from their prompts (response dropped): as they
        were handed out (the outstanding copy), since a rollout may change a group past what
        `_fresh` undoes (a custom generate that returned several samples for one grew it)."""
        with self._lock:
            for g in groups:
                handed_out = self.outstanding.pop(g[0].group_index, None)
                self.requeued.append(handed_out if handed_out is not None else [_fresh(s) for s in g])

    def get_buffer_length(self) -> int:
        """slime's name: the groups handed back (`add_samples`) that go out first."""
        with self._lock:
            return len(self.requeued)

    def update_metadata(self, metadata: dict[str, Any]) -> None:
        """slime's: merge a rollout function's notes into `metadata` (plain values: a checkpoint
        keeps them)."""
        with self._lock:
            self.metadata.update(metadata)

    def get_metadata(self) -> dict[str, Any]:
        """slime's: the notes `update_metadata` kept, resumed with the run."""
        return self.metadata

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
                "metadata": dict(self.metadata),
            }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        with self._lock:
            self.epoch = int(state["epoch"])
            self.offset = int(state["offset"])
            self.next_index = int(state["next_index"])
            self.next_group = int(state["next_group"])
            self.requeued = deque([_sample_from_dict(d) for d in g] for g in state["requeued"])
            self.outstanding = {}
            self.metadata = dict(state.get("metadata", {}))  # none in a checkpoint from before it
            self._order = self._epoch_order(self.epoch)
