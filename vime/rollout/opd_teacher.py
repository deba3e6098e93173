"""The teacher engine a served on-policy distillation asks (`--opd-type sglang`: SGLang's scoring
request, which `vime serve` answers too), and what vLLM's teacher (opd_vllm.py) shares with it:
the connection, the vocabulary check, the one-line `TeacherError`. The slime-facing functions
that use them are in on_policy_distillation.py.
"""

from __future__ import annotations

import asyncio
import math
import os
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import aiohttp

from vime.models import load_tokenizer, read_config, table_fits, vocab_size_of
from vime.rollout.rewards import RewardSettingError
from vime.rollout.rewards.remote import RemoteReward, RemoteRewardError
from vime.rollout.types import Sample

API_KEY_ENV = "VIME_TEACHER_API_KEY"  # the teacher engine's key (`vime serve --api-key`), if it has one


# A log-prob above 0 is a probability above 1: a teacher that answers one is not scoring. Rounding
# of a near-certain token's log-softmax stays far below this (bf16 rounds 1.0 by at most 2^-8).
LOGPROB_TOLERANCE = 1e-2


class TeacherError(RewardSettingError):
    """The teacher cannot score this run's tokens (one line; stops the run)."""


class ImpossibleLogProb(ValueError):
    """A teacher answered a log-prob above 0 for a sample: that sample's reward is an error
    (`rollout/reward_errors`) and it trains without the teacher's term."""


class Teacher(RemoteReward):
    """The teacher engine at one `--rm-url`, asked SGLang's way (`--opd-type sglang`): one scoring
    request per sample, and its vocabulary compared with the student's on the first contact.
    `VLLMTeacher` (opd_vllm.py) asks vLLM's way; the rest is this class's."""

    kind = "sglang"
    routes = "its /generate"  # what --rm-url should be, named in a refusal

    def __init__(self, url: str, timeout: float, model_dir: str | None) -> None:
        key = os.environ.get(API_KEY_ENV)
        super().__init__(self.endpoint(url), timeout, {"Authorization": f"Bearer {key}"} if key else None)
        self.model_dir = model_dir
        self.checked = model_dir is None  # no student to compare with: no check
        self._locks: dict[asyncio.AbstractEventLoop, asyncio.Lock] = {}

    @staticmethod
    def endpoint(url: str) -> str:
        return generate_url(url)

    def body(self, sample: Sample) -> dict[str, Any]:
        return {
            "input_ids": list(sample.tokens),
            "sampling_params": {"max_new_tokens": 0, "temperature": 0.0, "skip_special_tokens": False},
            "return_logprob": True,
            "logprob_start_len": sample.prompt_length,  # the first response token's position
        }

    def log_probs(self, answer: Any, sample: Sample) -> list[float]:
        """The teacher's log-prob of each of `sample`'s response tokens, read from its answer."""
        return teacher_log_probs(answer, sample, self.url)

    async def score(self, sample: Sample) -> Any:
        if not self.checked:
            async with self._locks.setdefault(asyncio.get_running_loop(), asyncio.Lock()):
                if not self.checked:
                    await self._check_vocabulary()
        try:
            answer = await self(sample)
        except RemoteRewardError as e:  # a refusal, not a busy teacher: every sample would get it
            raise TeacherError(
                f"--opd-type {self.kind}: the teacher {e} (is --rm-url {self.routes}, and {API_KEY_ENV} its key?)"
            ) from None
        highest = max(self.log_probs(answer, sample), default=0.0)  # an answer of another shape: TeacherError
        if highest > LOGPROB_TOLERANCE:
            raise ImpossibleLogProb(
                f"--opd-type {self.kind}: the teacher at {self.url} answered sample {sample.index} with the log-prob "
                f"{highest:g}, above 0 (a probability above 1): it is not scoring the tokens"
            )
        return answer

    async def _get(self, path: str, body: dict[str, Any] | None = None) -> Any:
        """The JSON answer of the teacher's `path` (a POST of `body`, else a GET), or None where it
        answers another status (a route it does not serve); ConnectionError where it cannot be
        reached (not up yet)."""
        url = urlunsplit(urlsplit(self.url)._replace(path=path, query=""))
        try:
            async with (
                aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout)) as session,
                session.request("POST" if body else "GET", url, json=body, headers=self.headers) as resp,
            ):
                return await resp.json(content_type=None) if resp.status == 200 else None
        except (aiohttp.ClientError, TimeoutError) as e:
            raise ConnectionError(f"{url}: {e}") from None
        except ValueError:  # 200 with a body that is not JSON
            return None

    async def _check_vocabulary(self) -> None:
        """The teacher's vocabulary size, where its `/get_model_info` says it (a vime engine does,
        SGLang does not), against the student's (`table_fits`): the teacher reads the student's
        token ids, which in another vocabulary are other tokens. A teacher not up yet is asked
        again at the next sample."""
        base = urlsplit(self.url).path.rstrip("/").removesuffix("/generate")
        try:
            info = await self._get(f"{base}/get_model_info")
        except ConnectionError:
            return
        self.checked = True
        theirs = info.get("vocab_size") if isinstance(info, dict) else None
        if theirs is None:
            return
        tokens = len(load_tokenizer(self.model_dir))
        ours = vocab_size_of(read_config(self.model_dir))
        if not table_fits(int(theirs), ours, tokens):
            raise TeacherError(
                f"--opd-type {self.kind}: the teacher at {self.url} has a vocabulary of {theirs} tokens and the "
                f"student {ours} (its tokenizer {tokens}): the teacher scores the student's token ids, so it needs the "
                "student's tokenizer; serve a teacher of the same family"
            )


def generate_url(url: str) -> str:
    """`--rm-url` as the teacher's `/generate` (slime's form); a bare `http://host:port` gets the path."""
    parts = urlsplit(url)
    return url if parts.path.rstrip("/") else urlunsplit(parts._replace(path="/generate"))


def teacher_log_probs(answer: Any, sample: Sample, url: str) -> list[float]:
    """The teacher's log-prob of each of `sample`'s response tokens, from its answer to
    `reward_func`'s request: `meta_info.input_token_logprobs`, one `[log-prob, token id, _]` per
    response token, the ids the sample's own."""
    where = f"--opd-type sglang: the teacher at {url} answered sample {sample.index}"
    items = (answer.get("meta_info") or {}).get("input_token_logprobs") if isinstance(answer, dict) else None
    if not isinstance(items, list):
        raise TeacherError(
            f"{where} without meta_info.input_token_logprobs: --rm-url must be a teacher engine's /generate "
            "(`vime serve`, or SGLang), not a reward model"
        )
    if len(items) != sample.response_length:
        raise TeacherError(
            f"{where} with {len(items)} log-probs for its {sample.response_length} response tokens: it must score "
            "from logprob_start_len (SGLang's /generate protocol)"
        )
    ids = [item[1] if isinstance(item, (list, tuple)) and len(item) > 1 else None for item in items]
    if ids != sample.response_tokens:
        raise TeacherError(f"{where} for other tokens than its response's: it must score the input_ids it is sent")
    values = [item[0] for item in items]
    bad = [v for v in values if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)]
    if bad:
        raise TeacherError(f"{where} with the log-prob {bad[0]!r}: every response token needs a finite one")
    return [float(v) for v in values]
