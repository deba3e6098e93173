"""Actor on the tiny model: log-probs, micro-batch invariance, a learning step, checkpoints,
weight names, and the shm/disk weight pushes."""

from __future__ import annotations

import logging
import math
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from vime.config import Config
from vime.rollout.types import Sample
from vime.trainer import actor as actor_mod
from vime.trainer.actor import Actor
from vime.trainer.packing import PAD_SEGMENT, pack, plan_packed_micro_batches, shard_by_tokens
from vime.transport.push import WeightPusher


def make_args(**overrides) -> Config:
    base = dict(
        lr=1e-3,
        weight_decay=0.0,
        adam_beta1=0.9,
        adam_beta2=0.98,
        clip_grad=1.0,
        eps_clip=0.2,
        eps_clip_high=None,
        kl_loss_coef=0.0,
        kl_loss_type="low_var_kl",
        entropy_coef=0.0,
        advantage_estimator="grpo",
        use_tis=False,
        tis_clip=2.0,
        max_tokens_per_gpu=4096,
        global_batch_size=None,
        seed=0,
        gradient_checkpointing=False,
        rollout_temperature=1.0,
        rollout_max_response_len=8,
    )
    base.update(overrides)
    return Config(**base)


def make_samples(n: int = 4, seed: int = 0) -> list[Sample]:
    """Samples of different prompt and response lengths (so micro-batches need padding)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = [rng.randrange(4, 100) for _ in range(3 + 2 * i)]
        response = [rng.randrange(4, 100) for _ in range(2 + (i * 3) % 7)]
        out.append(Sample(index=i, tokens=prompt + response, response_length=len(response)))
    return out


@pytest.fixture(scope="module")
def actor(tiny_model) -> Actor:
    return Actor(make_args(), tiny_model)


def test_packed_plan_respects_budget_and_fills_bins():
    lengths = [5, 9, 3, 9, 20]
    batches = plan_packed_micro_batches(lengths, max_tokens=18)
    assert sorted(i for b in batches for i in b) == list(range(5))
    assert [4] in batches  # longer than the budget: alone
    for b in batches:
        assert len(b) == 1 or sum(lengths[i] for i in b) <= 18
    # first-fit decreasing: 9+9, 5+3 → two bins besides the long one (padding would need three)
    assert len(batches) == 3


def test_packed_plan_caps_the_samples_per_micro_batch():
    lengths = [5, 9, 3, 9, 20]
    assert plan_packed_micro_batches(lengths, max_tokens=100, max_samples=None) == [[0, 1, 2, 3, 4]]
    # first-fit decreasing, 2 a bin: 20+9, 9+5, 3
    assert plan_packed_micro_batches(lengths, max_tokens=100, max_samples=2) == [[1, 4], [0, 3], [2]]
    assert plan_packed_micro_batches(lengths, max_tokens=100, max_samples=1) == [[4], [1], [3], [0], [2]]
    # both limits: the token budget of 18 splits 9+9 and 5+3 already; the cap of 1 splits them further
    assert plan_packed_micro_batches(lengths, max_tokens=18, max_samples=2) == [[4], [1, 3], [0, 2]]
    assert len(plan_packed_micro_batches(lengths, max_tokens=18, max_samples=1)) == 5


def _pack_by_lists(token_lists, response_lengths, pad_to, pad_id):
    """The row `pack` must build, written the plain way: sequence after sequence."""
    ids, pos, select, targets, cu = [], [], [], [], [0]
    for tokens, resp in zip(token_lists, response_lengths):
        start, n = len(ids), len(tokens)
        ids += tokens
        pos += range(n)
        select += range(start + n - resp - 1, start + n - 1)
        targets += tokens[n - resp :]
        cu.append(cu[-1] + n)
    missing = -len(ids) % pad_to if pad_to else 0
    while missing:  # pad sequences of at most PAD_SEGMENT tokens, which nothing scores
        n = min(missing, PAD_SEGMENT)
        ids += [pad_id] * n
        pos += range(n)
        cu.append(cu[-1] + n)
        missing -= n
    return ids, pos, cu, max(b - a for a, b in zip(cu, cu[1:])), select, targets


@pytest.mark.parametrize("pad_to", [None, 7, 64, 1000])
def test_pack_builds_the_row_sequence_by_sequence(pad_to):
    rng = random.Random(pad_to)
    for _ in range(20):
        lengths = [rng.randint(2, 300) for _ in range(rng.randint(1, 6))]
        token_lists = [[rng.randrange(2, 1000) for _ in range(n)] for n in lengths]
        responses = [rng.randint(0, n - 1) for n in lengths]  # 0 (nothing scored) up to all but the first
        mb = pack(token_lists, responses, list(range(len(lengths))), torch.device("cpu"), pad_to, pad_id=1)
        ids, pos, cu, max_len, select, targets = _pack_by_lists(token_lists, responses, pad_to, 1)
        assert mb.input_ids.tolist() == [ids] and mb.position_ids.tolist() == [pos]
        assert mb.cu_seqlens.tolist() == cu and mb.cu_seqlens.dtype == torch.int32
        assert mb.max_seqlen == max_len and mb.select.tolist() == select and mb.targets.tolist() == targets
        assert pad_to is None or mb.num_tokens % pad_to == 0


def test_shard_by_tokens_balances_tokens_not_sequences():
    lengths = [100, 10, 10, 10, 10, 60, 40]
    shards = shard_by_tokens(lengths, 2)
    assert sorted(i for s in shards for i in s) == list(range(7))
    loads = [sum(lengths[i] for i in s) for s in shards]
    assert abs(loads[0] - loads[1]) <= 10  # 240 tokens → 120 / 120
    assert shard_by_tokens(lengths, 2) == shards  # deterministic: every rank derives the same split
    assert shard_by_tokens([5], 3)[1:] == [[], []]  # fewer samples than ranks: some get none


def test_log_probs_match_full_forward(actor):
    samples = make_samples()
    got = actor.compute_log_probs(samples)
    with torch.no_grad():
        for s, lp in zip(samples, got):
            logits = actor.model(torch.tensor([s.tokens])).logits[0]
            logp = torch.log_softmax(logits.float(), -1)
            pos = torch.arange(s.prompt_length - 1, len(s.tokens) - 1)
            want = logp[pos, torch.tensor(s.response_tokens)]
            assert lp.shape == (s.response_length,)
            assert torch.allclose(lp, want, atol=1e-5)


def test_log_probs_do_not_depend_on_batch_composition(actor):
    samples = make_samples(6)
    actor.batches.max_tokens = 4096
    together = actor.compute_log_probs(samples)
    actor.batches.max_tokens = 1  # one sequence per micro-batch
    alone = actor.compute_log_probs(samples)
    actor.batches.max_tokens = 4096
    reordered = actor.compute_log_probs(samples[::-1])[::-1]
    subset = actor.compute_log_probs(samples[1:3])
    for a, b, c in zip(together, alone, reordered):
        assert torch.allclose(a, b, atol=1e-5) and torch.allclose(a, c, atol=1e-5)
    for a, b in zip(together[1:3], subset):
        assert torch.allclose(a, b, atol=1e-5)


def test_gradients_do_not_depend_on_micro_batch_size(tiny_model):
    samples = make_samples(5)
    for s in samples[:2]:  # a loss mask that skips tokens must weigh the same in every split
        s.loss_mask = [1] * (s.response_length - 1) + [0]
    advantages = [1.0, -0.5, 0.25, -1.0, 2.0]
    grads = []
    # one sequence a micro-batch by the token budget, all in one, and 2 samples at most (--micro-batch-size)
    for budget, cap, micro_batches in ((1, None, 5), (100_000, None, 1), (100_000, 2, 3)):
        a = Actor(make_args(max_tokens_per_gpu=budget, micro_batch_size=cap, entropy_coef=0.01), tiny_model)
        assert len(a.batches.plan(samples)) == micro_batches
        old = [lp - 0.05 for lp in a.compute_log_probs(samples)]  # ratio ≠ 1, so the clip is exercised too
        a.accumulate_gradients(samples, advantages, old)
        grads.append({n: p.grad.clone() for n, p in a.model.named_parameters()})
    for other in grads[1:]:
        for name, g in grads[0].items():
            assert torch.allclose(g, other[name], atol=1e-5), name
    assert any(g.abs().sum() > 0 for g in grads[0].values())


def test_the_sample_mean_loss_weighs_samples_alike_in_any_split(tiny_model):
    """--no-calculate-per-token-loss (slime's default): on-policy (ratio 1), the loss is the mean
    over samples of each sample's token mean of -A: -mean(A), whatever the responses' lengths
    (the token mean weighs them by length). A token of sample i gets the gradient -A_i / (n_i S)
    of its log-prob: the same in every micro-batch split, and not the token mean's."""
    samples = make_samples(5)
    samples[0].loss_mask = [1] * (samples[0].response_length - 1) + [0]  # n_0 counts loss tokens only
    advantages = [1.0, -0.5, 0.25, -1.0, 2.0]
    n = [sum(s.effective_loss_mask()) for s in samples]
    grads, metrics = [], []
    for budget in (1, 100_000):
        a = Actor(make_args(max_tokens_per_gpu=budget, calculate_per_token_loss=False), tiny_model)
        metrics.append(a.accumulate_gradients(samples, advantages, None))
        grads.append({k: p.grad.clone() for k, p in a.model.named_parameters()})
    for name, g in grads[0].items():
        assert torch.allclose(g, grads[1][name], atol=1e-5), name
    assert all(float(m["train/pg_loss"]) == pytest.approx(-sum(advantages) / 5, abs=1e-5) for m in metrics)
    token = Actor(make_args(), tiny_model).accumulate_gradients(samples, advantages, None)
    by_tokens = -sum(x * k for x, k in zip(advantages, n)) / sum(n)
    assert float(token["train/pg_loss"]) == pytest.approx(by_tokens, abs=1e-5)
    assert abs(by_tokens + sum(advantages) / 5) > 0.05  # the two means differ here


@pytest.fixture(scope="module")
def three_layer_model(tmp_path_factory) -> Path:
    from vime.models import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("three") / "qwen3", num_layers=3)


