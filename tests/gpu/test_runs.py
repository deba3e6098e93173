"""Whole runs on one GPU: a colocated run that pushes into the engine it resumed, a fully-async
run sharing its GPU through an MPS daemon of its own, and that daemon's end with a killed
trainer. Run on a GPU machine with `make test-gpu` (never in CI, which has no GPU; here every test
skips)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_colocated_run_on_cuda_pushes_into_the_engine_it_resumed(tmp_path):
    """train.py --colocate with the built-in engine, trainer and engine on one GPU: each step the
    engine gives its memory back (KV pool freed, weights to host memory; over a GiB, as the run
    logs), the trainer steps, the engine takes its memory back, and the weights go in over CUDA
    IPC. With a push every second
    step the engine samples step 2 from step 0's weights: the engine's log-probs then differ from
    the trainer's by how far one step moved the policy, which shows what a lost push would look
    like. At step 1 (the start's weights on both sides) and step 3 (after the push into the
    resumed engine) they are the trainer's within bf16 rounding, at most half that (on CPU, in
    float32: 0.30 at step 2, under 1e-6 at steps 1 and 3)."""
    import json

    from conftest import run_cli

    # a reward that varies within every group whatever the random model says: on the GPU's
    # samples the tiny config's math_shaped reward can be equal within all groups, and then no
    # step moves the weights (its first run here: step 2 only 6e-4 off)
    out = run_cli(
        "train.py", "--config", "examples/tiny.yaml", "--colocate", "--no-compile", "--num-rollout", "3",
        "--custom-rm-path", "varied_reward.last_token_parity", "--lr", "0.1", "--update-weights-interval", "2",
        "--runs-dir", str(tmp_path), "--run-name", "c", timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [json.loads(line) for line in (tmp_path / "c" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "perf/step_time" in r]
    assert [r["step"] for r in steps] == [1, 2, 3] and steps[-1]["train/weight_pushes"] == 1
    diff = [r["train/train_rollout_logprob_abs_diff"] for r in steps]
    assert steps[0]["train/grad_norm"] > 0, steps[0]  # the first step moved the weights
    assert diff[1] > 0.05 and diff[0] < diff[1] / 2 and diff[2] < diff[1] / 2, diff
    # the KV pools (half the GPU's free memory at the engine's start) and the weights, each step
    assert all(r["perf/engine_released_bytes"] > 2**30 for r in steps), [r["perf/engine_released_bytes"] for r in steps]
    assert "weights by cuda_ipc" in (tmp_path / "c" / "log.txt").read_text()


def _mps_processes() -> list[int]:
    from pathlib import Path

    found = []
    for p in Path("/proc").glob("[0-9]*"):
        try:
            if b"nvidia-cuda-mps" in (p / "cmdline").read_bytes():
                found.append(int(p.name))
        except OSError:
            continue
    return found


FULLY_ASYNC = ["--rollout-function-path", "vime.rollout.fully_async_rollout.generate_rollout_fully_async"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_fully_async_run_on_one_gpu_shares_it_through_an_mps_daemon_of_its_own(tmp_path):
    """--gpu-sharing mps on one GPU: the run starts an MPS daemon of its own, the trainer and the
    engine are clients of its server (so their kernels may run side by side), generation and
    rewards run in the rollout process, the weights reach the engine by CUDA IPC under MPS
    (every push checked by checksum), and at the end no MPS process is left and the daemon's
    log is in the run."""
    import json

    from conftest import run_cli

    assert not _mps_processes(), "an MPS daemon was running before the test"
    out = run_cli(
        "train_async.py", "--config", "examples/tiny.yaml", *FULLY_ASYNC, "--no-compile", "--num-rollout", "4",
        "--gpu-sharing", "mps", "--custom-rm-path", "process_plugins.mps_clients_in_step_two", "--runs-dir", str(tmp_path), "--run-name", "m",
        timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    log = (tmp_path / "m" / "log.txt").read_text()
    assert "MPS: a daemon of this run's" in log and "rollout process" in log and "weights by cuda_ipc" in log, log[
        -3000:
    ]
    seen = json.loads((tmp_path / "m" / "mps-clients.json").read_text())
    assert len(seen["servers"]) == 1 and seen["engines"], seen
    assert seen["trainer"] in seen["clients"] and all(e in seen["clients"] for e in seen["engines"]), seen
    assert not _mps_processes(), "the run left an MPS process behind"
    assert (tmp_path / "m" / "mps" / "control.log").exists()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_mps_daemon_and_server_end_with_a_killed_trainer(tmp_path):
    import os
    import signal
    import subprocess
    import sys
    import time

    from conftest import PLUGINS, ROOT

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(PLUGINS), str(ROOT)]))
    run = subprocess.Popen(
        [sys.executable, "train_async.py", "--config", "examples/tiny.yaml", *FULLY_ASYNC, "--no-compile",
         "--num-rollout", "500", "--gpu-sharing", "mps", "--runs-dir", str(tmp_path), "--run-name", "k"],
        cwd=ROOT, env=env, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 240
        while not (tmp_path / "k" / "metrics.jsonl").exists():
            assert run.poll() is None and time.monotonic() < deadline, "the run took no step"
            time.sleep(0.2)
        assert _mps_processes(), "no MPS daemon while the run trains"
    finally:
        run.send_signal(signal.SIGKILL)
        run.wait()
    deadline = time.monotonic() + 30
    while _mps_processes():
        assert time.monotonic() < deadline, f"MPS processes outlived the killed trainer: {_mps_processes()}"
        time.sleep(0.2)
