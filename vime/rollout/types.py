"""The data that flows from rollout to trainer.

A `Sample` is one prompt + one response. Groups of `--n-samples-per-prompt` samples share a
prompt and are the unit GRPO normalizes over, so rollout functions return `list[list[Sample]]`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

MULTI_TURN_STATE = "multi_turn"  # metadata key of a multi-turn sample's state (vime.rollout.multi_turn)


class Status(str, Enum):
    PENDING = "pending"
    COMPLETED = "completed"  # ended on a stop/eos token
    TRUNCATED = "truncated"  # hit max_new_tokens
    ABORTED = "aborted"  # engine aborted it (pause/abort); partial tokens kept
    FAILED = "failed"  # engine error; never trained on


@dataclass
class Sample:
    index: int = 0
    group_index: int = 0
    prompt: str | list[dict[str, Any]] = ""
    label: str | None = None
    tokens: list[int] = field(default_factory=list)  # prompt ids + response ids
    response_length: int = 0
    response: str = ""  # decoded response text (what rewards read)
    loss_mask: list[int] | None = None  # one per response token; None means all ones
    rollout_log_probs: list[float] | None = None  # one per response token
    weight_versions: list[int] | None = None  # one per response token
    temperature: float | None = None  # what its response was drawn at, stamped by the generate that drew it
    reward: float | None = None
    reward_error: str | None = None  # "error" or "timeout" when the reward failed and 0 stood in for it
    # the reward's other numeric values (a dict reward's keys besides --reward-key), logged as
    # rollout/reward_<key> means
    reward_extras: dict[str, float] = field(default_factory=dict)
    status: Status = Status.PENDING
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def prompt_length(self) -> int:
        return len(self.tokens) - self.response_length

    @property
    def response_tokens(self) -> list[int]:
        return self.tokens[self.prompt_length :]

    @property
    def final_response(self) -> str:
        """What built-in rewards and eval grade: the response, or with --tools its last turn (a
        number in a tool's answer earlier in the conversation is not the model's answer)."""
        state = self.metadata.get(MULTI_TURN_STATE)
        return state.get("last_turn", self.response) if state else self.response

    def effective_loss_mask(self) -> list[int]:
        return self.loss_mask if self.loss_mask is not None else [1] * self.response_length


@dataclass
class RolloutOutput:
    samples: list[list[Sample]]
    metrics: dict[str, float] = field(default_factory=dict)