def test_gradient_checkpointing_recomputes_the_first_n_layers_only(three_layer_model):
    """--gradient-checkpointing-layers N: the first N decoder layers run their forward again in
    the backward (their MLP is called twice), the others once; the gradients are those of no
    checkpointing at all."""
    samples = make_samples(3)
    calls, grads = {}, {}
    for n in ("off", None, 1, 2):
        a = Actor(
            make_args(gradient_checkpointing=n != "off", gradient_checkpointing_layers=None if n == "off" else n),
            three_layer_model,
        )
        counts = [0, 0, 0]
        for i, layer in enumerate(a.model.get_decoder().layers):
            # a pre-hook: the recompute stops early, once it has made the last tensor the backward
            # needs (inside the MLP), so the MLP's forward hook would not run a second time
            layer.mlp.register_forward_pre_hook(lambda *_, i=i, c=counts: c.__setitem__(i, c[i] + 1))
        a.policy.scorer.train()  # as train_step runs it: checkpointing applies in training mode only
        a.accumulate_gradients(samples, [1.0, -0.5, 2.0], None)
        calls[n] = counts
        grads[n] = {name: p.grad.clone() for name, p in a.model.named_parameters()}
    assert calls == {"off": [1, 1, 1], None: [2, 2, 2], 1: [2, 1, 1], 2: [2, 2, 1]}
    for n in (None, 1, 2):
        for name, g in grads["off"].items():
            assert torch.allclose(g, grads[n][name], atol=1e-6), (n, name)


