"""`slime.rollout.sglang_rollout`: slime's default rollout module, which its run scripts name as
their rollout function and its plug-ins import their helpers from (retool, search-r1, tau-bench,
strands and geo3k import `GenerateState`; slime's fully-async rollout `generate_and_rm_group`).

Each name keeps slime's signature and meaning, built on vime's own rollout (`vime.rollout.generate`):
`generate` is vime's generate (its engines, failover and weight versions, no HTTP hop),
`generate_and_rm` the run's generate (custom, --tools or default) then its reward, and
`generate_rollout` / `generate_rollout_async` vime's batch with its dynamic-sampling filter. A
plug-in that talks to SGLang itself posts to `http://{args.sglang_router_ip}:{args.sglang_router_port}/generate`,
which vime's router answers in SGLang's shapes (router.py, sglang_api.py).
(`--rollout-function-path slime.rollout.sglang_rollout.generate_rollout` runs vime's default
rollout: dialect.py's PATHS.)
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass
from typing import Any

from vime.compat import vllm_rollout_helpers
from vime.compat.sample_hooks import apply_rollout_sample_hooks
from vime.compat.sglang_api import DEFAULT_SERVER_CONCURRENCY, ENGINE_KEYS
from vime.compat.utils.http_utils import get_rollout_num_engines
from vime.rollout import async_loop
from vime.rollout import generate as vime_generate
from vime.rollout.rewards import score_samples
from vime.rollout.runtime import runtime_of
from vime.rollout.types import RolloutOutput, Sample, Status, flatten

__all__ = [
    "GenerateState",
    "RolloutFnEvalOutput",
    "abort",
    "eval_rollout",
    "generate",
    "generate_and_rm",
    "generate_and_rm_group",
    "generate_rollout",
    "generate_rollout_async",
    "get_model_url",
]


@dataclass
class RolloutFnEvalOutput:
    """What slime's eval rollout returns: per eval set, its `rewards`, `truncated` flags and `samples`."""

    data: dict[str, dict[str, list[Any]]]
    metrics: dict[str, Any] | None = None


def slime_sampling_params(args: Any) -> dict[str, Any]:
    """The rollout's sampling params as slime's GenerateState builds them: SGLang's keys, the
    stop string kept in the text (`no_stop_trim`), special tokens kept unless
    --rollout-skip-special-tokens."""
    return {
        "temperature": args.rollout_temperature,
        "top_p": args.rollout_top_p,
        "top_k": args.rollout_top_k,
        "max_new_tokens": args.rollout_max_response_len,
        "stop": list(args.rollout_stop) if args.rollout_stop else None,
        "stop_token_ids": list(args.rollout_stop_token_ids) if args.rollout_stop_token_ids else None,
        "skip_special_tokens": bool(getattr(args, "rollout_skip_special_tokens", False)),
        "no_stop_trim": True,
        "spaces_between_special_tokens": False,
    }


class GenerateState(vllm_rollout_helpers.GenerateState):
    """slime's `GenerateState(args)`, one per model per process: `tokenizer` (the run's),
    `processor` (None: vime rolls out text), `sampling_params` (slime's, in SGLang's keys),
    `semaphore` (--sglang-server-concurrency per engine), `group_sampling_seeds` (with
    --sglang-enable-deterministic-inference), and the bookkeeping slime's batch loop keeps
    (`reset`, `pendings`, `remaining_batch_size`, `aborted`, `submit_generate_tasks`). vime's
    engines are separate servers, each one data-parallel rank to a plug-in: `dp_rank_context`
    yields 0."""

    _made: dict[str, GenerateState] = {}  # noqa: RUF012 (slime's: apart from vllm-project/vime's)

    def __init__(self, args: Any) -> None:
        self.sampling_params = slime_sampling_params(args)
        if getattr(args, "sglang_enable_deterministic_inference", False):
            self.group_sampling_seeds = [args.rollout_seed + i for i in range(args.n_samples_per_prompt)]
        if not hasattr(self, "pendings"):  # once: the singleton's state
            concurrency = getattr(args, "sglang_server_concurrency", None) or DEFAULT_SERVER_CONCURRENCY
            self.semaphore = asyncio.Semaphore(concurrency * get_rollout_num_engines(args))
            self.dp_counts, self.dp_rank = [0], 0
            self.reset()

    @contextlib.contextmanager
    def dp_rank_context(self) -> Iterator[int]:
        yield 0

    def reset(self) -> None:
        self.remaining_batch_size = 0
        self.pendings: set[asyncio.Task] = set()
        self.aborted = False

    def submit_generate_tasks(self, samples: list[list[Sample]]) -> None:
        for group in samples:
            params = self.sampling_params.copy()
            self.pendings.add(asyncio.create_task(generate_and_rm_group(self.args, group, params, evaluation=False)))
        self.remaining_batch_size += len(samples)


