"""Plug-ins that inject faults into a real training run, loaded by dotted path (tests/plugins is on the
runs' PYTHONPATH). Each leaves a marker file in the run directory once its fault is under way, so
the test knows when to act or what happened."""

from __future__ import annotations

import os
import signal
from pathlib import Path

from vime.rollout.generate import generate as default_generate
from vime.rollout.generate import generate_rollout

# A response the math grader needs seconds for (nested parentheses through sympy).
SLOW_TO_GRADE = "\\boxed{" + "(" * 60 + "x" + ")" * 60 + "}"


def _first_batch(args, sample) -> bool:
    return sample.index < args.rollout_batch_size * args.n_samples_per_prompt


def engine_pids() -> list[int]:
    """The engine servers this trainer started (its children running vime.engine.server)."""
    return server_pids(os.getpid())


def server_pids(parent: int | None) -> list[int]:
    """Engine servers (processes running vime.engine.server) whose parent is `parent`, or all."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (stat.parent / "cmdline").read_bytes()
        except (OSError, IndexError):
            continue
        if (parent is None or ppid == parent) and b"vime.engine.server" in cmdline:
            found.append(int(stat.parent.name))
    return found


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


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
    return await _kill_one_then_wait(args, sample, params, ray_actor=False)


async def kill_engine_actor_one(args, sample, params):
    """As kill_engine_one, with --launcher ray: engine 1's Ray actor, the process hosting its
    server on another node, is killed (SIGKILL), and the server goes with it."""
    return await _kill_one_then_wait(args, sample, params, ray_actor=True)


def check_engine_one_came_back(run_dir: Path) -> None:
    """What a five-step sync run with kill_engine_one (or _actor_one) must show: engine 1 down
    in step 2 and back from step 3, every step's samples from exactly the trainer's weights
    (log-probs equal), engine 1 serving before and after, its new log beside the first."""
    import json

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "perf/step_time" in r]
    assert [r["rollout/engines_up"] for r in rows] == [2, 1, 2, 2, 2]
    assert [r["rollout/engine_restarts"] for r in rows] == [0, 1, 1, 1, 1]
    for r in rows:
        assert r["rollout/staleness_max"] == 0 and r["train/train_rollout_logprob_abs_diff"] < 1e-4, r
    served = [r["rollout/engine1_requests"] for r in rows]
    assert served[0] > 0 and served[4] > served[3] > served[2], served
    log_text = (run_dir / "log.txt").read_text()
    assert "engine 1 is back at" in log_text and "holds the current weights again" in log_text
    assert (run_dir / "engine1.1.log").exists()


async def _kill_one_then_wait(args, sample, params, ray_actor: bool):
    import asyncio
    import time

    runtime = args.runtime
    step = sample.index // (args.rollout_batch_size * args.n_samples_per_prompt) + 1
    marker = args.run_dir / "engine-killed"
    if step == 2 and not marker.exists():
        marker.write_text("killed")
        # engine i runs with --seed rollout_seed + i (its port is its own pick)
        seed = f"--seed\0{args.rollout_seed + 1}\0".encode()
        for pid in server_pids(None if ray_actor else os.getpid()):  # with Ray: the servers of actors, not ours
            if seed in Path(f"/proc/{pid}/cmdline").read_bytes() and (_parent(pid) != os.getpid()) == ray_actor:
                os.kill(_parent(pid) if ray_actor else pid, signal.SIGKILL)
    if step == 3:
        deadline = time.monotonic() + 120
        while runtime.engines[1].state != "unsynced":
            assert time.monotonic() < deadline, "engine 1 did not come back"
            await asyncio.sleep(0.1)
    return await default_generate(args, sample, params)


async def kill_trainer_rank_one(args, sample, params):
    """With --launcher ray and two trainer ranks: in step 3's rollout, trainer rank 1's Ray actor
    (its process titled `ray::TrainerRank...`) is SIGKILLed, as a crash or a lost node ends it."""
    step = sample.index // (args.rollout_batch_size * args.n_samples_per_prompt) + 1
    marker = args.run_dir / "rank-killed"
    if step == 3 and not marker.exists():
        marker.write_text("killed")
        for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
            try:
                title = cmdline.read_bytes()
            except OSError:
                continue
            if title.startswith(b"ray::TrainerRank"):
                os.kill(int(cmdline.parent.name), signal.SIGKILL)
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


def engine_server_pid(args, i: int) -> int:
    """The pid of engine i this trainer launched (engine i runs with --seed rollout_seed + i;
    its port is its own pick)."""
    seed = f"--seed\0{args.rollout_seed + i}\0".encode()
    (pid,) = [p for p in engine_pids() if seed in Path(f"/proc/{p}/cmdline").read_bytes()]
    return pid


def stop_engines_while_training(args, groups, rewards):
    """An advantage function (it runs in the train step, while fully-async's worker generates):
    once the first checkpoint is written, the engines are stopped (SIGSTOP), so the next thing
    the trainer asks of them is the weight push's pause."""
    saved = any(p.name.isdigit() for p in Path(args.save).glob("*"))
    if saved and not (args.run_dir / "engine-stopped").exists():
        for pid in engine_pids():
            os.kill(pid, signal.SIGSTOP)
        (args.run_dir / "engine-stopped").write_text("stopped")
    return rewards - rewards.mean(dim=-1, keepdim=True)


def fail_on_rank_one(args, *, log_probs, old_log_probs, advantages, loss_mask, rollout_log_probs, seq_ids):
    """A custom loss that fails on trainer rank 1 only (a plug-in's bug, a rank out of memory)."""
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise ValueError("the loss hook broke on this rank")
    return -(advantages * (log_probs - old_log_probs).exp())


# ---- plug-ins that do not fit, or fail mid-run (tests/unit/test_preflight.py, tests/e2e/test_faults.py) -----------------


def generate_not_async(args, sample, params):
    return sample


async def generate_of_two_arguments(args, sample):
    return sample


async def generate_that_raises(args, sample, params):
    raise KeyError("tool_calls")


async def generate_returning_nothing(args, sample, params):
    return None


def rollout_of_two_arguments(args, rollout_id):
    return None


def _after_step_one(args) -> bool:
    """True once the run has checkpointed step 1 (with --save-interval 1): the fault then comes
    in step 2, past the start-up checks and with a checkpoint to keep."""
    return args.save is not None and (Path(args.save) / "1" / "trainer_state.pt").exists()


def filter_failing_in_step_two(args, samples):
    if _after_step_one(args):
        return samples[0].metadata["difficulty"] > 1
    return True


def loss_failing_in_step_two(args, *, log_probs, old_log_probs, advantages, loss_mask, rollout_log_probs, seq_ids):
    if _after_step_one(args):
        raise ZeroDivisionError("float division by zero")
    return -advantages * log_probs


def rollout_as_a_flat_list(args, rollout_id: int, data_source, evaluation: bool = False):
    """The samples without their groups: slime's bare list of groups is taken, this is not."""
    return [s for g in generate_rollout(args, rollout_id, data_source, evaluation).samples for s in g]
