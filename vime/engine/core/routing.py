"""Rollout routing replay (R3), the engine's half: the experts every position of a request was
routed to, for a trainer that replays them (its forward takes the engine's expert choice).

Each MoE layer writes its top-k expert ids at the token's KV slot, in the routing pool beside the
keys and values (`KVCache.routes`), on every step and on every path (CUDA graphs included: the
slots are the graph's static input). When a sequence whose request asked for them ends, its
rows are gathered from its blocks before the blocks are given back. Why there rather than a
per-step copy to the host: a prompt prefix found in the prefix cache is not recomputed, and its
blocks hold its routing too (the same tokens under the same weights route the same way; a
weight update forgets the cache); a sequence preempted and recomputed overwrites its rows, so
the routing returned is the one its final KV came from; and nothing crosses to the host until a
request ends.

The answer is SGLang's: `meta_info["routed_experts"]` is base64 of a little-endian int32 array
[len(prompt) + len(output) - 1, MoE layers, top_k] (every position the model processed; the
last token is never fed). Its layer axis counts MoE layers only, in order; SGLang's counts every
decoder layer, which is the same for every released Qwen3-MoE and Mixtral (all layers sparse).
Positions never computed (a request aborted before them) are -1.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass

import numpy as np
import torch

from vime.engine.core.kv_cache import KVCache
from vime.engine.core.scheduler import Sequence


@dataclass
class RoutedExperts:
    """One sequence's routing on its way to the host: `ids` [positions, MoE layers, top_k]
    int32, complete once `event` has passed (None: already)."""

    ids: torch.Tensor
    event: torch.cuda.Event | None

    def array(self) -> np.ndarray:
        """The ids, waiting for the copy (on CUDA, at most the step in flight)."""
        if self.event is not None:
            self.event.synchronize()
        return self.ids.numpy()

    def base64(self) -> str:
        return base64.b64encode(self.array().astype("<i4", copy=False).tobytes()).decode("ascii")


def read_routes(kv: KVCache, seq: Sequence, block_size: int) -> RoutedExperts:
    """The routing of `seq`'s positions 0 .. num_tokens - 2 from its blocks, while it still holds
    them. The gather and the copy are queued on the device's stream, so they read the blocks
    before any later step can write them, and the engine does not wait for them here."""
    assert kv.route_shape is not None, "a dense model has no routing pool"
    n = seq.num_tokens - 1
    done = min(n, seq.num_computed)  # an aborted sequence may have fewer rows computed
    cuda = kv.device.type == "cuda"
    ids = torch.full((n, *kv.route_shape[1:]), -1, dtype=torch.int32, pin_memory=cuda)
    if done == 0:  # nothing computed (a released engine has sent every sequence back to waiting)
        return RoutedExperts(ids, None)
    assert kv.routes is not None
    pos = np.arange(done)
    slots = torch.from_numpy(
        np.asarray(seq.block_table, dtype=np.int64)[pos // block_size] * block_size + pos % block_size
    )
    if not cuda:
        ids[:done] = kv.routes[slots]
        return RoutedExperts(ids, None)
    # pinned, or the copy from pageable memory could wait for the step in flight
    rows = kv.routes[slots.pin_memory().to(kv.routes.device, non_blocking=True)]  # [done, layers, K]
    ids[:done].copy_(rows, non_blocking=True)
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(rows.device))
    return RoutedExperts(ids, event)
