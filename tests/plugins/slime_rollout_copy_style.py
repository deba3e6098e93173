"""A rollout function written after slime's `sglang_rollout.generate_rollout` (the loop users copy
to change): `GenerateState`'s `submit_generate_tasks` and `pendings`, groups drawn
`args.over_sampling_batch_size` at a time, slime's dynamic-filter helpers and `MetricGatherer`,
`abort` at the end, and the optional sample filters slime's loop checks
(`args.rollout_sample_filter_path`, `args.rollout_all_samples_process_path`). Returns
`RolloutFnTrainOutput` with the gatherer's metrics only: the batch's reward metrics are the
run's to log. For tests/unit/compat/test_slime_rollout_copy.py in that API, not copied."""

import asyncio

from slime.rollout.base_types import RolloutFnTrainOutput
from slime.rollout.filter_hub.base_types import MetricGatherer, call_dynamic_filter, should_drop_dynamic_filter_output
from slime.rollout.sglang_rollout import GenerateState, abort
from slime.utils.async_utils import run
from slime.utils.misc import load_function


async def _batch(args, rollout_id, draw):
    state = GenerateState(args)
    path = args.dynamic_sampling_filter_path
    keep = load_function(path) if path is not None else None
    gatherer = MetricGatherer()
    target, data = args.rollout_batch_size, []
    while len(data) < target:
        while state.remaining_batch_size < target:
            state.submit_generate_tasks(draw(args.over_sampling_batch_size))
        done, state.pendings = await asyncio.wait(state.pendings, return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            group = task.result()
            verdict = call_dynamic_filter(keep, args, group)
            if should_drop_dynamic_filter_output(
                verdict, remaining_batch_size=state.remaining_batch_size, target_data_size=target
            ):
                gatherer.on_dynamic_filter_drop(reason=verdict.reason)
                state.remaining_batch_size -= 1
            elif len(data) < target:
                data.append(group)
    aborted = await abort(args, rollout_id)
    state.reset()
    for hook in (args.rollout_sample_filter_path, args.rollout_all_samples_process_path):
        if hook is not None:
            load_function(hook)(args, data)
    return RolloutFnTrainOutput(samples=sorted(data, key=lambda g: g[0].index), metrics=gatherer.collect()), aborted


def generate_rollout(args, rollout_id, data_source, evaluation=False):
    assert not evaluation
    output, aborted = run(_batch(args, rollout_id, data_source.get_samples))
    if aborted:
        data_source.add_samples(aborted)
    return output
