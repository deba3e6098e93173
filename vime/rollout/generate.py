"""The default rollout function: one batch of prompt groups through the engines, then rewards.

`generate_rollout(args, rollout_id, data_source, evaluation=False)` keeps slime's signature.
It is synchronous for the train loop; the requests themselves run concurrently on the shared
rollout event loop (`async_loop`). It talks to any engine behind `EngineClient` (the built-in
one, or vLLM) through the run's clients (`args.runtime`). The per-sample pieces here
(`generate`, `generate_samples`, `score_group`, `sampling_params`) are shared by the fully-async
worker and by evaluation. (vllm-project/vime's scripts name this module `vime.rollout.vllm_rollout`
and import their helpers from it: vime/compat/vllm_rollout.py answers that name.)
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

from vime.dialect import dialect_of
from vime.errors import EngineError
from vime.plugin_args import PluginArgs
from vime.plugins import load_function, load_plugin
from vime.rollout import async_loop
from vime.rollout.engine_requests import generate_on_engines, sampling_params
from vime.rollout.filters import GroupFilter, GroupSieve, load_filter
from vime.rollout.rewards import score_samples
from vime.rollout.runtime import runtime_of
from vime.rollout.types import MULTI_TURN_STATE, RolloutOutput, Sample, Status, flatten

if TYPE_CHECKING:
    from vime.rollout.settings import RolloutConfig

# a generate returns the sample it was given, or (vllm-project/vime's multi-agent plug-ins) a list of samples
GenerateFn = Callable[[Any, Sample, dict], Awaitable[Sample | list[Sample]]]

_FINISH_TO_STATUS = {"stop": Status.COMPLETED, "length": Status.TRUNCATED, "abort": Status.ABORTED}

# The prompt (as the data gave it) and its ids of the sample a custom generate was handed, which
# it gets without its ids (custom_generate): for `generate` when the plug-in calls it on a sample
# of that prompt.
_PROMPT_IDS: ContextVar[tuple[Any, list[int]] | None] = ContextVar("vime_prompt_ids", default=None)


def _prompt_ids(tokenizer: Any, sample: Sample) -> list[int]:
    """The ids to generate from for a sample a plug-in hands `generate` without them: the data's
    when its prompt is still the one the plug-in was handed (chat template and all, as vime
    rendered it), else its prompt as the plug-in wrote it, a text tokenized as it is, or chat
    messages through the chat template, as vllm-project/vime's generate takes `sample.prompt`."""
    given = _PROMPT_IDS.get()
    if given is not None and sample.prompt == given[0]:
        return list(given[1])
    text = sample.prompt
    if not isinstance(text, str):
        text = tokenizer.apply_chat_template(text, tokenize=False, add_generation_prompt=True)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def sample_seed(rollout: RolloutConfig, sample: Sample) -> int:
    """The engine's `sampling_seed` for a sample: fixed by --rollout-seed and the sample's index.

    With it, a sample's tokens depend only on the weights and its prompt, never on which other
    requests shared the engine's steps, so async runs (whose batches mix by timing) are as
    reproducible as sync ones. A re-queued sample keeps its index and therefore its seed.
    """
    return (rollout.rollout_seed * 0x9E3779B1 + sample.index) & 0x7FFFFFFF


def max_new_tokens(rollout: RolloutConfig, sample: Sample, budget: int) -> int:
    """Tokens a sample may still generate: what is left of the response budget (`budget`, the
    whole response's) after the tokens it already has, and at most what --rollout-max-context-len
    leaves after its prompt and partial response. 0 or less: nothing more."""
    left = budget - sample.response_length
    if rollout.rollout_max_context_len is not None:
        left = min(left, rollout.rollout_max_context_len - len(sample.tokens))
    return left


