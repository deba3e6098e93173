"""The optimizer and the learning-rate schedule: Megatron's schedule against values worked by
hand, weight decay of the weight matrices only, SGD, skipped non-finite steps (fused and not),
and a resumed run that goes on with the schedule where it stopped."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from unit.trainer.actors import make_args, make_samples
from vime.trainer.actor import Actor
from vime.trainer.checkpoint import TRAINER_STATE, CheckpointError
from vime.trainer.optim import LRSchedule, make_optimizer, param_groups

# ---- the schedule: a pure function of the step -------------------------------------------


def test_warm_up_then_constant_by_hand():
    # step k < 4 runs at lr·k/4, so step 0 runs at 0; from step 4 on, lr
    s = LRSchedule(lr=1e-3, warmup_iters=4)
    assert [s(k) for k in range(7)] == pytest.approx([0.0, 2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3, 1e-3])
    assert LRSchedule(lr=1e-3)(0) == 1e-3  # no warm-up: the first step runs at lr


def test_linear_decay_counts_the_warm_up_in_its_steps():
    # lr 1 → min 0.1 over 6 steps, the first 2 of them warm-up: ratio (k − 2) / 4 from step 2;
    # k=3: 0.1 + 0.75·0.9 = 0.775, k=4: 0.55, k=5: 0.325, k=6: 0.1, then held at 0.1
    s = LRSchedule(lr=1.0, min_lr=0.1, warmup_iters=2, decay_iters=6, decay_style="linear")
    assert [s(k) for k in range(9)] == pytest.approx([0.0, 0.5, 1.0, 0.775, 0.55, 0.325, 0.1, 0.1, 0.1])
    assert s(10_000) == pytest.approx(0.1)


def test_cosine_decay_by_hand():
    # no warm-up, 4 steps: coeff = ½(cos(π k/4) + 1) = 1, 0.853553, 0.5, 0.146447, 0; lr = 0.1 + 0.9·coeff
    s = LRSchedule(lr=1.0, min_lr=0.1, decay_iters=4, decay_style="cosine")
    assert [s(k) for k in range(6)] == pytest.approx([1.0, 0.868198, 0.55, 0.231802, 0.1, 0.1], abs=1e-6)


def test_a_decay_no_longer_than_the_warm_up_ends_at_min_lr():
    # Megatron refuses it; here it is well defined (no 0 / 0): warm up to lr, then min_lr
    s = LRSchedule(lr=1.0, min_lr=0.1, warmup_iters=3, decay_iters=2, decay_style="cosine")
    assert [s(k) for k in range(6)] == pytest.approx([0.0, 1 / 3, 2 / 3, 1.0, 0.1, 0.1])


def test_schedule_refuses_what_it_cannot_compute():
    with pytest.raises(ValueError):
        LRSchedule(lr=1.0, decay_style="linear")  # decaying over how many steps?
    with pytest.raises(ValueError):
        LRSchedule(lr=1.0, decay_style="step")
    with pytest.raises(ValueError):
        LRSchedule(lr=1.0, warmup_iters=-1)


def test_the_decay_spans_the_whole_run_by_default():
    # 5 rollouts of 4 × 2 = 8 samples, global batches of 2: 4 optimizer steps each, 20 in all
    args = make_args(
        num_rollout=5,
        rollout_batch_size=4,
        n_samples_per_prompt=2,
        global_batch_size=2,
        lr_decay_style="linear",
        lr_warmup_iters=3,
        min_lr=1e-5,
    )
    s = LRSchedule.of(args, args.num_rollout)
    assert (s.decay_iters, s.warmup_iters, s.lr, s.min_lr) == (20, 3, 1e-3, 1e-5)
    args.lr_decay_iters = 7
    assert LRSchedule.of(args, args.num_rollout).decay_iters == 7
    # slime's SFT scripts' --lr-warmup-fraction: a share of the decay's steps, as Megatron takes it
    args.lr_decay_iters, args.lr_warmup_iters, args.lr_warmup_fraction = None, 0, 0.1
    assert LRSchedule.of(args, args.num_rollout).warmup_iters == 2


# ---- the optimizer -----------------------------------------------------------------------


class Tiny(nn.Module):
    """A weight matrix, a bias and a norm gain, all 1."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(2, 2)
        self.norm = nn.LayerNorm(2)
        for p in self.parameters():
            nn.init.ones_(p)


