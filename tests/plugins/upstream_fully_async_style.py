"""A rollout function written as vllm-project/vime's fully-async example is (its
examples/fully_async): a worker thread with an asyncio loop of its own keeps groups in flight
with `generate_and_rm_group`, the rollout function collects finished groups from its queue
(returning aborted ones to the data buffer) and hands back the bare list of groups, through
`vime.utils.async_utils.run`. Written for tests/test_slime_flags.py in that API, not copied."""

from __future__ import annotations

import asyncio
import queue
import threading
from typing import Any

from vime.rollout.vllm_rollout import GenerateState, generate_and_rm_group
from vime.utils.async_utils import run
from vime.utils.types import Sample

_worker: _Worker | None = None


class _Worker:
    def __init__(self, args: Any, data_buffer: Any) -> None:
        self.args, self.data_buffer = args, data_buffer
        self.limit = min(args.vllm_server_concurrency, args.rollout_batch_size)
        self.done: queue.Queue = queue.Queue()
        self.state = GenerateState(args)
        self.running = True
        self.thread = threading.Thread(target=lambda: asyncio.run(self.loop()), daemon=True)
        self.thread.start()

    async def loop(self) -> None:
        active: set[asyncio.Task] = set()
        while self.running:
            active = {t for t in active if not t.done()}
            while len(active) < self.limit:
                for group in self.data_buffer.get_samples(1):
                    task = asyncio.create_task(
                        generate_and_rm_group(self.args, group, sampling_params=self.state.sampling_params.copy())
                    )
                    task.add_done_callback(lambda t: self.done.put(t.result()))
                    active.add(task)
            await asyncio.sleep(0.05)


async def _collect(args: Any, data_buffer: Any) -> list[list[Sample]]:
    global _worker
    assert args.rollout_global_dataset
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
    if evaluation:
        raise ValueError("Evaluation mode not supported in simple async rollout")
    return run(_collect(args, data_buffer))