async def generate(args, sample: Sample, params: dict) -> Sample:
    """Default per-sample generate: append the engine's tokens to the sample.

    A sample that already holds part of a response (an aborted one being resumed) continues
    from where it stopped, with the remaining token budget and the same seed (the built-in
    engine seeds each draw by token position, so the resumed draws are the ones it would have
    made; vLLM's client gives each request a seed of its own, `request_seed`).
    With --rollout-max-context-len the budget also stops where prompt + response reach it; a
    sample with no room left is TRUNCATED without a request.

    An engine matches stop strings on its own output only, so a resumed request misses one that
    began in the part it resumes from, or that the part held whole: the model wrote on past it
    (a tool call it went on to answer itself, trained on). So a resumed generation is searched
    from where it began (`Sample.generation_start`, set here by the call that began it: the
    response's start, or a later turn's, whoever loops over the turns) and ends after its first
    stop string, as the engine would have ended it (`cut_at_stop`).
    """
    runtime, rollout = runtime_of(args), args.rollout
    if not sample.tokens:  # a custom generate's sample, handed over without its ids
        sample.tokens = _prompt_ids(runtime.tokenizer, sample)
    if sample.status != Status.ABORTED:
        sample.generation_start = sample.response_length
    stops = params.get("stop") if sample.status == Status.ABORTED else None
    if stops and cut_at_stop(runtime.tokenizer, sample, sample.generation_start, stops):
        return sample  # what it had before the abort already ends it
    params = dict(
        params,
        max_new_tokens=max_new_tokens(rollout, sample, params["max_new_tokens"]),
        sampling_seed=sample_seed(rollout, sample),
    )
    if params["max_new_tokens"] <= 0:
        sample.status = Status.TRUNCATED
        return sample
    routed = args.algorithm.wants_routed_experts  # a mixture of experts' routing, for R3 (and its metrics)
    out = await generate_on_engines(runtime, sample.group_index, sample.tokens, params, routed_experts=routed)
    meta = out["meta_info"]
    sample.append_generated(out["output_ids"], meta["output_token_logprobs"], meta["output_weight_versions"])
    if routed:
        if out["output_ids"] and not meta.get("routed_experts"):
            raise EngineError(
                "an engine answered without routed_experts, which --use-rollout-routing-replay and "
                "--record-routed-experts read: it cannot return a mixture of experts' routing (vime's engine and "
                "SGLang started with --enable-return-routed-experts do)"
            )
        sample.take_routed_experts(meta)
    sample.temperature = params.get("temperature", 1.0)  # the engine's default; the trainer scores at it
    sample.status = _FINISH_TO_STATUS[meta["finish_reason"]["type"]]
    if stops:
        cut_at_stop(runtime.tokenizer, sample, sample.generation_start, stops)
    sample.response = runtime.tokenizer.decode(sample.response_tokens, skip_special_tokens=True)
    return sample


def cut_at_stop(tokenizer: Any, sample: Sample, start: int, stops: list[str] | str) -> bool:
    """Whether the response past `start` holds one of `stops` (decoded as the engines match
    them, special tokens skipped); if so, the response ends with the token that completes the
    first one (the engines keep it, as vLLM's include_stop_str_in_output) and the sample is
    COMPLETED, every per-token list cut with it."""
    stops = [stops] if isinstance(stops, str) else stops
    ids = sample.response_tokens[start:]

    def holds(n: int) -> bool:
        text = tokenizer.decode(ids[:n], skip_special_tokens=True)
        return any(s in text for s in stops)

    if not ids or not holds(len(ids)):
        return False
    lo, hi = 1, len(ids)  # the fewest tokens whose text holds a stop string
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if holds(mid) else (mid + 1, hi)
    sample.truncate_response(sample.response_length - len(ids) + lo)
    sample.response = tokenizer.decode(sample.response_tokens, skip_special_tokens=True)
    sample.status = Status.COMPLETED
    return True


MULTI_TURN_FN = (
    "vime.rollout.tools.multi_turn:generate"  # the generate of --tools (loaded by name: it builds on this module)
)


GENERATE_SIGNATURE = "async generate(args, sample, sampling_params) -> Sample or list[Sample]"

