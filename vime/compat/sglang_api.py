"""SGLang's native `/generate`, request and answer, as slime's plug-ins speak it to
`http://{args.sglang_router_ip}:{args.sglang_router_port}/generate` (the router serves it:
router.py). Each item of a request becomes one request of vime's engine protocol; each answer is
put back in SGLang's shape.

The shapes are SGLang's, read off its code: the request is `GenerateReqInput`
(`sglang/srt/managers/io_struct.py`: `text` or `input_ids`, one prompt or a list of them,
`sampling_params` one dict or one per prompt, `return_logprob`, `logprob_start_len`, `rid`,
`stream`), its sampling params are `sglang/srt/sampling/sampling_params.py`'s, and an answer is
what the tokenizer manager builds (`{text, output_ids, meta_info}`; `meta_info`: `id`,
`finish_reason` `{type: stop, matched: token id or string}` / `{type: length, length}` /
`{type: abort, message}`, `prompt_tokens`, `completion_tokens`, `cached_tokens`, `weight_version` (a string, as
SGLang's server args keep it), `e2e_latency`, and with `return_logprob`
`output_token_logprobs` as `[log-prob, token id, None]` triples (the token's text in place of
None with `return_text_in_logprobs`), `input_token_logprobs` from `logprob_start_len` on, the
first prompt token's log-prob None). A batch is answered with a list, one answer per prompt, as
is one prompt with `n` > 1. The text is decoded as SGLang's detokenizer does it
(`skip_special_tokens`, `spaces_between_special_tokens`) and cut at the stop it matched unless
`no_stop_trim`; `output_ids` and the log-probs keep every token generated.

vime's additions, which SGLang clients ignore: `meta_info.output_weight_versions`, the policy
version of each output token (`Sample.append_response_tokens` reads it, so a multi-turn sample
keeps each turn's versions). `cached_tokens` is 0 unless the engine tells (vime's engines count
prefix-cache hits per engine, not per request; clients read the key: strands-sglang's usage). Not
served: top log-probs, images and other media, LoRA, grammars.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

# SGLang's sampling params vime's engines take, by the same name (`priority` is vime's own: eval
# asks for it); the router hands them to the engines as they are
ENGINE_KEYS = frozenset(
    {
        "max_new_tokens",
        "temperature",
        "top_p",
        "top_k",
        "stop",
        "stop_token_ids",
        "ignore_eos",
        "n",
        "sampling_seed",
        "repetition_penalty",
        "min_p",
        "presence_penalty",
        "frequency_penalty",
        "logit_bias",
        "priority",
    }
)
DEFAULT_SERVER_CONCURRENCY = 512  # slime's --sglang-server-concurrency: requests in flight per engine
# how the answer's text is decoded, with SGLang's defaults
TEXT_KEYS = {"skip_special_tokens": True, "spaces_between_special_tokens": True, "no_stop_trim": False}
# SGLang's sampling params vime's engines have no counterpart of: taken at SGLang's default (what
# every slime plug-in sends), refused by name at any other value, which would sample otherwise
AT_DEFAULT = {
    "min_new_tokens": 0,
    "stop_regex": None,
    "json_schema": None,
    "regex": None,
    "ebnf": None,
    "structural_tag": None,
}
# no effect on the tokens: custom_params feeds a custom logit processor (refused below),
# stream_interval paces a stream
IGNORED_KEYS = frozenset({"custom_params", "stream_interval"})
# request fields that need what vime's rollout does not have, refused when given (a value that
# asks for nothing passes)
UNSERVED = {
    "input_embeds": "prompts as embeddings",
    "image_data": "images (vime rolls out text)",
    "video_data": "videos (vime rolls out text)",
    "audio_data": "audio (vime rolls out text)",
    "lora_path": "LoRA adapters per request",
    "custom_logit_processor": "custom logit processors",
    "top_logprobs_num": "top log-probs",
    "token_ids_logprob": "log-probs of chosen token ids",
    "return_hidden_states": "hidden states",
    "return_routed_experts": "routed experts (vime trains dense models)",
    "session_params": "sessions",
}
DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's, for a request that names none


class RequestError(ValueError):
    """A request the router cannot serve; answered 400 with this message, SGLang's way."""


