"""nccl (GPUs) and gloo (CPU, and what `make test` runs): the engines join a process group with the
trainer's rank 0 once (`connect`); each push then streams the weights, cast to the engines'
dtype, in flat buckets of `bucket_bytes`, each announced over HTTP and broadcast (`group.py` has
the protocol, `buckets.py` the payload). Bounded: an engine that dies or hangs mid-push fails the
push with its URL within the timeout."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import torch
from torch import Tensor

from vime.errors import EngineError
from vime.transport.base import Metrics, NamedTensors, PushSettings, Sums, Transport, common_dtype, each_client
from vime.transport.buckets import FLATTENED, pack
from vime.transport.checksums import checksums
from vime.transport.group import WeightGroup, WeightSyncError, join, open_store

log = logging.getLogger("vime")

GROUP_NAME = "vime-weights"


class Broadcast(Transport):
    """The weight group of one backend (its row's name, nccl or gloo) and the buckets broadcast
    through it. One group per run: the pusher refuses engines that mix the two."""

    streams = True

    def __init__(self, name: str, settings: PushSettings) -> None:
        super().__init__(name, settings)
        self.group: WeightGroup | None = None  # formed by `connect`, left by `close` or a failed push
        self._dtype: torch.dtype | None = None  # the engines': every bucket is cast to it

    def connect(self, clients: list[Any], device: str | torch.device) -> None:
        """Form the weight group, once per run (no-op while formed).

        The trainer's rank 0 is rank 0 of the group; engine i holds ranks `rank_offset` ..
        `rank_offset + tp − 1`. The engines' join calls run in threads while this side joins;
        any of them failing (an engine that died or refused) ends the wait at once."""
        if not clients or self.group is not None:
            return
        s = self.settings
        device = torch.device(device) if self.name == "nccl" else torch.device("cpu")
        deadline = time.monotonic() + s.timeout
        pool = ThreadPoolExecutor(len(clients), thread_name_prefix="vime-weights")
        try:
            asked = {c: pool.submit(c.model_info) for c in clients}
            infos = [_result(c, f, "reading its model info", _left(deadline)) for c, f in asked.items()]
            self._dtype = common_dtype(infos, [c.url for c in clients])
            tp = [int(i.get("tp_size", 1)) for i in infos]
            world = 1 + sum(tp)
            store = open_store(s.master_address, 0, world, s.timeout)
            offsets = [1 + sum(tp[:i]) for i in range(len(tp))]
            body = {
                "master_address": s.master_address,
                "master_port": store.port,
                "world_size": world,
                "group_name": GROUP_NAME,
                "backend": self.name,
                "timeout": s.timeout,
            }
            joins = {
                c: pool.submit(c.init_weights_update_group, {**body, "rank_offset": off})
                for c, off in zip(clients, offsets)
            }
            check = _failed_calls(joins, "joining the weight group")
            self.group = join(
                self.name,
                s.master_address,
                store.port,
                0,
                world,
                GROUP_NAME,
                device,
                s.timeout,
                store=store,
                check=check,
            )
            for c, f in joins.items():
                _result(c, f, "joining the weight group", _left(deadline))
        except WeightSyncError as e:
            raise EngineError(f"weight group ({self.name}) with {', '.join(c.url for c in clients)}: {e}") from None
        finally:
            pool.shutdown(wait=False, cancel_futures=True)

    def push(
        self, clients: list[Any], weights: NamedTensors, version: int, lora_base: bool, sums: Sums | None
    ) -> Metrics:
        """Broadcast flat buckets (`load_format: flattened_bucket`) to every engine of the group.

        Per bucket: announce it to the engines (HTTP, in threads), broadcast it, then wait for the
        broadcast and for every engine's answer together. An engine that dies or refuses ends the
        wait at once and aborts the group; the whole push is bounded by the timeout."""
        stream = iter(weights)
        first = next(stream, None)
        if first is None:
            return {}
        if self.group is None:
            self.connect(clients, first[1].device)
        group, dtype = self.group, self._dtype
        assert group is not None and dtype is not None
        deadline = time.monotonic() + self.settings.timeout
        nbuckets = nbytes = 0
        pool = ThreadPoolExecutor(len(clients), thread_name_prefix="vime-weights")
        try:
            buckets = pack(_chain(first, stream), self.settings.bucket_bytes, dtype, group.device)
            current = next(buckets)
            while current is not None:
                items, flat = current
                following = next(buckets, None)  # staged now: the last bucket must say it is the last
                nbuckets += 1
                nbytes += flat.numel() * flat.element_size()
                if sums is not None:
                    pieces = flat.split([t.numel() for _, t in items])
                    sums.setdefault(dtype, {}).update(zip([n for n, _ in items], checksums(pieces)))
                body = {
                    "names": [n for n, _ in items],
                    "dtypes": [str(dtype).removeprefix("torch.")] * len(items),
                    "shapes": [list(t.shape) for _, t in items],
                    "group_name": GROUP_NAME,
                    "weight_version": version,
                    "flush_cache": following is None,  # cached prefixes hold KV of the old weights
                    "load_format": FLATTENED,
                    "lora_base": lora_base,
                }
                what = f"weight push v{version}, bucket {nbuckets}"
                calls = {c: pool.submit(c.update_weights_from_distributed, body) for c in clients}
                group.wait(group.broadcast(flat), what, _failed_calls(calls, what), deadline)
                for c, f in calls.items():
                    _result(c, f, what, _left(deadline))
                current = following
        except (WeightSyncError, EngineError) as e:
            group.abort(str(e))
            # the engines still in the group leave it too, now: one waiting on a bucket that will
            # never come holds its step thread, and with it the pause's continue, until it does
            self.close(clients)
            for _ in stream:  # a sharded trainer's other ranks gather every tensor: go along to the end
                pass
            if isinstance(e, EngineError):
                raise
            raise EngineError(f"weight push v{version} to {', '.join(c.url for c in clients)}: {e}") from None
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
        return {"perf/update_weights_buckets": float(nbuckets), "perf/update_weights_bytes": float(nbytes)}

    def close(self, clients: list[Any]) -> None:
        """Leave the weight group, every engine at once: a dead engine's refusal or timeout holds
        up no other."""
        if self.group is None:
            return
        group, self.group = self.group, None

        def leave(c: Any) -> None:
            try:
                c.destroy_weights_update_group({"group_name": GROUP_NAME})
            except EngineError as e:
                log.debug("leaving the weight group at %s: %s", c.url, e)

        each_client(clients, leave)
        group.close()


def _left(deadline: float) -> float:
    return max(0.0, deadline - time.monotonic())


def _chain(first: tuple[str, Tensor], rest: Iterator[tuple[str, Tensor]]) -> Iterator[tuple[str, Tensor]]:
    yield first
    yield from rest


def _failed_calls(calls: dict[Any, Future], what: str) -> Callable[[], None]:
    """A check for WeightGroup.wait: raises as soon as any engine's HTTP call has failed."""

    def check() -> None:
        for client, f in calls.items():
            if f.done() and f.exception() is not None:
                _result(client, f, what, 0)

    return check


def _result(client: Any, f: Future, what: str, timeout: float) -> Any:
    """The call's answer, or an EngineError naming the engine and what it was doing."""
    try:
        return f.result(timeout=timeout)
    except FutureTimeout:
        raise EngineError(f"engine at {client.url} did not answer ({what}) in time") from None
    except EngineError as e:
        raise EngineError(f"{what}: {e}") from None