def get_model_url(args: Any, model_name: str, endpoint: str = "/generate") -> str:
    """The router's URL: vime serves one model, whatever name is asked for (slime's falls back the same way)."""
    return f"http://{args.sglang_router_ip}:{args.sglang_router_port}{endpoint}"


def _prepare_prompt_ids(sample: Sample, tokenizer: Any, processor: Any = None) -> list[int]:
    """The ids to generate from: the sample's tokens when it has them, else its prompt tokenized
    (chat messages through the chat template)."""
    if sample.tokens:
        return sample.tokens
    prompt = sample.prompt
    if not isinstance(prompt, str):
        prompt = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(prompt, add_special_tokens=False)


async def generate(args: Any, sample: Sample, sampling_params: dict[str, Any]) -> Sample:
    """slime's default generate: vime's, with the engine's keys of `sampling_params` (the text
    options are for the router's answers; vime's generate decodes the response itself). A sample
    that holds part of a response continues it with what is left of the budget."""
    params = {k: v for k, v in sampling_params.items() if k in ENGINE_KEYS and v is not None}
    return await vime_generate.generate(args, sample, params)


async def generate_and_rm(
    args: Any, sample: Sample | list[Sample], sampling_params: dict[str, Any], evaluation: bool = False
) -> Sample | list[Sample]:
    """The run's generate on one sample (its own `generate_function_path`'s, as slime's, or
    --custom-generate-function-path's, --tools' or vime's), the hooks a plug-in named on
    `args.rollout_sample_hook_path` (slime's, vime/compat/sample_hooks.py), then its reward, as
    slime's: a sample already finished is returned as it is, an aborted one unscored, a reward
    the generate set kept; with --group-rm the group's caller scores."""
    masked = getattr(args, "partial_rollout", False) and getattr(args, "mask_offpolicy_in_partial_rollout", False)
    if masked and sample.response_length > 0:  # what an earlier policy wrote trains nothing
        sample.loss_mask = [0] * sample.response_length
    if sample.status in (Status.COMPLETED, Status.TRUNCATED):
        return sample
    if GenerateState(args).aborted:
        sample.status = Status.ABORTED
        return sample
    own = sample.generate_function_path  # slime's per-sample generate, where one was set
    generate = vime_generate.custom_generate(own, evaluation) if own else vime_generate.generate_fn(args, evaluation)
    out = await apply_rollout_sample_hooks(args, await generate(args, sample, sampling_params), evaluation=evaluation)
    samples = out if isinstance(out, list) else [out]
    if runtime_of(args).closed:  # the run ended while it generated: its rewards are closed too
        for s in samples:
            s.status = Status.ABORTED
    if args.rollout.group_rm or any(s.status == Status.ABORTED for s in samples):
        return out
    await score_samples(args, [s for s in samples if s.reward is None])
    return out


