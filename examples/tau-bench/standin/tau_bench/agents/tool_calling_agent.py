"""tau-bench's tool-calling agent module, reduced to what the agents built on it take: the action
name that means "say this to the user" rather than "call a tool" (vllm-project/vime's agent), and
`ToolCallingAgent`'s constructor, which slime's tau-bench agent subclasses and calls."""

from typing import Any

from tau_bench.agents.base import Agent
from tau_bench.types import RESPOND_ACTION_NAME

__all__ = ["RESPOND_ACTION_NAME", "ToolCallingAgent"]


class ToolCallingAgent(Agent):
    """tau-bench's constructor and its fields; its own `solve` (which calls an LLM through
    litellm) is not here: the trainable agents bring theirs."""

    def __init__(
        self, tools_info: list[dict[str, Any]], wiki: str, model: str, provider: str, temperature: float = 0.0
    ):
        self.tools_info, self.wiki, self.model, self.provider = tools_info, wiki, model, provider
        self.temperature = temperature
