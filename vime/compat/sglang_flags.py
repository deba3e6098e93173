"""slime's `--sglang-NAME` flags: SGLang's server arguments, which slime adds to its command line
whole (every field of SGLang's `ServerArgs`, prefixed), and a few of slime's own about its SGLang
servers and router. Every run script of slime passes some (`--sglang-mem-fraction-static` in
all of them), so none may stop a script; vime starts no SGLang server, so each one either becomes
the vime setting or vLLM server argument that does the same (`ARGS`), or is named at start-up
with what vime does instead.

`take` collects them from the command line as a family (SGLang has hundreds, and grows), each
with the values after it; `effects` says what each given one does on this run's engines, for
`parse.translate` (which applies it) and `startup.notes` (which says it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from vime.config.parse import split_family
from vime.errors import ConfigError

PREFIX = "sglang_"  # slime's dests: sglang_mem_fraction_static


def _number(value: Any, what: str) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ValueError(what) from None


def _fraction(value: Any) -> float:
    f = _number(value, "a share of the GPU's memory, in (0, 1]")
    if not 0 < f <= 1:
        raise ValueError("a share of the GPU's memory, in (0, 1]")
    return f


def _count(value: Any) -> int:
    n = _number(value, "a whole number of at least 1")
    if n != int(n) or n < 1:
        raise ValueError("a whole number of at least 1")
    return int(n)


def _counts(value: Any) -> list[int]:
    return [_count(v) for v in (value if isinstance(value, list) else [value])]


def _switch(value: Any) -> bool:
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    if not isinstance(value, bool):
        raise ValueError("no value (it is a switch)")
    return value


def _as_given(value: Any) -> Any:
    return value


@dataclass(frozen=True)
class ServerArg:
    """One of SGLang's server arguments (`name`, its `ServerArgs` field) by what it becomes: the
    vime setting `setting` on any backend, the built-in engine's setting `builtin`, the vLLM server
    argument `vllm` of the vLLM servers vime starts. `same`: what vime always does. `says`: what
    vime does where none of those applies (start-up and docs/slime-flags.md)."""

    name: str
    read: Callable[[Any], Any] = _as_given  # the value as SGLang takes it (ValueError: what it takes)
    setting: str | None = None
    builtin: str | None = None
    vllm: str | None = None
    same: bool = False
    says: str = ""

    @property
    def flag(self) -> str:
        return "--sglang-" + self.name.replace("_", "-")


_GRAPHS = "the built-in engine captures decode graphs for every batch size up to --engine-max-num-seqs"
_ROUTER = "slime's SGLang router: vime routes requests to its engines itself"
ARGS: dict[str, ServerArg] = {
    a.name: a
    for a in [
        ServerArg(
            "mem_fraction_static",
            _fraction,
            builtin="engine_kv_cache_memory_fraction",
            vllm="gpu-memory-utilization",
            says="SGLang's share of the whole GPU (weights and KV cache); the built-in engine's is of the memory "
            "free once its weights are loaded",
        ),
        ServerArg("max_running_requests", _count, builtin="engine_max_num_seqs", vllm="max-num-seqs"),
        ServerArg("context_length", _count, setting="rollout_max_context_len", vllm="max-model-len"),
        ServerArg("cuda_graph_max_bs", _count, vllm="max-cudagraph-capture-size", says=_GRAPHS),
        ServerArg("cuda_graph_bs", _counts, vllm="cudagraph-capture-sizes", says=_GRAPHS),
        ServerArg(
            "disable_cuda_graph", _switch, vllm="enforce-eager", says="the built-in engine captures its decode graphs"
        ),
        ServerArg(
            "kv_cache_dtype", vllm="kv-cache-dtype", says="the built-in engine keeps its KV cache in the model's dtype"
        ),
        ServerArg(
            "disable_radix_cache",
            _switch,
            vllm="no-enable-prefix-caching",
            says="the built-in engine reuses the cached prefix of a group's prompt",
        ),
        ServerArg(
            "enable_deterministic_inference",
            _switch,
            same=True,
            says="every sample's draws are fixed by --rollout-seed and its index, as the engines' sampling_seed, "
            "whatever else shares the engine's batch",
        ),
        ServerArg("enable_metrics", _switch, same=True, says="the built-in engine always serves /metrics"),
        ServerArg(
            "attention_backend",
            says="the built-in engine runs its own attention kernels; vLLM names its backends otherwise: "
            "--vllm-attention-backend",
        ),
        ServerArg(
            "dp_size",
            _count,
            says="vime spreads requests over its engines itself (--rollout-num-gpus, --rollout-num-gpus-per-engine)",
        ),
        ServerArg(
            "server_concurrency",
            _count,
            says="vime sends a batch's requests at once, and each engine runs --engine-max-num-seqs of them at a "
            "time; plug-ins read the value as args.sglang_server_concurrency",
        ),
        ServerArg("router_ip", says=_ROUTER),
        ServerArg("router_port", says=_ROUTER),
        ServerArg("router_request_timeout_secs", says=_ROUTER),
    ]
}
OTHER = (
    "an argument of the SGLang servers slime starts, and vime starts none; with --rollout-backend vllm, vLLM's "
    "own arguments go as --vllm-NAME"
)


def server_concurrency(given: dict[str, Any], default: int) -> int:
    """What slime's plug-ins read as `args.sglang_server_concurrency` (strands-sglang sizes its
    connection pool by it): the script's `--sglang-server-concurrency`, else slime's default."""
    raw = given.get(PREFIX + "server_concurrency")
    return default if raw is None else ARGS["server_concurrency"].read(raw)


def take(rest: list[str]) -> tuple[dict[str, Any], list[str]]:
    """The `--sglang-NAME [VALUE ...]` tokens of what argparse did not take, as {sglang_NAME:
    value} (a switch: True; several values: a list); the other tokens, as they came."""
    given, others = split_family(rest, "--sglang-")
    return {PREFIX + name.replace("-", "_"): value for name, value in given.items()}, others


@dataclass(frozen=True)
class Effect:
    """What one given `--sglang-NAME` does on this run: `kind` mapped (`setting` or `vllm` names
    the target), same, or inert (`why`)."""

    flag: str  # the flag and its value, as the start-up line shows it
    kind: str
    setting: tuple[str, Any] | None = None  # a vime setting and its value
    vllm: tuple[str, Any] | None = None  # a vLLM server argument and its value
    why: str = ""


def effects(given: dict[str, Any], backend: str, starts_engines: bool) -> list[Effect]:
    """What each `--sglang-*` of `given` (slime's flags of a run, as {dest: value}) does with
    `backend`'s engines (`starts_engines`: vime starts them, not --rollout-engine-urls). A value
    SGLang would not take is a ConfigError naming the flag."""
    out = []
    for dest, raw in given.items():
        if not dest.startswith(PREFIX):
            continue
        name = dest[len(PREFIX) :]
        row = ARGS.get(name) or ServerArg(name, says=OTHER)
        try:
            value = row.read(raw)
        except ValueError as e:
            raise ConfigError(f"{row.flag} {_shown(raw)}: SGLang takes {e}") from None
        flag = row.flag + ("" if value is True else f" {_shown(value)}")
        setting = row.setting or (row.builtin if starts_engines and backend == "vime" else None)
        vllm = row.vllm if starts_engines and backend == "vllm" else None
        if setting or vllm:  # --sglang-context-length: vime's rollout cap, and the vLLM servers' context too
            as_vllm = [str(v) for v in value] if isinstance(value, list) else value
            out.append(
                Effect(
                    flag,
                    "mapped",
                    setting=(setting, value) if setting else None,
                    vllm=(vllm, as_vllm) if vllm else None,
                )
            )
        elif row.same:
            out.append(Effect(flag, "same", why=row.says))
        elif not starts_engines and (row.builtin or row.vllm):
            out.append(
                Effect(flag, "inert", why="vime starts no engine with --rollout-engine-urls: start yours with it")
            )
        else:
            out.append(Effect(flag, "inert", why=row.says or OTHER))
    return out


def _shown(value: Any) -> str:
    return " ".join(map(str, value)) if isinstance(value, list) else str(value)
