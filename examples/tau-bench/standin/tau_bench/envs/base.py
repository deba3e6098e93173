"""The stand-in's environment: tau-bench's `Env` contract (tools_info, wiki, tasks, reset/step
and the reward at the end) over a small in-memory database."""

from __future__ import annotations

import copy
import json
import random
from collections.abc import Callable
from typing import Any

from tau_bench.envs.user import STOP, load_user
from tau_bench.types import (
    RESPOND_ACTION_NAME,
    Action,
    EnvInfo,
    EnvResetResponse,
    EnvResponse,
    RewardResult,
    Task,
)

Tool = Callable[..., str]  # (data, **kwargs) -> observation; may change `data`


class Env:
    """One episode at a time: `reset` loads a fresh copy of the database and the task's user;
    each `step` runs a tool on the database or passes a message to the user; the episode ends
    when the user says ###STOP###, and only then is the reward computed (as in tau-bench)."""

    def __init__(
        self,
        data: dict[str, Any],
        tools: dict[str, tuple[Tool, dict[str, Any]]],
        tasks: list[Task],
        wiki: str,
        user_strategy: str,
        user_model: str,
        user_provider: str | None = None,
        task_index: int | None = None,
    ) -> None:
        self._initial = data
        self.data = copy.deepcopy(data)
        self.tools_map = {name: fn for name, (fn, _) in tools.items()}
        self.tools_info = [info for _, info in tools.values()]
        self.tasks = tasks
        self.wiki = wiki
        self.user = load_user(user_strategy, model=user_model, provider=user_provider)
        self.task_index = self._check_index(task_index if task_index is not None else random.randrange(len(tasks)))
        self.task = tasks[self.task_index]
        self.actions: list[Action] = []

    def _check_index(self, index: int) -> int:
        if not 0 <= index < len(self.tasks):
            raise IndexError(f"task index {index} is out of range: this split has {len(self.tasks)} tasks")
        return index

    def reset(self, task_index: int | None = None) -> EnvResetResponse:
        self.task_index = self._check_index(task_index if task_index is not None else random.randrange(len(self.tasks)))
        self.task = self.tasks[self.task_index]
        self.data = copy.deepcopy(self._initial)
        self.actions = []
        first = self.user.reset(instruction=self.task.instruction)
        return EnvResetResponse(observation=first, info=EnvInfo(task=self.task, source="user"))

    def step(self, action: Action) -> EnvResponse:
        self.actions.append(action)
        info = EnvInfo(task=self.task, source=action.name)
        done = False
        if action.name == RESPOND_ACTION_NAME:
            observation = self.user.step(str(action.kwargs.get("content", "")))
            info.source = "user"
            done = STOP in observation
        elif action.name in self.tools_map:
            try:
                observation = self.tools_map[action.name](self.data, **action.kwargs)
            except Exception as e:  # a wrong argument is the agent's mistake, told back to it
                observation = f"Error: {e}"
        else:
            observation = f"Unknown action {action.name}"
        reward = 0.0
        if done:
            info.reward_info = self.calculate_reward()
            info.user_cost = self.user.get_total_cost()
            reward = info.reward_info.reward
        return EnvResponse(observation=observation, reward=reward, done=done, info=info)

    def calculate_reward(self) -> RewardResult:
        """1.0 when the database is what the task's own actions make of a fresh copy, and each of
        the task's outputs appears in something the agent said to the user (case and commas
        ignored, as in tau-bench); else 0.0."""
        reference = copy.deepcopy(self._initial)
        for action in self.task.actions:
            if action.name != RESPOND_ACTION_NAME:
                self.tools_map[action.name](reference, **action.kwargs)
        data_matches = _canonical(reference) == _canonical(self.data)
        said = [
            str(a.kwargs.get("content", "")).lower().replace(",", "")
            for a in self.actions
            if a.name == RESPOND_ACTION_NAME
        ]
        outputs = {out: any(out.lower() in text for text in said) for out in self.task.outputs}
        reward = 1.0 if data_matches and all(outputs.values()) else 0.0
        return RewardResult(reward=reward, data_matches=data_matches, outputs=outputs)


def _canonical(data: dict[str, Any]) -> str:
    return json.dumps(data, sort_keys=True)
