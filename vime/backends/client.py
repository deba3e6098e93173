"""The engine protocol, client side.

Rollouts call the async `generate` (aiohttp, many requests in flight on one event loop); the
train loop calls the control methods synchronously (urllib, no event loop needed). Only
failures to connect are retried, never an answer: a 4xx means the request itself is wrong, and
a generate that reached the server may already be running.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import time
import urllib.error
import urllib.request
from typing import Any

import aiohttp

from vime.errors import EngineError


class EngineSilent(EngineError):
    """An engine whose process no longer answers at all (stopped, wedged, its host gone): the
    verdict of the runtime's health watch (vime/rollout/runtime.py), needing no second probe."""


def _one_line(text: str, limit: int = 500) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit] + "..."


class EngineClient:
    def __init__(
        self,
        url: str,
        timeout: float = 600.0,
        max_retries: int = 3,
        retry_backoff: float = 0.2,
        control_timeout: float | None = None,
        api_key: str | None = None,
    ):
        self.url = url.rstrip("/")
        # the engine's --api-key, sent with every request (vLLM and OpenAI servers read the same header)
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.timeout = timeout  # a generate: long responses take minutes
        # everything else (pause, push, health): none may hang a run
        self.control_timeout = min(timeout, 120.0) if control_timeout is None else control_timeout
        # requests an engine answers between two steps (health, pause, continue, abort): a live
        # engine answers within seconds, so the runtime bounds them by its health check's timeout
        self.quick_timeout = self.control_timeout
        self.max_retries = max(1, max_retries)
        self.retry_backoff = retry_backoff
        # aiohttp sessions belong to the loop they were made on; a client may be used from
        # several (the rollout loop, a test's asyncio.run), so keep one per loop.
        self._sessions: dict[asyncio.AbstractEventLoop, aiohttp.ClientSession] = {}

    def __repr__(self) -> str:
        return f"EngineClient({self.url!r})"

    # ---- async: generation -------------------------------------------------------------

    async def generate(
        self,
        input_ids: list[int],
        sampling_params: dict,
        return_logprob: bool = True,
        rid: str | None = None,
        return_routed_experts: bool = False,
        logprob_start_len: int | None = None,
    ) -> Any:
        """POST /generate; returns the response body (a dict, or a list of dicts when n > 1).
        `return_routed_experts`: a mixture of experts' routing in `meta_info["routed_experts"]`
        (SGLang's field, sent only when asked: an engine that does not know it may refuse it).
        `logprob_start_len`: also the prompt's log-probs from there on (`input_token_logprobs`)."""
        body: dict[str, Any] = {
            "input_ids": list(input_ids),
            "sampling_params": sampling_params,
            "return_logprob": return_logprob,
            "return_text": False,  # the rollout decodes the ids itself: the engine need not
        }
        if rid is not None:
            body["rid"] = rid
        if return_routed_experts:
            body["return_routed_experts"] = True
        if logprob_start_len is not None:
            body["logprob_start_len"] = logprob_start_len
        return await self.apost("/generate", body)

    async def apost(self, route: str, body: dict) -> Any:
        session = self._session()
        last: Exception | None = None
        for attempt in range(self.max_retries):
            try:
                async with session.post(self.url + route, json=body) as resp:
                    text = await resp.text()
                    if resp.status != 200:
                        raise EngineError(f"engine at {self.url}{route}: HTTP {resp.status}: {_one_line(text)}")
                    return json.loads(text)
            except (aiohttp.ClientOSError, aiohttp.ServerDisconnectedError) as e:
                # refused, closed or reset (an engine that died or restarted): worth another try
                last = e
                if attempt + 1 < self.max_retries:
                    await asyncio.sleep(self.retry_backoff * 2**attempt)
            except TimeoutError:
                raise EngineError(f"engine at {self.url}{route} timed out after {self.timeout:g}s") from None
            except (aiohttp.ClientError, json.JSONDecodeError) as e:  # a broken answer: no retry, one line
                raise EngineError(
                    f"engine at {self.url}{route}: {type(e).__name__}: {_one_line(str(e), 200)}"
                ) from None
        raise EngineError(
            f"engine at {self.url} unreachable after {self.max_retries} tries ({_reason(last)}): is the server running?"
        ) from None

    def _session(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        for other in [lp for lp in self._sessions if lp.is_closed()]:
            del self._sessions[other]  # its loop is gone; the session cannot be used or closed
        session = self._sessions.get(loop)
        if session is None or session.closed:
            # No connection limit: a rollout keeps hundreds of generations in flight at once.
            session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=self.timeout),
                connector=aiohttp.TCPConnector(limit=0),
                headers=self.headers,
            )
            self._sessions[loop] = session
        return session

    async def unanswered(self, timeout: float) -> str | None:
        """Why /health got no answer within `timeout` s, or None when it got one. Any answer,
        503 included, proves the process alive: the requests it holds fail by themselves. A
        pooled connection the server had closed (servers drop idle ones) is tried again on a
        new one, not taken for silence; a refused connection is (nothing listens there)."""
        for attempt in range(2):
            try:
                async with self._session().get(
                    self.url + "/health", timeout=aiohttp.ClientTimeout(total=timeout)
                ) as resp:
                    await resp.read()
                    return None
            except TimeoutError:
                return f"no answer to /health within {timeout:g}s"
            except aiohttp.ClientConnectorError as e:  # refused, unreachable: no process answers there
                return _reason(e)
            except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as e:
                if attempt == 1:
                    return _reason(e)
            except aiohttp.ClientError:
                return None  # an answer, if a broken one: the process is there
        return None

    async def close(self) -> None:
        """Close this loop's session (call before the loop ends to avoid aiohttp warnings)."""
        session = self._sessions.pop(asyncio.get_running_loop(), None)
        if session is not None:
            await session.close()

    # ---- sync: control -----------------------------------------------------------------

    def health(self) -> dict:
        return self._request("GET", "/health", quick=True)

    def model_info(self) -> dict:
        return self._request("GET", "/get_model_info")

    def pause_generation(self, mode: str = "abort") -> dict:
        return self._request("POST", "/pause_generation", {"mode": mode}, quick=True)

    def continue_generation(self) -> dict:
        return self._request("POST", "/continue_generation", {}, quick=True)

    def abort_request(self, rid: str | None = None, abort_all: bool = False) -> dict:
        if (rid is None) == (not abort_all):
            raise ValueError("abort_request: give either rid or abort_all=True")
        body = {"abort_all": True} if abort_all else {"rid": rid}
        return self._request("POST", "/abort_request", body, quick=True)

    def flush_cache(self) -> dict:
        return self._request("POST", "/flush_cache", {})

    def update_weights_from_tensor(self, payload: dict, timeout: float | None = None) -> dict:
        """payload: {transport: "shm", path, weight_version} or {transport: "cuda_ipc", handles, weight_version}.
        `timeout`: the push's (--update-weights-timeout), else the control timeout."""
        return self._request("POST", "/update_weights_from_tensor", payload, timeout=timeout)

    def update_weights_from_disk(
        self, model_path: str, weight_version: int | None = None, timeout: float | None = None, lora_base: bool = False
    ) -> dict:
        """Load weights from a safetensors directory. `lora_base` needs no word here: the engine
        keeps its copy of a LoRA base when the first adapters come (`vime/engine/core/lora.py`)."""
        body = {"model_path": str(model_path), "weight_version": weight_version}
        return self._request("POST", "/update_weights_from_disk", body, timeout=timeout)

    def init_weights_update_group(self, body: dict) -> dict:
        """Ask the engine to join a trainer's weight group (vime/transport/group.py); answers
        once it has joined."""
        return self._request("POST", "/init_weights_update_group", body)

    def update_weights_from_distributed(self, body: dict) -> dict:
        """Announce one bucket; answers once the engine has received it and copied it in."""
        return self._request("POST", "/update_weights_from_distributed", body)

    def destroy_weights_update_group(self, body: dict) -> dict:
        return self._request("POST", "/destroy_weights_update_group", body)

    def weight_checksums(self) -> dict[str, list[int]]:
        """vime.transport.checksums (bit sum, count) of each weight the engine holds, by HF name (the proof a push
        arrived: WeightPusher compares them with the trainer's)."""
        return self._request("GET", "/weight_checksums")["checksums"]

    def release_memory_occupation(self) -> dict:
        return self._request("POST", "/release_memory_occupation", {})

    def resume_memory_occupation(self) -> dict:
        return self._request("POST", "/resume_memory_occupation", {})

    def _request(
        self, method: str, route: str, body: dict | None = None, timeout: float | None = None, quick: bool = False
    ) -> dict:
        """`quick`: a call a live engine answers between two steps (health, pause, continue,
        abort), bounded by `quick_timeout`; no answer within it is silence (EngineSilent), the
        verdict a health probe would give, so no second wait follows."""
        timeout = self.quick_timeout if quick else self.control_timeout if timeout is None else timeout
        data = None if body is None else json.dumps(body).encode()
        last: Exception | None = None
        for attempt in range(self.max_retries):
            req = urllib.request.Request(
                self.url + route, data=data, method=method, headers={"Content-Type": "application/json", **self.headers}
            )
            try:
                with urllib.request.urlopen(req, timeout=timeout) as resp:
                    return json.loads(resp.read() or b"{}")
            except urllib.error.HTTPError as e:
                raise EngineError(
                    f"engine at {self.url}{route}: HTTP {e.code}: {_one_line(e.read().decode(errors='replace'))}"
                ) from None
            except (TimeoutError, urllib.error.URLError) as e:
                reason = getattr(e, "reason", e)
                if isinstance(e, TimeoutError) or isinstance(reason, TimeoutError):
                    if quick:
                        raise EngineSilent(
                            f"engine at {self.url} stopped answering (no answer to {route} within {timeout:g}s)"
                        ) from None
                    raise EngineError(f"engine at {self.url}{route} timed out after {timeout:g}s") from None
                if not isinstance(reason, ConnectionError):
                    raise EngineError(f"engine at {self.url}{route}: {_one_line(str(reason))}") from None
                last = reason
            except ConnectionError as e:  # reset or closed mid-request
                last = e
            except (http.client.HTTPException, json.JSONDecodeError) as e:  # a broken answer: no retry, one line
                raise EngineError(
                    f"engine at {self.url}{route}: {type(e).__name__}: {_one_line(str(e), 200)}"
                ) from None
            if attempt + 1 < self.max_retries:
                time.sleep(self.retry_backoff * 2**attempt)
        raise EngineError(
            f"engine at {self.url} unreachable after {self.max_retries} tries ({_reason(last)}): is the server running?"
        )


def _reason(e: BaseException | None) -> str:
    if isinstance(e, aiohttp.ClientConnectorError):
        e = e.os_error
    if isinstance(e, ConnectionRefusedError):
        return "connection refused"
    if isinstance(e, aiohttp.ServerDisconnectedError):
        return "server disconnected"
    if isinstance(e, (ConnectionResetError, aiohttp.ClientOSError)) and "reset" in str(e).lower():
        return "connection reset"
    return _one_line(str(e) or type(e).__name__, 200)
