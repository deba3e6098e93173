"""On-policy distillation with a teacher served by an engine (`--use-opd --opd-type sglang`, or
`vllm`: opd_vllm.py): slime's `slime.rollout.on_policy_distillation`, whose path loads this module.

    vime serve --model-path TEACHER --port 30010 &
    vime train ... --use-opd --opd-type sglang --rm-url http://127.0.0.1:30010/generate \\
        --custom-rm-path vime.rollout.on_policy_distillation.reward_func \\
        --custom-reward-post-process-path vime.rollout.on_policy_distillation.post_process_rewards

`reward_func` sends each sample's prompt + response tokens to the teacher's `/generate` with
nothing to generate (`max_new_tokens: 0`) and `logprob_start_len` at the response's first token:
SGLang's scoring request, which a vime engine answers too (engine/core/scoring.py), so the teacher
scores exactly the tokens the student drew, and only those. Its answer is the sample's reward
answer. The calls go through vime's reward runner: all of a group's at once, at most 64 open per
teacher, each retried while the teacher is busy (a vime engine answers 503 while its KV cache is
full) until `--reward-timeout`. One that still fails scores 0, counts in `rollout/reward_errors`,
and its sample trains without the teacher's term, as a failed reward costs a reward, not the run.
What no retry can mend stops the run in one line (`TeacherError`): a teacher of another vocabulary
(its `/get_model_info`, asked once, where it says; a table padded to another size is the same
vocabulary: models.table_fits), a refusal (a 4xx: a wrong key or path, a
sequence longer than the teacher's context), an answer that is not a scoring of the tokens sent.

`post_process_rewards` stores the teacher's log-prob of each response token on its sample
(`Sample.teacher_log_probs`, which the trainer reads: algorithms/opd.py) and returns 0 as every
sample's reward, as slime's does: the run distills. To mix in a task reward, call it from a
post-process of your own and return the task's rewards instead.
"""

from __future__ import annotations

import asyncio
import math
import os
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import aiohttp

from vime.models import load_tokenizer, read_config, table_fits, vocab_size_of
from vime.plugins import PluginError
from vime.rollout.rewards import RewardSettingError
from vime.rollout.rewards.remote import RemoteReward, RemoteRewardError
from vime.rollout.settings import RolloutConfig
from vime.rollout.types import Sample, Status

API_KEY_ENV = "VIME_TEACHER_API_KEY"  # the teacher engine's key (`vime serve --api-key`), if it has one


class TeacherError(RewardSettingError):
    """The teacher cannot score this run's tokens (one line; stops the run)."""


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
            return await self(sample)
        except RemoteRewardError as e:  # a refusal, not a busy teacher: every sample would get it
            raise TeacherError(
                f"--opd-type {self.kind}: the teacher {e} (is --rm-url {self.routes}, and {API_KEY_ENV} its key?)"
            ) from None

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


_TEACHERS: dict[tuple[str, str, float, str | None], Teacher] = {}


def teacher_of(rollout: RolloutConfig, kind: str | None) -> Teacher:
    """The process's one teacher for the run's --opd-type (`kind`: sglang when not given) and
    --rm-url (its connection limit and checks shared by every sample)."""
    kind = kind or "sglang"
    model_dir = rollout.model_dir
    key = (kind, rollout.rm_url, float(rollout.reward_timeout), str(model_dir) if model_dir else None)
    if key not in _TEACHERS:
        if kind == "vllm":
            from vime.rollout.opd_vllm import VLLMTeacher as cls
        else:
            cls = Teacher
        _TEACHERS[key] = cls(rollout.rm_url, float(rollout.reward_timeout), key[3])
    return _TEACHERS[key]


def generate_url(url: str) -> str:
    """`--rm-url` as the teacher's `/generate` (slime's form); a bare `http://host:port` gets the path."""
    parts = urlsplit(url)
    return url if parts.path.rstrip("/") else urlunsplit(parts._replace(path="/generate"))


async def reward_func(args: Any, sample: Sample, **kwargs: Any) -> Any:
    """`--custom-rm-path`: the teacher's answer to the scoring request of `sample`'s response tokens
    (a sample without any asks nothing)."""
    if sample.response_length == 0:
        return {}  # nothing to score: the post-process reads no answer for it
    return await teacher_of(args.rollout, args.algorithm.opd_type).score(sample)


def post_process_rewards(args: Any, samples: list[Sample], **kwargs: Any) -> tuple[list[float], list[float]]:
    """`--custom-reward-post-process-path`: each sample's `teacher_log_probs` from the teacher's
    answer (None where its reward failed: it trains without the teacher's term), and 0 as every
    sample's reward, raw and trained (slime's pair)."""
    teacher = teacher_of(args.rollout, args.algorithm.opd_type)
    for s in samples:
        answer = s.reward_result
        if answer is None:
            s.teacher_log_probs = None
        else:
            s.teacher_log_probs = teacher.log_probs(answer, s) if s.response_length else []
    zeros = [0.0] * len(samples)
    return zeros, list(zeros)


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


def check_served(samples: list[Any], post_process: str) -> None:
    """A served teacher (`--opd-type sglang` or `vllm`), once the post-process ran: every sample whose reward (the teacher's
    answer) came has the teacher's log-prob of each response token; one line otherwise, naming
    the sample, before anything is trained on it."""
    for s in samples:
        scores = s.teacher_log_probs
        if scores is None and (s.reward_error is not None or s.status == Status.FAILED):
            continue  # the teacher was not reached: counted in rollout/reward_errors, trained without it
        if scores is None or len(scores) != s.response_length:
            what = "no" if scores is None else f"{len(scores)}"
            raise PluginError(
                f"--custom-reward-post-process-path {post_process} left sample {s.index} with {what} teacher log-probs "
                f"for its {s.response_length} response tokens: a served teacher's run trains on sample.teacher_log_probs, "
                "one per response token (vime.rollout.on_policy_distillation.post_process_rewards sets them)"
            )