def long_samples(n: int, length: int = 400) -> list[Sample]:
    """Sequences long enough that a tiny model's activations outweigh its weights (~0.1M
    parameters against ~8 kB of float32 activations per token and layer), so what a forward
    keeps for the backward is mostly activations."""
    rng = random.Random(n)
    out = []
    for i in range(n):
        tokens = [rng.randrange(4, 100) for _ in range(length - 7 * i)]
        out.append(Sample(index=i, tokens=tokens, response_length=len(tokens) // 2))
    return out


def saved_bytes_and_grads(actor: Actor, samples: list[Sample], advantages: list[float]) -> tuple[int, dict]:
    """One accumulation of gradients in training mode, as train_step runs it: the bytes autograd
    kept for the backward, and the gradients as full host tensors. Under --compile transformers 5
    checkpoints inside the compiled layer, so Dynamo turns the recomputation into part of the
    compiled backward: no second Python forward runs for a hook to count, and what the forward
    keeps is what shows that the activations are recomputed."""
    saved = [0]

    def pack_hook(t: torch.Tensor) -> torch.Tensor:
        saved[0] += t.numel() * t.element_size()
        return t

    actor.optimizer_step.optimizer.zero_grad(set_to_none=True)
    actor.policy.scorer.train()  # checkpointing applies in training mode only
    with torch.autograd.graph.saved_tensors_hooks(pack_hook, lambda t: t):
        actor.accumulate_gradients(samples, advantages, None)
    grads = {}
    for name, p in actor.model.named_parameters():
        g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        grads[name] = g.detach().float().cpu().clone()
    return saved[0], grads


def relative_gap(a: dict, b: dict) -> float:
    """‖a − b‖ / ‖b‖ over all the tensors of two name → tensor maps together."""
    diff = sum(float((a[n] - b[n]).pow(2).sum()) for n in b)
    return math.sqrt(diff / sum(float(t.pow(2).sum()) for t in b.values()))


@pytest.mark.slow
def test_compiled_gradient_checkpointing_keeps_a_fraction_and_changes_no_gradient(three_layer_model):
    """--gradient-checkpointing with --compile: the forward keeps under half of what it keeps
    without checkpointing (the decoder layers' activations are recomputed in the compiled
    backward), a step after the warm-up compiles nothing new, and the gradients are those of no
    checkpointing, within float32 rounding (the two are different compiled graphs)."""
    import torch._dynamo.utils

    samples, advantages = long_samples(3), [1.0, -0.5, 2.0]
    a = Actor(make_args(max_tokens_per_gpu=1024, gradient_checkpointing=True, compile=True), three_layer_model)
    a.ready()
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    kept, checkpointed = saved_bytes_and_grads(a, samples, advantages)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs  # the warm-up compiled it
    for layer in a.model.get_decoder().layers:
        layer.gradient_checkpointing = False
    kept_plain, plain = saved_bytes_and_grads(a, samples, advantages)
    assert kept < kept_plain / 2, (kept, kept_plain)
    assert relative_gap(checkpointed, plain) < 1e-5, relative_gap(checkpointed, plain)
    assert any(float(g.abs().sum()) > 0 for g in plain.values())


def test_ref_load_is_the_reference_model(tiny_model, tmp_path):
    """--ref-load DIR: the KL's reference log-probs are DIR's model's, not the policy's start."""
    from vime.models import make_tiny_model

    other = make_tiny_model(tmp_path / "ref", seed=1)
    samples = make_samples(3)
    a = Actor(make_args(kl_loss_coef=0.1, ref_load=str(other)), tiny_model)
    ref = a.compute_log_probs(samples, scorer=a.ref_scorer)
    want = Actor(make_args(), other).compute_log_probs(samples)
    policy = a.compute_log_probs(samples)
    for r, w, p in zip(ref, want, policy):
        assert torch.allclose(r, w, atol=1e-6) and not torch.allclose(r, p, atol=1e-3)
    default = Actor(make_args(kl_loss_coef=0.1), tiny_model)
    for r, p in zip(default.compute_log_probs(samples, scorer=default.ref_scorer), policy):
        assert torch.allclose(r, p, atol=1e-6)


def test_unbiased_kl_weighs_the_same_value_with_another_gradient(tiny_model, tmp_path):
    """--use-unbiased-kl in one optimizer step: π_old is the forward's own log-probs, so ρ = 1
    and the KL loss is the same number, but ρ's gradient makes it the KL's own (test_loss), so
    the gradients differ."""
    from vime.models import make_tiny_model

    other = make_tiny_model(tmp_path / "ref", seed=1)
    samples = make_samples(3)
    out = []
    for unbiased in (False, True):
        a = Actor(make_args(kl_loss_coef=1.0, ref_load=str(other), use_unbiased_kl=unbiased), tiny_model)
        ref = a.compute_log_probs(samples, scorer=a.ref_scorer)
        m = a.accumulate_gradients(samples, [0.0, 0.0, 0.0], None, ref)  # no policy gradient: the KL's alone
        out.append((m["train/kl_loss"], {n: p.grad.clone() for n, p in a.model.named_parameters()}))
    (kl, g), (kl_unbiased, g_unbiased) = out
    assert kl > 0 and kl_unbiased == pytest.approx(kl, rel=1e-6)
    assert any(not torch.allclose(x, g_unbiased[n], atol=1e-6) for n, x in g.items())


def test_one_step_rollout_uses_the_forward_as_old_log_probs(tiny_model):
    """With one optimizer step per rollout the recompute pass is skipped: the training
    forward's detached log-probs are the old ones, which must give the recompute's gradient
    and metrics (TIS included) exactly."""
    samples = make_samples(3)
    results = []
    for given in (True, False):
        a = Actor(make_args(use_tis=True, entropy_coef=0.01), tiny_model)
        for s in samples:
            s.rollout_log_probs = [float(x) - 0.3 for x in a.compute_log_probs([s])[0]]  # an older policy sampled them
        old = a.compute_log_probs(samples) if given else None
        metrics = a.accumulate_gradients(samples, [1.0, -0.5, 2.0], old)
        results.append(({n: p.grad.clone() for n, p in a.model.named_parameters()}, metrics))
    (g_given, m_given), (g_fwd, m_fwd) = results
    for name, g in g_given.items():
        assert torch.allclose(g, g_fwd[name], atol=1e-6), name
    for k in ("train/loss", "train/tis", "train/_lp_diff_sum"):
        assert m_given[k] == pytest.approx(m_fwd[k], abs=1e-6), k
    assert m_fwd["train/tis"] > 1.2  # the 0.3 nat gap was weighed in, truncated at 2


def test_use_rollout_logprobs_takes_the_ratio_against_the_engine(tiny_model):
    """Coupled PPO: with the engine's log-probs 0.3 nat below the trainer's, the ratio is
    e^0.3 = 1.35 on every token; with A = +1 the clip (1.2) is the active side everywhere, so
    pg_loss = -1.2, clipfrac 1, ppo_kl = mean(old - new) = -0.3 and no gradient. Against the
    trainer's own weights (the default) the ratio is 1: pg_loss -1, nothing clipped."""
    samples = make_samples(3)
    out = {}
    for coupled in (True, False):
        a = Actor(make_args(use_rollout_logprobs=coupled), tiny_model)
        for s in samples:
            s.rollout_log_probs = [float(x) - 0.3 for x in a.compute_log_probs([s])[0]]
        m = a.accumulate_gradients(samples, [1.0, 1.0, 1.0], None)
        out[coupled] = (m, sum(float(p.grad.abs().sum()) for p in a.model.parameters() if p.grad is not None))
    (m, grad), (m_prox, grad_prox) = out[True], out[False]
    assert m["train/pg_loss"] == pytest.approx(-1.2, abs=1e-5) and m["train/pg_clipfrac"] == 1.0
    assert m["train/ppo_kl"] == pytest.approx(-0.3, abs=1e-5) and grad == 0.0
    # the trainer/engine gap is still measured against the trainer's own log-probs
    assert m["train/_lp_diff_sum"] / m["train/_lp_diff_count"] == pytest.approx(0.3, abs=1e-5)
    assert (
        m_prox["train/pg_loss"] == pytest.approx(-1.0, abs=1e-5)
        and m_prox["train/pg_clipfrac"] == 0.0
        and grad_prox > 0
    )


def test_dual_clip_caps_a_far_off_policy_token_in_a_train_step(tiny_model):
    """--eps-clip-c through the trainer: with the engine's log-probs 3 nats below the trainer's
    (ratio e^3 = 20) and A = -1 everywhere, PPO's loss per token is 20 (the unclipped side); the
    dual clip at c = 3 caps every token at 3: no gradient, everything counted as capped.
    Without it the loss is 20 and the gradient is not zero."""
    samples = make_samples(2)
    out = {}
    for c in (3.0, None):
        a = Actor(make_args(use_rollout_logprobs=True, eps_clip_c=c), tiny_model)
        for s in samples:
            s.rollout_log_probs = [float(x) - 3.0 for x in a.compute_log_probs([s])[0]]
        m = a.accumulate_gradients(samples, [-1.0, -1.0], None)
        out[c] = (m, sum(float(p.grad.abs().sum()) for p in a.model.parameters() if p.grad is not None))
    (m, grad), (m_plain, grad_plain) = out[3.0], out[None]
    assert m["train/pg_loss"] == pytest.approx(3.0, abs=1e-4) and m["train/pg_clipfrac_lower"] == 1.0 and grad == 0.0
    assert m_plain["train/pg_loss"] == pytest.approx(math.exp(3.0), rel=1e-4) and grad_plain > 0
    assert "train/pg_clipfrac_lower" not in m_plain


@pytest.mark.parametrize(
    "global_batch_size, extra",
    [
        (None, {}),
        (2, {"advantage_estimator": "dr_grpo", "tis_mode": "mask", "use_unbiased_kl": True}),
        (None, {"use_rollout_logprobs": True, "use_tis": False, "use_rs": False}),
    ],
)
def test_the_gradient_taken_in_the_head_forward_trains_the_same_weights(tiny_model, global_batch_size, extra):
    """The default path (the loss's gradient taken per head chunk inside the forward,
    `chunked_loss`) and log-probs first, loss after (the path sequence-level rejection needs)
    train the same weights bit for bit, with every loss term on and several chunks per
    micro-batch: with one optimizer step (old log-probs = the forward's own), with two (Dr.GRPO's
    constant denominator, IcePop's TIS mask), and coupled to the engine's log-probs."""
    assert not Actor(
        make_args(use_rs=True, rs_level="sequence", rollout_max_response_len=16), tiny_model
    ).optimizer_step.grad_in_forward
    samples = make_samples(4)
    results = []
    for in_forward in (True, False):
        a = Actor(
            make_args(
                logprob_chunk_size=3,
                global_batch_size=global_batch_size,
                kl_loss_coef=0.1,
                entropy_coef=0.01,
                **{"use_tis": True, "use_rs": True, **extra},
                max_tokens_per_gpu=30,
            ),
            tiny_model,
        )
        assert a.optimizer_step.grad_in_forward
        a.optimizer_step.grad_in_forward = in_forward
        before = {n: p.detach().clone() for n, p in a.model.named_parameters()}
        g = torch.Generator().manual_seed(1)
        for s in samples:  # an older policy sampled them: some tokens outside the rejection band
            lp = a.compute_log_probs([s])[0]
            s.rollout_log_probs = (lp + torch.randn(len(lp), generator=g)).tolist()
        metrics = a.train_step(samples, [1.0, -0.5, 2.0, -1.0])
        results.append((metrics, {n: p.detach().clone() for n, p in a.model.named_parameters()}))
    (m_fwd, w_fwd), (m_after, w_after) = results
    assert all(torch.equal(w, w_after[n]) for n, w in w_fwd.items())
    assert any(not torch.equal(w, before[n]) for n, w in w_fwd.items())
    if a.objective.correction.settings.use_rs:
        assert 0 < m_fwd["train/rs_dropfrac"] < 1
    if global_batch_size:  # the policy leaves the reference at the first of the two steps
        assert m_fwd["train/kl_loss"] > 0
    for k, v in m_after.items():
        if k.startswith("train/"):  # not the timings
            assert m_fwd[k] == pytest.approx(v, rel=1e-5, abs=1e-7), k


@pytest.mark.slow
def test_compiled_layers_match_eager(tiny_model):
    """--compile (torch.compile per decoder layer, dynamic shapes) changes speed, not results:
    same log-probs and gradients over micro-batches of two different packed lengths."""
    samples = make_samples(5)
    results = []
    for compiled in (False, True):
        a = Actor(make_args(compile=compiled, max_tokens_per_gpu=60), tiny_model)
        lps = a.compute_log_probs(samples)
        a.accumulate_gradients(samples, [1.0, -0.5, 0.25, -1.0, 2.0], None)
        results.append((lps, {n: p.grad.clone() for n, p in a.model.named_parameters()}))
    (lp_e, g_e), (lp_c, g_c) = results
    assert all(torch.allclose(x, y, atol=1e-5) for x, y in zip(lp_e, lp_c))
    for name, g in g_e.items():
        assert torch.allclose(g, g_c[name], atol=1e-5), name


def test_train_step_moves_log_probs_with_the_advantage(tiny_model):
    a = Actor(make_args(), tiny_model)
    samples = make_samples(2)
    for s in samples:
        s.rollout_log_probs = [-4.0] * s.response_length
    before = [float(lp.sum()) for lp in a.compute_log_probs(samples)]
    metrics = a.train_step(samples, [1.0, -1.0])
    after = [float(lp.sum()) for lp in a.compute_log_probs(samples)]
    assert after[0] > before[0] and after[1] < before[1]
    for k in [
        "train/loss",
        "train/pg_loss",
        "train/pg_clipfrac",
        "train/ppo_kl",
        "train/entropy",
        "train/grad_norm",
        "train/lr",
        "train/train_rollout_logprob_abs_diff",
    ]:
        assert k in metrics, k
    assert metrics["train/pg_clipfrac"] == 0.0 and abs(metrics["train/ppo_kl"]) < 1e-6  # one step: on-policy, ratio 1
    assert metrics["train/lr"] == 1e-3


def test_train_step_splits_into_global_batches_with_kl_tis_and_dr_grpo(tiny_model):
    a = Actor(make_args(global_batch_size=2, kl_loss_coef=0.1, use_tis=True, advantage_estimator="dr_grpo"), tiny_model)
    assert a.ref_scorer is not None
    samples = make_samples(4)
    for s in samples:
        s.rollout_log_probs = [float(x) for x in a.compute_log_probs([s])[0]]
    metrics = a.train_step(samples, [1.0, -1.0, 0.5, -0.5])
    assert a.optimizer_step.optimizer.state_dict()["state"][0]["step"] == 2  # 4 samples / global batch 2
    assert metrics["train/kl_loss"] >= 0 and metrics["train/tis"] > 0
    assert metrics["train/train_rollout_logprob_abs_diff"] < 1e-5
    with pytest.raises(ValueError):
        a.train_step(samples[:3], [0.0] * 3)


def test_train_step_splits_its_diagnostics_by_staleness(tiny_model):
    """Tokens drawn 0, 1 and 5 versions before the trained one land in buckets 0, 1 and 4+;
    each bucket's log-prob gap is that of its own tokens, and a sample with no versions is in
    none of them."""
    a = Actor(make_args(use_tis=True), tiny_model)
    a.optimizer_step.count = 5  # the policy version this step trains
    samples = make_samples(4)
    exact = a.compute_log_probs(samples)
    gaps = {0: 0.0, 1: 0.3, 4: 1.0}
    for s, lp, (bucket, version) in zip(samples, exact, [(0, 5), (1, 4), (4, 0), (None, None)]):
        s.rollout_log_probs = [float(x) - gaps.get(bucket, 0.0) for x in lp]
        s.weight_versions = None if version is None else [version] * s.response_length
    m = a.train_step(samples, [1.0, -1.0, 0.5, -0.5])
    assert set(k.split("/")[1] for k in m if k.startswith("stale/")) == {"0", "1", "4+"}
    for bucket, label in ((0, "0"), (1, "1"), (4, "4+")):
        assert abs(m[f"stale/{label}/train_rollout_logprob_abs_diff"] - gaps[bucket]) < 1e-4, label
        assert abs(m[f"stale/{label}/log_ratio_sq"] - gaps[bucket] ** 2) < 1e-4, label
    assert abs(m["stale/4+/is_weight"] - 2.0) < 1e-4  # e^1 truncated at --tis-clip 2
    assert m["stale/4+/is_clipfrac"] == 1.0 and m["stale/0/is_clipfrac"] == 0.0
    lengths = [s.response_length for s in samples]
    assert m["stale/1/response_len"] == lengths[1] and m["stale/4+/response_len"] == lengths[2]
    shares = [m[f"stale/{b}/token_share"] for b in ("0", "1", "4+")]
    assert abs(sum(shares) - 1.0) < 1e-6 and abs(shares[0] - lengths[0] / sum(lengths[:3])) < 1e-6
    drift = sum(share * gaps[bucket] ** 2 for share, bucket in zip(shares, (0, 1, 4)))  # the token mean over all
    assert abs(m["train/log_ratio_sq"] - drift) < 1e-4
    assert not any(k.startswith("train/_stale") for k in m)


def test_the_sft_loss_is_the_token_mean_nll_and_falls(tiny_model):
    """--loss-type sft_loss: the step's loss is the mean over its loss tokens of -log π (one step
    per rollout, so before the step), and a few steps on the same samples lower it."""
    a = Actor(make_args(lr=1e-2, loss_type="sft_loss"), tiny_model)
    samples = make_samples(3)
    samples[1].loss_mask = [0] + [1] * (samples[1].response_length - 1)  # a token out of the loss
    lps = a.compute_log_probs(samples)
    masks = [torch.tensor(s.effective_loss_mask(), dtype=torch.float32) for s in samples]
    nll = float(-sum((lp * m).sum() for lp, m in zip(lps, masks)) / sum(m.sum() for m in masks))
    first = a.train_step(samples, [0.0] * 3)
    assert first["train/sft_loss"] == pytest.approx(nll, rel=1e-5) and first["train/loss"] == first["train/sft_loss"]
    for _ in range(4):
        last = a.train_step(samples, [0.0] * 3)["train/sft_loss"]
    assert last < first["train/sft_loss"]


def test_save_load_roundtrip_and_hf_loadable(tiny_model, tmp_path):
    a = Actor(make_args(), tiny_model)
    a.train_step(make_samples(2), [1.0, -1.0])
    ckpt = a.save(tmp_path / "ckpt" / "1", {"step": 1, "data_source": {"offset": 7}})
    weights = {n: t.clone() for n, t in a.model.state_dict().items()}
    opt = a.optimizer_step.optimizer.state_dict()
    rng = torch.get_rng_state()

    b = Actor(make_args(), tiny_model)
    torch.rand(3)  # move the RNG on; load must bring it back
    extra = b.load(ckpt)
    assert extra == {"step": 1, "data_source": {"offset": 7}}
    for n, t in b.model.state_dict().items():
        assert torch.equal(t, weights[n]), n
    got = b.optimizer_step.optimizer.state_dict()

    def groups(sd):  # the name-keyed round trip may turn the betas tuple into a list
        return [{k: list(v) if isinstance(v, tuple) else v for k, v in g.items()} for g in sd["param_groups"]]

    assert groups(got) == groups(opt)
    for pid, st in opt["state"].items():
        for k, v in st.items():
            assert torch.equal(got["state"][pid][k], v), (pid, k)
    assert torch.equal(torch.get_rng_state(), rng)

    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(ckpt)
    for n, t in hf.state_dict().items():
        assert torch.equal(t, weights[n]), n
    assert (ckpt / "tokenizer.json").exists()
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["1"]  # no .tmp / .old left


class _RunsCode:
    """Unpickling it makes a directory: a stand-in for whatever command a crafted file would run."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (os.mkdir, (str(self.path),))


def test_a_crafted_trainer_state_is_refused_before_it_runs_anything(tiny_model, tmp_path):
    from vime.trainer.checkpoint import CheckpointError

    ckpt = Actor(make_args(), tiny_model).save(tmp_path / "ckpt" / "1", {"step": 1})
    state = torch.load(ckpt / "trainer_state.pt", weights_only=True)  # what vime writes is plain data
    marker = tmp_path / "ran"
    torch.save({**state, "extra": _RunsCode(marker)}, ckpt / "trainer_state.pt")
    with pytest.raises(
        CheckpointError, match=r"asks to run \S*mkdir when loaded; vime loads checkpoints as plain data"
    ) as e:
        Actor(make_args(), tiny_model).load(ckpt)
    assert "\n" not in str(e.value)
    assert not marker.exists()


def test_a_checkpoint_of_an_older_vime_with_numpys_rng_array_still_resumes(tiny_model, tmp_path):
    import numpy as np

    ckpt = Actor(make_args(), tiny_model).save(tmp_path / "ckpt" / "1", {"step": 1})
    np.random.seed(5)
    expected = np.random.rand(3)
    np.random.seed(5)
    state = torch.load(ckpt / "trainer_state.pt", weights_only=True)
    torch.save({**state, "rng": {**state["rng"], "numpy": np.random.get_state()}}, ckpt / "trainer_state.pt")
    np.random.seed(6)
    assert Actor(make_args(), tiny_model).load(ckpt) == {"step": 1}
    assert np.array_equal(np.random.rand(3), expected)


def test_interrupted_save_keeps_the_previous_checkpoint(tiny_model, tmp_path, monkeypatch):
    a = Actor(make_args(), tiny_model)
    ckpt = a.save(tmp_path / "5", {"step": 5})
    saved = {n: t.clone() for n, t in a.model.state_dict().items()}
    a.train_step(make_samples(2), [1.0, -1.0])  # the weights move on

    def crash(*args, **kwargs):
        raise KeyboardInterrupt("killed mid-save")

    monkeypatch.setattr(actor_mod.torch, "save", crash)  # dies after the weights, before trainer_state.pt
    with pytest.raises(KeyboardInterrupt):
        a.save(ckpt, {"step": 6})
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["5"]
    b = Actor(make_args(), tiny_model)
    assert b.load(ckpt) == {"step": 5}
    for n, t in b.model.state_dict().items():
        assert torch.equal(t, saved[n]), n


def names_in_file(model_dir: Path) -> list[str]:
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        return sorted(f.keys())


def test_named_weights_match_checkpoint_keys(actor, tiny_model, tmp_path):
    assert sorted(n for n, _ in actor.named_weights()) == names_in_file(tiny_model)
    from vime.models import make_tiny_model

    tied_dir = make_tiny_model(tmp_path / "tied", tie_word_embeddings=True)
    tied = Actor(make_args(), tied_dir)
    names = sorted(n for n, _ in tied.named_weights())
    assert "lm_head.weight" not in names and names == names_in_file(tied_dir)


class RecordingClient:
    """Stands in for EngineClient: records each push and reads the weights while they exist."""

    url = "recording"

    def __init__(self) -> None:
        self.calls: list[dict] = []

    def model_info(self) -> dict:
        return {"dtype": "float32"}  # a disk push is written in the engines' dtype

    def _read(self, path: Path) -> dict[str, torch.Tensor]:
        with safe_open(str(path), framework="pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (a safetensors handle, not a dict)

    def update_weights_from_tensor(self, payload: dict, timeout: float | None = None) -> dict:
        self.calls.append({**payload, "tensors": self._read(Path(payload["path"]))})
        return {"success": True}

    def update_weights_from_disk(
        self, model_path: str, weight_version: int | None = None, timeout: float | None = None
    ) -> dict:
        self.calls.append(
            {
                "model_path": model_path,
                "weight_version": weight_version,
                "tensors": self._read(Path(model_path) / "model.safetensors"),
            }
        )
        return {"success": True}


@pytest.mark.parametrize("transport", ["shm", "disk", "auto"])
def test_weight_push_writes_once_and_cleans_up(actor, transport, tmp_path):
    clients = [RecordingClient(), RecordingClient()]
    pusher = WeightPusher(clients, transport=transport, tmp_dir=tmp_path / "w", check=False)  # no engine to ask
    (tmp_path / "w").mkdir(exist_ok=True)
    metrics = pusher.push(actor.named_weights(), version=3)
    expected = dict(actor.named_weights())
    assert metrics["perf/update_weights_bytes"] == sum(t.numel() * t.element_size() for t in expected.values())
    for c in clients:
        (call,) = c.calls
        assert call["weight_version"] == 3
        if transport != "disk":
            assert call["transport"] == "shm"  # auto on CPU weights
        assert sorted(call["tensors"]) == sorted(expected)
        assert all(torch.equal(call["tensors"][n], t) for n, t in expected.items())
    paths = {c.calls[0].get("path") or c.calls[0]["model_path"] for c in clients}
    assert len(paths) == 1  # written once for all engines
    assert list((tmp_path / "w").iterdir()) == []  # and removed after the push


def test_step_without_loss_tokens_leaves_weights_alone(tiny_model):
    a = Actor(make_args(), tiny_model)
    a.train_step(make_samples(2), [1.0, -1.0])  # AdamW now has momentum
    before = {n: t.clone() for n, t in a.model.state_dict().items()}
    samples = make_samples(2)
    for s in samples:
        s.loss_mask = [0] * s.response_length
    metrics = a.train_step(samples, [1.0, -1.0])
    assert metrics["train/grad_norm"] == 0.0
    assert all(torch.equal(t, before[n]) for n, t in a.model.state_dict().items())


def test_packed_batch_matches_padded_hf_forward_log_probs_and_gradients(tiny_model):
    """One packed row (no padding, positions restarting, attention cut at sequence ends) gives
    the log-probs and parameter gradients of HF's own padded SDPA forward with full logits
    (float32; atol 1e-5 on log-probs and gradients)."""
    from transformers import AutoModelForCausalLM

    samples = make_samples(5)
    weights = [
        torch.randn(s.response_length, generator=torch.Generator().manual_seed(i)) for i, s in enumerate(samples)
    ]

    a = Actor(make_args(max_tokens_per_gpu=100_000), tiny_model)
    (idx,) = a.batches.plan(samples)  # every sample in one packed micro-batch
    mb = a.batches.pack(samples, idx)
    assert mb.input_ids.shape == (1, sum(len(s.tokens) for s in samples))
    packed, _ = a.policy.scorer(mb, 1.0, False)
    order = mb.indices
    (packed * torch.cat([weights[i] for i in order])).sum().backward()

    ref = AutoModelForCausalLM.from_pretrained(str(tiny_model), attn_implementation="sdpa")
    width = max(len(s.tokens) for s in samples)
    ids = torch.zeros(len(samples), width, dtype=torch.long)
    mask = torch.zeros(len(samples), width, dtype=torch.long)
    for b, s in enumerate(samples):
        ids[b, : len(s.tokens)] = torch.tensor(s.tokens)
        mask[b, : len(s.tokens)] = 1
    log_p = torch.log_softmax(ref(input_ids=ids, attention_mask=mask).logits.float(), -1)
    per_sample = [
        log_p[b, torch.arange(s.prompt_length - 1, len(s.tokens) - 1), torch.tensor(s.response_tokens)]
        for b, s in enumerate(samples)
    ]
    sum((lp * w).sum() for lp, w in zip(per_sample, weights)).backward()

    for got, i in zip(packed.split(mb.response_lengths), order):
        assert torch.allclose(got, per_sample[i], atol=1e-5)
    ref_grads = dict(ref.named_parameters())
    for name, p in a.model.named_parameters():
        assert torch.allclose(p.grad, ref_grads[name].grad, atol=1e-5), name


@pytest.mark.slow
def test_compiled_trainer_compiles_once_for_any_lengths(tiny_model):
    """--compile: micro-batches are padded to one of a few sizes, all compiled before the first
    step, and the per-sequence attention is one opaque op, so steps of other lengths and sequence
    counts (training and scoring) compile nothing; and padding changes no log-prob (pad tokens
    are sequences of their own that nothing scores). OPD scores the policy, so its warm-up
    compiles the scoring forward too."""
    import torch._dynamo.utils

    eager = Actor(make_args(max_tokens_per_gpu=64), tiny_model)
    compiled = Actor(make_args(max_tokens_per_gpu=64, compile=True, use_opd=True, opd_type="sglang"), tiny_model)
    assert compiled.warm_up.scoring
    compiled.ready()  # one rank compiles on a thread of its own (vime/trainer/warm_up.py)
    warm = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    counts = []
    for step, n in enumerate((6, 3, 9, 2)):  # 6 to 9 sequences in 1 to 3 micro-batches of other lengths
        samples = make_samples(n, seed=step)
        before = [p.detach().clone() for p in compiled.model.parameters()]
        compiled.train_step(samples, [1.0 if i % 2 else -1.0 for i in range(n)])
        assert any(not torch.equal(b, p) for b, p in zip(before, compiled.model.parameters()))
        counts.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    eager.model.load_state_dict(compiled.model.state_dict())
    samples = make_samples(5, seed=9)
    for a, b in zip(eager.compute_log_probs(samples), compiled.compute_log_probs(samples)):
        assert torch.allclose(a, b, atol=1e-5)
    counts.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    assert warm > 0 and counts == [warm] * 5, (warm, counts)  # every graph made by the warm-up


def test_default_grpo_warm_up_leaves_the_scoring_forward_out(tiny_model, caplog):
    """One optimizer step per rollout scores nothing (the training forward's log-probs are π_old),
    so the warm-up compiles the training graphs alone: a step compiles nothing after it, and a
    scoring call made anyway compiles its graph then and says so once. Several steps per
    rollout recompute π_old, so that warm-up compiles the scoring forward as well."""
    import torch._dynamo.utils

    counter = torch._dynamo.utils.counters["stats"]
    several = Actor(make_args(global_batch_size=8, n_samples_per_prompt=8, rollout_batch_size=2), tiny_model)
    assert several.settings.steps_per_rollout == 2 and several.scores_the_policy()
    torch._dynamo.reset()  # count this warm-up's graphs from none, not reuse an earlier test's
    before = counter["unique_graphs"]
    actor = Actor(make_args(max_tokens_per_gpu=64, compile=True), tiny_model)
    actor.ready()
    warm = counter["unique_graphs"] - before
    assert not actor.warm_up.scoring and warm > 0
    samples = make_samples(6, seed=1)
    weights = [p.detach().clone() for p in actor.model.parameters()]
    actor.train_step(samples, [1.0 if i % 2 else -1.0 for i in range(6)])
    assert any(not torch.equal(w, p) for w, p in zip(weights, actor.model.parameters()))
    assert counter["unique_graphs"] - before == warm  # the step met only warmed graphs
    with caplog.at_level(logging.INFO, logger="vime"):
        actor.compute_log_probs(samples)
        actor.compute_log_probs(samples)
    assert counter["unique_graphs"] - before > warm  # the scoring graph, compiled at its first call
    assert sum("scoring forward now" in r.getMessage() for r in caplog.records) == 1


def test_a_trainer_closed_before_its_first_step_stops_compiling(tiny_model):
    """One rank compiles on a thread of its own (vime/trainer/warm_up.py); a run that ends before
    step 1 closes the trainer, which stops that compile and waits for it, so no compile runs
    on while the process group and the process go."""
    actor = Actor(make_args(max_tokens_per_gpu=64, compile=True), tiny_model)
    actor.close()  # at once (in a process that compiled these layers before, the warm-up may be done)
    assert not actor.compiling


def test_a_closed_trainer_is_freed_with_its_last_reference(tiny_model):
    """A closed Actor goes (its model, optimizer state and, on a GPU, their memory) when its
    last reference does, not at Python's next cycle collection: none of its parts refers back to
    it (the compile warm-up holds the optimizer step, not the Actor). A bench that builds one
    trainer after another ran out of GPU memory at 4B on the one before it."""
    import gc
    import weakref

    actor = Actor(make_args(max_tokens_per_gpu=64, compile=True), tiny_model)
    actor.train_step(make_samples(2), [1.0, -1.0])
    ref = weakref.ref(actor)
    actor.close()
    gc.disable()
    try:
        del actor
        assert ref() is None
    finally:
        gc.enable()


def test_triton_head_in_interpreter():
    """The LM head's Triton kernels (what CUDA runs) against its PyTorch math, float32 and
    bfloat16, under the Triton interpreter on CPU tensors: log-probs, entropies and both
    gradients, over chunks with a short last one and a vocabulary that no block size divides; and
    from a plain `.sum()`, whose gradient autograd hands over as one number of stride 0. And the
    trainer's float32 += bfloat16 gradient accumulation (`model.accumulate`): bit for bit
    PyTorch's add, at sizes no block divides."""
    pytest.importorskip("triton")
    env = {
        **os.environ,
        "TRITON_INTERPRET": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [os.getcwd(), "tests", os.environ.get("PYTHONPATH")])),
    }
    proc = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]


