"""The checks every entry point runs (train.py, train_async.py, `vime eval`): the model, how a
response is sampled and graded, the engines, slime's flags, and finite numbers. Each check is
(bad, message): `Config.validate` raises the first bad one's message as one line."""

from __future__ import annotations

import math
from typing import Any

from vime.backends import BACKENDS, Backend
from vime.config.schema import FIELDS, Settings
from vime.dialect import dialect_of
from vime.launchers import launcher_checks


def common_checks(c: Settings) -> list[tuple[bool, str]]:
    """What any entry point needs: the model, sampling, engines, and finite numbers."""
    return [*_sampling_checks(c), *_reward_checks(c), *_engine_checks(c), *dialect_of(c).checks(c), *_non_finite(c)]


def _sampling_checks(c: Settings) -> list[tuple[bool, str]]:
    """The data and how a response is sampled, in training and in evaluation."""
    return [
        (c.hf_checkpoint is None, "--hf-checkpoint is required (an HF model directory, or 'smollm2')"),
        (c.rollout_temperature < 0, "--rollout-temperature must be >= 0 (0 = greedy)"),
        (not 0 < c.rollout_top_p <= 1, "--rollout-top-p must be in (0, 1]"),
        (c.rollout_max_response_len < 1, "--rollout-max-response-len must be at least 1"),
        (
            c.eval_limit is not None and c.eval_limit < 1,
            f"--eval-limit {c.eval_limit}: give at least 1 (leave it out to evaluate every prompt)",
        ),
        (c.eval_temperature is not None and c.eval_temperature < 0, "--eval-temperature must be >= 0 (0 = greedy)"),
        (c.eval_top_p is not None and not 0 < c.eval_top_p <= 1, "--eval-top-p must be in (0, 1]"),
        (c.eval_top_k is not None and c.eval_top_k < -1, "--eval-top-k must be -1 or 0 (off) or a positive count"),
        (c.rollout_top_k < -1, "--rollout-top-k must be -1 or 0 (off) or a positive count"),
        # 0 evaluated nothing and logged accuracy 0.000 (0/0)
        (
            c.n_samples_per_eval_prompt < 1,
            f"--n-samples-per-eval-prompt {c.n_samples_per_eval_prompt}: give at least 1",
        ),
        (
            c.rollout_max_context_len is not None and c.rollout_max_context_len < 2,
            "--rollout-max-context-len must be at least 2 (a prompt token and a response token)",
        ),
        (
            c.rollout_max_prompt_len is not None
            and c.rollout_max_context_len is not None
            and c.rollout_max_prompt_len >= c.rollout_max_context_len,
            f"--rollout-max-prompt-len {c.rollout_max_prompt_len} leaves no room for a response in "
            f"--rollout-max-context-len {c.rollout_max_context_len}: set it below {c.rollout_max_context_len}",
        ),
        (
            any(not isinstance(s, str) or not s for s in c.rollout_stop),
            "--rollout-stop: every stop string must be non-empty text",
        ),
        (  # a YAML list's 'x' or 1.5 got through to the engine, which refused the first request of step 1
            any(type(t) is not int or t < 0 for t in c.rollout_stop_token_ids),
            f"--rollout-stop-token-ids {c.rollout_stop_token_ids}: every stop token id must be a whole number >= 0",
        ),
    ]


def _reward_checks(c: Settings) -> list[tuple[bool, str]]:
    """How responses are graded, and the multi-turn tools."""
    from vime.rollout.rewards.grading import BUILTIN_RM_TYPES  # here: the rewards package imports vime.config

    return [
        (
            c.reward_timeout <= 0,
            f"--reward-timeout {c.reward_timeout:g} must be > 0 seconds (it bounds each reward call; a hung one scores 0)",
        ),
        (
            c.max_failed_reward_steps < 1,
            f"--max-failed-reward-steps {c.max_failed_reward_steps} must be >= 1 (the failing steps in a row that stop "
            "the run)",
        ),
        (
            c.rm_type == "remote_rm" and not c.custom_rm_path and c.rm_url is None,
            "--rm-type remote_rm needs --rm-url http://host:port/path, the reward model's endpoint",
        ),
        (
            c.rm_url is not None and not str(c.rm_url).startswith(("http://", "https://")),
            f"--rm-url {c.rm_url!r} is not an http(s) URL; give e.g. http://127.0.0.1:8000/reward",
        ),
        (
            c.rm_url is not None
            and c.rm_type != "remote_rm"
            and not c.custom_rm_path
            and not c.algorithm.teacher_served,  # the teacher's: checks_algorithm.py
            f"--rm-url is read by --rm-type remote_rm (or by your --custom-rm-path), and this run grades with --rm-type {c.rm_type}: add --rm-type remote_rm",
        ),
        (
            c.eval_rm_type is not None and c.eval_rm_type not in BUILTIN_RM_TYPES,
            f"--eval-rm-type {c.eval_rm_type!r}: use one of {', '.join(BUILTIN_RM_TYPES)}",
        ),
        (c.reward_key == "", "--reward-key needs a key name, e.g. score"),
        (c.max_turns < 1, f"--max-turns {c.max_turns}: give at least 1"),
        (c.tool_timeout <= 0, f"--tool-timeout {c.tool_timeout:g} must be > 0 seconds"),
        (c.tool_max_output_chars < 1, "--tool-max-output-chars must be at least 1"),
        (
            bool(c.tools) and c.custom_generate_function_path is not None,
            "--tools runs the built-in multi-turn generate, and --custom-generate-function-path replaces it: give one of them",
        ),
    ]


