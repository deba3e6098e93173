"""Attention over the paged KV cache, and the per-step metadata that says where tokens go.

Separate from `kv_cache.py`, which owns the memory (pools, block allocator): this file only reads
and writes it. On GPU `paged_attention` calls the Triton kernels (`kernels/attention.py`); elsewhere it runs
plain PyTorch (gather each sequence's blocks, masked SDPA) over the groups `make_group` builds.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from vime.engine.core import kernels


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


def make_group(
    token_index: list[list[int]],
    q_positions: list[list[int]],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device,
) -> AttnGroup:
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


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor | None,
    v: torch.Tensor | None,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttnMetadata,
    scale: float,
) -> torch.Tensor:
    """Write this step's keys/values into their slots, then attend each group over its blocks.

    All writes of a layer happen before any read, so a sequence may read blocks that another
    sequence in the same step is filling (prefix sharing within one step). On the Triton path
    the writes were already done by `kernels.qkv_rope_store` (k and v are None).
    q: [T, H, D]; k, v: [T, Hkv, D]; caches: [num_blocks, block_size, Hkv, D]. Returns [T, H, D].
    """
    if meta.block_tables is not None:
        if meta.cu_q is None:
            return kernels.decode_attention(q, k_cache, v_cache, meta.block_tables, meta.context_lens, scale)
        return kernels.prefill_attention(
            q, k_cache, v_cache, meta.block_tables, meta.context_lens, meta.cu_q, meta.max_q_len, scale
        )
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