def _interpreted_head_checks() -> None:
    from test_engine import _patch_triton_interpreter

    from vime.trainer import logprobs

    _patch_triton_interpreter()
    torch.manual_seed(0)
    for dtype, atol in ((torch.float32, 1e-5), (torch.bfloat16, 1e-3)):
        h = torch.randn(37, 16).to(dtype).requires_grad_()
        w = (torch.randn(5003, 16) / 4).to(dtype).requires_grad_()
        y = torch.randint(0, 5003, (37,))
        up_lp, up_ent = torch.randn(37), torch.randn(37)
        for weighted in (True, False):
            runs = []
            for fns in (
                (logprobs._stats_triton, logprobs._grad_logits_triton),
                (logprobs._stats, logprobs._grad_logits),
            ):
                logprobs._fused = lambda device, fns=fns: fns
                lp, ent = logprobs.chunked_log_probs(h, w, y, temperature=0.7, with_entropy=True, chunk_size=16)
                loss = (lp * up_lp).sum() + (ent * up_ent).sum() if weighted else lp.sum() + ent.sum()
                runs.append((lp, ent, *torch.autograd.grad(loss, [h, w])))
            for a, b in zip(*runs):
                err = (a.float() - b.float()).abs().max()
                assert torch.allclose(a.float(), b.float(), atol=atol, rtol=1e-3), (dtype, weighted, err)


