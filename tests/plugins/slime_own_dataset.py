"""A rollout function written as slime's copied rollout files build a data set of their own (its
eval rollout builds one per eval file): `slime.utils.data.Dataset` over a second prompt file,
shuffled per rollout, each prompt copied `n_samples_per_prompt` times into a group and run with
slime's `generate_and_rm_group`. For tests/unit/compat/test_slime_utils_data.py, in slime's API,
not copied."""

import asyncio
import copy

from slime.rollout.base_types import RolloutFnTrainOutput
from slime.rollout.sglang_rollout import GenerateState, generate_and_rm_group
from slime.utils.async_utils import run
from slime.utils.data import Dataset
from slime.utils.types import Sample

OWN_PROMPTS = "examples/data/addition/test.jsonl"
_datasets: dict[str, Dataset] = {}


def _dataset(args) -> Dataset:
    if OWN_PROMPTS not in _datasets:
        state = GenerateState(args)
        _datasets[OWN_PROMPTS] = Dataset(
            OWN_PROMPTS, tokenizer=state.tokenizer, processor=None, max_length=16, prompt_key="input", label_key="label"
        )
    return _datasets[OWN_PROMPTS]


async def _groups(args, rollout_id: int) -> list[list[Sample]]:
    dataset = _dataset(args)
    dataset.shuffle(rollout_id)
    groups = []
    for g in range(args.rollout_batch_size):
        group = []
        for i in range(args.n_samples_per_prompt):
            sample = copy.deepcopy(dataset[g])
            sample.group_index, sample.index = g, g * args.n_samples_per_prompt + i
            group.append(sample)
        groups.append(group)
    state = GenerateState(args)
    jobs = [generate_and_rm_group(args, g, sampling_params=state.sampling_params.copy()) for g in groups]
    return list(await asyncio.gather(*jobs))


def generate_rollout(args, rollout_id: int, data_source, evaluation: bool = False) -> RolloutFnTrainOutput:
    return RolloutFnTrainOutput(samples=run(_groups(args, rollout_id)))
