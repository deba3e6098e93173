"""tau-bench's tool-calling agent module, reduced to the one name vllm-project/vime's agent takes from
it: the action name that means "say this to the user" rather than "call a tool"."""

from tau_bench.types import RESPOND_ACTION_NAME

__all__ = ["RESPOND_ACTION_NAME"]