def test_weight_decay_reaches_weight_matrices_only(actor_model):
    """One AdamW step on zero gradients moves nothing but the decay: p ← p (1 − lr·wd) on the
    matrices (embeddings and LM head included), biases and norm gains untouched."""
    decays, keeps = param_groups(actor_model, 0.1)
    names = {id(p): n for n, p in actor_model.named_parameters()}
    decayed = {names[id(p)] for p in decays["params"]}
    assert "model.embed_tokens.weight" in decayed and "lm_head.weight" in decayed
    assert all("norm" not in n for n in decayed)
    assert {names[id(p)] for p in keeps["params"]} == {n for n, p in actor_model.named_parameters() if p.ndim == 1}
    assert any("norm" in names[id(p)] for p in keeps["params"]) and keeps["weight_decay"] == 0.0

    model = Tiny()
    opt = make_optimizer(make_args(lr=0.1, weight_decay=0.5), model, fused=False)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    assert torch.allclose(model.proj.weight, torch.full((2, 2), 0.95))  # 1 − 0.1 · 0.5
    for p in (model.proj.bias, model.norm.weight, model.norm.bias):
        assert torch.equal(p, torch.ones(2))


def test_sgd_with_momentum_and_l2_decay_by_hand():
    """--optimizer sgd: torch's SGD, momentum 0.9, weight decay as an L2 term on the matrices only.
    lr 0.1, wd 0.1, every gradient 0.5, all weights 1:
    matrix: g = 0.5 + 0.1·1 = 0.6, buf = 0.6, p = 0.94; then g = 0.5 + 0.094 = 0.594,
    buf = 0.9·0.6 + 0.594 = 1.134, p = 0.94 − 0.1134 = 0.8266.
    norm gain: g = 0.5, p = 0.95; then buf = 0.45 + 0.5 = 0.95, p = 0.95 − 0.095 = 0.855."""
    model = Tiny()
    opt = make_optimizer(make_args(optimizer="sgd", lr=0.1, weight_decay=0.1, sgd_momentum=0.9), model, fused=False)
    assert isinstance(opt, torch.optim.SGD)
    for want_matrix, want_gain in ((0.94, 0.95), (0.8266, 0.855)):
        for p in model.parameters():
            p.grad = torch.full_like(p, 0.5)
        opt.step()
        assert torch.allclose(model.proj.weight, torch.full((2, 2), want_matrix))
        assert torch.allclose(model.norm.weight, torch.full((2,), want_gain))


def test_adam_eps_and_betas_reach_adamw():
    opt = make_optimizer(make_args(adam_eps=1e-5, adam_beta1=0.8, adam_beta2=0.95), Tiny(), fused=False)
    assert isinstance(opt, torch.optim.AdamW)
    assert all(g["eps"] == 1e-5 and tuple(g["betas"]) == (0.8, 0.95) for g in opt.param_groups)


@pytest.fixture(scope="module")
def actor_model(tiny_model):
    return Actor(make_args(), tiny_model).model


def _poisoned_step(a: Actor) -> dict[str, float]:
    """Accumulate a step's gradients, make one of them NaN, and clip and step."""
    a.accumulate_gradients(make_samples(2), [1.0, -1.0], None)
    next(p for p in a.model.parameters() if p.grad is not None).grad[0] = float("nan")
    return a.optimizer_step.clip_and_step()