NO_LOG_PROBS = (
    "returned a sample whose response has no rollout log-probs, which this run's off-policy correction "
    "(--use-tis/--use-rs, or an async mode's default) needs: append the engine's tokens with "
    "sample.append_response_tokens(args, tokens=..., log_probs=...), or give --off-policy-correction none"
)


def generate_fn(args, evaluation: bool = False) -> GenerateFn:
    """The run's per-sample generate: --custom-generate-function-path's, --tools' multi-turn one,
    or `generate`; each is called with the plug-ins' `args`. `evaluation`: for vime.eval."""
    rollout = args.rollout
    if rollout.custom_generate_function_path:
        return custom_generate(rollout.custom_generate_function_path, evaluation)
    if rollout.tools:
        return load_function(MULTI_TURN_FN, "--tools")
    return generate


def custom_generate(path: str, evaluation: bool = False) -> GenerateFn:
    """--custom-generate-function-path, its faults one line naming the sample: one that raises,
    or returns something else than a Sample or a non-empty list of them (which a later step
    would trip over). Each sample of a list is trained, in the group of the prompt (compat.py).

    A sample with no response yet comes without tokens, as vllm-project/vime hands them over: its
    plug-ins build their own prompt (a tool template, a rendered chat) and take `sample.tokens`
    as theirs only when it is empty (tau-bench). vime's `generate`, called on it, starts from
    the data's prompt ids all the same, and a sample handed back without tokens gets them back.

    Each call gets its own writable view of `args` (`PluginArgs.for_call`): vllm-project/vime's plug-ins
    set their state on it (multi_agent: the tokenizer, sampling params, its agent settings). A
    function with an `evaluation` parameter is told which calls are eval's, as slime tells it."""
    plugin = load_plugin(path, "--custom-generate-function-path", signature=GENERATE_SIGNATURE)
    extra = {"evaluation": evaluation} if plugin.takes_keyword("evaluation") else {}

    async def generate_with(args, sample: Sample, params: dict) -> Sample | list[Sample]:
        where = f"on sample {sample.index}"
        refused = args.refusals()[0] if isinstance(args, PluginArgs) else 0
        prompt_ids = list(sample.tokens)
        if sample.response_length == 0:
            sample.tokens = []
        view = args.for_call() if isinstance(args, PluginArgs) else args
        params = {**dialect_of(args).plugin_sampling_params(args), **params}  # slime's: SGLang's text options
        token = _PROMPT_IDS.set((sample.prompt, prompt_ids))
        try:
            out = await plugin.acall(where, view, sample, params, **extra)
        finally:  # also when the call is cancelled: a re-queued sample keeps its prompt
            _PROMPT_IDS.reset(token)
            if not sample.tokens:
                sample.tokens = prompt_ids
        if out == []:
            raise plugin.error(returned_nothing(args, refused), where)
        if not (isinstance(out, Sample) or (isinstance(out, list) and all(isinstance(s, Sample) for s in out))):
            raise plugin.error(
                f"returned {type(out).__name__}: it must return the Sample it was given, or a list of Samples", where
            )
        samples = out if isinstance(out, list) else [out]
        if isinstance(args, PluginArgs):
            args.restore(samples)
        needs = not evaluation and args.algorithm.needs_rollout_log_probs
        if needs and any(s.response_length and s.rollout_log_probs is None for s in samples):
            raise plugin.error(NO_LOG_PROBS, where)
        return out

    return generate_with


def returned_nothing(args, refused_before: int) -> str:
    """Why a generate returned an empty list, as far as vime can tell: it returns the samples of
    the calls that worked, and catches the errors of the others itself (multi_agent's agents print
    them and go on), so when every call failed the cause is behind its own try/except. The
    requests the router refused while it ran name it; else its own output does."""
    refused, last = args.refusals() if isinstance(args, PluginArgs) else (0, "")
    if refused > refused_before:
        cause = (
            f"while it ran, the router refused {refused - refused_before} plug-in request(s), the last with {last}: "
            "the likeliest error its own try/except hid"
        )
    else:
        log = getattr(getattr(args, "output", None), "run_dir", None)
        cause = (
            "a generate that catches its own errors returns nothing when every call it made failed: the error "
            f"is in what it printed or logged above{f' (and in {log}/log.txt)' if log else ''}"
        )
    return f"returned an empty list, no sample to train: {cause}"


