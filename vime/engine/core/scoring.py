"""Scoring given tokens: the log-prob of each token of a text under the engine's model, with
nothing sampled.

This is what a teacher does in on-policy distillation: the student's tokens, scored by another
model. slime and vllm-project/vime ask an SGLang server for it (`/generate` with
`max_new_tokens: 0`, `return_logprob` and `logprob_start_len`), so the server answers that same
request (server.py) and functions written for their teacher servers call a vime engine unchanged.

A scoring runs in the engine thread between two steps, on KV blocks of its own taken from the
free list and given back at once: it never waits behind the batch, and the batch never sees
it. A text whose blocks are not free now (a full cache) is refused as busy (503, try again),
not queued: scoring is a short forward, a retry is cheaper than a second queue.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vime.engine.core.sampler import SamplingParams
from vime.engine.core.scheduler import Sequence

if TYPE_CHECKING:
    from vime.engine.core.engine import LLMEngine


class EngineBusy(RuntimeError):
    """Not now (the cache is full, weights are arriving, memory is released): ask again."""

    http_status = 503


def score(engine: LLMEngine, token_ids: list[int], start: int = 0) -> list[float | None]:
    """Log-prob of `token_ids[p]` given `token_ids[:p]` for p in start .. len - 1, under the raw
    distribution (no temperature); None at p = 0, which nothing predicts (as SGLang answers)."""
    return score_top(engine, token_ids, start)[0]


def score_top(
    engine: LLMEngine, token_ids: list[int], start: int = 0, top: int = 0
) -> tuple[list[float | None], list[list[tuple[int, float]] | None]]:
    """`score`, and at each scored position the `top` likeliest tokens as (id, log-prob),
    likeliest first (None at p = 0): the OpenAI routes' log-probs and top log-probs."""
    engine.check_token_ids(token_ids)
    if not 0 <= start < len(token_ids):
        raise ValueError(f"logprob_start_len {start} must be in [0, {len(token_ids)}) for {len(token_ids)} input ids")
    if len(token_ids) > engine.max_seq_len:
        raise ValueError(
            f"{len(token_ids)} tokens can never be scored: the engine's maximum sequence length is {engine.max_seq_len}"
        )
    if not engine.may_step():
        raise EngineBusy("the engine is paused, has its memory released or is taking new weights: score again later")
    allocator = engine.allocator
    need = allocator.blocks_for(len(token_ids))
    if need > allocator.num_free:
        raise EngineBusy(
            f"scoring {len(token_ids)} tokens needs {need} free KV blocks, {allocator.num_free} are: score again later"
        )
    seq = Sequence("score", list(token_ids), len(token_ids), SamplingParams(max_new_tokens=0), frozenset())
    seq.block_table = allocator.allocate(need)
    logprobs: list[float | None] = [None] if start == 0 else []
    tops: list[list[tuple[int, float]] | None] = [None] if start == 0 else []
    try:
        while seq.num_computed < len(token_ids):
            n = min(engine.cfg.max_num_batched_tokens, len(token_ids) - seq.num_computed)
            chunk, chunk_tops = engine.runner.prompt_logprobs(seq, n, first=start, top=top)
            logprobs += chunk
            tops += chunk_tops if top > 0 else [[] for _ in chunk]
            seq.num_computed += n
    finally:
        allocator.release(seq.block_table)
    engine.stats.prompt_tokens += len(token_ids)
    engine.stats.computed_tokens += len(token_ids)
    return logprobs, tops


def input_token_logprobs(engine: LLMEngine, token_ids: list[int], start: int) -> list[list]:
    """`score` as SGLang answers it: one [log-prob, token id, None] per position from `start`, the
    form OPD functions written for slime index (`item[0]`)."""
    return [[lp, tok, None] for lp, tok in zip(score(engine, token_ids, start), token_ids[start:], strict=True)]