@dataclass
class Item:
    """One prompt of a request: what goes to the engines and how its answer is written."""

    input_ids: list[int]
    params: dict[str, Any]  # vime's engine protocol sampling params
    text: dict[str, bool] = field(default_factory=lambda: dict(TEXT_KEYS))
    return_logprob: bool = False
    logprob_start_len: int = -1  # -1: no prompt log-probs (SGLang's default)
    return_text_in_logprobs: bool = False
    rid: str = ""


@dataclass
class Request:
    items: list[Item]
    batch: bool  # answered with a list (several prompts, or n > 1)
    stream: bool


def parse_generate(body: Any, tokenizer: Any) -> Request:
    """The items of a `/generate` body; a body vime cannot serve is a RequestError naming why."""
    if not isinstance(body, dict):
        raise RequestError("the body must be a JSON object (SGLang's GenerateReqInput)")
    for name, what in UNSERVED.items():
        if body.get(name) not in (None, False, 0, [], {}):
            raise RequestError(f"{name}: vime's router does not serve {what}")
    prompts, batch = _prompts(body, tokenizer)
    n = len(prompts)
    params = _per_item(body, "sampling_params", n, dict, {})
    logprob = _per_item(body, "return_logprob", n, bool, False)
    start = _per_item(body, "logprob_start_len", n, int, -1)
    rids = _rids(body.get("rid"), n)
    items = [
        Item(
            ids,
            *_sampling(p),
            return_logprob=bool(lp),
            logprob_start_len=s,
            return_text_in_logprobs=bool(body.get("return_text_in_logprobs")),
            rid=r,
        )
        for ids, p, lp, s, r in zip(prompts, params, logprob, start, rids)
    ]
    many = [it for it in items if int(it.params.get("n", 1)) != 1]
    if many and (batch or int(many[0].params["n"]) < 1):
        raise RequestError("n must be 1 in a batch, and at least 1 (send one request per prompt)")
    return Request(items, batch or bool(many), bool(body.get("stream")))


def _prompts(body: dict, tokenizer: Any) -> tuple[list[list[int]], bool]:
    """The prompts' ids, from `text` (tokenized as SGLang does, with the tokenizer's special
    tokens) or `input_ids`, and whether the request is a batch."""
    text, ids = body.get("text"), body.get("input_ids")
    if (text is None) == (ids is None):
        raise RequestError("give either text or input_ids (one prompt, or a list of them for a batch)")
    if text is not None:
        texts = text if isinstance(text, list) else [text]
        if not texts or not all(isinstance(t, str) for t in texts):
            raise RequestError("text must be a string or a non-empty list of strings")
        return [list(tokenizer.encode(t)) for t in texts], isinstance(text, list)
    batch = isinstance(ids, list) and bool(ids) and isinstance(ids[0], list)
    prompts = ids if batch else [ids]
    for p in prompts:
        if not isinstance(p, list) or not p or not all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            raise RequestError("input_ids must be a non-empty list of token ids, or a list of such lists")
    return prompts, batch


def _per_item(body: dict, name: str, n: int, kind: type, default: Any) -> list[Any]:
    """A field given once for all prompts or as a list of one value per prompt."""
    value = body.get(name)
    values = value if isinstance(value, list) else [value] * n
    if len(values) != n:
        raise RequestError(f"{name} is a list of {len(values)} for {n} prompts")
    out = [default if v is None else v for v in values]
    if not all(isinstance(v, kind) and (kind is bool or not isinstance(v, bool)) for v in out):
        raise RequestError(f"{name} must be {kind.__name__} (or a list of one per prompt)")
    return out


def _rids(rid: Any, n: int) -> list[str]:
    """One request id per prompt: the given ones; for a batch with one string, that string with
    each prompt's index (SGLang's prefix rule); new ones where none is given."""
    if rid is None:
        return [uuid.uuid4().hex for _ in range(n)]
    if isinstance(rid, str):
        return [rid] if n == 1 else [f"{rid}_{i}" for i in range(n)]
    if isinstance(rid, list) and len(rid) == n and all(isinstance(r, str) and r for r in rid):
        return list(rid)
    raise RequestError(f"rid must be a string or a list of {n} strings")


