"""`--rm-type remote_rm --rm-url URL`: a reward model behind HTTP, as slime calls one.

Each sample is one POST of `{"prompt", "response", "label"}` (slime's body, so a server written
for slime answers vime unchanged); the answer's JSON is the reward, a number or a dict read at
`--reward-key` like any other reward. A reward model is a server that can be busy or restarting,
so a refused connection, a timeout of the socket or a 408/429/5xx is tried again, with a growing
pause, until `--reward-timeout` runs out; any other status is the server saying no, and fails the
sample at once. Either way a failure scores 0 and is counted, as every reward failure is: in
`rollout/reward_errors` where nothing answered at all (`Unreachable`) or the answer was a refusal,
in `rollout/reward_timeouts` where the server was there but slow. A reward model that goes away for
a minute costs that minute's rewards; one that stays away stops the run after
`--max-failed-reward-steps` steps (`vime/rollout/rewards/watch.py`).

At most `MAX_CONCURRENT` requests are open at once, whatever the batch: a reward model serves
the whole rollout, and a few hundred connections at once would be its own denial of service.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import TYPE_CHECKING, Any

import aiohttp

from vime.rollout.rewards.runner import RewardRunner
from vime.rollout.types import Sample

if TYPE_CHECKING:
    from vime.rollout.settings import RolloutConfig

MAX_CONCURRENT = 64
# the most of an answer read: a reward is a number, a teacher's answer a few log-probs per token
# (a 32k-token sample with its top-k is a few MiB); a service answering gigabytes was read whole,
# 64 samples at once, into the rollout's memory
MAX_ANSWER_BYTES = 64 * 2**20
RETRY_STATUSES = frozenset({408, 429, 500, 502, 503, 504})
FIRST_PAUSE = 0.25  # seconds before the first retry; doubled each time, never past the deadline


class RemoteRewardError(Exception):
    """The reward model answered, but not with a reward (a refusal, or a body that is not JSON)."""


class Unreachable(ConnectionError):
    """Nothing answered at the URL (a refused connection, a name that does not resolve) for as
    long as the sample's --reward-timeout: the service is down, not busy. An error of the sample
    (`rollout/reward_errors`), not a timeout: a dead service counted as slow hid what was wrong."""


class RemoteReward:
    """The per-sample reward of `--rm-type remote_rm`. One semaphore per event loop: the run's
    rollout loop and a separate eval loop must not share an asyncio primitive."""

    def __init__(self, url: str, timeout: float, headers: dict[str, str] | None = None) -> None:
        self.url, self.timeout, self.headers = url, timeout, headers or {}
        self._limits: dict[asyncio.AbstractEventLoop, asyncio.Semaphore] = {}

    def body(self, sample: Sample) -> dict[str, Any]:
        """What one sample's request sends (the OPD teacher's request is another: on_policy_distillation.py)."""
        return {"prompt": sample.prompt, "response": sample.response, "label": sample.label}

    async def __call__(self, sample: Sample) -> Any:
        loop = asyncio.get_running_loop()
        limit = self._limits.setdefault(loop, asyncio.Semaphore(MAX_CONCURRENT))
        async with limit:
            return await asyncio.wait_for(self._post(self.body(sample)), self.timeout)

    async def _post(self, body: dict[str, Any]) -> Any:
        deadline = time.monotonic() + self.timeout
        pause = FIRST_PAUSE
        async with aiohttp.ClientSession() as session:
            while True:
                down: Exception | None = None  # the last try reached nothing
                try:
                    async with session.post(self.url, json=body, headers=self.headers) as resp:
                        text = await _bounded_text(resp, self.url)
                        if resp.status == 200:
                            return _json(text, self.url)
                        if resp.status not in RETRY_STATUSES:
                            raise RemoteRewardError(f"{self.url} answered {resp.status}: {text[:200]}")
                except aiohttp.ClientConnectorError as e:  # refused, or no such host: down or restarting
                    down = e
                except (TimeoutError, aiohttp.ClientConnectionError):
                    pass  # busy or restarting: try again while there is time
                if time.monotonic() + pause >= deadline:
                    if down is not None:
                        why = " ".join(str(down.os_error or down).split())[:120]
                        raise Unreachable(f"cannot be reached at {self.url} for {self.timeout:g}s ({why})")
                    raise TimeoutError()
                await asyncio.sleep(pause)
                pause *= 2


async def _bounded_text(resp: aiohttp.ClientResponse, url: str) -> str:
    """The answer's body as text, at most MAX_ANSWER_BYTES of it (a longer one is the sample's
    error); bytes that are not UTF-8 are replaced, and the JSON they spoil is refused as not JSON."""
    data = bytearray()
    async for chunk in resp.content.iter_any():
        data += chunk
        if len(data) > MAX_ANSWER_BYTES:
            raise RemoteRewardError(f"{url} answered more than {MAX_ANSWER_BYTES // 2**20} MiB: not a reward")
    return data.decode("utf-8", "replace")


def _json(text: str, url: str) -> Any:
    try:
        return json.loads(text)
    except (json.JSONDecodeError, RecursionError):  # RecursionError: nested too deeply
        raise RemoteRewardError(f"{url} answered 200 with a body that is not JSON: {text[:200]!r}") from None


def make_reward(rollout: RolloutConfig, runner: RewardRunner) -> RemoteReward:
    """MODULE_RM_TYPES' factory (`rollout`: the rollout component's settings): Config checked that
    --rm-url is an http(s) URL."""
    return RemoteReward(rollout.rm_url, runner.timeout)
