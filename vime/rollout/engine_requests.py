"""What every rollout path asks the engines, below the rollout functions: the sampling params of a
rollout or an eval, and one request on the engine the runtime picks. The default rollout
(generate.py), the fully-async worker, evaluation and the router vllm-project/vime's plug-ins
post to (vime/compat/router.py) all build on these two, so they sit in a module none of those imports back.
"""

from __future__ import annotations

import asyncio
import uuid

from vime.errors import EngineError


def sampling_params(args, evaluation: bool = False) -> dict:
    """The engine protocol's sampling_params of a rollout (or, with `evaluation`, of eval), from
    the rollout component's settings (`args.rollout`) and, for eval, the eval component's (`args.eval`).

    Eval is greedy with one sample per prompt; with more it samples at the rollout's settings.
    --eval-temperature / --eval-top-p / --eval-top-k override either. Stop strings (--rollout-stop) are sent only when given, so a request without
    them is the same as before they existed.
    """
    rollout = args.rollout
    if evaluation:
        ev = args.eval
        temperature = ev.eval_temperature
        if temperature is None:
            temperature = 0.0 if ev.n_samples_per_eval_prompt == 1 else rollout.rollout_temperature
        top_p = ev.eval_top_p
        if top_p is None:
            top_p = 1.0 if temperature == 0 else rollout.rollout_top_p
        params = {
            "max_new_tokens": ev.eval_max_response_len,
            "temperature": temperature,
            "top_p": top_p,
            "top_k": ev.eval_top_k if ev.eval_top_k is not None else -1 if temperature == 0 else rollout.rollout_top_k,
            # ahead of waiting rollout requests: an eval during async training waits for seats,
            # not for the worker's whole backlog (bench/real_ab.py's eval column shows it)
            "priority": -1,
        }
    else:
        params = {
            "max_new_tokens": rollout.rollout_max_response_len,
            "temperature": rollout.rollout_temperature,
            "top_p": rollout.rollout_top_p,
            "top_k": rollout.rollout_top_k,
        }
    params.update(stop_token_ids=list(rollout.rollout_stop_token_ids), n=1)
    if rollout.rollout_stop:
        params["stop"] = list(rollout.rollout_stop)
    return params


async def generate_on_engines(
    runtime, group_index: int, input_ids: list[int], params: dict, routed_experts: bool = False
) -> dict:
    """One engine request, on the engine the runtime picks for the group (its prefix is cached
    there) or, when that engine is gone, on another (runtime.py: engines that fail).
    `routed_experts`: ask for each position's routed experts too (SGLang's `return_routed_experts`)."""
    cost = len(input_ids) + int(params.get("max_new_tokens") or 0)
    extra = {"return_routed_experts": True} if routed_experts else {}
    while True:
        engine = runtime.pick(group_index, cost)
        try:
            request = engine.client.generate(input_ids, params, return_logprob=True, rid=uuid.uuid4().hex, **extra)
            return await runtime.watched(engine, request)
        except EngineError as e:
            if not await asyncio.to_thread(runtime.engine_failed, engine, e):
                raise
        finally:
            runtime.release(engine, cost)
