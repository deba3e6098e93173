"""What the vLLM backend's tests share, here and in the runs against vLLM: whether vllm is here, the
`vllm` mark that skips a test where it is not, the tolerance, the tiny shape vLLM's CPU attention
takes, requests sent to a server, and an Actor that recomputes what a server sampled."""

from __future__ import annotations

import asyncio
import importlib.util
from pathlib import Path

import pytest

from vime.backends.vllm.client import VLLMClient
from vime.config import Config

ATOL = 1e-4
HAS_VLLM = importlib.util.find_spec("vllm") is not None
# The tiny model's shape with head_dim 32, which vLLM's CPU attention accepts.
SHAPE32 = dict(arch="qwen3", hidden_size=64, num_heads=2, num_kv_heads=1, head_dim=32)


def needs_vllm(fn):
    """A test against a real vLLM server: marked `vllm`, skipped where vllm is not installed."""
    return pytest.mark.skipif(not HAS_VLLM, reason="vllm is not installed here: run make test-vllm")(
        pytest.mark.vllm(fn)
    )


def run(client: VLLMClient, *requests: dict) -> list:
    """Generate calls (kwargs of `generate`) concurrently on a fresh event loop."""

    async def main() -> list:
        try:
            return list(await asyncio.gather(*(client.generate(**r) for r in requests)))
        finally:
            await client.close()

    return asyncio.run(main())


def actor_for(model: Path, temperature: float):
    from vime.trainer.actor import Actor

    args = Config(
        lr=1e-3,
        weight_decay=0.0,
        adam_beta1=0.9,
        adam_beta2=0.98,
        clip_grad=1.0,
        max_tokens_per_gpu=4096,
        seed=0,
        rollout_temperature=temperature,
        kl_loss_coef=0.0,
    )
    return Actor(args, model)
