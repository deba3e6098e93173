"""`from vime.utils.http_utils import post, get`: JSON over HTTP, as vllm-project/vime's plug-ins call
their engines' router (`http://{args.vllm_router_ip}:{args.vllm_router_port}/inference/v1/generate`,
served in vime by vime/compat/router.py).

A call retries a connection that fails or a 5xx answer `max_retries` times, with a short
backoff; a 4xx answer is the request's own fault and raises at once with the server's message.
One aiohttp session per event loop, kept for the loop's life (a plug-in makes thousands of calls)
and closed with the run (`close_sessions`), so a run that used it ends without aiohttp's
unclosed-session errors.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp

_sessions: dict[int, aiohttp.ClientSession] = {}


class HTTPError(RuntimeError):
    """A request that got no usable answer: the URL, the status and what the server said."""


def _session() -> aiohttp.ClientSession:
    loop = asyncio.get_running_loop()
    session = _sessions.get(id(loop))
    if session is None or session.closed:
        session = _sessions[id(loop)] = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))
    return session


async def _request(method: str, url: str, payload: Any, headers: dict | None, max_retries: int) -> Any:
    last: BaseException | None = None
    for attempt in range(max_retries + 1):
        if attempt:
            await asyncio.sleep(min(0.2 * 2 ** (attempt - 1), 5.0))
        try:
            async with _session().request(method, url, json=payload, headers=headers) as resp:
                text = await resp.text()
                if resp.status < 400:
                    return await resp.json(content_type=None) if text else None
                error = HTTPError(f"{method} {url}: HTTP {resp.status}: {' '.join(text.split())[:300]}")
                if resp.status < 500:
                    raise error
                last = error
        except aiohttp.ClientError as e:
            last = HTTPError(f"{method} {url}: {type(e).__name__}: {e}")
    assert last is not None
    raise last


async def post(
    url: str,
    payload: Any = None,
    max_retries: int = 3,
    headers: dict | None = None,
    json: Any = None,
) -> Any:
    """POST `payload` (or `json=`) as JSON; the answer's JSON."""
    return await _request("POST", url, payload if payload is not None else json, headers, max_retries)


async def get(url: str, max_retries: int = 3, headers: dict | None = None) -> Any:
    """GET; the answer's JSON."""
    return await _request("GET", url, None, headers, max_retries)


async def close_sessions() -> None:
    """Close the sessions of every loop (called on the rollout loop as a run closes)."""
    sessions = list(_sessions.values())
    _sessions.clear()
    for session in sessions:
        if not session.closed:
            await session.close()


__all__ = ["HTTPError", "close_sessions", "get", "post"]
