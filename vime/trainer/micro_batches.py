"""A step's samples as the scorer takes them: split over the ranks, packed into micro-batches on
the device, and scored at the temperature they were drawn at.

Every rank receives the whole batch and derives, without talking to the others, the same split:
samples go to ranks balanced by tokens, each rank packs its share into micro-batches of at most
`--max-tokens-per-gpu` real tokens and `--micro-batch-size` samples (padded only when compiled,
see `MicroBatches.pack`), and ranks with fewer micro-batches run empty ones so the FSDP
collectives stay in step. The packing itself is `vime.trainer.packing`'s.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from vime.config import ConfigError, TrainerConfig
from vime.rollout.types import Sample
from vime.trainer.model import length_limits
from vime.trainer.moe import MoeShape
from vime.trainer.packing import PAD_BUCKETS, PackedBatch, pack, plan_packed_micro_batches, shard_by_tokens, to_device
from vime.trainer.ranks import Ranks
from vime.trainer.routing import packed_routing

log = logging.getLogger("vime")


@dataclass(kw_only=True)
class MicroBatches:
    """How this rank splits and packs a step's samples."""

    ranks: Ranks
    max_tokens: int  # --max-tokens-per-gpu: real tokens a micro-batch may hold
    max_samples: int | None  # --micro-batch-size
    model_config: Any  # the policy's HF config: its attention and RoPE limit the lengths (`length_limits`)
    pad_token_id: int
    pad_to: int | None  # compiled: lengths are rounded up to a multiple of this, up to PAD_BUCKETS of it
    temperature: float  # --rollout-temperature: a sample's when nothing stamped its own
    moe: MoeShape | None = None  # a mixture of experts: its micro-batches carry the engine's routing
    warned_oversize: bool = False

    @classmethod
    def of(
        cls,
        trainer: TrainerConfig,
        ranks: Ranks,
        model_config: Any,
        tokenizer: Any,
        compiled: bool,
        temperature: float,
        moe: MoeShape | None = None,
    ) -> MicroBatches:
        """`temperature`: --rollout-temperature, what log-probs are scored at (the samples say theirs);
        `moe`: the policy's mixture of experts, None for a dense model."""
        pad = tokenizer.pad_token_id
        return cls(
            ranks=ranks,
            max_tokens=trainer.max_tokens_per_gpu,
            max_samples=trainer.micro_batch_size,
            model_config=model_config,
            pad_token_id=pad if pad is not None else (tokenizer.eos_token_id or 0),
            pad_to=-(-trainer.max_tokens_per_gpu // PAD_BUCKETS) if compiled else None,
            temperature=temperature,
            moe=moe,
        )

    def plan(self, samples: list[Sample]) -> list[list[int]]:
        """This rank's micro-batches as indices into `samples`. Every rank gets the same number
        (padding with empty ones), so FSDP's collectives pair up."""
        lengths = [len(s.tokens) for s in samples]
        longest = max(lengths, default=0)
        if self.pad_to is not None and longest > self.max_tokens and not self.warned_oversize:
            self.warned_oversize = True
            log.warning(
                "a %d-token sequence is longer than --max-tokens-per-gpu %d: its micro-batch may compile once more "
                "mid-run; raise the budget above prompt + response length",
                longest,
                self.max_tokens,
            )
        shards = shard_by_tokens(lengths, self.ranks.world)
        limits = (self.max_samples, length_limits(self.model_config, longest))
        plans = [
            [
                [shard[j] for j in mb]
                for mb in plan_packed_micro_batches([lengths[i] for i in shard], self.max_tokens, *limits)
            ]
            for shard in shards
        ]
        mine = plans[self.ranks.rank]
        return mine + [[] for _ in range(max(len(p) for p in plans) - len(mine))]

    def pack(self, samples: list[Sample], idx: list[int]) -> PackedBatch:
        """One micro-batch on the device. Compiled layers get its length rounded up to one of
        `PAD_BUCKETS` sizes (`sizes`), all of which the warm-up compiled: each other token count
        risks a compile of its own mid-run (inductor guards ranges of it, e.g. T >= 5120;
        bench/RESULTS.md, issue 16). A sequence longer than the budget gets a micro-batch of its
        own, of a size the warm-up did not see (`plan` warns once)."""
        if not idx:
            return self.empty(self.pad_to)
        mb = pack(
            [samples[i].tokens for i in idx],
            [samples[i].response_length for i in idx],
            idx,
            self.ranks.device,
            self.pad_to,
            self.pad_token_id,
        )
        routed = [samples[i].rollout_routed_experts for i in idx]
        if self.moe is not None and any(r is not None for r in routed):
            lengths = [len(samples[i].tokens) for i in idx]
            mb.routed_experts = to_device(packed_routing(routed, lengths, mb.num_tokens, self.moe), self.ranks.device)
        return mb

    def empty(self, pad_to: int | None) -> PackedBatch:
        """A micro-batch that nothing scores (one dummy sequence), padded to `pad_to`: what a rank
        with fewer micro-batches runs, and what the warm-up compiles."""
        return pack([[self.pad_token_id] * 2], [1], [], self.ranks.device, pad_to, self.pad_token_id)

    def sizes(self) -> list[int]:
        """Every padded length a compiled micro-batch can have."""
        assert self.pad_to is not None
        return list(range(self.pad_to, self.pad_to * PAD_BUCKETS + 1, self.pad_to))

    def temperature_of(self, samples: list[Sample]) -> float:
        """The temperature a step's responses were drawn at: what the generate that drew each
        stamped on it (`Sample.temperature`), or --rollout-temperature for a sample nothing
        stamped (a custom generate function of slime's signature). One step is scored at one,
        so trainer and engine score the same distribution (top-p/top-k truncation is not
        reproduced)."""
        drawn = {
            self.temperature if s.temperature is None else s.temperature
            for s in samples
            if s.response_length  # a sample with nothing drawn scores nothing
        }
        if len(drawn) > 1:
            raise ConfigError(
                f"one step's samples were drawn at temperatures {sorted(drawn)}, and the trainer scores a step at one: "
                "generate a rollout at a single temperature"
            )
        return drawn.pop() if drawn else self.temperature
