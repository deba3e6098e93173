"""The trainer's tests share one Actor on the tiny model per file (building one loads the model)."""

from __future__ import annotations

import pytest

from unit.trainer.actors import make_args
from vime.trainer.actor import Actor


@pytest.fixture(scope="module")
def actor(tiny_model) -> Actor:
    return Actor(make_args(), tiny_model)
