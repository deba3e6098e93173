"""The engine's tests share a tiny float32 Qwen3 and its HF twin, once per file. test_fp8,
test_scoring and test_openai_server build models of their own under these names (a module's own
fixture wins over this file's)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from vime.models import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("engine") / "qwen3", arch="qwen3", seed=0)


@pytest.fixture(scope="module")
def hf(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