def _interpreted_accumulate_checks() -> None:
    from vime.trainer.model import accumulate

    torch.manual_seed(0)
    for n in (1, 8191, 8192 * 2 + 5):
        acc, grad = torch.randn(n), torch.randn(n).bfloat16()
        want = acc + grad
        accumulate(acc, grad)
        assert torch.equal(acc, want), n


def test_a_step_is_scored_at_the_temperature_its_samples_were_drawn_at(tiny_model):
    """The temperature is the sample's (stamped by the generate that drew it), not the
    trainer's own reading of --rollout-temperature: a sample drawn at 0.5 scores as an actor
    configured for 0.5 scores it, unstamped samples fall back to the flag, and a step drawn at
    two temperatures is refused in one line."""
    from vime.config import ConfigError

    at_one, at_half = (
        Actor(make_args(rollout_temperature=1.0), tiny_model),
        Actor(make_args(rollout_temperature=0.5), tiny_model),
    )
    stamped = make_samples(3)
    for s in stamped:
        s.temperature = 0.5
    want = at_half.compute_log_probs(make_samples(3))
    got = at_one.compute_log_probs(stamped)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert not all(torch.equal(a, b) for a, b in zip(at_one.compute_log_probs(make_samples(3)), want))
    stamped[0].temperature = 0.7
    with pytest.raises(ConfigError, match=r"drawn at temperatures \[0.5, 0.7\]"):
        at_one.train_step(stamped, [1.0, -1.0, 0.5])