def _sampling(given: dict[str, Any]) -> tuple[dict[str, Any], dict[str, bool]]:
    """SGLang's sampling params as vime's engine params and the text options."""
    unknown = sorted(k for k in given if k not in ENGINE_KEYS | TEXT_KEYS.keys() | AT_DEFAULT.keys() | IGNORED_KEYS)
    if unknown:
        raise RequestError(f"sampling_params {', '.join(unknown)}: not one of SGLang's sampling params vime takes")
    changed = sorted(k for k, v in AT_DEFAULT.items() if given.get(k) not in (None, v))
    if changed:
        raise RequestError(
            f"sampling_params {', '.join(changed)}: vime's engines sample without {'it' if len(changed) == 1 else 'them'} "
            f"(only SGLang's default is taken: {', '.join(f'{k}={AT_DEFAULT[k]}' for k in changed)})"
        )
    params = {k: v for k, v in given.items() if k in ENGINE_KEYS and v is not None}
    params.setdefault("max_new_tokens", DEFAULT_MAX_NEW_TOKENS)
    text = {k: bool(given[k]) if given.get(k) is not None else v for k, v in TEXT_KEYS.items()}
    return params, text


def answer(item: Item, out: dict[str, Any], tokenizer: Any, version: int | None, seconds: float) -> dict[str, Any]:
    """One engine answer (vime's protocol) in SGLang's shape; `version`: the engines' weight
    version now, for an answer whose engine gave none."""
    ids = [int(t) for t in out["output_ids"]]
    meta = out["meta_info"]
    kind = meta["finish_reason"]["type"]
    reason, text = _finish(kind, ids, item, tokenizer)
    own = meta.get("weight_version")
    info: dict[str, Any] = {
        "id": item.rid,
        "finish_reason": reason,
        "prompt_tokens": meta.get("prompt_tokens", len(item.input_ids)),
        "completion_tokens": len(ids),
        "cached_tokens": int(meta.get("cached_tokens") or 0),
        "weight_version": str(own if own is not None else version),
        "e2e_latency": seconds,
        "output_weight_versions": list(meta.get("output_weight_versions") or []),
    }
    if item.return_logprob:
        pieces = [tokenizer.decode([t]) if item.return_text_in_logprobs else None for t in ids]
        lps = meta.get("output_token_logprobs") or []
        info["output_token_logprobs"] = [[lp, t, p] for lp, t, p in zip(lps, ids, pieces)]
        if item.logprob_start_len >= 0:  # the engine answers them in SGLang's triples already
            info["input_token_logprobs"] = meta.get("input_token_logprobs") or []
    return {"text": text, "output_ids": ids, "meta_info": info}


def _finish(kind: str, ids: list[int], item: Item, tokenizer: Any) -> tuple[dict[str, Any], str]:
    """SGLang's finish reason and the answer's text, cut where SGLang's detokenizer cuts it
    (`trim_matched_stop`): a stop string matched ends the text before it (after it with
    `no_stop_trim`); a stop token matched is left out of the text unless `no_stop_trim`."""
    opts = item.text

    def decode(tokens: list[int]) -> str:
        return tokenizer.decode(
            tokens,
            skip_special_tokens=opts["skip_special_tokens"],
            spaces_between_special_tokens=opts["spaces_between_special_tokens"],
        )

    if kind == "length":
        return {"type": "length", "length": item.params["max_new_tokens"]}, decode(ids)
    if kind == "abort":
        return {"type": "abort", "message": "aborted"}, decode(ids)
    stops = item.params.get("stop") or []
    stops = [stops] if isinstance(stops, str) else stops
    text = decode(ids)
    # the stop string the engines ended on: the one that appears first (they match on text decoded
    # without special tokens, which the text here may keep)
    plain = tokenizer.decode(ids, skip_special_tokens=True)
    found = sorted((plain.find(s), s) for s in stops if s in plain)
    if found:
        matched = found[0][1]
        pos = text.find(matched)
        if pos >= 0:
            text = text[: pos + len(matched)] if opts["no_stop_trim"] else text[:pos]
        return {"type": "stop", "matched": matched}, text
    if not ids:
        return {"type": "stop", "matched": None}, text
    return {"type": "stop", "matched": ids[-1]}, text if opts["no_stop_trim"] else decode(ids[:-1])
