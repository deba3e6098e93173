"""Mixtures of experts on CUDA (issue 70), run by `make test-gpu` on a GPU machine (skipped
elsewhere): the compiled bf16 trainer runs the experts as one grouped GEMM and replays routing,
the replaying router is transformers' bit for bit in bf16 on the GPU, and expert parallelism over
two NCCL ranks matches one rank within bfloat16's tolerance (the CPU tests check it exactly in
float32)."""

from __future__ import annotations

import math

import pytest
import torch
from unit.trainer.actors import make_args, make_samples
from unit.trainer.moe_models import make_tiny_moe
from unit.trainer.test_r3 import hf_model, with_routing

from vime.trainer.moe import MoeShape
from vime.trainer.routing import Routing

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
ADVANTAGES = [1.0, -0.5, 0.25, -1.0, 2.0, -0.75]


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_the_replaying_router_is_transformers_on_cuda_in_bf16(tmp_path, arch):
    model_dir = make_tiny_moe(tmp_path / "m", arch)
    plain, patched = (hf_model(model_dir).to("cuda", torch.bfloat16) for _ in range(2))
    Routing.install(MoeShape.of(patched), patched, replay=True)
    hidden = torch.randn(257, plain.config.hidden_size, device="cuda", dtype=torch.bfloat16)
    for a, b in zip(plain.model.layers, patched.model.layers):
        assert all(torch.equal(x, y) for x, y in zip(a.mlp.gate(hidden), b.mlp.gate(hidden)))


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_a_compiled_moe_trains_with_replay_on_one_gpu(tmp_path, arch):
    """FSDP2 on one rank (bf16 compute), each layer compiled, grouped GEMM experts, R3 replay and
    the balance loss: finite metrics, a gradient, the routers and experts moved."""
    from vime.trainer.distributed import launch_actor

    model_dir = make_tiny_moe(tmp_path / "m", arch)
    samples = with_routing(make_samples(6), model_dir)
    args = make_args(
        use_rollout_routing_replay=True, moe_aux_loss_coeff=0.01, global_batch_size=6, max_tokens_per_gpu=64
    )
    actor = launch_actor(args, model_dir, "cuda:0")
    try:
        assert actor.policy.compiled and actor.model.config._experts_implementation == "grouped_mm"
        before = {n: t.float().cpu() for n, t in actor.named_weights()}
        m = actor.train_step(samples, ADVANTAGES)
        after = {n: t.float().cpu() for n, t in actor.named_weights()}
    finally:
        actor.close()
    assert all(math.isfinite(v) for v in m.values()) and m["train/grad_norm"] > 0
    assert 0.0 <= m["train/routing_mismatch"] <= 1.0 and "train/logprob_gap_no_replay" in m
    moved = {n for n in before if not torch.equal(before[n], after[n])}
    assert any(".gate.weight" in n for n in moved) and any(".experts." in n for n in moved)


@two_gpus
def test_expert_parallelism_over_two_gpus_matches_one(tmp_path):
    from vime.trainer.distributed import launch_actor

    model_dir = make_tiny_moe(tmp_path / "m", "qwen3_moe")
    samples = make_samples(6)
    results = []
    for gpus in (1, 2):
        args = make_args(
            actor_num_gpus_per_node=gpus, expert_model_parallel_size=gpus, global_batch_size=6, max_tokens_per_gpu=64
        )
        actor = launch_actor(args, model_dir, "cuda:0")
        try:
            lp = [t.float().cpu() for t in actor.compute_log_probs(samples)]
            m = actor.train_step(samples, ADVANTAGES)
            w = {n: t.float().cpu() for n, t in actor.named_weights()}
        finally:
            actor.close()
        results.append((lp, m, w))
    (lp1, m1, w1), (lp2, m2, w2) = results
    assert all(torch.allclose(x, y, atol=2e-2) for x, y in zip(lp1, lp2))
    for k in ("train/loss", "train/grad_norm"):
        assert abs(m1[k] - m2[k]) <= 2e-2 * max(1.0, abs(m1[k])), (k, m1[k], m2[k])
    assert sorted(w1) == sorted(w2) and all(torch.allclose(w1[n], w2[n], atol=2.5e-3) for n in w1)
