"""A short run on examples/tiny.yaml with a slime-shaped plug-in, as the compat tests start one to
see that plug-in drive training: the run must finish every step, and what it generated, scored
and logged comes back to assert on."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from conftest import run_cli


@dataclass
class TinyRun:
    saved: list[dict]  # each step's --save-debug-rollout-data: its "samples" and "metrics"
    rows: list[dict]  # metrics.jsonl

    @property
    def samples(self) -> list[dict]:
        """The first step's samples."""
        return self.saved[0]["samples"]


def tiny_run(tmp_path: Path, steps: int, *flags: str) -> TinyRun:
    res = run_cli(
        "train.py", "--config", "examples/tiny.yaml", "--num-rollout", str(steps), "--runs-dir", str(tmp_path),
        "--run-name", "r", "--save-debug-rollout-data", str(tmp_path / "rollout_{rollout_id}.pt"), *flags,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-2000:]
    assert f"step {steps}/{steps}" in res.stderr
    saved = [torch.load(tmp_path / f"rollout_{i}.pt", weights_only=False) for i in range(steps)]
    rows = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    return TinyRun(saved, rows)
