"""Streamed requests: after every step the engine thread hands each one's new tokens to the HTTP
handler that streams it (the OpenAI routes' `stream: true`).

Only the engine thread reads the engine, so the taps live there: added with the request, read
after each step, dropped when the request is delivered. What a tap hands over goes to the event
loop with `call_soon_threadsafe`, in order, so a handler sees every piece before the request's
final output (which stays the authority: a stream ends on it).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vime.engine.core.requests import Request

OnTokens = Callable[[list[list[int]]], None]  # each sample's new token ids; runs on the event loop


@dataclass
class Tap:
    on_tokens: OnTokens
    sent: list[int]  # per sample, the tokens handed over so far


class Taps:
    """The engine thread's streamed requests, by request id."""

    def __init__(self) -> None:
        self._taps: dict[str, Tap] = {}

    def add(self, rid: str, n: int, on_tokens: OnTokens) -> None:
        self._taps[rid] = Tap(on_tokens, [0] * n)

    def drop(self, rid: str) -> None:
        self._taps.pop(rid, None)

    def clear(self) -> None:
        self._taps.clear()

    def after_step(self, requests: dict[str, Request], loop: asyncio.AbstractEventLoop) -> None:
        """Hand each streamed request's newly booked tokens to its handler."""
        for rid, tap in self._taps.items():
            req = requests.get(rid)
            if req is None:  # finished: its output is on its way, with every token
                continue
            new = req.booked(tap.sent)
            if any(new):
                tap.sent = [k + len(ids) for k, ids in zip(tap.sent, new)]
                loop.call_soon_threadsafe(tap.on_tokens, new)