def _engine_checks(c: Settings) -> list[tuple[bool, str]]:
    """The engines: where they run, how many, how they are probed and how weights reach them."""
    return [
        (c.rollout_health_check_interval < 0, "--rollout-health-check-interval must be >= 0 seconds (0: no probes)"),
        (c.rollout_health_check_timeout <= 0, "--rollout-health-check-timeout must be > 0 seconds"),
        *(
            (
                True,
                f"--rollout-engine-urls: {u!r} is not an engine URL; give http://host:port (comma-separated for several)",
            )
            for u in c.rollout_engine_urls
            if not _is_engine_url(u)
        ),
        (c.rollout_num_gpus_per_engine < 1, "--rollout-num-gpus-per-engine must be at least 1"),
        # refused by the engine only once started; 0 KV blocks silently meant "sized from memory"
        (c.engine_max_num_seqs < 1, f"--engine-max-num-seqs {c.engine_max_num_seqs}: give at least 1"),
        (
            c.engine_num_kv_blocks is not None and c.engine_num_kv_blocks < 1,
            f"--engine-num-kv-blocks {c.engine_num_kv_blocks}: give at least 1 (leave it out to size the cache from memory)",
        ),
        (c.rollout_num_engines is not None and c.rollout_num_engines < 1, "--rollout-num-engines must be at least 1"),
        (
            c.rollout_num_engines is not None
            and c.rollout_num_gpus is not None
            and c.rollout_num_engines * c.rollout_num_gpus_per_engine != c.rollout_num_gpus,
            f"--rollout-num-engines {c.rollout_num_engines} × --rollout-num-gpus-per-engine {c.rollout_num_gpus_per_engine} "
            f"is not --rollout-num-gpus {c.rollout_num_gpus}: give the two that you mean",
        ),
        (
            c.rollout_num_gpus_per_engine != 1 and not _backend(c).tensor_parallel,
            f"--rollout-num-gpus-per-engine {c.rollout_num_gpus_per_engine}: {_backend(c).what} has no "
            "tensor parallelism; use 1 (--rollout-num-gpus N then runs N engines of one GPU each) or --rollout-backend "
            + " / ".join(b.name for b in BACKENDS.values() if b.tensor_parallel),
        ),
        (
            c.weight_transport not in _backend(c).transports,
            f"--weight-transport {c.weight_transport} does not reach {c.rollout_backend} engines (they receive by "
            f"{', '.join(t for t in _backend(c).transports if t != 'auto')}): leave it at auto",
        ),
        *_engine_only(
            c, "--engine-quantization", c.engine_quantization, _backend(c).quantization_flag, "--quantization"
        ),
        *_engine_only(
            c, "--engine-num-kv-blocks", c.engine_num_kv_blocks, _backend(c).kv_blocks_flag, "--num-kv-blocks"
        ),
        (
            c.engine_kv_cache_memory_fraction is not None and not 0 < c.engine_kv_cache_memory_fraction <= 1,
            f"--engine-kv-cache-memory-fraction {c.engine_kv_cache_memory_fraction}: a share of the free GPU memory, "
            "in (0, 1]",
        ),
        (
            c.launcher == "ray" and _backend(c).ray_place is None,
            f"--launcher ray places engines as Ray actors, and {_backend(c).what} has no Ray placement "
            "(its row's ray_place): use --launcher local",
        ),
        *launcher_checks(c),  # what the chosen launcher cannot do (vime/launchers.py)
    ]


def _engine_only(c: Settings, flag: str, value: Any, own: str | None, server_flag: str) -> list[tuple[bool, str]]:
    """The refusals of a flag that only the built-in engines vime starts read: with a backend whose
    engines take their own flag for it (`own`, the row's), and with engines given by URL, which
    were started with the server's `server_flag`. Dropping it silently would run with a setting
    the user did not get."""
    return [
        (
            value is not None and own is not None,
            f"{flag} is the built-in engine's, and --rollout-backend {c.rollout_backend} engines take their own "
            f"flag for it: use {own} instead",
        ),
        (
            value is not None and bool(c.rollout_engine_urls),
            f"{flag} applies to the engines vime starts, and --rollout-engine-urls names running ones: "
            f"start those with {server_flag} {value} instead",
        ),
    ]


def _backend(c: Settings) -> Backend:
    # an unknown name is refused by the choices check; until then, check as the default would
    return BACKENDS.get(c.rollout_backend, BACKENDS["vime"])


def _is_engine_url(u: Any) -> bool:
    from urllib.parse import urlsplit

    if not isinstance(u, str):
        return False
    try:
        parts = urlsplit(u)
        parts.port  # noqa: B018 (raises on a port that is not a number)
    except ValueError:
        return False
    return parts.scheme in ("http", "https") and bool(parts.hostname)


def _non_finite(cfg: Settings) -> list[tuple[bool, str]]:
    """NaN passes every `<` and `>` check (`--rollout-temperature nan` sampled garbage), and inf
    most of them: no float setting may be either."""
    out = []
    for name in FIELDS:
        value = getattr(cfg, name)
        if isinstance(value, float) and not math.isfinite(value):
            out.append((True, f"--{name.replace('_', '-')} {value}: give a finite number"))
    return out
