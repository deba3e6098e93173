"""`vime bench ab`: the same config through several training modes, one after another, then the
side-by-side report.

Each arm is a fresh process (`vime train` / `vime train-async`) on the same config, seeds and
step budget, so arms cannot leak state (caches, threads, engine processes) into each other.
The first arm is the speedup reference.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

from vime.config import ConfigError
from vime.errors import VimeError
from vime.lifetime import signals_held
from vime.modes import MODES

ARM_STOP_S = 30.0  # a run stops within seconds of SIGTERM; what is left after this is killed


def arm_command(arm: str, staleness: int) -> list[str]:
    """The CLI words that make one arm: its mode's row (vime/modes.py)."""
    if arm not in MODES:
        raise ConfigError(f"unknown arm '{arm}': choose from {', '.join(MODES)}")
    return [w.format(staleness=staleness) for w in MODES[arm].arm]


def run_arm(
    arm: str,
    config: str,
    run_name: str,
    runs_dir: str,
    extra: list[str],
    staleness: int = 2,
    timeout: float | None = None,
) -> Path:
    cmd = [
        sys.executable,
        "-m",
        "vime.cli",
        *arm_command(arm, staleness),
        "--config",
        config,
        "--run-name",
        run_name,
        "--runs-dir",
        runs_dir,
        *extra,
    ]
    print(f"[ab] {arm}: {' '.join(cmd[1:])}", flush=True)
    # in a process group of its own, which ends with it however this process is stopped: an arm
    # left running (its engines, ranks and reward workers with it) held this bench's output pipe
    # open for minutes after a SIGTERM
    proc = subprocess.Popen(cmd, start_new_session=True)
    try:
        code = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        stop_group(proc)
        raise VimeError(
            f"arm '{arm}' did not finish within {timeout:g} s; its log is in {runs_dir}/{run_name}/log.txt"
        ) from None
    except BaseException:  # Ctrl-C, SIGTERM (vime.lifetime.Terminated): the arm stops as a run does
        stop_group(proc)
        raise
    if code != 0:
        raise VimeError(f"arm '{arm}' failed with exit code {code}; its log is in {runs_dir}/{run_name}/log.txt")
    return Path(runs_dir) / run_name


def stop_group(proc: subprocess.Popen, grace: float = ARM_STOP_S) -> None:
    """SIGTERM to the arm, which stops a run within seconds, its engines, ranks and workers
    ended by its own cleanup; then SIGKILL to whatever is left of its process group, at once or
    after `grace` seconds. A second Ctrl-C waits for it (`signals_held`)."""
    with signals_held():
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(grace)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="vime bench ab",
        description="Run one config as several training modes, one after another, then print the speed and accuracy tables. Extra flags after the known ones go to every arm.",
    )
    p.add_argument("--config", required=True, help="YAML config shared by every arm")
    p.add_argument(
        "--arms",
        default="sync,one-step-off,fully-async",
        help=f"comma-separated: {', '.join(MODES)} (first = speedup reference)",
    )
    p.add_argument("--staleness", type=int, default=2, help="--max-staleness of the decoupled arm")
    p.add_argument("--runs-dir", default="runs", help="where the arms' run directories go")
    p.add_argument("--name", default="ab", help="run names are <name>-<arm>")
    p.add_argument("--no-plots", action="store_true", help="tables only (no PNG plots)")
    a, extra = p.parse_known_args(argv)
    if not Path(a.config).exists():
        raise ConfigError(f"config file {a.config} not found")
    arms = [x.strip() for x in a.arms.split(",") if x.strip()]
    for arm in arms:
        arm_command(arm, a.staleness)  # reject a bad arm before anything runs
    dirs = [run_arm(arm, a.config, f"{a.name}-{arm}", a.runs_dir, extra, a.staleness) for arm in arms]
    from vime.report import main as report_main

    return report_main([str(d) for d in dirs] + (["--no-plots"] if a.no_plots else []))
