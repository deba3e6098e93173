"""An OpenAI request body read into a `Plan`: every field is sampled by, accepted and ignored, or
refused, each by name.

A client that sends a field the engine would not honour must hear so: a `response_format` or a
`presence_penalty` dropped in silence gives an answer from another request than the one sent.
So each field of the two routes is a row of `FIELDS` (its JSON types and routes), of `IGNORED`
(fields about OpenAI's platform, not the sampling: accepted, no effect, listed in the README) or
of `REFUSED` (with what to do instead); any other field is a 400 that names it. vLLM's
extensions that change sampling (`top_k`, `repetition_penalty`, `stop_token_ids`, `ignore_eos`,
`skip_special_tokens`, `include_stop_str_in_output`, `chat_template_kwargs`, ...) are rows too.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vime.engine.http_common import BadRequest
from vime.engine.openai_api.chat import Tools, read_tools

if TYPE_CHECKING:
    from vime.engine.core.sampler import SamplingParams

CHAT, COMPLETIONS, BOTH = "chat", "completions", "both"
MAX_TOP_LOGPROBS = 20  # vLLM's default limit; OpenAI's own is 20 (chat) and 5 (completions)
COMPLETIONS_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat's is the context's room


@dataclass(frozen=True)
class Field:
    kinds: tuple[type, ...]  # its JSON types (int also passes for float)
    route: str = BOTH


FIELDS: dict[str, Field] = {
    "model": Field((str,)),
    "messages": Field((list,), CHAT),
    "prompt": Field((str, list), COMPLETIONS),
    "max_tokens": Field((int,)),
    "max_completion_tokens": Field((int,), CHAT),
    "temperature": Field((float,)),
    "top_p": Field((float,)),
    "n": Field((int,)),
    "seed": Field((int,)),
    "stop": Field((str, list)),
    "stream": Field((bool,)),
    "stream_options": Field((dict,)),
    "logprobs": Field((bool, int)),  # chat: true or false; completions: how many likeliest tokens
    "top_logprobs": Field((int,), CHAT),
    "echo": Field((bool,), COMPLETIONS),
    "logit_bias": Field((dict,)),
    "frequency_penalty": Field((float,)),
    "presence_penalty": Field((float,)),
    "best_of": Field((int,), COMPLETIONS),  # n only
    "tools": Field((list,), CHAT),
    "tool_choice": Field((str, dict), CHAT),
    "parallel_tool_calls": Field((bool,), CHAT),
    "response_format": Field((dict,)),  # {"type": "text"} only
    "modalities": Field((list,), CHAT),  # ["text"] only
    # vLLM's extensions
    "top_k": Field((int,)),
    "min_p": Field((float,)),
    "repetition_penalty": Field((float,)),
    "stop_token_ids": Field((list,)),
    "ignore_eos": Field((bool,)),
    "skip_special_tokens": Field((bool,)),
    "include_stop_str_in_output": Field((bool,)),
    "priority": Field((int,)),
    "chat_template_kwargs": Field((dict,), CHAT),
    "add_generation_prompt": Field((bool,), CHAT),
    "continue_final_message": Field((bool,), CHAT),
}
# about OpenAI's platform (accounts, storage, billing, caching), not what is sampled
IGNORED = frozenset({"user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier"})
# vLLM's extensions the engine has no counterpart of, each with its value that asks for nothing
# (what clients written for vLLM send, whole sampling presets): taken at it, a 400 naming the
# field at any other (`echo` is the chat route's only: the completions route has its own)
AT_DEFAULT: dict[str, Any] = {
    "min_tokens": 0,
    "use_beam_search": False,
    "length_penalty": 1.0,
    "spaces_between_special_tokens": True,
    "echo": False,
    "return_tokens_as_token_ids": False,
    "bad_words": [],
}
REFUSED = {
    "functions": "deprecated by OpenAI: give tools",
    "function_call": "deprecated by OpenAI: give tool_choice",
    "suffix": "the vime engine does not fill in the middle",
    "audio": "the vime engine answers text only",
    "prediction": "the vime engine has no predicted outputs",
    "web_search_options": "the vime engine has no web search",
    "reasoning_effort": "the vime engine has no reasoning effort: a chat template's own switch goes in chat_template_kwargs",
}


@dataclass(frozen=True)
class Prompt:
    ids: list[int]
    text: str | None  # what `echo` shows: the text sent, or the ids sent decoded; None for a chat


@dataclass(frozen=True)
class Plan:
    """What one request asks for, checked; the prompts are read by the route (they need the
    tokenizer, and a chat's the template)."""

    chat: bool
    model: str | None
    params: SamplingParams  # max_new_tokens is set per prompt (`max_new_tokens`)
    max_tokens: int | None  # asked; None: the route's default
    stream: bool = False
    include_usage: bool = False
    logprobs: int | None = None  # None: none; k: each token's log-prob and the k likeliest
    echo: bool = False
    stop: tuple[str, ...] = ()
    include_stop: bool = False
    skip_special_tokens: bool = True
    tools: Tools | None = None  # shown to the model and read back
    parallel_tool_calls: bool = True  # false: the first call only (as vLLM)
    template_kwargs: dict = field(default_factory=dict)

    def max_new_tokens(self, prompt_len: int, max_seq_len: int) -> int:
        """The request's output limit for a prompt of `prompt_len` tokens: a limit that cannot fit
        the context is refused (as OpenAI and vLLM do), never cut short in silence."""
        room = max_seq_len - prompt_len
        if self.max_tokens is None:
            return room if self.chat else min(COMPLETIONS_MAX_TOKENS, room)
        if self.max_tokens > room:
            raise BadRequest(
                f"max_tokens {self.max_tokens} and the prompt's {prompt_len} tokens are more than the model's "
                f"context of {max_seq_len} tokens: ask for at most {room}"
            )
        return self.max_tokens


def _checked(body: dict, route: str) -> dict[str, Any]:
    """The body's fields that matter (None is absent, as clients send unset fields), each of a
    known row, for this route and of its type."""
    given = {k: v for k, v in body.items() if v is not None and k not in IGNORED}
    for name in given.keys() & REFUSED.keys():
        raise BadRequest(f"field '{name}' is not supported: {REFUSED[name]}")
    unknown = sorted(k for k in given if k not in FIELDS or FIELDS[k].route not in (BOTH, route))
    for name in [k for k in unknown if k in AT_DEFAULT]:
        if given.pop(name) != AT_DEFAULT[name]:
            raise BadRequest(
                f"{name} {body[name]!r} is not supported: the vime engine takes it at {AT_DEFAULT[name]!r} only"
            )
        unknown.remove(name)
    if unknown:
        raise BadRequest(
            f"unsupported field(s) {unknown} for /v1/{'chat/completions' if route == CHAT else 'completions'}: "
            "the vime engine would not honour them (the README's 'Serving a checkpoint' lists what it takes)"
        )
    for name, value in given.items():
        kinds = FIELDS[name].kinds
        ok = isinstance(value, kinds) and (not isinstance(value, bool) or bool in kinds)
        if float in kinds and isinstance(value, int) and not isinstance(value, bool):
            ok = True
        if not ok:
            raise BadRequest(f"field '{name}' has the wrong type ({type(value).__name__})")
    return given


def _only(given: dict, name: str, allowed: Any, why: str) -> None:
    if name in given and given[name] != allowed:
        raise BadRequest(f"{name} {given[name]!r} is not supported: {why}")


def _logprobs(given: dict, chat: bool) -> int | None:
    """None (no log-probs) or how many likeliest tokens come with each token's log-prob."""
    if chat:
        if not isinstance(given.get("logprobs", False), bool):
            raise BadRequest(
                f"logprobs of /v1/chat/completions is true or false (top_logprobs says how many), got {given['logprobs']!r}"
            )
        top = given.get("top_logprobs")
        if top is not None and not given.get("logprobs"):
            raise BadRequest("top_logprobs needs logprobs: true")
        k = (top or 0) if given.get("logprobs") else None
    else:
        k = given.get("logprobs")
        if k is not None and (isinstance(k, bool) or not isinstance(k, int)):
            raise BadRequest(
                f"logprobs of /v1/completions is how many likeliest tokens to list (0-{MAX_TOP_LOGPROBS}), got {k!r}"
            )
    if k is not None and not 0 <= k <= MAX_TOP_LOGPROBS:
        raise BadRequest(f"{'top_logprobs' if chat else 'logprobs'} {k}: give 0 to {MAX_TOP_LOGPROBS}")
    return k


def _stop(given: dict) -> tuple[str, ...]:
    stop = given.get("stop", ())
    stop = [stop] if isinstance(stop, str) else stop
    if not all(isinstance(s, str) and s for s in stop):
        raise BadRequest("stop must be a non-empty string or a list of them")
    return tuple(stop)


def _stream_options(given: dict) -> bool:
    """include_usage; stream_options without stream, or with keys the engine lacks, is refused."""
    options = given.get("stream_options")
    if options is None:
        return False
    if not given.get("stream"):
        raise BadRequest("stream_options needs stream: true")
    unknown = sorted(set(options) - {"include_usage"})
    if unknown:
        raise BadRequest(f"unsupported stream_options {unknown}: the vime engine takes include_usage")
    if not isinstance(options.get("include_usage", False), bool):
        raise BadRequest("stream_options.include_usage must be true or false")
    return bool(options.get("include_usage"))


def _limits(given: dict) -> None:
    """Fields the engine takes at one value only: their neutral one."""
    if "best_of" in given and given["best_of"] != given.get("n", 1):
        raise BadRequest(f"best_of {given['best_of']} is not supported: the vime engine returns every sample (n)")
    _only(given, "modalities", ["text"], "the vime engine answers text only")
    kind = given.get("response_format", {}).get("type", "text")
    if kind != "text":
        raise BadRequest(
            f"response_format {kind!r} is not supported: the vime engine has no constrained decoding (ask for JSON "
            "in the prompt, and parse the text)"
        )


def read_plan(body: dict, chat: bool) -> Plan:
    """The request's `Plan`; a BadRequest (400) naming the first field that is wrong."""
    from vime.engine.core.sampler import SamplingParams  # torch: loaded with the engine, not with the routes

    given = _checked(body, CHAT if chat else COMPLETIONS)
    _limits(given)
    max_tokens = given.get("max_completion_tokens", given.get("max_tokens"))
    if max_tokens is not None and max_tokens < 0:
        raise BadRequest(f"max_tokens {max_tokens} must be >= 0")
    stop = _stop(given)
    keys = (
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "n",
        "stop_token_ids",
        "ignore_eos",
        "repetition_penalty",
        "logit_bias",
        "presence_penalty",
        "frequency_penalty",
    )
    params = SamplingParams.from_dict(
        {
            **{k: given[k] for k in keys if k in given},
            "stop": stop,  # the engine ends a sample on one; the answer's text ends before it
            "sampling_seed": given.get("seed"),
            "priority": given.get("priority", 0),
        }
    )
    template_kwargs = dict(given.get("chat_template_kwargs", {}))
    for name in ("add_generation_prompt", "continue_final_message"):
        if name in given:
            template_kwargs[name] = given[name]
    return Plan(
        chat=chat,
        model=given.get("model"),
        params=params,
        max_tokens=max_tokens,
        stream=given.get("stream", False),
        include_usage=_stream_options(given),
        logprobs=_logprobs(given, chat),
        echo=given.get("echo", False),
        stop=stop,
        include_stop=given.get("include_stop_str_in_output", False),
        skip_special_tokens=given.get("skip_special_tokens", True),
        tools=read_tools(given.get("tools"), given.get("tool_choice")),
        parallel_tool_calls=given.get("parallel_tool_calls", True),
        template_kwargs=template_kwargs,
    )
