"""Rewards that fail without holding anything up (issue 12): non-finite rewards score 0 and are
counted, hung ones are abandoned, the pool's workers ignore Ctrl-C and die with their parent, a
worker that dies costs its sample only, and the rollout loop outlives a task that raises
KeyboardInterrupt."""

from __future__ import annotations

import asyncio
import os
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import ROOT, alive_pids, child_pids

from vime.config import Config
from vime.rollout.generate import rollout_metrics
from vime.rollout.rewards import Rewards
from vime.rollout.types import Sample

# ---- rewards -------------------------------------------------------------------------------

HANG_RM = """
import threading
release = threading.Event()
calls = []

def hang_first_20(args, sample):
    calls.append(sample.index)
    if sample.index < 20:
        release.wait()
    return 1.0

def not_finite(args, sample):
    return [float("inf"), float("-inf"), float("nan"), 0.5, 1e300][sample.index]
"""


@pytest.fixture
def fault_rm(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "fault_rm.py").write_text(HANG_RM)
    import importlib

    import fault_rm

    module = importlib.reload(fault_rm)
    yield module
    module.release.set()


def rm_args(**kw) -> Config:
    return Config(**{"rm_type": "math", "custom_rm_path": None, "reward_timeout": 10.0, **kw})


def test_non_finite_rewards_score_zero_and_are_counted(fault_rm):
    samples = [Sample(index=i) for i in range(5)]
    metrics = asyncio.run(Rewards(rm_args(custom_rm_path="fault_rm:not_finite")).score(samples))
    # 1e300 is finite, but inf in the float32 advantages: an error too, and said to be too large
    assert [s.reward for s in samples] == [0.0, 0.0, 0.0, 0.5, 0.0]
    assert metrics == {"rollout/reward_errors": 4.0, "rollout/reward_timeouts": 0.0}
    assert rollout_metrics([samples])["rollout/reward_errors"] == 4  # what reaches metrics.jsonl


def test_hung_sync_rewards_are_abandoned_counted_and_starve_nothing(fault_rm):
    """20 calls that never return (more than the reward threads) time out and are counted; the
    calls after them run at once, and the hung threads cannot keep the process alive."""
    rewards = Rewards(rm_args(custom_rm_path="fault_rm:hang_first_20", reward_timeout=0.5))
    hung = [Sample(index=i) for i in range(20)]
    metrics = asyncio.run(rewards.score(hung))
    assert metrics == {"rollout/reward_errors": 0.0, "rollout/reward_timeouts": 20.0}
    assert all(s.reward == 0.0 and s.reward_error == "timeout" for s in hung)
    later = [Sample(index=i) for i in range(20, 30)]
    # had they queued behind the hung calls for a thread, they would have timed out too
    assert asyncio.run(rewards.score(later)) == {"rollout/reward_errors": 0.0, "rollout/reward_timeouts": 0.0}
    assert all(s.reward == 1.0 for s in later)
    threads = [t for t in threading.enumerate() if t.name == "vime-reward"]
    assert len(threads) >= 20 and all(t.daemon for t in threads)  # the hung ones, which exit cannot wait for


POOL_USER = """
import asyncio, os, sys, time
from vime.config import Config
from vime.rollout.rewards import Rewards
from vime.rollout.types import Sample
rewards = Rewards(Config(rm_type="math", custom_rm_path=None, reward_timeout=10.0))  # held, as a run holds it
if __name__ == "__main__":
    print(asyncio.run(rewards.score([Sample(index=0, response="\\\\boxed{2}", label="2")])), flush=True)
    time.sleep(600)
"""


def test_reward_workers_ignore_ctrl_c_and_die_with_their_parent(tmp_path):
    """A Ctrl-C reaches the pool workers too: they go on grading (the trainer decides); a
    SIGKILLed trainer takes them and multiprocessing's resource tracker along within seconds."""
    script = tmp_path / "pool_user.py"
    script.write_text(POOL_USER)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, text=True, env=env, start_new_session=True
    )
    try:
        assert select.select([proc.stdout], [], [], 120)[0], "the pool never graded"
        assert proc.stdout.readline().strip() == "{'rollout/reward_errors': 0.0, 'rollout/reward_timeouts': 0.0}"
        children = child_pids(proc.pid)  # multiprocessing's resource tracker and the worker(s) started so far
        assert len(children) >= 2, children
        for pid in children:
            os.kill(pid, signal.SIGINT)
        time.sleep(1)
        assert alive_pids(children) == children
        proc.kill()
        deadline = time.monotonic() + 10
        while alive_pids(children) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert alive_pids(children) == []
    finally:
        proc.kill()
        proc.wait()


def test_a_reward_worker_that_dies_mid_sample_costs_that_sample_only():
    """A grading worker killed (OOM, say) while it grades: that sample scores 0 as an error, at
    once, and the next one is graded by a fresh pool."""
    from fault_plugins import SLOW_TO_GRADE

    rewards = Rewards(rm_args(reward_timeout=60.0))

    async def main() -> tuple[dict, list[Sample]]:
        slow = [Sample(index=0, response=SLOW_TO_GRADE, label="3")]
        task = asyncio.create_task(rewards.score(slow))
        while not (
            workers := [
                pid for pid in child_pids(os.getpid()) if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()
            ]
        ):
            await asyncio.sleep(0.05)
        await asyncio.sleep(1)  # grading (seconds for this response) is under way
        for pid in workers:
            os.kill(pid, signal.SIGKILL)
        return await asyncio.wait_for(task, 30), slow

    metrics, slow = asyncio.run(main())
    assert metrics == {"rollout/reward_errors": 1.0, "rollout/reward_timeouts": 0.0} and slow[0].reward_error == "error"
    fine = [Sample(index=1, response="\\boxed{2}", label="2")]
    assert asyncio.run(rewards.score(fine)) == {"rollout/reward_errors": 0.0, "rollout/reward_timeouts": 0.0}
    assert fine[0].reward == 1.0
    rewards.close()


def test_the_rollout_loop_outlives_a_task_that_raises_keyboard_interrupt():
    """asyncio lets KeyboardInterrupt escape run_forever; the loop used to die with it and every
    later call (closing the clients) waited for ever."""
    from vime.rollout import async_loop

    async def interrupted():
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        async_loop.submit(interrupted()).result(timeout=10)
    assert async_loop.submit(asyncio.sleep(0, result=7)).result(timeout=10) == 7
    pending = async_loop.submit(asyncio.sleep(600))
    async_loop.cancel_all(timeout=5)
    assert pending.cancelled()
