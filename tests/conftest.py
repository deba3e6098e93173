"""What every test shares: a tiny real model and toy data (generated once per test session),
tests/plugins on the path, the ways a test starts a run, and the helpers that tests of several
packages use. A folder's own conftest.py holds what only its tests share."""

from __future__ import annotations

import contextlib
import os
import resource
import signal
import subprocess
import sys
from pathlib import Path

import pytest

# The Ctrl-C tests need SIGINT to reach the runs they start. A shell starts background jobs
# (`make test &`, nohup, some CI runners) with SIGINT ignored, and an ignored signal stays ignored
# across exec, so every run would ignore Ctrl-C and those tests would hang. A handled one is reset
# to the default at exec: with Python's own handler here, the runs start as from a terminal.
signal.signal(signal.SIGINT, signal.default_int_handler)

ROOT = Path(__file__).resolve().parents[1]
# The plug-ins tests name by dotted path (`--custom-rm-path varied_reward.digit_share`), as a user
# names a module of their own: importable here, where a test loads one in-process, and in the runs
# tests start (run_cli and the tests that start a process put it on the child's PYTHONPATH).
PLUGINS = ROOT / "tests" / "plugins"
sys.path.insert(0, str(PLUGINS))

# The module names of slime's and vllm-project/vime's plug-ins (`slime.*`, `vime.rollout.vllm_rollout`,
# `vime.utils.*`), importable as vime's entry points make them (vime/compat/): the plug-ins
# of tests/plugins/ written their way import them at the top.
from vime.compat import SLIME  # noqa: E402

SLIME.install()

# Under pytest-xdist (`-n 2`: make test-slow, make test-vllm) two workers share the machine's
# cores: a run with torch's default of one thread per core in each of its processes, twice over,
# oversubscribed them so badly that the learning runs took four times as long. One thread per
# process, for the workers and every process they start (torch reads this at import).
# vLLM's CPU servers are pinned to cores; each worker's to its own (gw0: core 0, gw1: core 1),
# or the servers of both workers would share one core.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"
    worker = int(os.environ["PYTEST_XDIST_WORKER"].removeprefix("gw") or 0)
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", str(worker % (os.cpu_count() or 1)))


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    from vime.models import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "qwen3", arch="qwen3", seed=0)


@pytest.fixture(scope="session")
def addition_data(tmp_path_factory) -> tuple[Path, Path]:
    from vime.datagen import write_dataset

    return write_dataset("addition", tmp_path_factory.mktemp("data"), n_train=200, n_test=50, seed=0)


def run_cli(*argv: str, timeout: float = 180, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """Run a vime entry point the way a user would (a fresh process), capturing its output."""
    # tests/plugins on the path so test-only plug-ins (custom generate/reward functions) load by dotted path
    env = dict(
        os.environ,
        PYTHONUNBUFFERED="1",
        PYTHONPATH=os.pathsep.join([str(PLUGINS), str(ROOT), os.environ.get("PYTHONPATH", "")]),
    )
    return subprocess.run([sys.executable, *argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


ENTRIES = {"train.py": "sync", "train_async.py": "async"}
# each mode's entry point and flags (decoupled at staleness 1), for the tests that run every mode
MODE_ARGS: dict[str, tuple[str, list[str]]] = {
    "sync": ("train.py", []),
    "one-step-off": ("train_async.py", []),
    "fully-async": (
        "train_async.py",
        ["--rollout-function-path", "vime.rollout.fully_async_rollout.generate_rollout_fully_async"],
    ),
    "decoupled": ("train_async.py", ["--max-staleness", "1"]),
}


def train_here(entry: str, *argv: str) -> None:
    """train.py (`entry` "sync" or "train.py") or train_async.py ("async" or "train_async.py") run
    in this process, as the script runs it (`train_main`: flags, resume point, locks), its engines
    still processes of their own. It saves a fresh interpreter's imports (torch, transformers,
    vime: ~5 of a tiny run's ~10 CPU seconds) for tests that read what a run wrote; how a run's
    process ends (exit code, signals, one-line errors) is run_cli's. An error raises here, with
    its traceback; what the run logs to stderr, a test reads by capfd."""
    from vime.cli import train_main

    with contextlib.chdir(ROOT):  # the examples' configs name their data relative to the repository
        assert train_main(list(argv), ENTRIES.get(entry, entry)) == 0


def make_correction(custom=None, **settings):
    """An `OffPolicyCorrection` over algorithm settings of these values (--use-tis, --tis-clip, ...),
    the rest their defaults; `custom`: a --custom-tis-function-path hook."""
    from vime.algorithms.corrections import OffPolicyCorrection
    from vime.algorithms.settings import AlgorithmConfig

    return OffPolicyCorrection(AlgorithmConfig(**settings), custom=custom)


def objective(
    eps_clip: float, correction=None, kind: str = "ppo", agg: str = "token_mean", custom_loss=None, **settings
):
    """The loss of the hand-worked tests: PPO's clip `eps_clip` and nothing else (no correction,
    entropy or KL term, a token mean), but for the algorithm `settings` given (--eps-clip-high,
    --kl-loss-coef, --use-opsm, ... by their setting names) and `correction`."""
    from vime.algorithms.objective import Objective
    from vime.algorithms.settings import AlgorithmConfig

    a = AlgorithmConfig(eps_clip=eps_clip, **{"eps_clip_high": None, "kl_loss_coef": 0.0, **settings})
    return Objective(a, correction or make_correction(), kind=kind, agg=agg, custom_loss=custom_loss)


def loss_inputs(advantages, mask, rollout_lp=None, seq_ids=None, **fields):
    """A micro-batch's `LossInputs` of these advantages and loss mask ([tokens] each): one sequence
    unless `seq_ids` says otherwise, the engine's log-probs `rollout_lp` (zeros: none sent)."""
    import torch

    from vime.algorithms.loss_inputs import LossInputs

    return LossInputs(
        mask=mask,
        advantages=advantages,
        rollout_lp=torch.zeros_like(mask) if rollout_lp is None else rollout_lp,
        has_rollout=mask if rollout_lp is not None else torch.zeros_like(mask),
        seq_ids=torch.zeros(len(mask), dtype=torch.long) if seq_ids is None else seq_ids,
        old=None,
        ref=None,
        **fields,
    )


# ---- the processes a test started, a full disk, a run refused at its start (tests of several
# packages check these) ----


def child_pids(pid: int) -> list[int]:
    """The live children of process `pid` (zombies waiting for their reaper do not count)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[1] == str(pid) and fields[0] != "Z":
            out.append(int(stat.parent.name))
    return out


def alive_pids(pids: list[int]) -> list[int]:
    """Those of `pids` still running (a zombie is not)."""
    out = []
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            out.append(pid)
    return out


@contextlib.contextmanager
def disk_full_at(size: int):
    """A full disk, as a file size limit (works unprivileged): writes past `size` bytes fail
    with EFBIG, as they would with ENOSPC."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (size, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)


def refused(tmp_path: Path, *argv: str) -> str:
    """Start a run in-process; it must fail with a user error before creating anything."""
    from vime.cli import train_main
    from vime.errors import VimeError

    runs = tmp_path / "runs"
    with pytest.raises(VimeError) as e:
        train_main(
            ["--config", "examples/tiny.yaml", "--num-rollout", "1", "--runs-dir", str(runs), "--run-name", "r", *argv]
        )
    assert not (runs / "r").exists()  # no run directory, no engine log, no locked run name
    msg = str(e.value)
    assert "\n" not in msg
    return msg
