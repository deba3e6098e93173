"""The training modes, one row each: how a run interleaves generation and training.

`Config.validate` decides a run's mode (`Config._derive_mode`, from the entry point,
--max-staleness and the rollout function) and records its name in `args.mode` and config.yaml;
everything else reads the row: the run picks its loop, the automatic off-policy correction
asks whether samples can be stale, `vime bench ab` builds an arm's command, `vime report`
names the runs. A new mode is one row here, plus its loop in `vime/loops.py` if it needs a new one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

DEFAULT_ROLLOUT_FN = "vime.rollout.generate.generate_rollout"
FULLY_ASYNC_FN = "vime.rollout.fully_async_rollout.generate_rollout_fully_async"
# SFT: the data's own conversations, nothing generated (vime/rollout/sft_rollout.py); a run with
# it starts no engine and trains sync, since there is no generation to overlap
SFT_ROLLOUT_FN = "vime.rollout.sft_rollout.generate_rollout"


@dataclass(frozen=True)
class Mode:
    name: str
    loop: str  # sequential: get a batch, train, push | one-step-off: batch N+1 generated while N trains
    overlaps: bool  # generation goes on while the trainer works: samples can be stale, saves pause the engines
    arm: tuple[str, ...]  # `vime` words of its `vime bench ab` arm; {staleness} is --max-staleness


MODES: dict[str, Mode] = {
    m.name: m
    for m in [
        Mode("sync", "sequential", overlaps=False, arm=("train",)),
        Mode("one-step-off", "one-step-off", overlaps=True, arm=("train-async",)),
        Mode(
            "fully-async",
            "one-step-off",  # with the continuous worker as the rollout function
            overlaps=True,
            arm=("train-async", "--rollout-function-path", FULLY_ASYNC_FN),
        ),
        # the continuous worker, drained by a sequential loop, admission bounded by --max-staleness
        Mode("decoupled", "sequential", overlaps=True, arm=("train-async", "--max-staleness", "{staleness}")),
    ]
}


def custom_rollout(rollout: Any) -> bool:
    """A plug-in that may talk to the engines itself, through a route a dialect serves it (slime's
    router, vime/compat/): a custom generate, or a rollout function other than vime's own
    (`rollout`: the rollout settings, `cfg.rollout`)."""
    return bool(rollout.custom_generate_function_path) or rollout.rollout_function_path not in (
        DEFAULT_ROLLOUT_FN,
        FULLY_ASYNC_FN,
    )
