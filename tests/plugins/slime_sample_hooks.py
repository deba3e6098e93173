"""A rollout function written slime's way that runs slime's per-sample hooks: it names them on
`args.rollout_sample_hook_path` (what slime's --rollout-sample-hook-path sets), tells them the
rollout (`set_current_rollout_id`) and runs its groups with slime's `generate_and_rm_group`,
which applies them to each generated sample before its reward. The hooks, one sync and one
async, tag the sample. For tests/unit/compat/test_slime_sample_hooks.py, in slime's API, not
copied."""

import asyncio

from slime.rollout.base_types import RolloutFnTrainOutput
from slime.rollout.sample_hooks import set_current_rollout_id
from slime.rollout.sglang_rollout import GenerateState, generate_and_rm_group
from slime.utils.async_utils import run
from slime.utils.types import Sample

HOOKS = ["slime_sample_hooks.note_rollout", "slime_sample_hooks.note_length"]


def note_rollout(args, sample: Sample, rollout_id=None) -> None:
    sample.metadata["hooked_rollout"] = rollout_id


async def note_length(args, sample: Sample, **kwargs) -> Sample:
    sample.metadata["hooked_length"] = sample.response_length
    sample.metadata["hooked_evaluation"] = kwargs["evaluation"]
    return sample


async def _groups(args, data_source) -> list[list[Sample]]:
    state = GenerateState(args)
    groups = data_source.get_samples(args.rollout_batch_size)
    jobs = [generate_and_rm_group(args, g, sampling_params=state.sampling_params.copy()) for g in groups]
    return list(await asyncio.gather(*jobs))


def generate_rollout(args, rollout_id: int, data_source, evaluation: bool = False) -> RolloutFnTrainOutput:
    args.rollout_sample_hook_path = HOOKS
    set_current_rollout_id(rollout_id)
    return RolloutFnTrainOutput(samples=run(_groups(args, data_source)))