@pytest.mark.parametrize("kind", ["adam_fused", "adam", "sgd"])
def test_a_non_finite_gradient_moves_neither_weights_nor_optimizer_state(tiny_model, kind):
    """The fused AdamW (what CUDA runs; on CPU too in torch 2.13) skips itself on the device
    (`found_inf`); the others are skipped by the host. Either way nothing moves, moments
    included, and SGD's next good step is a first step: its momentum buffer is that step's
    gradient plus the L2 term, not one left uninitialized by a skipped first step."""
    args = make_args(optimizer="sgd" if kind == "sgd" else "adam", weight_decay=0.1, clip_grad=0.0)
    a = Actor(args, tiny_model)
    if kind == "adam_fused":
        a.optimizer_step.optimizer = make_optimizer(args, a.model, fused=True)
        a.optimizer_step.apply_schedule()
    if kind == "adam":
        a.train_step(make_samples(2), [1.0, -1.0])  # moments exist: a skipped step must keep them
    weights = {n: p.detach().clone() for n, p in a.model.named_parameters()}
    state = {p: {k: v.clone() for k, v in s.items()} for p, s in a.optimizer_step.optimizer.state.items()}
    m = _poisoned_step(a)
    assert m["train/skipped_steps"] == 1.0 and not math.isfinite(m["train/grad_norm"])
    assert all(torch.equal(p, weights[n]) for n, p in a.model.named_parameters())
    for p, s in a.optimizer_step.optimizer.state.items():  # the fused AdamW makes its zero moments even when it skips
        for k, v in s.items():
            assert torch.equal(v, state[p][k]) if p in state else not v.any(), k
    a.accumulate_gradients(make_samples(2), [1.0, -1.0], None)
    grads = {p: p.grad.clone() for p in a.model.parameters()}
    assert a.optimizer_step.clip_and_step()["train/skipped_steps"] == 0.0
    assert any(not torch.equal(p, weights[n]) for n, p in a.model.named_parameters())
    if kind == "sgd":
        for n, p in a.model.named_parameters():
            l2 = 0.1 * weights[n] if p.ndim >= 2 else 0.0
            assert torch.allclose(a.optimizer_step.optimizer.state[p]["momentum_buffer"], grads[p] + l2), n


# ---- the actor's step count: every slot, and across a checkpoint -------------------------


def test_each_optimizer_step_runs_at_its_scheduled_lr(tiny_model):
    """train/lr is the step's own rate; step 0 of a warm-up runs at 0 and leaves the weights as
    they were (AdamW, no decay); a step with nothing to learn and a skipped rollout count too."""
    args = make_args(lr=1e-2, min_lr=1e-3, lr_warmup_iters=2, lr_decay_iters=5, lr_decay_style="linear", num_rollout=20)
    schedule = LRSchedule.of(args, args.num_rollout)
    a = Actor(args, tiny_model)
    before = {n: p.detach().clone() for n, p in a.model.named_parameters()}
    m = a.train_step(make_samples(2), [1.0, -1.0])
    assert m["train/lr"] == 0.0 and a.optimizer_step.count == 1
    assert all(torch.equal(p, before[n]) for n, p in a.model.named_parameters())
    lrs = [a.train_step(make_samples(2), [1.0, -1.0])["train/lr"]]
    empty = make_samples(2)
    for s in empty:
        s.loss_mask = [0] * s.response_length
    lrs.append(a.train_step(empty, [1.0, -1.0])["train/lr"])
    a.skip_steps(1)  # the run skipped a rollout of non-finite rewards: step 3's slot
    lrs.append(a.train_step(make_samples(2), [1.0, -1.0])["train/lr"])
    lrs.append(a.train_step(make_samples(2), [1.0, -1.0])["train/lr"])
    assert a.optimizer_step.count == 6
    # 1: 0.5·1e-2; 2: 1e-2; 4: 1e-3 + (1 − 2/3)·9e-3 = 4e-3; 5: 1e-3
    assert lrs == pytest.approx([schedule(1), schedule(2), schedule(4), schedule(5)])
    assert lrs == pytest.approx([5e-3, 1e-2, 4e-3, 1e-3])


