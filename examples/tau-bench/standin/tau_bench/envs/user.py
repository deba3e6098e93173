"""The stand-in's simulated user: it says its task's instruction line by line, one line per
agent message, then `###STOP###`. No model is called, so the user model, provider and strategy
asked for are accepted and only recorded. `MAX_RETRIES` and `RETRY_DELAY_SECONDS` exist because
vllm-project/vime's agent sets them (for the LLM calls of the real package's user); nothing reads them."""

from __future__ import annotations

import enum

MAX_RETRIES = 3
RETRY_DELAY_SECONDS = 1.0
STOP = "###STOP###"


class UserStrategy(enum.Enum):
    HUMAN = "human"
    LLM = "llm"
    REACT = "react"
    VERIFY = "verify"
    REFLECTION = "reflection"


class ScriptedUser:
    """A user whose every message is fixed in advance by the task."""

    def __init__(self, strategy: UserStrategy, model: str | None, provider: str | None) -> None:
        self.strategy, self.model, self.provider = strategy, model, provider
        self.lines: list[str] = []
        self.heard: list[str] = []

    def reset(self, instruction: str | None = None) -> str:
        self.lines = [line for line in (instruction or "").splitlines() if line.strip()]
        self.heard = []
        return self.lines.pop(0) if self.lines else STOP

    def step(self, content: str) -> str:
        self.heard.append(content)
        return self.lines.pop(0) if self.lines else STOP

    def get_total_cost(self) -> float:
        return 0.0


def load_user(user_strategy: str | UserStrategy, model: str | None = None, provider: str | None = None) -> ScriptedUser:
    try:
        strategy = UserStrategy(user_strategy)
    except ValueError:
        names = ", ".join(s.value for s in UserStrategy)
        raise ValueError(f"unknown user strategy {user_strategy!r}; tau-bench's are {names}") from None
    return ScriptedUser(strategy, model, provider)
