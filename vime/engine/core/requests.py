"""A request inside the engine, what it gives back, and the engine's counters: plain records,
apart from `engine.py` so the server's routes can name them without the engine's logic."""

from __future__ import annotations

from dataclasses import dataclass, field

from vime.engine.core.routing import RoutedExperts
from vime.engine.core.scheduler import Sequence


@dataclass
class SeqOutput:
    output_ids: list[int]
    logprobs: list[float]
    weight_versions: list[int]
    finish_reason: str
    routed_experts: RoutedExperts | None = None  # where the request asked for them (routing.py)


@dataclass
class RequestOutput:
    rid: str
    prompt_tokens: int
    outputs: list[SeqOutput]  # one per sample (n)
    weight_version: int  # the engine's version when the request finished


@dataclass
class Request:
    rid: str
    prompt_len: int
    seqs: list[Sequence]
    routed_experts: bool = False  # keep each sample's experts as it ends (rollout routing replay)
    routes: dict[int, RoutedExperts] = field(default_factory=dict)  # sample index → its experts

    def output(self, weight_version: int) -> RequestOutput:
        """What the request gives back (partial where aborted); `weight_version`: the engine's now."""
        outputs = [
            SeqOutput(s.output_ids, list(s.logprobs), list(s.weight_versions), s.finish_reason or "abort")
            for s in self.seqs
        ]
        for j, routes in self.routes.items():
            outputs[j].routed_experts = routes
        return RequestOutput(self.rid, self.prompt_len, outputs, weight_version)

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.seqs)

    def booked(self, since: list[int]) -> list[list[int]]:
        """Each sample's output tokens past its first `since[j]`, up to the last one booked: a
        token the step in flight drew is not known yet (a placeholder), so it is not among them."""
        return [s.token_ids[s.prompt_len + k : s.prompt_len + len(s.logprobs)] for s, k in zip(self.seqs, since)]


@dataclass
class EngineStats:
    steps: int = 0
    prompt_tokens: int = 0  # of requests received (x n)
    computed_tokens: int = 0  # run through the model, recomputation after preemption included
    generated_tokens: int = 0
    finished_requests: int = 0
    aborted_requests: int = 0
