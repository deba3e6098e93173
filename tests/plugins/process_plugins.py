"""Plug-ins for tests/e2e/test_rollout_process.py, loaded by dotted path; they run in the rollout
process, where rewards are computed when a run has one."""

from __future__ import annotations

import os
import signal
from pathlib import Path

from fault_plugins import server_pids
from varied_reward import digit_share


def _step(args, sample) -> int:
    return sample.index // (args.rollout_batch_size * args.n_samples_per_prompt) + 1


def die_in_step_two(args, sample) -> float:
    """The process computing it ends (SIGKILL) at the first sample of step 2."""
    if _step(args, sample) == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    return digit_share(args, sample)


def reward_with_a_wrong_key(args, sample) -> dict:
    """A dict without --reward-key's key, from step 2 on (its start-up check passes): a setting
    that cannot work, which stops the run."""
    return {"score": 1.0} if _step(args, sample) < 2 else {"points": 1.0}


def kill_engine_one_in_step_two(args, sample) -> float:
    """Once, in step 2: engine 1 (the one started with --seed rollout_seed + 1, a child of the
    trainer, which is this process's parent) is killed while requests are in flight. Step 3's
    rewards wait until the trainer has started it again (its new log says it serves), so the
    run cannot end before it is back, however fast its steps are."""
    import time

    from vime.engine.server import READY_LINE

    marker = Path(args.run_dir) / "engine-killed"
    step = _step(args, sample)
    if step == 2 and not marker.exists():
        marker.write_text("killed")
        seed = f"--seed\0{args.rollout_seed + 1}\0".encode()
        for pid in server_pids(os.getppid()):
            if seed in Path(f"/proc/{pid}/cmdline").read_bytes():
                os.kill(pid, signal.SIGKILL)
    if step == 3:
        log = Path(args.run_dir) / "engine1.1.log"
        deadline = time.monotonic() + 120
        while not (log.exists() and READY_LINE in log.read_text()):
            assert time.monotonic() < deadline, "engine 1 was not started again"
            time.sleep(0.1)
    return digit_share(args, sample)


def mps_clients_in_step_two(args, sample) -> float:
    """Once, in step 2: which processes are clients of the run's MPS server, beside the trainer's
    and its engines' pids, written to <run>/mps-clients.json (the daemon is found through the
    CUDA_MPS_PIPE_DIRECTORY this process inherited from the trainer)."""
    import json
    import subprocess

    from vime.launch.mps import _binary

    out = Path(args.run_dir) / "mps-clients.json"
    if _step(args, sample) == 2 and not out.exists():

        def ask(command: str) -> list[int]:
            answer = subprocess.run([_binary()], input=command + "\n", capture_output=True, text=True, timeout=30)
            return [int(x) for x in answer.stdout.split() if x.isdigit()]

        servers = ask("get_server_list")
        clients = [c for s in servers for c in ask(f"get_client_list {s}")]
        trainer = os.getppid()
        out.write_text(
            json.dumps({"servers": servers, "clients": clients, "trainer": trainer, "engines": server_pids(trainer)})
        )
    return digit_share(args, sample)
