"""The router's recent answers, so a sample a plug-in built from one of them gets its log-probs back.

vllm-project/vime's multi-agent example asks the router for a response, keeps the token ids and drops the
log-probs (`new_response_tokens, _ = _inference_generate_tokens_and_logprobs(choice)`), then
returns the sample with `tokens` and `response_length` set by hand. The trainer needs each
response token's rollout log-prob wherever it corrects for off-policy tokens (--use-tis, and
every async mode by default) and its weight version for the staleness metrics; the engine
computed both. The router notes them here under the whole sequence (prompt + answer), and when a
custom generate returns a sample without log-probs whose tokens are exactly one answer's, vime
fills them in (`restore`). A sample built from several requests (a multi-turn one) is not
matched: those call `append_response_tokens`, which keeps the log-probs as they come.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from dataclasses import dataclass

from vime.rollout.types import Sample

# A custom generate's answers are claimed as soon as it returns them without log-probs; one that
# keeps its log-probs, or asks for answers it never returns, leaves them here until the cap
# evicts the oldest: ~24 bytes a token (ids, log-probs, versions in arrays), so at most ~400 MB.
MAX_TOKENS = 16 * 2**20


@dataclass
class _Answer:
    output: array
    log_probs: array
    versions: array | None


class AnswerLog:
    """Recent answers by the hash of their whole sequence, oldest evicted past MAX_TOKENS."""

    def __init__(self, max_tokens: int = MAX_TOKENS) -> None:
        self._answers: OrderedDict[int, _Answer] = OrderedDict()
        self._tokens = 0
        self._max_tokens = max_tokens

    def record(self, prompt: list[int], output: list[int], log_probs: list[float], versions: list[int]) -> None:
        """Note one answer (its log-probs, and its per-token versions when the engine gave them)."""
        if not output or len(log_probs) != len(output):
            return
        key = hash((*prompt, *output))
        old = self._answers.pop(key, None)
        if old is not None:
            self._tokens -= len(old.output)
        self._answers[key] = _Answer(
            array("q", output), array("d", log_probs), array("q", versions) if len(versions) == len(output) else None
        )
        self._tokens += len(output)
        while self._tokens > self._max_tokens and self._answers:
            _, dropped = self._answers.popitem(last=False)
            self._tokens -= len(dropped.output)

    def restore(self, sample: Sample) -> bool:
        """Give a sample without rollout log-probs those of the answer its response is, if it is
        exactly one; whether it did."""
        n = sample.response_length
        if sample.rollout_log_probs is not None or n <= 0 or len(sample.tokens) <= n:
            return False
        answer = self._answers.get(hash(tuple(sample.tokens)))
        if answer is None or answer.output != array("q", sample.tokens[-n:]):
            return False
        del self._answers[hash(tuple(sample.tokens))]
        self._tokens -= n
        sample.rollout_log_probs = list(answer.log_probs)
        if sample.weight_versions is None and answer.versions is not None:
            sample.weight_versions = list(answer.versions)
        return True
