"""Stop strings: does the token a sequence just drew complete one of its stop strings?

A stop string is text and the engine deals in token ids, so the check decodes, the way the
rollout reads a response (`decode(output_ids, skip_special_tokens=True)`). Checked after every
token, the first occurrence of a stop string is found by the token that completes it, so the
sequence ends there with that token kept (as vLLM's `include_stop_str_in_output` and SGLang's
`no_stop_trim` do).

Cost: decoding the whole output each step would grow with its length; only a tail window is
decoded. An occurrence that the new token completes ends past the text before that token, so
it starts at most `len(stop) - 1` characters before that text's end: the window holds that
many characters plus a margin (`MARGIN`), or the whole output. While the window's start stays
put, the text before the new token is the previous check's text: one decode of a few tokens per
sequence and step, and two when the window moves on.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

# characters: what decoding may change at a window's start that the whole output would not (a
# word's leading space dropped, a UTF-8 character cut in the middle shown as U+FFFD), and a
# character the new token completes
MARGIN = 4


@dataclass
class StopWindow:
    """The tail of a sequence's tokens decoded at its last check: `token_ids[start:end]` → text."""

    start: int
    end: int
    text: str


class StopSequence(Protocol):
    """What the check reads of a sequence (`scheduler.Sequence`), and the window it keeps there."""

    token_ids: list[int]
    prompt_len: int
    stop_window: StopWindow | None


def decoder(tokenizer: Any) -> Callable[[list[int]], str]:
    """`tokenizer.decode(ids, skip_special_tokens=True)`, by the Rust tokenizer of a fast one
    directly where that is all its decode does (no clean-up of spaces): half the time, most of
    a step's cost being the Python wrapper's."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and getattr(tokenizer, "clean_up_tokenization_spaces", True) is False:
        return lambda ids: backend.decode(ids, skip_special_tokens=True)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)


class StopStrings:
    """Stop-string checks for the engine, with the tokenizer loaded on first use (an engine
    whose requests bring no stop strings never loads it)."""

    def __init__(self, load_tokenizer: Callable[[], Any]):
        self._load = load_tokenizer
        self._decode: Callable[[list[int]], str] | None = None

    def ready(self) -> None:
        """Load the tokenizer now (at the first request with stop strings, so a model without
        one fails that request, not a later step)."""
        if self._decode is None:
            try:
                self._decode = decoder(self._load())
            except (OSError, ValueError) as e:  # the request's fault only in asking: a 400 naming the cause
                raise ValueError(
                    f"stop strings need the model's tokenizer, which does not load ({type(e).__name__}: {' '.join(str(e).split())[:200]})"
                ) from None

    def decode(self, ids: list[int]) -> str:
        self.ready()
        return self._decode(ids)

    def completed(self, seq: StopSequence, stops: tuple[str, ...], end: int | None = None) -> bool:
        """Whether `seq.token_ids[end - 1]` (default: the last) completes one of `stops` in the
        text of the sequence's output (`token_ids[prompt_len:end]`); updates `seq.stop_window`.
        `end` leaves out a token drawn after it and not read yet."""
        ids, end = seq.token_ids, len(seq.token_ids) if end is None else end
        n = end - seq.prompt_len
        if n <= 0 or not stops:
            return False
        need = max(map(len, stops)) + 2 * MARGIN  # characters before the new token
        first = need + 1  # tokens in a fresh window: almost every token decodes to a character or more
        w = seq.stop_window
        # the window's start stays put until it has grown to twice its first size
        if w is not None and w.end == end - 1 and end - w.start <= 2 * first:
            start, before = w.start, w.text  # the same window, one token longer
        else:
            k = first
            while True:
                k = min(k, n)
                start = end - k
                before = self.decode(ids[start : end - 1])
                if k == n or len(before) >= need:
                    break
                k *= 2
        text = self.decode(ids[start:end])
        seq.stop_window = StopWindow(start, end, text)
        return any(text.find(s, max(0, len(before) - len(s) + 1 - MARGIN)) >= 0 for s in stops)