if __name__ == "__main__":
    _interpreted_head_checks()
    _interpreted_accumulate_checks()


def test_a_sliding_window_model_is_scored_exactly_within_its_window_and_refused_beyond(tmp_path):
    """A model whose layers attend through a sliding window (here Qwen2's, 24 positions, every
    layer): vime's packed attention is full causal attention, the model's own at every position
    a sequence of up to 25 tokens is scored at (the last token is predicted, not attended from),
    so those score as HF's eager forward with its sliding mask does; a longer one, whose scores
    the window changes, is refused in one line rather than scored under other attention."""
    import json

    from transformers import AutoModelForCausalLM

    from vime.models import ModelError, make_tiny_model

    path = make_tiny_model(tmp_path / "m", arch="qwen2", seed=0)
    config = json.loads((path / "config.json").read_text())
    config.update(use_sliding_window=True, sliding_window=24, max_window_layers=0, layer_types=None)
    (path / "config.json").write_text(json.dumps(config))
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, attn_implementation="eager")
    assert set(hf.config.layer_types) == {"sliding_attention"}
    trainer = Actor(make_args(), path)
    rng = random.Random(0)
    tokens = [rng.randrange(4, 100) for _ in range(26)]
    with torch.no_grad():
        logp = {n: torch.log_softmax(hf(torch.tensor([tokens[:n]])).logits[0].float(), -1) for n in (25, 26)}
    want = logp[25][torch.arange(14, 24), torch.tensor(tokens[15:25])]
    assert torch.allclose(
        trainer.compute_log_probs([Sample(index=0, tokens=tokens[:25], response_length=10)])[0], want, atol=1e-5
    )
    # at 26 tokens the window masks the first token from the last position scored
    with torch.no_grad():
        full = trainer.model(torch.tensor([tokens])).logits[0].float().log_softmax(-1)[24, tokens[25]]
    assert abs(float(full) - float(logp[26][24, tokens[25]])) > 1e-4
    longer = [Sample(index=0, tokens=tokens, response_length=11)]
    with pytest.raises(ModelError, match="a sequence of 26 tokens is scored with attention over 25 of them") as e:
        trainer.compute_log_probs(longer)
    assert "\n" not in str(e.value)
    with pytest.raises(ModelError, match="sliding window of 24"):
        trainer.train_step(longer, [1.0])


