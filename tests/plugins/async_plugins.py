"""Plug-ins of the async-mode runs, loaded by dotted path: rollout functions and a generate that
record what a run trained on (a test compares it across modes), and a generate that stalls after
the first batch (a test stops the run while it is pending)."""

from __future__ import annotations

import copy
import json
import time


def _record(args, rollout_id: int, out):
    """Append the batch a rollout function hands the trainer to <run dir>/batches.jsonl: its
    groups (index, prompt) in order, and every sample's index, tokens and reward."""
    samples = [[s.index, s.tokens, s.reward] for g in out.samples for s in g]
    with open(args.run_dir / "batches.jsonl", "a") as f:
        f.write(
            json.dumps(
                {
                    "rollout_id": rollout_id,
                    "groups": [[g[0].group_index, g[0].prompt] for g in out.samples],
                    "samples": samples,
                }
            )
            + "\n"
        )
    return out


def recorded_fully_async_rollout(args, rollout_id: int, data_source, evaluation: bool = False):
    """The fully-async rollout function, recording each batch (so a test sees what a run trained on)."""
    from vime.rollout.fully_async_rollout import generate_rollout_fully_async

    return _record(args, rollout_id, generate_rollout_fully_async(args, rollout_id, data_source, evaluation))


def recorded_rollout(args, rollout_id: int, data_source, evaluation: bool = False):
    """The default rollout function, recording each batch. Being a rollout function of its own,
    it keeps train_async.py --max-staleness in the one-step-off loop."""
    from vime.rollout.generate import generate_rollout

    return _record(args, rollout_id, generate_rollout(args, rollout_id, data_source, evaluation))


async def recorded_generate(args, sample, params):
    """The default per-sample generate, appending each finished sample to <run dir>/generated.jsonl."""
    from vime.rollout.generate import generate

    sample = await generate(args, sample, params)
    with open(args.run_dir / "generated.jsonl", "a") as f:
        f.write(json.dumps([sample.index, sample.tokens, sample.weight_versions]) + "\n")
    return sample


async def stall_after_first_batch(args, sample, params):
    """A generate function for the stop test: the first batch as usual, then requests that keep
    the engines busy for minutes unless aborted, as a long tail would when a run is stopped."""
    from vime.rollout.generate import generate
    from vime.rollout.types import Status

    if sample.index < args.rollout_batch_size * args.n_samples_per_prompt:
        return await generate(args, sample, params)
    (args.run_dir / "stalling").touch()
    deadline = time.monotonic() + 300
    while True:
        out = await generate(args, copy.copy(sample), params)
        if out.status == Status.ABORTED or time.monotonic() > deadline:
            return out
