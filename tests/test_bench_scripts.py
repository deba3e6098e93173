"""The trainer's benches run their CPU smoke settings end to end: they import the trainer's
internals by name (`profile_trainer.py` wraps `pack`, `to_device` and the optimizer step), so a
restructure that moves one breaks them silently until the next GPU session finds out; this is
where it shows instead. Their figures are GPU claims (bench/RESULTS.md), not checked here."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_bench(*argv: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def rows(out: str) -> dict[str, float]:
    """The summary table's tokens/s by variant."""
    return {m[1]: float(m[2].replace(",", "")) for m in re.finditer(r"^\| ([^|]+?) \| ([\d,]+) \|", out, re.M)}


def test_profile_trainer_runs_and_traces_its_step():
    out = run_bench("bench/profile_trainer.py", "--device", "cpu", "--tiny", "--variants", "eager", "--steps", "1")
    assert "eager: traced step" in out and "| idle (no kernel running) |" in out
    assert rows(out).get("eager", 0) > 0, out[-2000:]


def test_bench_trainer_runs_its_variants():
    out = run_bench("bench/bench_trainer.py", "--device", "cpu", "--tiny", "--no-hf", "--no-compile", "--steps", "1")
    got = rows(out)
    assert got.get("vime train_step", 0) > 0 and got.get("vime packed+chunked (fwd+bwd+opt)", 0) > 0, out[-2000:]
