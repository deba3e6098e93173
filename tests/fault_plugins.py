"""Plug-ins that inject faults into a real training run, loaded by dotted path (tests/ is on the
runs' PYTHONPATH). Each leaves a marker file in the run directory once its fault is under way, so
the test knows when to act or what happened."""

from __future__ import annotations

import os
import signal
from pathlib import Path

from vime.rollout.vllm_rollout import generate as default_generate
from vime.rollout.vllm_rollout import generate_rollout

# A response the math grader needs seconds for (nested parentheses through sympy).
SLOW_TO_GRADE = "\\boxed{" + "(" * 60 + "x" + ")" * 60 + "}"


def _first_batch(args, sample) -> bool:
    return sample.index < args.rollout_batch_size * args.n_samples_per_prompt


def engine_pids() -> list[int]:
    """The engine servers this trainer started (its children running vime.engine.server)."""
    me, found = str(os.getpid()), []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = stat.read_text().rsplit(")", 1)[1].split()[1]
            cmdline = (stat.parent / "cmdline").read_bytes()
        except (OSError, IndexError):
            continue
        if ppid == me and b"vime.engine.server" in cmdline:
            found.append(int(stat.parent.name))
    return found


async def slow_grading(args, sample, params):
    """From the second batch on, responses that keep a reward-pool worker busy for seconds."""
    sample = await default_generate(args, sample, params)
    if not _first_batch(args, sample):
        sample.response = SLOW_TO_GRADE
        (args.run_dir / "grading").write_text("grading")
    return sample


async def kill_engine_mid_step(args, sample, params):
    """In the second batch, the engine is killed (SIGKILL) while its requests are in flight."""
    if not _first_batch(args, sample) and not (args.run_dir / "engine-killed").exists():
        (args.run_dir / "engine-killed").write_text("killed")
        for pid in engine_pids():
            os.kill(pid, signal.SIGKILL)
    return await default_generate(args, sample, params)


def kill_engine_after_rollout(args, rollout_id: int, data_source, evaluation: bool = False):
    """The second batch is generated whole, then the engine dies: the next call to it is the push."""
    out = generate_rollout(args, rollout_id, data_source, evaluation)
    if rollout_id == 1:
        for pid in engine_pids():
            os.kill(pid, signal.SIGKILL)
        (args.run_dir / "engine-killed").write_text("killed")
    return out


def inf_rewards_from_step_two(args, rollout_id: int, data_source, evaluation: bool = False):
    """A rollout function that hands the trainer infinite rewards from its second batch on (past
    the reward functions' own checks, as a custom rollout can)."""
    out = generate_rollout(args, rollout_id, data_source, evaluation)
    if rollout_id >= 1:
        for group in out.samples:
            group[0].reward = float("inf")
    return out


def inf_reward(args, sample) -> float:
    return float("inf")


async def kill_engine_one(args, sample, params):
    """Two engines: in step 2, engine 1 is killed (SIGKILL) while requests are in flight; step 3
    waits until it is back, so the push after step 3 re-syncs it and later steps use it again."""
    import asyncio
    import time

    runtime = args.runtime
    step = sample.index // (args.rollout_batch_size * args.n_samples_per_prompt) + 1
    marker = args.run_dir / "engine-killed"
    if step == 2 and not marker.exists():
        marker.write_text("killed")
        for pid in engine_pids():  # engine i runs with --seed rollout_seed + i (its port is its own pick)
            if f"--seed\0{args.rollout_seed + 1}\0".encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                os.kill(pid, signal.SIGKILL)
    if step == 3:
        deadline = time.monotonic() + 120
        while runtime.engines[1].state != "unsynced":
            assert time.monotonic() < deadline, "engine 1 did not come back"
            await asyncio.sleep(0.1)
    return await default_generate(args, sample, params)


async def stop_engine_mid_step(args, sample, params):
    """Once the first checkpoint is written (fully-async generates ahead of it), the engine is
    stopped (SIGSTOP: alive, holding its port, answering nothing) while requests are in flight."""
    saved = any(p.name.isdigit() for p in Path(args.save).glob("*"))
    if saved and not _first_batch(args, sample) and not (args.run_dir / "engine-stopped").exists():
        for pid in engine_pids():
            os.kill(pid, signal.SIGSTOP)
        (args.run_dir / "engine-stopped").write_text("stopped")
    return await default_generate(args, sample, params)
