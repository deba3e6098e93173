"""One scheduled step on the device: inputs in, sampled tokens and log-probs out.

Two ways through. A *decode* step (every sequence brings exactly one token and wants the next)
fills preallocated host buffers, copies them to the device in one transfer and, on CUDA,
replays a CUDA graph captured for the next batch size up the ladder: the whole forward of a
few hundred kernels costs one launch. Every other step (prefills, chunked or mixed with
decodes) runs eagerly. Sampling runs after the forward, on the device; the step ends with one
device-to-host copy of token ids and log-probs into pinned memory.

`launch` returns without waiting for that copy (a `Launched` step), so the engine can book
the step before while the device computes this one. A decode row whose input token is still
on its way (the previous step drew it) names that step's row instead, and the token is
gathered on the device before the replay.

Graphs bake in the addresses of the weights, the KV pools and the static buffers: weight
updates therefore `copy_` into the parameters, and a memory release keeps the weights' and the
pools' addresses (CUDA virtual memory, `vmem.py`), so the graphs captured at start serve for
the engine's life. Where that is unavailable, a release drops the graphs (`drop_graphs`) and
resume captures them again.
"""

from __future__ import annotations

import bisect
import logging
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from vime.engine.core import kernels
from vime.engine.core.attention import AttnMetadata, make_group
from vime.engine.core.kv_cache import KVCache
from vime.engine.core.model import CausalLM
from vime.engine.core.sampler import add_logit_bias, penalize_occurrences, penalize_repeats, sample, step_seeds
from vime.engine.core.scheduler import PENDING, Sequence

log = logging.getLogger(__name__)

GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 384, 512)
STAGED = 7  # per-row int32 fields staged before the block tables


@dataclass
class Launched:
    """A step on its way: its sampled sequences in row order, their tokens on the device (the
    next step's inputs) and the copy of tokens and log-probs to the host, done when `event` is."""

    seqs: list[Sequence]
    tokens: torch.Tensor
    h_tok: torch.Tensor
    h_lp: torch.Tensor
    event: torch.cuda.Event | None
    index: list[int] = field(default_factory=list)  # the engine's: where each row's token goes in its sequence

    def rows(self) -> dict[int, int]:
        """id(sequence) → its row."""
        return {id(s): i for i, s in enumerate(self.seqs)}

    def result(self) -> tuple[list[int], list[float]]:
        """The tokens and log-probs, once the device has them (the step's one wait)."""
        if self.event is not None:
            self.event.synchronize()
        return self.h_tok.tolist(), self.h_lp.tolist()


