"""`from vime.utils.http_utils import post, get` (and slime's `slime.utils.http_utils`): JSON over
HTTP, as vllm-project/vime's plug-ins call their engines' router
(`http://{args.vllm_router_ip}:{args.vllm_router_port}/inference/v1/generate`) and slime's call
SGLang's (`http://{args.sglang_router_ip}:{args.sglang_router_port}/generate`), both served in vime
by vime/compat/router.py. A request to that router carries the run's key when the run has one
(the router notes it in `ROUTER_KEYS`), so a plug-in written for a router without keys works
behind one.

A call retries a connection that fails or a 5xx answer `max_retries` times, with a short
backoff; a 4xx answer is the request's own fault and raises at once with the server's message.
One aiohttp session per event loop, kept for the loop's life (a plug-in makes thousands of calls)
and closed with the run (`close_sessions`), so a run that used it ends without aiohttp's
unclosed-session errors. A session holds up to 100 connections (aiohttp's default), or, after
slime's `init_http_client(args)`, slime's `--sglang-server-concurrency` × engines, as slime sizes
its client. slime's `--use-distributed-post` (posts spread over Ray actors) has no vime
counterpart: vime runs no Ray, and a plug-in's posts go out from the rollout process.
slime's `get_host_info`, `find_available_port` and `is_port_available` serve a plug-in that starts
a server of its own and says where it listens.
"""

from __future__ import annotations

import asyncio
import os
import random
import socket
from typing import Any
from urllib.parse import urlsplit

import aiohttp

_sessions: dict[int, aiohttp.ClientSession] = {}
_connection_limit = 100  # per session; init_http_client sets slime's
# the key each keyed router of this process wants, by its address ("127.0.0.1:port")
ROUTER_KEYS: dict[str, str] = {}


class HTTPError(RuntimeError):
    """A request that got no usable answer: the URL, the status and what the server said."""


def _session() -> aiohttp.ClientSession:
    loop = asyncio.get_running_loop()
    session = _sessions.get(id(loop))
    if session is None or session.closed:
        session = _sessions[id(loop)] = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None), connector=aiohttp.TCPConnector(limit=_connection_limit)
        )
    return session


async def _request(method: str, url: str, payload: Any, headers: dict | None, max_retries: int) -> Any:
    key = ROUTER_KEYS.get(urlsplit(url).netloc)
    if key is not None and not any(h.lower() == "authorization" for h in headers or {}):
        headers = {**(headers or {}), "Authorization": f"Bearer {key}"}
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


def get_rollout_num_engines(args: Any) -> int:
    """How many rollout engines the run has (slime's helper: its plug-ins scale their concurrency by it)."""
    runtime = getattr(args, "runtime", None)
    if runtime is not None and runtime.engines:
        return len(runtime.engines)
    return max(1, (args.rollout_num_gpus or 1) // max(1, args.rollout_num_gpus_per_engine))


def init_http_client(args: Any) -> None:
    """slime's: size the connections `post` may hold open at once to what the engines take
    (`args.sglang_server_concurrency` per engine), so a plug-in that sends a whole rollout's
    requests at once is not held to aiohttp's 100. vime needs no client made before `post`; a
    session already open on a loop keeps its size, as slime keeps a client it made."""
    global _connection_limit
    concurrency = getattr(args, "sglang_server_concurrency", None)
    if concurrency:
        _connection_limit = int(concurrency) * get_rollout_num_engines(args)


def is_port_available(port: int) -> bool:
    """slime's: whether a TCP port can be bound and listened on here now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
            s.listen(1)
        except (OSError, OverflowError):
            return False
    return True


def find_available_port(base_port: int) -> int:
    """slime's: a free port a few hundred above `base_port` (random, so processes that start
    together rarely pick the same one), for a server a plug-in starts itself."""
    port = base_port + random.randint(100, 1000)
    while not is_port_available(port):
        port = port + 42 if port < 60000 else port - 43
    return port


def get_host_info() -> tuple[str, str]:
    """slime's: this host's name and the address other machines reach it at, for a plug-in that
    serves something and tells others where: `SLIME_HOST_IP` where set, else the address of the
    interface the default route leaves by (a UDP socket's, which sends nothing), else loopback."""
    hostname = socket.gethostname()
    given = os.environ.get("SLIME_HOST_IP")
    if given:
        return hostname, given
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("10.255.255.255", 1))
            return hostname, s.getsockname()[0]
    except OSError:
        return hostname, "127.0.0.1"


async def close_sessions() -> None:
    """Close the sessions of every loop (called on the rollout loop as a run closes)."""
    sessions = list(_sessions.values())
    _sessions.clear()
    for session in sessions:
        if not session.closed:
            await session.close()


__all__ = [
    "HTTPError",
    "close_sessions",
    "find_available_port",
    "get",
    "get_host_info",
    "get_rollout_num_engines",
    "init_http_client",
    "is_port_available",
    "post",
]
