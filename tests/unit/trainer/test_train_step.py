"""The Actor's log-probs and train step on the tiny model: log-probs equal a full forward
whatever the batch, gradients whatever the micro-batch split, the reference model, the ratio's
old log-probs (the forward's or the engine's), the clip, KL, SFT and the head-forward gradient in
a real step, global batches, diagnostics by staleness, and the temperature a step is scored at."""

from __future__ import annotations

import math

import pytest
import torch

from unit.trainer.actors import make_args, make_samples
from vime.trainer.actor import Actor


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