@dataclass
class StepInfo:
    """What the last step was, for metrics and benchmarks: its path, sequences and the number
    of cached tokens its attention read."""

    kind: str  # "graph" (decode, replayed), "decode" (static buffers, no graph) or "eager"
    num_seqs: int
    context_tokens: int


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        kv_cache: KVCache,
        block_size: int,
        max_num_seqs: int,
        max_seq_len: int,
        device: torch.device,
        cuda_graphs: bool,
    ):
        self.model, self.kv_cache = model, kv_cache
        self.block_size, self.device = block_size, device
        self.kernels = kernels.enabled(device)
        # Graphs need the Triton path: the PyTorch attention sizes its tensors from the batch.
        self.use_graphs = cuda_graphs and self.kernels and device.type == "cuda"
        self.batch_sizes = [b for b in GRAPH_BATCH_SIZES if b < max_num_seqs] + [max_num_seqs]
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.capture_time = 0.0
        self.last_step = StepInfo("eager", 0, 0)
        pin = device.type == "cuda"
        n = self.max_bs = self.batch_sizes[-1]
        self.width = -(-max_seq_len // block_size)  # block-table columns: a full-length sequence
        if self.kernels:
            # One int32 staging buffer: ids | positions | slots | context lens | temperatures (float32 bits)
            # | sampling seeds | source rows of pending ids | block tables.
            self.host = torch.empty(STAGED * n + n * self.width, dtype=torch.int32, pin_memory=pin)
            h = self.host.numpy()
            self.h_ids, self.h_pos, self.h_slot, self.h_ctx = h[:n], h[n : 2 * n], h[2 * n : 3 * n], h[3 * n : 4 * n]
            self.h_temp = h[4 * n : 5 * n].view(np.float32)
            self.h_seed, self.h_src = h[5 * n : 6 * n], h[6 * n : 7 * n]
            self.h_bt = h[STAGED * n :].reshape(n, self.width)
            self.h_bt[:] = kv_cache.scratch_block
            self.dev = torch.zeros_like(self.host, device=device)
            d = self.dev
            self.d_ids, self.d_pos, self.d_slot, self.d_ctx = d[:n], d[n : 2 * n], d[2 * n : 3 * n], d[3 * n : 4 * n]
            self.d_temp = d[4 * n : 5 * n].view(torch.float32)
            self.d_seed, self.d_src = d[5 * n : 6 * n], d[6 * n : 7 * n]
            self.d_bt = d[STAGED * n :].view(n, self.width)
            self._bt_rows: list[tuple[list[int], int] | None] = [None] * n  # (block table list, length) each row holds
        # Two sets of pinned outputs, taken in turn: a step's copy lands while the step before's is read.
        self._outs = [
            (
                torch.empty(max_num_seqs, dtype=torch.int64, pin_memory=pin),
                torch.empty(max_num_seqs, dtype=torch.float32, pin_memory=pin),
            )
            for _ in range(2)
        ]
        self._launches = 0
        # the last upload from the staging buffer: with steps overlapped it may still be queued
        # behind the step before, so the buffer is not written again until it has run
        self._uploaded: torch.cuda.Event | None = None

    # ---- graphs ------------------------------------------------------------------------

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture the decode forward for every ladder size, largest first, in one memory pool."""
        if not self.use_graphs:
            return
        t0 = time.perf_counter()
        self._set_padding(0, self.max_bs)
        self._upload(self.max_bs)
        pool = None
        for bs in reversed(self.batch_sizes):
            self._decode_forward(bs)  # warm-up: Triton compiles, cuBLAS picks its kernels
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self._decode_forward(bs)
            pool = graph.pool()
            self.graphs[bs] = (graph, out)
        torch.cuda.synchronize(self.device)
        self.capture_time = time.perf_counter() - t0
        log.info("captured CUDA graphs for decode batch sizes %s in %.2fs", self.batch_sizes, self.capture_time)

    def drop_graphs(self) -> None:
        self.graphs.clear()

    def _decode_forward(self, bs: int) -> torch.Tensor:
        meta = AttnMetadata(slot_mapping=self.d_slot[:bs], block_tables=self.d_bt[:bs], context_lens=self.d_ctx[:bs])
        kv = self.kv_cache
        return self.model(self.d_ids[:bs], self.d_pos[:bs], kv.layers(), meta, None, kv.routes)

    # ---- a step ------------------------------------------------------------------------

    def is_decode(self, scheduled: list[tuple[Sequence, int]]) -> bool:
        """Whether the step takes the decode path: every sequence brings one token and wants the next."""
        return (
            self.kernels
            and len(scheduled) <= self.max_bs
            and all(n == 1 and s.num_computed + 1 == s.num_tokens for s, n in scheduled)
        )

    def launch(self, scheduled: list[tuple[Sequence, int]], prev: Launched | None = None) -> Launched:
        """Run the model over the scheduled chunks and sample, without waiting for the result.
        A decode row whose last token is PENDING takes it from `prev`, the step that drew it;
        other steps must not read pending tokens."""
        if self.is_decode(scheduled):
            seqs = [s for s, _ in scheduled]
            logits, temps, seeds = self._decode(seqs, prev)
        else:
            seqs, logits = self._eager(scheduled)
            temps = torch.tensor([s.params.temperature for s in seqs], dtype=torch.float32).to(
                self.device, non_blocking=True
            )
            seeds = torch.from_numpy(self._seeds(seqs, np.array([s.num_tokens for s in seqs], dtype=np.int64))).to(
                self.device, non_blocking=True
            )
        repeats = [  # one pass over the batch, and nothing more, when no request asks for a penalty
            (i, s.params.repetition_penalty, s.token_ids[:-1] if s.token_ids[-1] == PENDING else s.token_ids)
            for i, s in enumerate(seqs)
            if s.params.repetition_penalty != 1.0
        ]
        if repeats:  # a decode step's newest token may still be pending: its input ids hold it
            last = self.d_ids[: len(seqs)] if self.is_decode(scheduled) else None
            logits = penalize_repeats(logits, repeats, last)
        counted = [  # the response's tokens only; a pending newest one is in the step's input ids
            (i, s.params.presence_penalty, s.params.frequency_penalty, *_response(s))
            for i, s in enumerate(seqs)
            if s.params.presence_penalty or s.params.frequency_penalty
        ]
        if counted:
            last = self.d_ids[: len(seqs)] if self.is_decode(scheduled) else None
            logits = penalize_occurrences(logits, counted, last)
        biased = [(i, s.params.logit_bias) for i, s in enumerate(seqs) if s.params.logit_bias]
        if biased:
            logits = add_logit_bias(logits, biased)
        tokens, logprobs = sample(logits, [s.params for s in seqs], temps, seeds)
        return self._download(seqs, tokens, logprobs)

    def run(self, scheduled: list[tuple[Sequence, int]]) -> tuple[list[Sequence], list[int], list[float]]:
        """`launch`, then wait: the sequences that got a token, the tokens and their log-probs."""
        step = self.launch(scheduled)
        return step.seqs, *step.result()

    @staticmethod
    def _seeds(seqs: list[Sequence], positions: np.ndarray) -> np.ndarray:
        """Each row's sampling seed (int32 bits) for drawing the token at `positions`."""
        return (
            step_seeds(np.fromiter((s.seed for s in seqs), dtype=np.int64, count=len(seqs)), positions)
            .astype(np.uint32)
            .view(np.int32)
        )

    def _decode(self, seqs: list[Sequence], prev: Launched | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        b = len(seqs)
        bs = self.batch_sizes[bisect.bisect_left(self.batch_sizes, b)]
        block = self.block_size
        if self._uploaded is not None:
            self._uploaded.synchronize()
        pos = [s.num_computed for s in seqs]
        ids = [s.token_ids[-1] for s in seqs]
        pending = PENDING in ids
        if pending:
            if prev is None:
                raise RuntimeError("a decode step reads a pending token, but no step in flight drew it")
            rows = prev.rows()
            self.h_src[:b] = [rows[id(s)] if t == PENDING else -1 for s, t in zip(seqs, ids)]
            ids = [max(t, 0) for t in ids]
        self.h_ids[:b] = ids
        self.h_pos[:b] = pos
        self.h_slot[:b] = [s.block_table[p // block] * block + p % block for s, p in zip(seqs, pos)]
        np.add(self.h_pos[:b], 1, out=self.h_ctx[:b])
        self.h_temp[:b] = [s.params.temperature for s in seqs]
        self.h_seed[:b] = self._seeds(
            seqs, self.h_ctx[:b].astype(np.int64)
        )  # the new token's position = context length
        self._set_padding(b, bs)
        # Block tables only grow by appending to the same list, so a row is rewritten only when
        # it holds another list (another sequence, or one re-admitted) or a shorter one.
        rows = self._bt_rows
        for i, s in enumerate(seqs):
            row, table = rows[i], s.block_table
            if row is None or row[0] is not table or row[1] != len(table):
                self.h_bt[i, : len(table)] = table
                rows[i] = (table, len(table))
        self._upload(bs)
        if pending:  # the previous step's tokens, gathered where it left them
            src = self.d_src[:b].long()
            drawn = prev.tokens.index_select(0, src.clamp(min=0)).to(torch.int32)
            self.d_ids[:b] = torch.where(src >= 0, drawn, self.d_ids[:b])
        if self.graphs:
            graph, out = self.graphs[bs]
            graph.replay()
            kind = "graph"
        else:
            out = self._decode_forward(bs)
            kind = "decode"
        self.last_step = StepInfo(kind, b, int(self.h_ctx[:b].sum()))
        return out[:b], self.d_temp[:b], self.d_seed[:b]

    def _set_padding(self, start: int, end: int) -> None:
        """Rows past the batch: one token at position 0 written to and read from the scratch block."""
        self.h_ids[start:end] = 0
        self.h_pos[start:end] = 0
        self.h_slot[start:end] = self.kv_cache.scratch_block * self.block_size
        self.h_ctx[start:end] = 1
        self.h_temp[start:end] = 0.0

    def _upload(self, bs: int) -> None:
        n = STAGED * self.max_bs + bs * self.width
        self.dev[:n].copy_(self.host[:n], non_blocking=True)
        if self.device.type == "cuda":
            self._uploaded = torch.cuda.Event()
            self._uploaded.record(torch.cuda.current_stream(self.device))

    def _eager(self, scheduled: list[tuple[Sequence, int]]) -> tuple[list[Sequence], torch.Tensor]:
        logit_rows: list[int] = []
        to_sample: list[Sequence] = []
        offset = 0
        for seq, n in scheduled:
            if seq.num_computed + n == seq.num_tokens:  # the chunk reaches the end: the next token is due
                logit_rows.append(offset + n - 1)
                to_sample.append(seq)
            offset += n
        return to_sample, self._forward(scheduled, logit_rows)

    def prompt_logprobs(
        self, seq: Sequence, n: int, first: int, top: int = 0
    ) -> tuple[list[float], list[list[tuple[int, float]]]]:
        """Log-probs of the tokens at positions max(first, c + 1) .. c + n of `seq` (c: its
        `num_computed`; none past its end), each under the model's raw distribution given the
        tokens before it, from one eager forward that also writes the chunk's KV; and at each of
        those positions the `top` likeliest tokens as (id, log-prob), likeliest first (OpenAI's
        top log-probs). Nothing is sampled: this is scoring given text (`scoring.py`)."""
        start = seq.num_computed
        targets = range(max(first, start + 1), min(start + n + 1, seq.num_tokens))
        if not targets:
            self._forward([(seq, n)], [])
            return [], []
        logits = self._forward([(seq, n)], [t - 1 - start for t in targets]).float()
        logprobs = logits - logits.logsumexp(-1, keepdim=True)  # [T, V]
        ids = torch.tensor(seq.token_ids[targets.start : targets.stop], device=logits.device)[:, None]
        tops: list[list[tuple[int, float]]] = []
        if top > 0:
            values, indices = logprobs.topk(min(top, logprobs.shape[-1]), dim=-1)  # [T, top]
            tops = [list(zip(i, v)) for i, v in zip(indices.tolist(), values.tolist())]
        return logprobs.gather(1, ids)[:, 0].tolist(), tops

    def _forward(self, scheduled: list[tuple[Sequence, int]], logit_rows: list[int]) -> torch.Tensor:
        """The eager forward of `scheduled`'s chunks (KV written to their blocks); logits of the
        chunk tokens at `logit_rows` (indices into the concatenated chunks)."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        for seq, n in scheduled:
            start = seq.num_computed
            input_ids += seq.token_ids[start : start + n]
            positions += range(start, start + n)
            slots += [seq.block_table[p // bs] * bs + p % bs for p in range(start, start + n)]
        dev = self.device
        slot_mapping = torch.tensor(slots, dtype=torch.int32 if self.kernels else torch.long).to(dev, non_blocking=True)
        meta = self._kernel_meta(scheduled, slot_mapping) if self.kernels else self._torch_meta(scheduled, slot_mapping)
        ids = torch.tensor(input_ids, dtype=torch.long).to(dev, non_blocking=True)
        pos = torch.tensor(positions, dtype=torch.long).to(dev, non_blocking=True)
        rows = torch.tensor(logit_rows, dtype=torch.long).to(dev, non_blocking=True)
        self.last_step = StepInfo("eager", len(scheduled), sum(s.num_computed + n for s, n in scheduled))
        return self.model(ids, pos, self.kv_cache.layers(), meta, rows, self.kv_cache.routes)

    def _kernel_meta(self, scheduled: list[tuple[Sequence, int]], slot_mapping: torch.Tensor) -> AttnMetadata:
        width = max(len(s.block_table) for s, _ in scheduled)
        tables = np.zeros((len(scheduled), width), dtype=np.int32)
        for i, (s, _) in enumerate(scheduled):
            tables[i, : len(s.block_table)] = s.block_table
        lens = np.array([n for _, n in scheduled], dtype=np.int32)
        cu_q = np.zeros(len(scheduled) + 1, dtype=np.int32)
        np.cumsum(lens, out=cu_q[1:])
        ctx = np.array([s.num_computed for s, _ in scheduled], dtype=np.int32) + lens
        dev = self.device
        return AttnMetadata(
            slot_mapping=slot_mapping,
            block_tables=torch.from_numpy(tables).to(dev, non_blocking=True),
            context_lens=torch.from_numpy(ctx).to(dev, non_blocking=True),
            cu_q=torch.from_numpy(cu_q).to(dev, non_blocking=True),
            max_q_len=int(lens.max()),
        )

    def _torch_meta(self, scheduled: list[tuple[Sequence, int]], slot_mapping: torch.Tensor) -> AttnMetadata:
        """Decodes and prefills in separate padded groups (see `AttnGroup`)."""
        groups: dict[bool, tuple[list, list, list]] = {}  # is_prefill → (token index, positions, block tables)
        offset = 0
        for seq, n in scheduled:
            g = groups.setdefault(n > 1, ([], [], []))
            g[0].append(list(range(offset, offset + n)))
            g[1].append(list(range(seq.num_computed, seq.num_computed + n)))
            g[2].append(seq.block_table)
            offset += n
        return AttnMetadata(
            slot_mapping=slot_mapping,
            groups=[make_group(i, p, t, self.block_size, self.device) for i, p, t in groups.values()],
        )

    def _download(self, seqs: list[Sequence], tokens: torch.Tensor, logprobs: torch.Tensor) -> Launched:
        """Start the step's one device → host transfer; `Launched.result` waits for it."""
        h_tok, h_lp = self._outs[self._launches % 2]
        self._launches += 1
        b = tokens.shape[0]
        if tokens.device.type != "cuda":
            h_tok[:b], h_lp[:b] = tokens, logprobs
            return Launched(seqs, tokens, h_tok[:b], h_lp[:b], None)
        h_tok[:b].copy_(tokens, non_blocking=True)
        h_lp[:b].copy_(logprobs, non_blocking=True)
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return Launched(seqs, tokens, h_tok[:b], h_lp[:b], event)


def _response(s: Sequence) -> tuple[list[int], bool]:
    """A sequence's response ids on the host, and whether its newest token is still pending."""
    ids = s.output_ids
    return (ids[:-1], True) if ids and ids[-1] == PENDING else (ids, False)
