"""reasoning-gym as data and reward: its tasks' own generators and their own scorers.

`vime data --task rg:<name>` writes rows whose metadata carries the generated entry (question,
answer, metadata) and the task's config. `--rm-type reasoning_gym` hands that entry back to the
task's `score_answer`, because many tasks cannot be graded by comparing with one label: a
puzzle with several solutions, an answer whose order does not matter, partial credit.
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Callable, Iterator
from functools import lru_cache
from types import ModuleType
from typing import Any

from vime.rollout.data.rows import DataError
from vime.rollout.rewards import RewardError, RewardFn
from vime.rollout.rewards.answers import extract_answer
from vime.rollout.rewards.runner import RewardRunner
from vime.rollout.types import Sample

PREFIX = "rg:"
METADATA_KEY = "reasoning_gym"  # where a row's metadata keeps {"task", "config", "entry"}


def _library(error: type[Exception]) -> ModuleType:
    """reasoning_gym, imported on first use (it registers every task: about a second)."""
    try:
        import reasoning_gym
    except ImportError:
        raise error("reasoning-gym tasks need the reasoning-gym package: pip install reasoning-gym") from None
    return reasoning_gym


def task_names() -> list[str]:
    """Every reasoning-gym task name (without the rg: prefix), sorted."""
    _library(DataError)
    from reasoning_gym.factory import DATASETS

    return sorted(DATASETS)


def _check_task(name: str) -> None:
    names = task_names()
    if name not in names:
        close = difflib.get_close_matches(name, names, n=3)
        hint = f" (did you mean {', '.join(PREFIX + c for c in close)}?)" if close else ""
        raise DataError(f"unknown reasoning-gym task '{name}'{hint}: `vime data --list` prints every task name")


def _stored(name: str, entry: dict[str, Any], score: Callable[[str | None, dict[str, Any]], float]) -> dict[str, Any]:
    """The entry as a JSONL row will give it back to the scorer, refused where that form would
    grade differently (JSON turns tuples into lists, and some scorers compare with tuples)."""
    try:
        stored = json.loads(json.dumps(entry))
    except (TypeError, ValueError) as e:
        raise DataError(
            f"rg:{name}: its entries are not JSON ({e}), so a row cannot carry them to the scorer; vime data cannot write this task"
        ) from None
    answer = entry.get("answer")
    if isinstance(answer, str) and score(answer, stored) != score(answer, entry):
        raise DataError(
            f"rg:{name}: its scorer grades the entry differently once it went through JSON (tuples become lists); vime data cannot write this task"
        )
    return stored


def rows(name: str, seed: int, size: int, config: dict[str, Any], instruction: str) -> Iterator[dict[str, Any]]:
    """Rows of entries 0, 1, 2, ... of the task seeded with `seed` (reasoning-gym seeds entry i
    with seed + i, so the order is the same in every process), each question followed by
    `instruction`. `size` is the number of entries the task may build up front: a few tasks
    keep a fixed list and have no entry past it."""
    rg = _library(DataError)
    _check_task(name)
    try:
        dataset = rg.create_dataset(name, seed=seed, size=size, **config)
    except Exception as e:  # the task's config dataclass: unknown field, failed validation, ...
        raise DataError(
            f"rg:{name}: cannot build the task from --rg-config {json.dumps(config)} ({type(e).__name__}: {e}); the fields are its config's, seed and size are vime data's"
        ) from None
    for index in range(size):
        entry = dataset[index]
        yield {
            "input": f"{entry['question']}\n\n{instruction}",  # many questions end in a list or a board
            "label": entry["answer"],
            "metadata": {
                "task": PREFIX + name,
                METADATA_KEY: {"task": name, "config": config, "entry": _stored(name, entry, dataset.score_answer)},
            },
        }


# ---------------------------------------------------------------- reward


@lru_cache(maxsize=64)
def _scorer(name: str, config_json: str) -> Callable[[str | None, dict[str, Any]], float]:
    """The task's score_answer, built once per (task, config) and process: some tasks load
    word lists or boards when built."""
    return _library(RewardError).create_dataset(name, **json.loads(config_json)).score_answer


def score(response: str | None, metadata: dict[str, Any]) -> float:
    """The task's own score of the answer the response commits to (vime's one answer parser:
    last \\boxed{}, else the Answer: line, else the last number)."""
    spec = metadata.get(METADATA_KEY)
    if not isinstance(spec, dict) or not {"task", "entry"} <= spec.keys():
        raise ValueError(
            f"the sample's metadata has no '{METADATA_KEY}' entry: --rm-type reasoning_gym grades rows written by `vime data --task rg:<name>`"
        )
    fn = _scorer(spec["task"], json.dumps(spec.get("config") or {}, sort_keys=True))
    return float(fn(extract_answer(response), spec["entry"]))


def make_reward(rollout: Any, runner: RewardRunner) -> RewardFn:
    """`--rm-type reasoning_gym`. Each score runs in one of the runner's daemon threads, not its
    pool (whose calls carry a response and a label, not the entry the scorer needs): a slow
    scorer must not stall generation, and a hung one is abandoned at --reward-timeout."""
    _library(RewardError)  # a missing package fails at start-up, not at the first sample

    async def reward(sample: Sample) -> float:
        return await runner.in_thread(score, sample.final_response, sample.metadata)

    return reward
