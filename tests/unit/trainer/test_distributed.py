"""Two gloo ranks (FSDP2) against one plain rank on the same batches: same log-probs, losses,
updated weights and optimizer state; a checkpoint written by two ranks loads in one rank and in
transformers."""

from __future__ import annotations

import pytest
import torch

from unit.trainer.actors import make_args, make_samples
from vime.trainer.actor import Actor
from vime.trainer.distributed import DistributedActor, launch_actor
from vime.trainer.model import fsdp_params


def test_two_ranks_match_one_rank_and_checkpoint_loads_anywhere(tiny_model, tmp_path):
    # 6 samples, 2 optimizer steps of 3: the ranks get unequal shares, and a token budget of
    # 24 gives them different micro-batch counts, so empty micro-batches are exercised too;
    # the second step is off-policy (clip active) and the entropy term carries gradient.
    args = make_args(max_tokens_per_gpu=24, global_batch_size=3, entropy_coef=0.01, actor_num_procs=2)
    samples = make_samples(6)
    advantages = [1.0, -0.5, 0.25, -1.0, 2.0, -0.75]

    one = Actor(args, tiny_model)
    two = launch_actor(args, tiny_model, "cpu")
    assert isinstance(two, DistributedActor)
    assert all(hasattr(p, "device_mesh") for p in two.model.parameters())  # really sharded
    # FSDP2's private per-parameter objects, which the trainer's Triton accumulation patches on
    # CUDA, are still found under their names in this torch
    assert len(fsdp_params(two.local.policy.scorer)) == len(list(two.model.parameters()))
    try:
        for a, b in zip(one.compute_log_probs(samples), two.compute_log_probs(samples)):
            assert torch.allclose(a, b, atol=1e-6)
        m1 = one.train_step(samples, advantages)
        m2 = two.train_step(samples, advantages)
        for k in (
            "train/loss",
            "train/pg_loss",
            "train/pg_clipfrac",
            "train/ppo_kl",
            "train/entropy",
            "train/grad_norm",
        ):
            assert abs(m1[k] - m2[k]) < 1e-5, (k, m1[k], m2[k])
        w1, w2 = dict(one.named_weights()), dict(two.named_weights())
        assert sorted(w1) == sorted(w2)
        for n, t in w1.items():
            assert torch.allclose(t, w2[n], atol=1e-5), n

        ckpt = two.save(tmp_path / "ckpt" / "1", {"step": 1})
    finally:
        two.close()

    loaded = Actor(make_args(), tiny_model)
    assert loaded.load(ckpt) == {"step": 1}
    for n, t in loaded.named_weights():
        assert torch.allclose(t, w1[n], atol=1e-5), n
    s1, s2 = one.optimizer_step.optimizer.state_dict()["state"], loaded.optimizer_step.optimizer.state_dict()["state"]
    assert sorted(s1) == sorted(s2)
    for pid, st in s1.items():
        assert float(st["step"]) == float(s2[pid]["step"]) == 2
        assert torch.allclose(st["exp_avg"], s2[pid]["exp_avg"], atol=1e-6)

    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(ckpt)
    for n, t in hf.state_dict().items():
        assert torch.allclose(t, w1[n], atol=1e-5), n


@pytest.mark.parametrize(
    "extra",
    [
        {"calculate_per_token_loss": False},  # the sample mean: its denominator is the step's samples on every rank
        {"advantage_estimator": "gspo", "eps_clip": 4e-4},  # one ratio per sequence: whole sequences per rank
        pytest.param(
            {"advantage_estimator": "cispo", "eps_clip": 1.0, "eps_clip_high": 4.0}, marks=pytest.mark.slow, id="cispo"
        ),
        pytest.param({"use_opsm": True}, marks=pytest.mark.slow, id="opsm"),
        pytest.param({"lora_rank": 4, "lora_alpha": 8.0}, id="lora"),  # adapters sharded beside a frozen base
    ],
    ids=["sample-mean", "gspo", "cispo", "opsm", "lora"],
)
def test_two_ranks_match_one_rank_for_every_objective(tiny_model, extra):
    """The objectives of issue 31 split over two ranks train what one rank trains: the same
    loss, gradient norm and weights (the second optimizer step is off-policy, so the clips,
    ratios and OPSM's drift are live)."""
    args = make_args(max_tokens_per_gpu=24, global_batch_size=3, actor_num_procs=2, **extra)
    samples = make_samples(6)
    advantages = [1.0, -0.5, 0.25, -1.0, 2.0, -0.75]
    one = Actor(args, tiny_model)
    two = launch_actor(args, tiny_model, "cpu")
    try:
        m1, m2 = one.train_step(samples, advantages), two.train_step(samples, advantages)
        for k in ("train/loss", "train/pg_loss", "train/grad_norm"):
            assert abs(m1[k] - m2[k]) < 1e-5, (k, m1[k], m2[k])
        w1, w2 = dict(one.named_weights()), dict(two.named_weights())
        assert all(torch.allclose(t, w2[n], atol=1e-5) for n, t in w1.items())
        if "lora_rank" in extra:  # what an adapter-only push sends, gathered from the ranks' shards
            a1, a2 = dict(one.adapter_weights()), dict(two.adapter_weights())
            assert a1 and a1.keys() == a2.keys() and all(torch.allclose(t, a2[n], atol=1e-5) for n, t in a1.items())
            b1, b2 = dict(one.named_weights(merge=False)), dict(two.named_weights(merge=False))
            assert b1.keys() == b2.keys() and all(torch.equal(t, b2[n]) for n, t in b1.items())
    finally:
        two.close()


def test_a_rank_started_elsewhere_that_ends_before_joining_is_one_line_at_once():
    """Ranks that a cluster started (Ray actors) are watched while rank 0 joins the group: one
    that ended before joining (a node that cannot write the run's log, an import error) is a
    one-line error within a second, not the group's 30-minute wait. Run in a process of its own:
    rank 0's join is left waiting there."""
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code = f"""
import time
from vime.trainer.distributed import TrainerRankError, _init_watching

class Gone:  # what a RayRank answers once its actor's `serve` call failed
    def is_alive(self): return False
    def ended_how(self): return "it failed on node n1: [Errno 2] No such file or directory: 'runs/r/trainer1.log'"

t0 = time.monotonic()
try:
    _init_watching([Gone()], 2, "tcp://127.0.0.1:{port}", "cpu")
except TrainerRankError as e:
    print(e)
    print(round(time.monotonic() - t0, 1))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    line, seconds = out.stdout.strip().splitlines()
    assert line == (
        "trainer rank 1 ended before joining the trainer's group: it failed on node n1: [Errno 2] No such file or "
        "directory: 'runs/r/trainer1.log'"
    ), out.stderr[-2000:]
    assert float(seconds) < 5