def test_several_steps_of_a_rollout_each_take_their_lr(tiny_model):
    """Two optimizer steps in one train_step: lr·0/2 then lr·1/2; train/lr is their mean."""
    a = Actor(make_args(lr=1e-2, lr_warmup_iters=2, global_batch_size=2), tiny_model)
    m = a.train_step(make_samples(4), [1.0, -1.0, 0.5, -0.5])
    assert a.optimizer_step.count == 2 and m["train/lr"] == pytest.approx((0.0 + 5e-3) / 2)
    assert a.optimizer_step.optimizer.param_groups[0]["lr"] == pytest.approx(5e-3)


def test_a_resumed_run_continues_the_schedule_exactly(tiny_model, tmp_path):
    args = dict(lr=1e-2, min_lr=1e-3, lr_warmup_iters=1, lr_decay_iters=4, lr_decay_style="cosine", weight_decay=0.1)
    batches = [(make_samples(3, seed=k), [1.0, -0.5, 0.25 * k]) for k in range(3)]
    a = Actor(make_args(**args), tiny_model)
    for samples, adv in batches[:2]:
        a.train_step(samples, adv)
    ckpt = a.save(tmp_path / "2", {"step": 2})
    third = a.train_step(*batches[2])

    b = Actor(make_args(**args), tiny_model)
    b.load(ckpt)
    assert b.optimizer_step.count == 2
    resumed = b.train_step(*batches[2])
    assert (
        resumed["train/lr"]
        == third["train/lr"]
        == pytest.approx(LRSchedule.of(make_args(**args), make_args(**args).num_rollout)(2))
    )
    for (n, p), q in zip(a.model.named_parameters(), b.model.parameters()):
        assert torch.equal(p, q), n

    # a checkpoint from before the count was kept: the run's policy version stands in for it
    state = torch.load(ckpt / TRAINER_STATE, weights_only=False)
    del state["optimizer_steps"]
    state["extra"]["policy_version"] = 2
    torch.save(state, ckpt / TRAINER_STATE)
    c = Actor(make_args(**args), tiny_model)
    c.load(ckpt)
    assert c.optimizer_step.count == 2 and c.train_step(*batches[2])["train/lr"] == third["train/lr"]


def test_a_one_group_checkpoint_loads_and_the_run_decays_matrices_only(tiny_model, tmp_path):
    """Checkpoints written before the decay groups hold one AdamW group that decays everything:
    their moments load parameter by parameter, and the run's own weight decay applies after."""
    a = Actor(make_args(weight_decay=0.5), tiny_model)
    a.optimizer_step.optimizer = torch.optim.AdamW(a.model.parameters(), lr=1e-3, betas=(0.9, 0.98), weight_decay=0.5)
    a.train_step(make_samples(2), [1.0, -1.0])
    moments = {n: a.optimizer_step.optimizer.state[p]["exp_avg"].clone() for n, p in a.model.named_parameters()}
    ckpt = a.save(tmp_path / "1", {"step": 1})

    b = Actor(make_args(weight_decay=0.1), tiny_model)
    b.load(ckpt)
    assert [g["weight_decay"] for g in b.optimizer_step.optimizer.param_groups] == [0.1, 0.0]
    for n, p in b.model.named_parameters():
        assert torch.equal(b.optimizer_step.optimizer.state[p]["exp_avg"], moments[n]), n


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_sgd_checkpoints_round_trip_and_are_not_mistaken_for_adam(tiny_model, tmp_path, momentum):
    args = make_args(optimizer="sgd", sgd_momentum=momentum, lr=1e-2)
    a = Actor(args, tiny_model)
    a.train_step(make_samples(2), [1.0, -1.0])
    ckpt = a.save(tmp_path / "1", {"step": 1})
    b = Actor(args, tiny_model)
    assert b.load(ckpt) == {"step": 1} and b.optimizer_step.count == 1
    for p, q in zip(a.model.parameters(), b.model.parameters()):
        assert torch.equal(p, q)
        if momentum:
            assert torch.equal(
                a.optimizer_step.optimizer.state[p]["momentum_buffer"],
                b.optimizer_step.optimizer.state[q]["momentum_buffer"],
            )
    with pytest.raises(CheckpointError, match="--optimizer sgd"):
        Actor(make_args(), tiny_model).load(ckpt)