async def generate_samples(
    args, group: list[Sample], params: dict, fn: GenerateFn, resume: bool = False
) -> list[Sample]:
    """Run `fn` on every sample of a group, concurrently; with `resume`, only on those the engine
    aborted (each continues from the tokens it has), the others passed through as they are."""

    async def one(s: Sample) -> Sample | list[Sample]:
        return await fn(args, s, params) if not resume or s.status == Status.ABORTED else s

    return flatten(await asyncio.gather(*(one(s) for s in group)))


async def score_group(args, group: list[Sample]) -> None:
    """A generated group: its engine may drop it from its prefix bookkeeping, and its samples are
    scored together; a reward a custom generate already set stays (vllm-project/vime's rule), except
    under --group-rm, whose reward scores the whole group (as vllm-project/vime's does)."""
    if group:
        runtime_of(args).forget_group(group[0].group_index)
    await score_samples(args, group if args.rollout.group_rm else [s for s in group if s.reward is None])


async def generated(args, group: list[Sample], params: dict, fn: GenerateFn, resume: bool = False) -> list[Sample]:
    """`generate_samples` of a training rollout, in the run's rollout process when it has one
    (`vime/rollout/process.py`, which runs the same function with its own `fn`)."""
    process = runtime_of(args).process
    if process is not None:
        return await process.generate(group, params, resume)
    return await generate_samples(args, group, params, fn, resume)


async def scored(args, group: list[Sample]) -> list[Sample]:
    """`score_group` of a training rollout, in the run's rollout process when it has one; use
    the group it returns (from another process, its samples are new objects)."""
    process = runtime_of(args).process
    if process is not None:
        return await process.score(group)
    await score_group(args, group)
    return group


async def generate_group(args, group: list[Sample], params: dict, fn: GenerateFn) -> list[Sample]:
    """Generate every sample of a group, then score them together (the fully-async worker does
    the same in two parts, with aborted samples resumed or re-queued in between)."""
    return await scored(args, await generated(args, group, params, fn))


def rollout_metrics(groups: list[list[Sample]], prefix: str = "rollout") -> dict[str, float]:
    """Means and counts of a batch; a dict reward's other values (`Sample.reward_extras`) as
    `<prefix>/reward_<key>` means over the samples that have them (the fixed names win a clash)."""
    flat = [s for g in groups for s in g]
    if not flat:
        return {}
    n = len(flat)
    extras: dict[str, list[float]] = {}
    for s in flat:
        for k, v in s.reward_extras.items():
            extras.setdefault(k, []).append(v)
    return {
        **{f"{prefix}/reward_{k}": sum(vs) / len(vs) for k, vs in extras.items()},
        **multi_turn_metrics(flat, prefix),
        f"{prefix}/reward_mean": sum(s.reward or 0.0 for s in flat) / n,
        f"{prefix}/response_len_mean": sum(s.response_length for s in flat) / n,
        f"{prefix}/response_len_max": max(s.response_length for s in flat),
        f"{prefix}/truncated_ratio": sum(s.status == Status.TRUNCATED for s in flat) / n,
        f"{prefix}/num_samples": n,
        f"{prefix}/reward_errors": sum(s.reward_error == "error" for s in flat),
        f"{prefix}/reward_timeouts": sum(s.reward_error == "timeout" for s in flat),
    }


