"""The stand-in's data types, with tau-bench's field names: vllm-project/vime's agent builds `Action`s and
`RunConfig`s and reads `observation`/`reward`/`done`/`info` off the env's answers (and calls
`model_dump()` on `info`), so these are pydantic models as there."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

RESPOND_ACTION_NAME = "respond"
RESPOND_ACTION_FIELD_NAME = "content"


class Action(BaseModel):
    """One step of the agent: a tool's name and its arguments, or RESPOND_ACTION_NAME with
    `{"content": text}` for a message to the user."""

    name: str
    kwargs: dict[str, Any]


class Task(BaseModel):
    """A user's errand: the user's lines (`instruction`, one message per line), the actions that
    solve it (their end state is the reward's reference) and strings the agent must say."""

    user_id: str
    actions: list[Action]
    instruction: str
    outputs: list[str]


class RewardResult(BaseModel):
    """How an episode was scored: whether the database matched and which outputs were said."""

    reward: float
    data_matches: bool
    outputs: dict[str, bool]


class EnvInfo(BaseModel):
    task: Task
    source: str | None = None
    user_cost: float | None = None
    reward_info: RewardResult | None = None


class EnvResponse(BaseModel):
    observation: str
    reward: float
    done: bool
    info: EnvInfo


class EnvResetResponse(BaseModel):
    observation: str
    info: EnvInfo


class RunConfig(BaseModel):
    """tau-bench's run settings (the fields vllm-project/vime's agent reads). Its generate_with_tau.py
    reads `.agent`, which sierra-research's RunConfig lacks (it has `agent_strategy`): the
    fork vllm-project/vime installs has it, so both are here. Other unknown keys are ignored."""

    model_provider: str
    user_model_provider: str
    model: str
    user_model: str = "gpt-4o"
    env: str = "retail"
    agent: str = "tool-calling"
    agent_strategy: str = "tool-calling"
    temperature: float = 0.0
    task_split: str = "test"
    user_strategy: str = "llm"
