"""The tool tests' autouse fixture, imported by each file whose tests start tool workers."""

from __future__ import annotations

import pytest

from vime.rollout.tools.workers import close_all


@pytest.fixture(autouse=True)
def no_tool_workers_left():
    """A user's tool runs in worker processes (vime/rollout/tools/workers.py): none outlives its
    test (a test of another file in this process counts its children)."""
    yield
    close_all()
