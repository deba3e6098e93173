"""A mark the trainer's and the engine's GPU checks share."""

from __future__ import annotations

import pytest
import torch

two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