async def generate_and_rm_group(
    args: Any, group: list[Sample], sampling_params: dict[str, Any], evaluation: bool = False
) -> list[Sample] | list[Sample | list[Sample]]:
    """`generate_and_rm` on every sample of a group at once (each with its own copy of the params,
    and its seed with --sglang-enable-deterministic-inference); with --group-rm the whole group
    is scored together. An entry is a list where its generate returned several samples. Once the
    run is over the group comes back aborted, as slime's does after its abort: a worker thread of
    the plug-in's own that outlives the run (slime's fully_async example) gets its groups back
    rather than errors from engines and rewards that are gone."""
    state, runtime = GenerateState(args), runtime_of(args)
    if state.aborted:
        return group
    if runtime.closed:
        return _aborted(group)
    seeds = getattr(state, "group_sampling_seeds", None)
    jobs = []
    for i, sample in enumerate(group):
        params = dict(sampling_params, **({"sampling_seed": seeds[i % len(seeds)]} if seeds else {}))
        jobs.append(generate_and_rm(args, sample, params, evaluation=evaluation))
    try:  # on vime's rollout loop, whatever loop awaits it (the fully_async example's worker thread has its own)
        out = list(await vllm_rollout_helpers.on_rollout_loop(_gathered(jobs)))
    except (asyncio.CancelledError, Exception):
        if not runtime.closed:
            raise
        return _aborted(group)
    if group:
        runtime.forget_group(group[0].group_index)
    if not state.aborted and args.rollout.group_rm:
        await score_samples(args, flatten(out))
    return out


async def _gathered(jobs: list[Coroutine[Any, Any, Any]]) -> list[Any]:
    return list(await asyncio.gather(*jobs))


def _aborted(group: list[Sample]) -> list[Sample]:
    for s in group:
        s.status = Status.ABORTED
    return group


async def abort(args: Any, rollout_id: int) -> list[list[Sample]]:
    """Abort what `submit_generate_tasks` has in flight (every request at the engines, as slime
    aborts every request at its servers) and wait for it; with --partial-rollout, the groups
    it had started come back, for the data source to resume."""
    state = GenerateState(args)
    state.aborted = True
    await asyncio.to_thread(runtime_of(args).abort_all)
    kept: list[list[Sample]] = []
    while state.pendings:
        done, state.pendings = await asyncio.wait(state.pendings, return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            group = task.result()
            if getattr(args, "partial_rollout", False):
                for s in flatten(group):
                    if s.response and "start_rollout_id" not in s.metadata:
                        s.metadata["start_rollout_id"] = rollout_id
                kept.append(group)
    return kept


async def generate_rollout_async(
    args: Any, rollout_id: int, data_source: Callable[[int], list[list[Sample]]] | Any
) -> tuple[RolloutOutput, list[list[Sample]]]:
    """One training batch as slime's: (its groups and metrics, the aborted groups to put back).
    vime's batch (`vime.rollout.generate.generate_batch`) does the work, its filter and all, and
    puts the groups it cancels back in the data source itself, so none comes back here.
    `data_source` is the source, or its `get_samples` as slime passes it."""
    source = getattr(data_source, "__self__", data_source)
    return await vime_generate.generate_batch(args, rollout_id, source), []


async def eval_rollout(args: Any, rollout_id: int) -> tuple[RolloutFnEvalOutput, list[list[Sample]]]:
    """Every eval set of the run generated and graded as vime's eval does it (`vime.eval`), in
    slime's shape: per set its rewards, truncated flags and samples, in index order."""
    from vime.eval import evaluate_set  # the eval module is the eval's, loaded when one runs

    data: dict[str, dict[str, list[Any]]] = {}
    for eval_set in args.eval.eval_sets:
        # evaluate_set runs its requests on the rollout loop: from a thread, so this loop goes on
        out = await asyncio.to_thread(evaluate_set, args, eval_set, rollout_id)
        samples = sorted((s for g in out.samples for s in g), key=lambda s: s.index)
        data[eval_set.get("name") or "eval"] = {
            "rewards": [s.reward for s in samples],
            "truncated": [s.status == Status.TRUNCATED for s in samples],
            "samples": samples,
        }
    return RolloutFnEvalOutput(data=data), []


def generate_rollout(
    args: Any, rollout_id: int, data_source: Any, evaluation: bool = False
) -> RolloutOutput | RolloutFnEvalOutput:
    """slime's rollout function: a training batch, or (`evaluation`) the eval sets."""
    if evaluation:
        return async_loop.run(eval_rollout(args, rollout_id))[0]
    return vime_generate.generate_rollout(args, rollout_id, data_source)
