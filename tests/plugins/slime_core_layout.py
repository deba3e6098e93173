"""Plug-ins written against slime's newer module layout, where its helpers live in subpackages:
`slime.utils.core.types` (Sample), `slime.utils.core.misc` (load_function),
`slime.utils.core.async_utils` (run) and `slime.utils.network.http_utils` (post), as slime's
current fully_async, multi_agent, geo3k and on_policy_distillation examples import them. Written
for tests/unit/compat/test_slime_core_layout.py in that API, not copied: a fully-async rollout
function of slime's shape (a worker thread of its own keeps groups in flight with
`generate_and_rm_group`, sized by `args.sglang_server_concurrency`) and a custom generate that
posts SGLang's `/generate` to the run's router and calls a helper found by `load_function`."""

from __future__ import annotations

import asyncio
import queue
import threading
from typing import Any

from slime.rollout.sglang_rollout import GenerateState, generate_and_rm_group
from slime.utils.core.async_utils import run
from slime.utils.core.misc import load_function
from slime.utils.core.types import Sample
from slime.utils.network.http_utils import post

_worker: _Worker | None = None


def finish(sample: Sample, output: dict[str, Any]) -> Sample:
    """The helper the generate loads by its dotted path (multi_agent loads its agent system so):
    the status from SGLang's `finish_reason`."""
    kind = output["meta_info"]["finish_reason"]["type"]
    sample.status = {"length": Sample.Status.TRUNCATED, "abort": Sample.Status.ABORTED}.get(
        kind, Sample.Status.COMPLETED
    )
    return sample


async def generate(args: Any, sample: Sample, sampling_params: dict[str, Any]) -> Sample:
    """One turn through the router's SGLang route, tokens and log-probs from
    `output_token_logprobs`, as slime's agent examples read them."""
    state = GenerateState(args)
    prompt_ids = state.tokenizer(sample.prompt, add_special_tokens=False)["input_ids"]
    url = f"http://{args.sglang_router_ip}:{args.sglang_router_port}/generate"
    output = await post(url, {"input_ids": prompt_ids, "sampling_params": sampling_params, "return_logprob": True})
    pairs = output["meta_info"].get("output_token_logprobs", [])
    sample.tokens = list(prompt_ids) + [p[1] for p in pairs]
    sample.rollout_log_probs = [p[0] for p in pairs]
    sample.response_length, sample.response = len(pairs), output["text"]
    sample.loss_mask = [1] * len(pairs)
    return load_function(f"{__name__}.finish")(sample, output)


class _Worker:
    def __init__(self, args: Any, data_buffer: Any) -> None:
        self.args, self.data_buffer = args, data_buffer
        self.limit = min(args.sglang_server_concurrency, args.rollout_batch_size)
        self.done: queue.Queue = queue.Queue()
        self.state = GenerateState(args)
        self.thread = threading.Thread(target=lambda: asyncio.run(self.loop()), daemon=True)
        self.thread.start()

    async def loop(self) -> None:
        active: set[asyncio.Task] = set()
        while True:
            active = {t for t in active if not t.done()}
            while len(active) < self.limit:
                for group in self.data_buffer.get_samples(1):
                    params = self.state.sampling_params.copy()
                    task = asyncio.create_task(generate_and_rm_group(self.args, group, sampling_params=params))
                    task.add_done_callback(lambda t: self.done.put(t.result()))
                    active.add(task)
            await asyncio.sleep(0.05)


async def _collect(args: Any, data_buffer: Any) -> list[list[Sample]]:
    global _worker
    if _worker is None:
        _worker = _Worker(args, data_buffer)
    data: list[list[Sample]] = []
    while len(data) < args.rollout_batch_size:
        try:
            group = _worker.done.get_nowait()
        except queue.Empty:
            await asyncio.sleep(0.01)
            continue
        if any(s.status == Sample.Status.ABORTED for s in group):
            data_buffer.add_samples([group])
            continue
        data.append(group)
    return sorted(data, key=lambda g: g[0].index)


def generate_rollout_fully_async(args: Any, rollout_id: int, data_buffer: Any, evaluation: bool = False) -> Any:
    """slime's fully_async rollout function: the bare list of groups, through `run`."""
    if evaluation:
        raise ValueError("Evaluation mode not supported in simple async rollout")
    return run(_collect(args, data_buffer))
