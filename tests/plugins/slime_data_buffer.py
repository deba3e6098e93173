"""A rollout function written the way slime's rollout_buffer example uses its data buffer: it
checks it was handed slime's `RolloutDataSourceWithBuffer`, asks `get_buffer_length()` how many
handed-back groups wait, takes one group more than it trains and hands that one back
(`add_samples`, so the next rollout starts with it), and notes each rollout's groups with
`update_metadata` (read back by `get_metadata`). For tests/unit/compat/test_slime_data_source.py,
in slime's API, not copied."""

import asyncio

from slime.rollout.base_types import RolloutFnTrainOutput
from slime.rollout.data_source import RolloutDataSourceWithBuffer
from slime.rollout.sglang_rollout import GenerateState, generate_and_rm_group
from slime.utils.async_utils import run
from slime.utils.types import Sample


async def _generated(args, groups: list[list[Sample]]) -> list[list[Sample]]:
    state = GenerateState(args)
    jobs = [generate_and_rm_group(args, g, sampling_params=state.sampling_params.copy()) for g in groups]
    return list(await asyncio.gather(*jobs))


def generate_rollout(args, rollout_id: int, data_buffer, evaluation: bool = False) -> RolloutFnTrainOutput:
    assert isinstance(data_buffer, RolloutDataSourceWithBuffer), type(data_buffer)
    waiting = data_buffer.get_buffer_length()
    groups = data_buffer.get_samples(args.rollout_batch_size + 1)
    data_buffer.add_samples(groups[-1:])
    kept = groups[:-1]
    data_buffer.update_metadata({str(rollout_id): [g[0].group_index for g in kept]})
    noted = data_buffer.get_metadata()
    metrics = {"waiting": float(waiting), "first_group": float(kept[0][0].group_index), "noted": float(len(noted))}
    return RolloutFnTrainOutput(samples=run(_generated(args, kept)), metrics=metrics)
