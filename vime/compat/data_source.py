"""`from slime.rollout.data_source import RolloutDataSourceWithBuffer, pop_first`: slime's data
source names, for a rollout function that annotates or checks the `data_source` it is handed,
and for a buffer filter that falls back on slime's `pop_first`.

vime hands every rollout function its own data source (vime/rollout/data/source.py), which has
slime's methods: `get_samples`, `add_samples` (groups handed back go out first, slime's buffer),
`get_buffer_length`, `update_metadata`/`get_metadata` (kept in the checkpoint). It is an instance
of slime's `DataSource`, `RolloutDataSource` and `RolloutDataSourceWithBuffer` here. vime builds
it from the run's flags and takes no data source class of one's own (`--data-source-path` is
refused), so building one of these from `args`, as slime's trainer does, raises one line saying so.
"""

from __future__ import annotations

import abc
from typing import Any

from vime.rollout.data.source import DataSource as VimeDataSource
from vime.rollout.types import Sample

NOT_BUILT_HERE = (
    "{name}: vime builds the run's data source itself from its flags (--prompt-data, "
    "--rollout-shuffle, ...) and hands it to the rollout function as `data_source`; it takes no "
    "data source class of one's own (--data-source-path)"
)


class DataSource(abc.ABC):
    """slime's interface of a data source: groups out, groups back, its state saved and loaded."""

    @abc.abstractmethod
    def get_samples(self, num_samples: int) -> list[list[Sample]]: ...

    @abc.abstractmethod
    def add_samples(self, samples: list[list[Sample]]) -> None: ...

    @abc.abstractmethod
    def __len__(self) -> int: ...


class RolloutDataSource(DataSource):
    """slime's data source of the run's prompts: vime's is one (see the module's docstring)."""

    def __new__(cls, *args: Any, **kwargs: Any) -> RolloutDataSource:
        raise TypeError(NOT_BUILT_HERE.format(name=cls.__name__))


class RolloutDataSourceWithBuffer(RolloutDataSource):
    """slime's default data source, whose handed-back groups go out first: vime's is one."""


RolloutDataSourceWithBuffer.register(VimeDataSource)  # and so an instance of the two above it


def pop_first(args: Any, rollout_id: int | None, buffer: list[list[Sample]], num_samples: int) -> list[list[Sample]]:
    """slime's default buffer filter: the oldest `num_samples` groups, taken out of `buffer`."""
    taken = buffer[:num_samples]
    del buffer[:num_samples]
    return taken
