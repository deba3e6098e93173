"""What every kernel module shares: whether Triton imported (`AVAILABLE`), whether it runs
interpreted on CPU (`INTERPRET`), and the launch helpers of the wrappers."""

from __future__ import annotations

import os

import torch

try:
    import triton  # noqa: F401 (imported to learn whether Triton is installed)

    AVAILABLE = True
except ImportError:  # CPU-only installs: the engine uses its PyTorch path
    AVAILABLE = False


INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def enabled(device: torch.device) -> bool:
    """Whether the Triton path runs on this device: CUDA with Triton installed, or any device
    under the Triton interpreter (how the CPU tests exercise the GPU code path)."""
    return AVAILABLE and (device.type == "cuda" or INTERPRET)


def _pow2(n: int) -> int:
    return 1 << (max(n, 1) - 1).bit_length()


def _precision(dtype: torch.dtype) -> str:
    """float32 models ask for exact float32 dots (tf32 would cost ~1e-3 in log-probs)."""
    return "ieee" if dtype == torch.float32 else "tf32"
