"""Continuous batching: which sequences run in the next step, and with how many new tokens.

Every sequence is treated the same way: it holds `token_ids` (prompt + generated) of which the
first `num_computed` have KV in the cache; a step computes the next chunk. A fresh prompt is a
long chunk (split over steps when it exceeds the token budget), a decode is a chunk of one, a
preempted sequence is simply recomputed from scratch over prompt + generated tokens.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from vime.engine.core.kv_cache import BlockAllocator
from vime.engine.core.sampler import SamplingParams
from vime.engine.core.stop import StopWindow

PENDING = -1  # a token id the device has drawn and the host has not read yet (engine.py's overlap)


@dataclass(eq=False)
class Sequence:
    rid: str
    token_ids: list[int]
    prompt_len: int
    params: SamplingParams
    stop_ids: frozenset[int]
    num_computed: int = 0
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # chain hashes of the registered full blocks
    cache_epoch: int = -1  # allocator epoch at admission; blocks are registered only while it matches
    logprobs: list[float] = field(default_factory=list)
    weight_versions: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # stop | length | abort
    seed: int = 0  # 32-bit sampling seed: with the token position, it fixes the sequence's draws
    stop_window: StopWindow | None = None  # the output's tail as its last stop-string check decoded it (stop.py)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len :]


class Scheduler:
    def __init__(self, allocator: BlockAllocator, max_num_seqs: int, max_num_batched_tokens: int):
        self.allocator = allocator
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order: the last is the first to be preempted
        self.num_preemptions = 0
        self.num_cached_tokens = 0  # prompt tokens whose KV was found in the prefix cache

    def add(self, seq: Sequence) -> None:
        """Queue behind every waiting sequence of the same or a lower priority value (FIFO
        within a priority). When every seat is taken, it takes one from a running sequence of a
        higher value (`outranked`): an eval during async training (priority -1) is not left
        waiting for the rollout's long responses to end."""
        i = len(self.waiting)
        while i > 0 and self.waiting[i - 1].params.priority > seq.params.priority:
            i -= 1
        self.waiting.insert(i, seq)

    def outranked(self) -> int:
        """How many running sequences must give their seats to waiting ones of a lower priority
        value: every seat is taken, so each such waiting sequence needs one from a running
        sequence of a higher value, while one is left."""
        if not self.waiting or len(self.running) < self.max_num_seqs:
            return 0
        waiting = [s.params.priority for s in self.waiting]  # lowest value first
        n = 0
        for victim in sorted((s.params.priority for s in self.running), reverse=True):
            if n >= len(waiting) or victim <= waiting[n]:
                break
            n += 1
        return n

    def schedule(self, preempt: bool = True) -> list[tuple[Sequence, int]] | None:
        """Pick (sequence, number of new tokens) for one step.

        Running sequences go first, oldest first; when one needs a block and none is free, the
        newest running sequence is preempted (possibly itself), or with `preempt=False` nothing
        is and None comes back: the engine first books the step in flight, whose ended
        sequences still hold blocks. New sequences are admitted only in steps without
        preemption, while seats, blocks and the token budget allow.
        """
        budget = self.max_num_batched_tokens
        out: list[tuple[Sequence, int]] = []
        if preempt:
            for _ in range(self.outranked()):  # the newest running one of the highest value goes first
                low = max(s.params.priority for s in self.running)
                victim = next(s for s in reversed(self.running) if s.params.priority == low)
                self.running.remove(victim)
                self._preempt(victim)
        preempted = False
        bs, epoch = self.allocator.block_size, self.allocator.epoch
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed, budget)
            end = seq.num_computed + n
            # The cheap tests first: most decode steps need no new block and fill no block.
            while len(seq.block_table) * bs < end and not self._grow(seq, end):
                if not preempt:
                    return None  # the blocks grown so far are kept: these sequences need them
                victim = self.running.pop()
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            else:
                if end // bs > len(seq.block_hashes) and seq.cache_epoch == epoch:
                    self._register(seq, n)
                out.append((seq, n))
                budget -= n
                i += 1
        while not preempted and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            n = self._admit(seq, budget)
            if n is None:
                break
            self.waiting.popleft()
            self.running.append(seq)
            self._register(seq, n)
            out.append((seq, n))
            budget -= n
        return out

    def remove(self, seq: Sequence) -> None:
        """Take a sequence out (finished or aborted) and give back its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.allocator.release(seq.block_table)
        seq.block_table, seq.block_hashes = [], []

    def retire(self, seq: Sequence) -> None:
        """Schedule a sequence no more, its blocks kept: its last token, still on the device,
        ends it whatever it is (the length limit). `remove` gives the blocks back."""
        self.running.remove(seq)

    def preempt_all(self) -> None:
        """Send every running sequence back to waiting (in order), keeping its tokens."""
        while self.running:
            self._preempt(self.running.pop())

    def _grow(self, seq: Sequence, num_tokens: int) -> bool:
        need = self.allocator.blocks_for(num_tokens) - len(seq.block_table)
        if need > self.allocator.num_free:
            return False
        if need > 0:
            seq.block_table += self.allocator.allocate(need)
        return True

    def _admit(self, seq: Sequence, budget: int) -> int | None:
        """Give a waiting sequence its cached prefix and blocks for its first chunk; returns the
        chunk length, or None when the blocks are not there."""
        alloc = self.allocator
        blocks, hashes = alloc.match_prefix(seq.token_ids)
        cached = len(blocks) * alloc.block_size
        n = min(seq.num_tokens - cached, budget)
        need = alloc.blocks_for(cached + n) - len(blocks)
        if need + alloc.num_unused(blocks) > alloc.num_free:
            return None
        alloc.take(blocks)
        seq.block_table = blocks + alloc.allocate(need)
        seq.block_hashes = hashes
        seq.num_computed = cached
        seq.cache_epoch = alloc.epoch
        self.num_cached_tokens += cached
        return n

    def _register(self, seq: Sequence, n: int) -> None:
        """Index the full blocks this step will complete, so later sequences (even in this same
        step) can reuse them."""
        if seq.cache_epoch != self.allocator.epoch:
            return
        bs = self.allocator.block_size
        for b in range(len(seq.block_hashes), (seq.num_computed + n) // bs):
            if (b + 1) * bs >= seq.num_tokens and seq.token_ids[-1] == PENDING:
                break  # the block ends in a token not read yet: indexed by a later step
            parent = seq.block_hashes[-1] if seq.block_hashes else None
            seq.block_hashes.append(
                self.allocator.register(seq.block_table[b], parent, seq.token_ids[b * bs : (b + 1) * bs])
            )

    def _preempt(self, seq: Sequence) -> None:
        """Back to waiting, first of its priority (its tokens kept: it is recomputed over them)."""
        self.allocator.release(seq.block_table)
        seq.block_table, seq.block_hashes, seq.num_computed = [], [], 0
        i = 0
        while i < len(self.waiting) and self.waiting[i].params.priority < seq.params.priority:
            i += 1
        self.waiting.insert(i, seq)
        self.num_preemptions += 1