def multi_turn_metrics(flat: list[Sample], prefix: str) -> dict[str, float]:
    """Of multi-turn samples (--tools): turns, tool calls and seconds per sample, the share of
    samples that called a tool at all, tool errors, and the share of response tokens the model
    did not generate (tool answers, out of the loss)."""
    states = [s.metadata[MULTI_TURN_STATE] for s in flat if MULTI_TURN_STATE in s.metadata]
    if not states:
        return {}
    n = len(states)
    tokens = sum(s.response_length for s in flat)
    masked = sum(s.response_length - sum(s.effective_loss_mask()) for s in flat)
    return {
        f"{prefix}/turns_mean": sum(st["turns"] for st in states) / n,
        f"{prefix}/tool_calls_mean": sum(st["tool_calls"] for st in states) / n,
        f"{prefix}/tool_call_rate": sum(st["tool_calls"] > 0 for st in states) / n,
        f"{prefix}/tool_errors": float(sum(st["tool_errors"] for st in states)),
        f"{prefix}/tool_seconds_mean": sum(st["tool_seconds"] for st in states) / n,
        f"{prefix}/masked_token_ratio": masked / tokens if tokens else 0.0,
    }


async def generate_batch(args, rollout_id: int, data_source) -> RolloutOutput:
    """One training batch (`generate_rollout`'s work) on the running loop: its prompt groups
    generated and scored, through --dynamic-sampling-filter-path's filter when one is given."""
    fn, params = generate_fn(args), sampling_params(args)
    judge = load_filter(args)
    t0 = time.perf_counter()
    if judge is None:
        groups = data_source.get_samples(args.rollout.rollout_batch_size)
        results = list(await asyncio.gather(*(generate_group(args, g, params, fn) for g in groups)))
        metrics = rollout_metrics(results)
    else:
        results, metrics = await _generate_filtered(args, data_source, fn, params, judge)
    metrics["perf/rollout_time"] = time.perf_counter() - t0
    return RolloutOutput(samples=results, metrics=metrics)


async def _generate_filtered(
    args, data_source, fn: GenerateFn, params: dict, judge: GroupFilter
) -> tuple[list[list[Sample]], dict[str, float]]:
    """Dynamic sampling in one batch: whenever the groups kept and those in flight could not
    fill it, --over-sampling-batch-size more are started; each is judged as it is scored. Once
    the batch is full, the groups still in flight are cancelled (their requests aborted at the
    engine) and go back to the data source to be generated again later, from their prompts,
    with the weights of then: nothing off-policy reaches a sync step, and no prompt is lost."""
    rollout = args.rollout
    target = rollout.rollout_batch_size
    chunk = rollout.over_sampling_batch_size or target
    sieve = GroupSieve(judge, data_source, target, rollout.dynamic_sampling_max_epochs)
    running: dict[asyncio.Task, list[Sample]] = {}
    kept: list[list[Sample]] = []
    try:
        while len(kept) < target:
            if len(kept) + len(running) < target:
                sieve.check(len(kept))
                for g in data_source.get_samples(chunk):
                    running[asyncio.create_task(generate_group(args, g, params, fn))] = g
            done, _ = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=lambda t: running[t][0].group_index):
                del running[task]
                group = task.result()
                # a fallback group is kept when dropping it would need another round of prompts
                if sieve.settle(group, judge(group), short=len(kept) + len(running) < target):
                    kept.append(group)
    finally:
        for task in running:
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)
        data_source.add_samples(list(running.values()))
    kept.sort(key=lambda g: g[0].group_index)
    extra = kept[target:]  # finished together with the last one needed: generated again later
    data_source.add_samples(extra)
    kept = kept[:target]
    metrics = rollout_metrics(kept)
    metrics.update(sieve.metrics(kept))
    metrics["rollout/dynamic_filter/cancelled"] = float(len(running) + len(extra))
    return kept, metrics


def generate_rollout(args, rollout_id: int, data_source, evaluation: bool = False) -> RolloutOutput:
    if evaluation:
        raise ValueError(
            "vime's rollout functions do not evaluate: evaluation runs through vime.eval.evaluate (greedy, graded the same way for every run)"
        )
    return async_loop.run(generate_batch(args, rollout_id, data_source))
