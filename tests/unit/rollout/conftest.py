"""The data tests' tokenizer: the tiny model's, built once per file."""

from __future__ import annotations

import pytest

from vime.models import make_tiny_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return make_tiny_tokenizer()
