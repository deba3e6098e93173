"""Paged KV cache: block pools, a block allocator with prefix reuse, and attention over blocks.

Keys and values live in fixed-size blocks, so a sequence grows one block at a time and memory
is never fragmented or reserved for a maximum length. Full blocks are remembered by content
(chained over the prefix), so requests that share a prompt, as the samples of a GRPO group do,
compute its KV once. Attention runs as Triton kernels on GPU (`kernels.py`) and as plain
PyTorch elsewhere (gather each sequence's blocks, masked SDPA).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from vime.engine.core import kernels

BlockKey = tuple[int | None, tuple[int, ...]]  # (hash of the previous block's key, this block's tokens)


class KVCache:
    """Per-layer K and V pools of shape [num_blocks + 1, block_size, num_kv_heads, head_dim].

    The extra block (`scratch_block`) is never handed out: the padding rows of a CUDA-graph
    batch write their keys and values there, so they can never touch a live sequence's.
    """

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device):
        self.shape = (num_layers, num_blocks + 1, block_size, num_kv_heads, head_dim)
        self.scratch_block = num_blocks
        self.dtype, self.device = dtype, device
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.allocate()

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * block_size * num_kv_heads * head_dim * dtype.itemsize

    def allocate(self) -> None:
        self.k = torch.zeros(self.shape, dtype=self.dtype, device=self.device)
        self.v = torch.zeros(self.shape, dtype=self.dtype, device=self.device)

    def release(self) -> None:
        """Drop the pools (the memory goes back to the device); `allocate` brings them back empty."""
        self.k = self.v = None

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


@dataclass
class AttnGroup:
    """Sequences whose new tokens are attended together, padded to the group's longest.

    Decodes (one new token each) and prefills go in separate groups so that a long prompt in
    the step does not pad every decode row to its length.
    """

    token_index: torch.Tensor  # [B, Q] index into the step's flat tokens; padding repeats a real index
    q_valid: torch.Tensor  # [B, Q] bool
    block_tables: torch.Tensor  # [B, NB] block ids; padding points at block 0, masked out
    mask: torch.Tensor  # [B, 1, Q, NB * block_size] bool: key position <= query position


@dataclass
class AttnMetadata:
    """Where this step's tokens go in the cache and what they attend to. The Triton path reads
    block_tables / context_lens (and cu_q when sequences bring more than one token); the PyTorch
    path reads groups."""

    slot_mapping: torch.Tensor  # [T] flat cache slot (block * block_size + offset) of each new token
    groups: list[AttnGroup] = field(default_factory=list)
    block_tables: torch.Tensor | None = None  # [B, W] int32, rows padded with any valid block id
    context_lens: torch.Tensor | None = None  # [B] int32: cached tokens after this step's writes
    cu_q: torch.Tensor | None = None  # [B + 1] int32 offsets of each sequence's new tokens; None: one each (decode)
    max_q_len: int = 1


def make_group(token_index: list[list[int]], q_positions: list[list[int]], block_tables: list[list[int]], block_size: int, device: torch.device) -> AttnGroup:
    """Pad a group's per-sequence lists into tensors and build its causal mask once per step."""
    q_len = max(len(r) for r in token_index)
    nb = max(len(t) for t in block_tables)
    idx = torch.tensor([r + [r[0]] * (q_len - len(r)) for r in token_index], dtype=torch.long)
    valid = torch.tensor([[True] * len(r) + [False] * (q_len - len(r)) for r in token_index])
    qpos = torch.tensor([p + [0] * (q_len - len(p)) for p in q_positions], dtype=torch.long)
    tables = torch.tensor([t + [0] * (nb - len(t)) for t in block_tables], dtype=torch.long)
    kpos = torch.arange(nb * block_size)
    mask = (kpos[None, None, :] <= qpos[:, :, None]).unsqueeze(1)  # padded query rows see key 0 only
    return AttnGroup(idx.to(device), valid.to(device), tables.to(device), mask.to(device))


def paged_attention(q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttnMetadata, scale: float) -> torch.Tensor:
    """Write this step's keys/values into their slots, then attend each group over its blocks.

    All writes of a layer happen before any read, so a sequence may read blocks that another
    sequence in the same step is filling (prefix sharing within one step). On the Triton path
    the writes were already done by `kernels.qkv_rope_store` (k and v are None).
    q: [T, H, D]; k, v: [T, Hkv, D]; caches: [num_blocks, block_size, Hkv, D]. Returns [T, H, D].
    """
    if meta.block_tables is not None:
        if meta.cu_q is None:
            return kernels.decode_attention(q, k_cache, v_cache, meta.block_tables, meta.context_lens, scale)
        return kernels.prefill_attention(q, k_cache, v_cache, meta.block_tables, meta.context_lens, meta.cu_q, meta.max_q_len, scale)
    n_kv, d = k.shape[1], k.shape[2]
    k_cache.view(-1, n_kv, d).index_copy_(0, meta.slot_mapping, k)
    v_cache.view(-1, n_kv, d).index_copy_(0, meta.slot_mapping, v)
    out = torch.empty_like(q)
    for g in meta.groups:
        qg = q[g.token_index].transpose(1, 2)  # [B, H, Q, D]
        kg = k_cache[g.block_tables].flatten(1, 2).transpose(1, 2)  # [B, Hkv, S, D]
        vg = v_cache[g.block_tables].flatten(1, 2).transpose(1, 2)
        if qg.shape[2] == 1 and qg.dtype != torch.float32:
            # CPU SDPA runs a one-query (decode) group in bfloat16 ~7x slower than in float32,
            # which made the whole bf16 engine slower than the float32 one: attend in float32
            qg, kg, vg = qg.float(), kg.float(), vg.float()
        o = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=g.mask, scale=scale, enable_gqa=True).to(q.dtype)
        out[g.token_index[g.q_valid]] = o.transpose(1, 2)[g.q_valid]
    return out