def test_a_run_whose_prompts_and_responses_outgrow_the_window_is_refused_at_start_up(tmp_path):
    """The trainer's refusal above comes when the first long sample arrives, hours in perhaps:
    start-up already knows the longest prompt and --rollout-max-response-len, so a run that can
    make a sequence past the window is refused before step 1, naming the flags, and one that
    cannot starts."""
    import json
    import re

    from vime.config import ConfigError, parse_args
    from vime.models import make_tiny_model
    from vime.preflight import check_inputs

    path = make_tiny_model(tmp_path / "m", arch="qwen2", seed=0)
    config = json.loads((path / "config.json").read_text())
    config.update(use_sliding_window=True, sliding_window=24, max_window_layers=0, layer_types=None)
    (path / "config.json").write_text(json.dumps(config))
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"input": p, "label": "1"}) + "\n" for p in ("1+2=", "11+22=", "3+4=")))
    base = ["--hf-checkpoint", str(path), "--prompt-data", str(data), "--rm-type", "math"]
    # engines by URL (one that runs windowed attention): the built-in engine refuses such a model itself
    base += ["--runs-dir", str(tmp_path / "runs"), "--num-rollout", "1", "--rollout-engine-urls", "http://127.0.0.1:9"]
    with pytest.raises(ConfigError) as e:
        check_inputs(parse_args([*base, "--rollout-max-response-len", "32"]))
    prompt = int(re.search(r"the longest prompt of --prompt-data \((\d+) tokens\)", str(e.value))[1])
    assert f"--rollout-max-response-len 32 makes up to {prompt + 32} tokens" in str(e.value)
    assert "sliding window of 24" in str(e.value) and "\n" not in str(e.value)
    check_inputs(parse_args([*base, "--rollout-max-response-len", str(25 - prompt)])).rewards.close()
    with pytest.raises(ConfigError, match="makes up to 26 tokens"):
        check_inputs(parse_args([*base, "--rollout-max-response-len", str(26 - prompt)]))
    # the context's own bound, named in the refusal, lets the long responses be
    check_inputs(
        parse_args([*base, "--rollout-max-response-len", "32", "--rollout-max-context-len", "25"])
    ).rewards.close()
    # nothing is trained with --debug-rollout-only: no trainer to refuse it
    check_inputs(parse_args([*base, "--rollout-max-response-len", "32", "--debug-rollout-only"])).rewards.close()


