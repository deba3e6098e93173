"""Expert parallelism (--expert-model-parallel-size 2) over two gloo ranks against one plain rank
on the same batches: the same log-probs, losses, gradient norm, updated weights and optimizer
state within float32's reordering (1e-5: the ranks sum tokens and experts in another order, as
FSDP2's own two-rank test allows), each rank holding half of every layer's experts; a checkpoint
the split trainer writes loads in one rank and in transformers.

SGD, not Adam: Adam divides each gradient by its own size, so where a gradient is ~0 (an expert a
few tokens reach) float32's reordering alone moves a weight by up to the learning rate, on two
FSDP2 ranks without expert parallelism as much as with it; SGD's step is the gradient's. No
balance loss either: it is a statistic of each micro-batch's tokens (Megatron's too), and two
ranks pack other micro-batches than one does."""

from __future__ import annotations

import pytest
import torch

from unit.trainer.actors import make_args, make_samples
from unit.trainer.moe_models import make_tiny_moe
from unit.trainer.test_r3 import with_routing
from vime.config import ConfigError
from vime.trainer.actor import Actor
from vime.trainer.distributed import DistributedActor, launch_actor

ADVANTAGES = [1.0, -0.5, 0.25, -1.0, 2.0, -0.75]
TOLERANCE = 1e-5


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral"])
def moe_model(request, tmp_path_factory):
    return make_tiny_moe(tmp_path_factory.mktemp(request.param) / "model", request.param)


def test_experts_split_over_two_ranks_train_what_one_rank_trains(moe_model, tmp_path):
    # 6 samples, 2 optimizer steps of 3 (the second off-policy), a budget of 24 tokens: unequal
    # shares and micro-batch counts, so a rank with no tokens of its own still serves the other's
    # the engine's routing replayed (the experts the trainer would choose last): R3's forward,
    # mismatch and gaps summed over the ranks too
    kw = dict(max_tokens_per_gpu=24, global_batch_size=3, entropy_coef=0.01, optimizer="sgd", lr=0.1)
    kw["use_rollout_routing_replay"] = True
    samples = with_routing(make_samples(6), moe_model, pick="bottom")
    one = Actor(make_args(**kw), moe_model)
    two = launch_actor(make_args(**kw, actor_num_procs=2, expert_model_parallel_size=2), moe_model, "cpu")
    assert isinstance(two, DistributedActor)
    gate_up = two.model.model.layers[0].mlp.experts.gate_up_proj
    assert gate_up.shape[0] == 4 and gate_up.to_local().shape[0] == 2  # two of the four experts here
    try:
        for a, b in zip(one.compute_log_probs(samples), two.compute_log_probs(samples)):
            assert torch.allclose(a, b, atol=TOLERANCE)
        m1, m2 = one.train_step(samples, ADVANTAGES), two.train_step(samples, ADVANTAGES)
        assert m2["train/routing_mismatch"] == 1.0
        for k in (
            "train/loss",
            "train/entropy",
            "train/grad_norm",
            "train/logprob_gap_replay",
            "train/logprob_gap_no_replay",
        ):
            assert abs(m1[k] - m2[k]) < TOLERANCE, (k, m1[k], m2[k])
        w1, w2 = dict(one.named_weights()), dict(two.named_weights())
        assert sorted(w1) == sorted(w2)
        moved = {n for n, t in w1.items() if not torch.equal(t, w2[n])}
        assert all(torch.allclose(t, w2[n], atol=TOLERANCE) for n, t in w1.items()), moved
        position = {"epoch": 0, "offset": 0, "next_index": 0, "next_group": 0, "requeued": []}
        ckpt = two.save(tmp_path / "ckpt" / "1", {"step": 1, "data_source": position})
    finally:
        two.close()

    resumed = Actor(make_args(**kw), moe_model)
    resumed.load(ckpt)
    assert all(torch.allclose(t, w1[n], atol=TOLERANCE) for n, t in resumed.named_weights())
    s1, s2 = (a.optimizer_step.optimizer.state_dict()["state"] for a in (one, resumed))
    assert sorted(s1) == sorted(s2)
    assert all(torch.allclose(s1[p]["momentum_buffer"], s2[p]["momentum_buffer"], atol=TOLERANCE) for p in s1)

    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(ckpt)
    ours = dict(resumed.model.named_parameters())
    assert all(torch.allclose(p, ours[n], atol=TOLERANCE) for n, p in hf.named_parameters())


def test_expert_parallelism_needs_every_rank_and_even_experts(moe_model):
    with pytest.raises(ConfigError, match="splits each layer's 4 experts evenly over all of the trainer's 1 rank"):
        Actor(make_args(expert_model_parallel_size=2), moe_model)
