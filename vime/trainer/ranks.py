"""Where one trainer process stands: its device and its place among the trainer's ranks, and the
few things every part of the actor asks of the ranks together (metric sums, gathered log-probs,
waiting for the device). The ranks themselves are started by `vime.trainer.distributed`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor


@dataclass(frozen=True)
class Ranks:
    """This process's device and rank. `sharded`: the model is sharded with FSDP2 over the
    default process group (which must exist); otherwise this is the only rank."""

    device: torch.device
    sharded: bool = False
    rank: int = 0
    world: int = 1
    cpu_group: Any = None  # gloo group for Python objects and metrics (the default one on CPU)

    @classmethod
    def of(cls, device: str | torch.device, sharded: bool, cpu_group: Any = None) -> Ranks:
        """This process's place in the default process group when `sharded`, else rank 0 of 1."""
        rank, world = (dist.get_rank(), dist.get_world_size()) if sharded else (0, 1)
        return cls(torch.device(device), sharded, rank, world, cpu_group)

    def sync(self) -> None:
        """Wait for the device's queued work (a timing's ends; CPU runs in order already)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def read(self, totals: dict[str, Tensor]) -> dict[str, float]:
        """Metric sums from the device, summed over ranks: one wait for the GPU for all of them."""
        keys = sorted(totals)
        values = torch.stack([totals[k] for k in keys]).tolist() if keys else []
        return self.sum(dict(zip(keys, values)))

    def sum(self, values: dict[str, float]) -> dict[str, float]:
        """Each value summed over the ranks (every rank calls, with the same keys)."""
        if self.world == 1:
            return values
        keys = sorted(values)
        t = torch.tensor([values[k] for k in keys], dtype=torch.float64)
        dist.all_reduce(t, group=self.cpu_group)
        return dict(zip(keys, t.tolist()))

    def gather(self, mine: dict[int, Tensor]) -> dict[int, Tensor]:
        """Every rank's entries, on every rank (host tensors: they travel pickled)."""
        gathered: list[dict[int, Tensor]] = [{} for _ in range(self.world)]
        dist.all_gather_object(gathered, mine, group=self.cpu_group)
        out: dict[int, Tensor] = {}
        for part in gathered:
            out.update(part)
        return out
