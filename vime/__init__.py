"""vime: RL post-training for language models, sync and async, measured side by side."""

import os

# torch.cuda.is_available() answered by NVML, not by initializing CUDA: a process becomes a CUDA
# MPS client (or not) at its first cuInit, so vime calls none before a run has set MPS up
# (vime/launch/mps.py); torch's own lazy initialization is unchanged
os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")

__version__ = "0.1.0"
