"""Paged KV cache: block pools and a block allocator with prefix reuse.

Keys and values live in fixed-size blocks, so a sequence grows one block at a time and memory
is never fragmented or reserved for a maximum length. Full blocks are remembered by content
(chained over the prefix), so requests that share a prompt, as the samples of a GRPO group do,
compute its KV once. Attention over these blocks is in `attention.py`.
"""

from __future__ import annotations

import logging
import math
import os
import time

import torch

from vime.engine.core.model_config import ModelConfig
from vime.engine.core.vmem import VirtualBuffer

log = logging.getLogger(__name__)

BlockKey = tuple[int | None, tuple[int, ...]]  # (hash of the previous block's key, this block's tokens)


class KVCache:
    """Per-layer K and V pools of shape [num_blocks + 1, block_size, num_kv_heads, head_dim].

    The extra block (`scratch_block`) is never handed out: the padding rows of a CUDA-graph
    batch write their keys and values there, so they can never touch a live sequence's.

    A mixture-of-experts model (`routes`: its number of MoE layers and top-k) also gets a routing
    pool, `routes` [(num_blocks + 1) * block_size, MoE layers, top_k] int32: the experts each
    token was routed to, written by the model at the token's KV slot. Kept beside the keys and
    values, it lives and dies with them: a prefix found in the cache has its routing too, and a
    recomputed sequence (preempted, or after a release) overwrites it with the routing it used
    the second time (`routing.py` reads it out for a request).

    `virtual` (CUDA with VMM, `vmem.py`): all pools live in one `VirtualBuffer`, so a release
    unmaps its memory and `allocate` maps fresh memory at the same addresses, where the captured
    decode graphs still look. Otherwise each allocation is a new tensor.
    """

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        virtual: bool = False,
        routes: tuple[int, int] | None = None,
    ):
        self.shape = (num_layers, num_blocks + 1, block_size, num_kv_heads, head_dim)
        self.route_shape = None if routes is None else ((num_blocks + 1) * block_size, *routes)
        self.scratch_block = num_blocks
        self.dtype, self.device, self.virtual = dtype, device, virtual
        self.buffer: VirtualBuffer | None = None
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.routes: torch.Tensor | None = None
        self.allocate()

    @classmethod
    def for_model(
        cls, mc: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device, virtual: bool
    ) -> KVCache:
        """The pools `mc`'s model needs: its layers' keys and values, and its routing if it has experts."""
        shape = (mc.num_layers, num_blocks, block_size, mc.num_kv_heads, mc.head_dim)
        return cls(*shape, dtype, device, virtual, mc.route_shape)

    @staticmethod
    def bytes_per_block(mc: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        """What one block costs in `mc`'s model: keys and values of every layer, and its routing rows."""
        routes = 0 if mc.route_shape is None else block_size * math.prod(mc.route_shape) * 4
        return 2 * mc.num_layers * block_size * mc.num_kv_heads * mc.head_dim * dtype.itemsize + routes

    @property
    def nbytes(self) -> int:
        """The pools' bytes (KV, and routing where the model has experts)."""
        return self._kv_bytes() + (0 if self.route_shape is None else math.prod(self.route_shape) * 4)

    def _kv_bytes(self) -> int:
        return 2 * math.prod(self.shape) * self.dtype.itemsize

    def allocate(self) -> None:
        """The pools, zeroed."""
        routes = self.route_shape
        if not self.virtual:
            self.k = torch.zeros(self.shape, dtype=self.dtype, device=self.device)
            self.v = torch.zeros(self.shape, dtype=self.dtype, device=self.device)
            if routes is not None:
                self.routes = torch.zeros(routes, dtype=torch.int32, device=self.device)
            return
        if self.buffer is None:
            self.buffer = VirtualBuffer(self.nbytes, self.device)
        else:
            self.buffer.map()
        flat = self.buffer.tensor()
        flat.zero_()  # as torch.zeros made them: a fresh mapping's contents are undefined
        kv = self._kv_bytes()  # a multiple of 4: the routing pool after it is aligned for int32
        pools = flat[:kv].view(self.dtype).view(2, *self.shape)
        self.k, self.v = pools[0], pools[1]
        if routes is not None:
            self.routes = flat[kv:].view(torch.int32).view(routes)

    def release(self) -> int:
        """Drop the pools (the memory goes back to the device) and return their bytes; `allocate`
        brings them back empty."""
        self.k = self.v = self.routes = None
        if self.buffer is not None:
            self.buffer.unmap()
        return self.nbytes

    @property
    def allocated(self) -> bool:
        return self.k is not None

    def layers(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        assert self.k is not None and self.v is not None, "KV cache is released"
        return list(zip(self.k.unbind(0), self.v.unbind(0)))


class BlockAllocator:
    """Hands out block ids, counts their users, and remembers full blocks by content.

    A block whose last user left stays in the free list with its content still indexed, so a
    later request with the same prefix can take it back; it is forgotten only when handed out
    again (least recently freed first) or on `flush` (new weights make old KV wrong).
    """

    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.reset()

    def reset(self) -> None:
        self.ref = [0] * self.num_blocks
        self.free: dict[int, None] = dict.fromkeys(range(self.num_blocks))  # insertion order = eviction order
        self.key_of: list[BlockKey | None] = [None] * self.num_blocks
        self.cached: dict[BlockKey, int] = {}
        self.epoch = 0

    @property
    def num_free(self) -> int:
        return len(self.free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def match_prefix(self, token_ids: list[int]) -> tuple[list[int], list[int]]:
        """Cached blocks holding the longest full-block prefix of `token_ids`, and their chain
        hashes. At least one token is left out so the model still computes the next logits."""
        blocks: list[int] = []
        hashes: list[int] = []
        parent: int | None = None
        bs = self.block_size
        for i in range((len(token_ids) - 1) // bs):
            key = (parent, tuple(token_ids[i * bs : (i + 1) * bs]))
            block = self.cached.get(key)
            if block is None:
                break
            parent = hash(key)
            blocks.append(block)
            hashes.append(parent)
        return blocks, hashes

    def num_unused(self, blocks: list[int]) -> int:
        """How many of these cached blocks sit in the free list (taking them uses free capacity)."""
        return sum(self.ref[b] == 0 for b in blocks)

    def take(self, blocks: list[int]) -> None:
        """Add a user to cached blocks found by `match_prefix`."""
        for b in blocks:
            if self.ref[b] == 0:
                del self.free[b]
            self.ref[b] += 1

    def allocate(self, n: int) -> list[int]:
        if n > len(self.free):
            raise RuntimeError(f"KV cache out of blocks: need {n}, {len(self.free)} free")
        out = []
        for _ in range(n):
            b = next(iter(self.free))
            del self.free[b]
            self._forget(b)
            self.ref[b] = 1
            out.append(b)
        return out

    def release(self, blocks: list[int]) -> None:
        # Tail blocks first: they are the least likely to be shared, so they are evicted first.
        for b in reversed(blocks):
            self.ref[b] -= 1
            if self.ref[b] == 0:
                self.free[b] = None

    def register(self, block: int, parent_hash: int | None, tokens: list[int]) -> int:
        """Index a block whose KV is (or within this step will be) computed; returns its chain hash."""
        key = (parent_hash, tuple(tokens))
        if self.cached.setdefault(key, block) == block:
            self.key_of[block] = key
        return hash(key)

    def flush(self) -> None:
        """Forget all content (blocks in use stay in use). Bumps `epoch`, so sequences admitted
        before the flush stop registering blocks that mix old and new weights."""
        self.cached.clear()
        self.key_of = [None] * self.num_blocks
        self.epoch += 1

    def _forget(self, block: int) -> None:
        key = self.key_of[block]
        if key is not None and self.cached.get(key) == block:
            del self.cached[key]
        self.key_of[block] = None


def wait_for_file(path: str, parent_pid: int | None = None) -> None:
    """Return once `path` exists: the engine sizes its cache from free GPU memory after it, when a
    trainer that shares the GPU holds its own (`EngineConfig.wait_for_file`). Exits if the
    process that started this one (`parent_pid`, else this one's parent now) ends first: it
    would never create the file."""
    parent = os.getppid() if parent_pid is None else parent_pid
    t0 = time.monotonic()
    log.info("waiting for %s before sizing the KV cache (a trainer on this GPU is building)", path)
    while not os.path.exists(path):
        if os.getppid() != parent:
            raise SystemExit(f"the process that started this engine ended before creating {path}")
        time.sleep(0.02)
    log.info("waited %.1f s for %s", time.monotonic() - t0, path)
