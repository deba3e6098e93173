"""On-policy distillation with the teacher served by vLLM (`--use-opd --opd-type vllm`,
vllm-project/vime's name): the same reward function, post-process and trainer term as `--opd-type sglang`
(on_policy_distillation.py; the base class: opd_teacher.py), with vLLM's request and answer.

    vllm serve TEACHER --port 30010 &
    vime train ... --use-opd --opd-type vllm --rm-url http://127.0.0.1:30010/v1/completions \\
        --custom-rm-path vime.rollout.on_policy_distillation.reward_func \\
        --custom-reward-post-process-path vime.rollout.on_policy_distillation.post_process_rewards

vLLM has no request that scores given tokens and generates nothing; the nearest is a prompt of
token ids with `prompt_logprobs` and one token to generate (`max_tokens` must be at least 1), the
generated token thrown away. vLLM then answers, for every prompt position but the first, the
log-prob of the token there given those before it: `prompt_logprobs`, a list as long as the
prompt, None first, then `{token id: {"logprob": ...}}`, the token's own entry always among them
(`prompt_logprobs: 0` asks for that one alone). These are the model's raw log-softmax (vLLM applies
no temperature or other sampling setting to prompt tokens, whatever its `--logprobs-mode`), as
the trainer's teacher computes them; a request that asks for them skips the prefix cache, so
each is a full prefill. Two routes take it, chosen by --rm-url's path:
* `/v1/completions` (a bare `http://host:port` gets it): the OpenAI route every vLLM server has;
  the log-probs are in `choices[0].prompt_logprobs`;
* `/inference/v1/generate`: vLLM's token-in/token-out route, which vllm-project/vime's scripts name
  (a server started with `--enable-scale-out`; vime's launched engines are); top-level
  `prompt_logprobs`.

The vocabulary check asks the teacher's `/tokenize` for a probe text's token ids and compares them
with the student's tokenizer's (vLLM names no vocabulary size anywhere; `/v1/models` says only
`max_model_len`): another tokenizer is refused in one line at start-up. A server without
`/tokenize` (started with `--skip-tokenizer-init`) is not checked. A student token id past the
teacher's table is vLLM's 400 ("Token id N is out of vocabulary"), a one-line `TeacherError`.
"""

from __future__ import annotations

import math
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from vime.models import load_tokenizer
from vime.rollout.opd_teacher import Teacher, TeacherError
from vime.rollout.types import Sample

COMPLETIONS = "/v1/completions"
GENERATE = "/inference/v1/generate"
ROUTES = (COMPLETIONS, GENERATE)
# Text whose token ids tell tokenizers apart: words, digits, punctuation, whitespace runs and
# non-ASCII, where vocabularies and their merges differ most.
PROBE = "On-policy distillation: 12 + 345 = 357, isn't it?\n\n\tnaïve café, 東京, ünïcödé 🙂 <tag>"


def vllm_url(url: str) -> str:
    """`--rm-url` as the teacher's route: a bare `http://host:port` gets `/v1/completions`."""
    parts = urlsplit(url)
    return url if parts.path.rstrip("/") else urlunsplit(parts._replace(path=COMPLETIONS))


def route_of(url: str) -> str | None:
    """Which of vLLM's two scoring routes `url` names (None: neither)."""
    path = urlsplit(vllm_url(url)).path.rstrip("/")
    return next((r for r in ROUTES if path.endswith(r)), None)


class VLLMTeacher(Teacher):
    """The teacher in a vLLM server at `--rm-url`: one prompt-log-probs request per sample."""

    kind = "vllm"
    routes = f"its {COMPLETIONS} or {GENERATE}"

    @staticmethod
    def endpoint(url: str) -> str:
        return vllm_url(url)

    def body(self, sample: Sample) -> dict[str, Any]:
        params = {"max_tokens": 1, "temperature": 0.0, "prompt_logprobs": 0}
        if route_of(self.url) == GENERATE:
            return {"token_ids": list(sample.tokens), "sampling_params": params}
        return {"prompt": list(sample.tokens), **params}

    def log_probs(self, answer: Any, sample: Sample) -> list[float]:
        return vllm_log_probs(answer, sample, self.url)

    async def _check_vocabulary(self) -> None:
        """The teacher's tokenizer against the student's: the token ids of `PROBE` from both. A
        teacher not up yet is asked again at the next sample."""
        base = urlsplit(self.url).path.rstrip("/")
        for route in ROUTES:
            base = base.removesuffix(route)
        try:
            answer = await self._get(f"{base}/tokenize", {"prompt": PROBE, "add_special_tokens": False})
        except ConnectionError:
            return
        self.checked = True
        theirs = answer.get("tokens") if isinstance(answer, dict) else None
        if theirs is None:
            return  # no /tokenize: nothing to compare (a student id past its table is still its 400)
        ours = list(load_tokenizer(self.model_dir).encode(PROBE, add_special_tokens=False))
        if theirs != ours:
            first = next((i for i, (a, b) in enumerate(zip(theirs, ours)) if a != b), min(len(theirs), len(ours)))
            raise TeacherError(
                f"--opd-type vllm: the teacher at {self.url} tokenizes text otherwise than the student (a probe's "
                f"{len(theirs)} tokens against {len(ours)}, first apart at token {first}): the teacher scores the "
                "student's token ids, so it needs the student's tokenizer; serve a teacher of the same family"
            )


def vllm_log_probs(answer: Any, sample: Sample, url: str) -> list[float]:
    """The teacher's log-prob of each of `sample`'s response tokens, from vLLM's answer to
    `VLLMTeacher.body`: entry i of `prompt_logprobs` scores token i of the sequence sent."""
    where = f"--opd-type vllm: the teacher at {url} answered sample {sample.index}"
    if isinstance(answer, dict) and "choices" in answer and "prompt_logprobs" not in answer:
        choices = answer["choices"]
        answer = choices[0] if isinstance(choices, list) and choices and isinstance(choices[0], dict) else {}
    items = answer.get("prompt_logprobs") if isinstance(answer, dict) else None
    if not isinstance(items, list):
        raise TeacherError(
            f"{where} without prompt_logprobs: --rm-url must be a vLLM server's {COMPLETIONS} or {GENERATE}, "
            "not a reward model"
        )
    if len(items) != len(sample.tokens):
        raise TeacherError(
            f"{where} with {len(items)} prompt log-probs for the {len(sample.tokens)} tokens sent: it must score "
            "every prompt token (vLLM's prompt_logprobs)"
        )
    out = []
    for position in range(sample.prompt_length, len(sample.tokens)):
        token, entry = sample.tokens[position], items[position]
        scored = entry.get(str(token), entry.get(token)) if isinstance(entry, dict) else None
        if scored is None:
            raise TeacherError(f"{where} without the log-prob of token {token} at position {position}, the one sent")
        value = scored.get("logprob") if isinstance(scored, dict) else scored
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise TeacherError(f"{where} with the log-prob {value!r}: every response token needs a finite one")
        out.append(float(value))
    return out
