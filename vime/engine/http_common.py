"""HTTP plumbing shared by the engine's routes (`server.py`, `weight_routes.py`, `openai_api/`).

Request parsing (`read_body`, `body_field`, `BadRequest`), the error middleware that turns
exceptions into one-line JSON errors, and API-key auth. Kept apart so the route modules use one
copy without importing each other (the OpenAI routes reshape its errors: `openai_api/routes.py`).
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import logging
from collections.abc import Callable
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestPayloadError

log = logging.getLogger("vime.engine")


class BadRequest(ValueError):
    """The request itself is wrong: answered with HTTP 400 and this one-line message."""


def json_error(status: int, msg: str) -> web.Response:
    return web.json_response({"error": msg}, status=status)


@web.middleware
async def error_middleware(request: web.Request, handler: Callable) -> web.StreamResponse:
    """Map exceptions to one-line JSON errors: the caller's fault is a 400, ours a 500."""
    try:
        return await handler(request)
    except web.HTTPException:
        raise
    except RuntimeError as e:
        if getattr(e, "http_status", None) is None:  # ours: a 500 below
            return await _internal_error(request, e)
        return json_error(e.http_status, " ".join(str(e).split()))
    except (BadRequest, ValueError, KeyError, FileNotFoundError) as e:
        msg = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
        return json_error(400, " ".join(str(msg).split()))
    except Exception as e:
        return await _internal_error(request, e)


async def _internal_error(request: web.Request, e: Exception) -> web.Response:
    log.exception("error in %s", request.path, exc_info=e)
    return json_error(500, f"{type(e).__name__}: {' '.join(str(e).split())}")


def body_limit_middleware(limit: int, flag: str) -> Callable:
    """Refuse a request body over `limit` bytes with a one-line 413 naming the limit and `flag`,
    before any of it is read when the request says its length (a chunked one once it passes the
    limit): parsing a body of many megabytes holds the event loop, and /health with it."""

    def refused(size: int | None) -> web.Response:
        got = f"of {size} bytes " if size is not None else ""
        return json_error(
            413, f"request body {got}is over this engine's limit of {limit} bytes: send less, or raise {flag}"
        )

    @web.middleware
    async def check(request: web.Request, handler: Callable) -> web.StreamResponse:
        if request.content_length is not None and request.content_length > limit:
            return refused(request.content_length)
        try:
            return await handler(request)
        except web.HTTPRequestEntityTooLarge:
            return refused(None)

    return check


class _OneLine(logging.Filter):
    """aiohttp logs a request it cannot parse (a byte no URL may hold, a broken header) with its
    traceback: one per request, from anyone who reaches the port, key or not. Kept as one line.
    A body that does not decode as its Content-Encoding says (`gzip` over plain bytes) is one too:
    aiohttp reads what a refused request left unread after the 401, and logged that traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if isinstance(error, (HttpProcessingError, RequestPayloadError)):
            record.msg, record.args = f"{record.getMessage()}: {' '.join(str(error).split())[:200]}", ()
            record.exc_info, record.exc_text = None, None
        return True


logging.getLogger("aiohttp.server").addFilter(_OneLine())  # every engine process: they all import this


def page_guard(open_to_pages: Callable[[str], bool]) -> Callable:
    """Refuse a request a web page sent (it carries a browser's `Origin` header) to a route not
    open to pages. A page may POST `text/plain` to any address without a preflight, and the engine
    reads JSON whatever the Content-Type says, so without this any site open in the user's
    browser could drive a loopback engine that has no key: push weights, pause, abort. Programs
    (vime's client, slime's, OpenAI's, curl) send no `Origin`."""

    @web.middleware
    async def check(request: web.Request, handler: Callable) -> web.StreamResponse:
        if "Origin" in request.headers and not open_to_pages(request.path):
            return json_error(
                403,
                f"{request.path} is not served to web pages (the request has a browser's Origin header): call it from a program",
            )
        return await handler(request)

    return check


API_KEY_ENV = "VIME_API_KEY"
OPEN_ROUTES = ("/health",)  # liveness probes need no key; it reveals nothing but ok / not ok


def _presented(request: web.Request) -> bytes:
    """The Authorization header's bytes as sent. aiohttp decodes a header's bytes that are not
    UTF-8 to lone surrogates, which `.encode()` refused with a 500 and a traceback in the engine's
    log per request, sent by anyone who reaches the port, key or not."""
    value = request.headers.get("Authorization", "")
    try:
        return value.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:  # a surrogate no byte decodes to: not the key either
        return b""


def auth_middleware(api_key: str, whose: str = "the engine's --api-key") -> Callable:
    """Every route but /health needs `Authorization: Bearer <api_key>` (what vime's client, vLLM's
    and OpenAI's send). Compared in constant time, on any bytes the header holds. `whose`: where
    the key comes from, for the refusal."""
    expected = f"Bearer {api_key}".encode()

    @web.middleware
    async def check(request: web.Request, handler: Callable) -> web.StreamResponse:
        if request.path not in OPEN_ROUTES and not hmac.compare_digest(_presented(request), expected):
            return json_error(401, f"missing or wrong API key: send 'Authorization: Bearer <key>' ({whose})")
        return await handler(request)

    return check


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve anywhere
        return False


async def read_body(request: web.Request) -> dict:
    try:
        body = await request.json() if request.can_read_body else {}
    except json.JSONDecodeError:
        raise BadRequest("request body is not valid JSON") from None
    except RecursionError:  # `[[[[...` 100,000 deep: a 500 with a traceback in the log
        raise BadRequest("request body is JSON nested too deeply to read") from None
    except RequestPayloadError as e:  # a body that is not what its Content-Encoding says (gzip, deflate)
        raise BadRequest(f"request body cannot be read: {' '.join(str(e).split())}") from None
    except (LookupError, UnicodeDecodeError):  # a charset Python does not know, or bytes not of it
        raise BadRequest("request body is not text in the charset its Content-Type names (send UTF-8 JSON)") from None
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    return body


def body_field(body: dict, name: str, kind: type | tuple[type, ...], required: bool = True, default: Any = None) -> Any:
    if name not in body or body[name] is None:
        if required:
            raise BadRequest(f"missing field '{name}'")
        return default
    value = body[name]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        raise BadRequest(f"field '{name}' has the wrong type ({type(value).__name__})")
    return value