def test_a_model_whose_attention_or_logits_take_another_form_is_refused_in_one_line(tmp_path):
    """Gemma 2 soft-caps its final logits and its attention scores: the chunked head and the
    packed attention compute neither, so such a model is refused when the trainer starts (the
    attention by the load's packed forward) rather than trained as another model."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    from vime.models import ModelError, make_tiny_tokenizer

    tokenizer = make_tiny_tokenizer()

    def gemma2(name: str, **overrides) -> Path:
        config = Gemma2Config(
            vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=64, **overrides,
        )  # fmt: skip
        Gemma2ForCausalLM(config).save_pretrained(tmp_path / name)
        tokenizer.save_pretrained(tmp_path / name)
        return tmp_path / name

    for path, match in (
        (gemma2("head", attn_logit_softcapping=None), "applies final_logit_softcapping=30.0 to its logits"),
        (
            gemma2("attention", final_logit_softcapping=None),
            r"attention takes softcap \(Gemma 2's logit soft-capping\)",
        ),
    ):
        with pytest.raises(ModelError, match=match) as e:
            Actor(make_args(), path)
        assert "\n" not in str(e.value)
    plain = Actor(make_args(), gemma2("plain", attn_logit_softcapping=None, final_logit_softcapping=None))
    assert len(plain.compute_log_probs(make_samples(2))) == 2


@pytest.mark.parametrize("model_type", ["stablelm", "nemotron", "bloom"])
def test_a_model_whose_layers_let_packed_sequences_see_each_other_is_refused_at_load(tmp_path, model_type):
    """StableLM's and Nemotron's decoder layers call their attention without the packed-sequence
    boundaries; Bloom never calls the attention interface: each would score every sequence of a
    micro-batch of two or more against its neighbours too. The load's probe (two sequences
    packed against each alone) refuses them; a Qwen3 passes it by four orders of magnitude."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from vime.models import ModelError
    from vime.trainer.model import PACKING_TOLERANCE, forward_gaps, load_model

    sizes = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2)
    sizes.update(num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **sizes)).save_pretrained(tmp_path / "m")
    with pytest.raises(ModelError, match="lets sequences packed into one row change each other's hidden states") as e:
        load_model(tmp_path / "m", torch.device("cpu"))
    assert "\n" not in str(e.value)
    AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen3", **sizes)).save_pretrained(tmp_path / "q")
    assert (
        max(forward_gaps(load_model(tmp_path / "q", torch.device("cpu")), torch.device("cpu")))
        < PACKING_TOLERANCE / 1e2
    )


def _hf_scores(path: Path, sample: Sample) -> torch.Tensor:
    """The sample's response log-probs from transformers' own eager forward of it alone."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        logp = torch.log_softmax(hf(torch.tensor([sample.tokens])).logits[0].float(), -1)
    n = len(sample.tokens)
    return logp[torch.arange(sample.prompt_length - 1, n - 1), torch.tensor(sample.response_tokens)]


def _tiny(tmp_path: Path, model_type: str, **config) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    from vime.models import make_tiny_tokenizer

    tokenizer = make_tiny_tokenizer()
    sizes = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=96, num_hidden_layers=2)
    sizes.update(num_attention_heads=4, num_key_value_heads=2, pad_token_id=0)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **sizes, **config)).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    return tmp_path


def test_longrope_sequences_on_either_side_of_its_switch_are_never_packed_together(tmp_path):
    """Phi-3's LongRoPE takes its long or short frequencies for a whole row by the row's longest
    position, where a sequence alone gets them by its own length: a 12-token sequence packed
    with a 30-token one (switch at 16) would be scored with the long ones. The planner keeps
    the two sides apart, so each scores as transformers scores it alone."""
    from vime.trainer.model import rope_split

    long_rope = {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 16}
    long_rope.update(short_factor=[1.0] * 8, long_factor=[4.0] * 8)
    path = _tiny(
        tmp_path / "phi3",
        "phi3",
        rope_parameters=long_rope,
        max_position_embeddings=256,
        original_max_position_embeddings=16,
    )
    trainer = Actor(make_args(), path)
    assert rope_split(trainer.model.config) == 16
    assert plan_packed_micro_batches([12, 30, 9, 17], 4096, None, 16) == [[1, 3], [0, 2]]
    assert plan_packed_micro_batches([12, 30, 9, 17], 4096) == [[0, 1, 2, 3]]
    rng = random.Random(0)
    samples = [
        Sample(index=i, tokens=[rng.randrange(4, 100) for _ in range(n)], response_length=5)
        for i, n in enumerate((12, 30))
    ]
    for got, sample in zip(trainer.compute_log_probs(samples), samples):
        assert torch.allclose(got, _hf_scores(path, sample), atol=1e-5)


def test_a_sequence_past_dynamic_ropes_original_length_is_refused_in_one_line(tmp_path):
    """Dynamic NTK RoPE rescales by the longest sequence transformers has seen once past
    `max_position_embeddings`: within it a sequence scores as alone, past it it is refused."""
    from vime.models import ModelError

    dynamic = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}
    path = _tiny(tmp_path / "llama", "llama", rope_parameters=dynamic, max_position_embeddings=24)
    trainer = Actor(make_args(), path)
    rng = random.Random(0)
    inside = Sample(index=0, tokens=[rng.randrange(4, 100) for _ in range(24)], response_length=6)
    assert torch.allclose(trainer.compute_log_probs([inside])[0], _hf_scores(path, inside), atol=1e-5)
    longer = Sample(index=0, tokens=inside.tokens + [5], response_length=7)
    with pytest.raises(ModelError, match="a sequence of 25 tokens is longer than the 24 past which") as e:
        trainer.compute_log_probs([longer])
    assert "\n" not in str(e.value)


def test_moe_aux_loss_and_the_cuda_kernels_for_latent_attention_are_refused_at_load(tmp_path):
    from vime.errors import ConfigError
    from vime.models import ModelError
    from vime.trainer.model import load_model

    moe = _tiny(tmp_path / "moe", "qwen3_moe", output_router_logits=True, num_experts=4, num_experts_per_tok=2)
    with pytest.raises(ModelError, match="sets output_router_logits"):
        load_model(moe, torch.device("cpu"))
    mla = dict(kv_lora_rank=16, q_lora_rank=None, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
    mla = _tiny(
        tmp_path / "mla", "deepseek_v3", **mla, n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=2
    )
    with pytest.raises(ConfigError, match="this model's values have 16 dims against 24 for queries and keys"):
        load_model(mla, torch.device("cpu"), "fa2")
    assert load_model(mla, torch.device("cpu")).config.v_head_dim == 16  # auto: SDPA, which is exact here
    # compiled, SDPA per sequence is an opaque op whose fake must give the values' width
    eager, compiled = (Actor(make_args(compile=c), mla).compute_log_probs(make_samples(2)) for c in (False, True))
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(eager, compiled))


def test_the_training_forward_is_the_scoring_forward_dropout_off_and_router_jitter_refused(tmp_path):
    """The policy ratio compares the training forward (train mode) with the scoring forward
    (eval mode). GPT-2 ships dropout 0.1 on its residuals, embeddings and attention: the
    trainer's model has it off, so its train-mode forward is its eval-mode one (transformers'
    own, dropout on, is not). Mixtral with router jitter routes by noise in train mode: refused."""
    from transformers import AutoModelForCausalLM

    from vime.models import ModelError
    from vime.trainer.model import load_model

    gpt2 = _tiny(tmp_path / "gpt2", "gpt2", n_positions=256)
    ids = torch.tensor([make_samples(1)[0].tokens])
    for model, same in (
        (load_model(gpt2, torch.device("cpu")), True),
        (AutoModelForCausalLM.from_pretrained(gpt2), False),
    ):
        with torch.no_grad():
            torch.manual_seed(0)
            trained = model.train()(ids).logits
            scored = model.eval()(ids).logits
        assert torch.allclose(trained, scored, atol=1e-6) == same
    jitter = _tiny(tmp_path / "mixtral", "mixtral", num_local_experts=4, num_experts_per_tok=2, router_jitter_noise=0.1)
    with pytest.raises(ModelError, match="training forward differs from its scoring forward") as e:
        load_model(jitter, torch.device("cpu"))
    assert "\n" not in str(e.value)
    assert load_model(jitter, torch.device("cpu"), trained=False).training is False  # a reference runs in eval only
