"""Advantages, PPO-clip, aggregation, TIS, KL and entropy against values worked out by hand."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import loss_inputs, make_correction, objective

from vime.algorithms.corrections import behaviour_weights, second_moment_mask
from vime.algorithms.credit import compute_advantages
from vime.algorithms.kl import kl_penalty
from vime.algorithms.objective import aggregate

TIS = make_correction(use_tis=True, tis_clip=2.0)


def close(a, b, atol=1e-5):
    return torch.allclose(torch.as_tensor(a, dtype=torch.float32), torch.as_tensor(b, dtype=torch.float32), atol=atol)


def lp(*ratios: float) -> torch.Tensor:
    """log-probs whose ratio to old log-probs of 0 is the given ratio."""
    return torch.tensor([math.log(r) for r in ratios])


# ---- advantages ----------------------------------------------------------------------


def test_grpo_advantages_by_hand():
    rewards = torch.tensor([[1.0, 0.0, 1.0, 0.0], [1.0, 2.0, 3.0, 2.0]])
    adv = compute_advantages(rewards, "grpo")
    # group 0: mean 0.5, population std sqrt(mean((±0.5)^2)) = 0.5 → ±0.5 / 0.5 = ±1
    # group 1: mean 2, deviations (-1, 0, 1, 0), population std sqrt(2/4) = 0.70711 → (-1.41421, 0, 1.41421, 0)
    s = math.sqrt(2)
    assert close(adv, [[1, -1, 1, -1], [-s, 0, s, 0]])


def test_grpo_equal_rewards_and_single_sample_groups_give_zero():
    assert close(compute_advantages(torch.tensor([[1.0, 1.0, 1.0]]), "grpo"), [[0, 0, 0]])
    assert close(compute_advantages(torch.tensor([[5.0], [0.0]]), "grpo"), [[0], [0]])  # no NaN at n = 1


def test_dr_grpo_and_disabled_std_only_center():
    rewards = torch.tensor([[1.0, 2.0, 3.0, 2.0]])
    # mean 2 → (-1, 0, 1, 0), not divided by the std
    assert close(compute_advantages(rewards, "dr_grpo"), [[-1, 0, 1, 0]])
    assert close(compute_advantages(rewards, "dr_grpo", std_normalize=True), [[-1, 0, 1, 0]])
    assert close(compute_advantages(rewards, "grpo", std_normalize=False), [[-1, 0, 1, 0]])


def test_advantages_reject_bad_input():
    with pytest.raises(ValueError):
        compute_advantages(torch.tensor([1.0, 0.0]), "grpo")
    with pytest.raises(ValueError):
        compute_advantages(torch.tensor([[1.0, 0.0]]), "ppo")


# ---- PPO clip ------------------------------------------------------------------------


def test_clip_both_sides_by_hand():
    # per token: (advantage, ratio) → loss = max(-A r, -A clip(r, 0.8, 1.2))
    #   (+1, 1.5): max(-1.5, -1.2) = -1.2   clipped (would push the ratio further up)
    #   (-1, 0.5): max( 0.5,  0.8) =  0.8   clipped (would push the ratio further down)
    #   (+1, 0.5): max(-0.5, -0.8) = -0.5   unclipped (pessimistic side is the raw ratio)
    #   (-1, 1.5): max( 1.5,  1.2) =  1.5   unclipped
    # token mean = (-1.2 + 0.8 - 0.5 + 1.5) / 4 = 0.15; clipfrac 2/4
    log_probs = lp(1.5, 0.5, 0.5, 1.5)
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0])
    loss, m = objective(0.2).policy_term(log_probs, torch.zeros(4), loss_inputs(adv, torch.ones(4)))
    assert close(loss, 0.15)
    assert close(m["pg_clipfrac"], 0.5)
    # ppo_kl = mean(old - new) = -(ln1.5 + ln0.5 + ln0.5 + ln1.5)/4 = -ln(0.75)/2 = 0.143841
    assert close(m["ppo_kl"], -math.log(0.75) / 2)


def test_asymmetric_clip_high():
    # ratio 1.25, A = +1: symmetric eps 0.2 clips to 1.2 → loss -1.2; eps_high 0.28 lets 1.25 through → -1.25
    log_probs, old, adv, mask = lp(1.25), torch.zeros(1), torch.ones(1), torch.ones(1)
    sym, m_sym = objective(0.2).policy_term(log_probs, old, loss_inputs(adv, mask))
    asym, m_asym = objective(0.2, eps_clip_high=0.28).policy_term(log_probs, old, loss_inputs(adv, mask))
    assert close(sym, -1.2) and close(m_sym["pg_clipfrac"], 1.0)
    assert close(asym, -1.25) and close(m_asym["pg_clipfrac"], 0.0)
    # the low side still uses eps_clip: ratio 0.7, A = -1 → clip(0.7) = 0.8 → loss max(0.7, 0.8) = 0.8
    low, _ = objective(0.2, eps_clip_high=0.28).policy_term(lp(0.7), old, loss_inputs(-adv, mask))
    assert close(low, 0.8)


def test_dual_clip_caps_negative_advantages_by_hand():
    # per token: (advantage, ratio) → PPO's max(-A r, -A clip(r, 0.8, 1.2)), then for A < 0 at most -A c, c = 3
    #   (-1, 5.0): max(5.0, 1.2) = 5.0 → capped at 3.0 (no gradient)
    #   (-2, 1.1): max(2.2, 2.2) = 2.2 → under the cap 6.0, kept
    #   (+1, 5.0): max(-5.0, -1.2) = -1.2 → a positive advantage is never capped
    #   (-1, 0.5): max(0.5, 0.8) = 0.8 → kept
    # token mean = (3.0 + 2.2 - 1.2 + 0.8) / 4 = 1.2; capped 1 of 4
    log_probs = lp(5.0, 1.1, 5.0, 0.5).requires_grad_()
    adv = torch.tensor([-1.0, -2.0, 1.0, -1.0])
    loss, m = objective(0.2, eps_clip_c=3.0).policy_term(log_probs, torch.zeros(4), loss_inputs(adv, torch.ones(4)))
    loss.backward()
    assert close(loss, 1.2) and close(m["pg_clipfrac_lower"], 0.25)
    # the capped token and the clipped ones carry no gradient; the kept ones d(-A r)/d logp = -A r / 4
    assert close(log_probs.grad, [0.0, 2.0 * 1.1 / 4, 0.0, 0.0])
    plain, m_plain = objective(0.2).policy_term(log_probs.detach(), torch.zeros(4), loss_inputs(adv, torch.ones(4)))
    assert close(plain, (5.0 + 2.2 - 1.2 + 0.8) / 4) and "pg_clipfrac_lower" not in m_plain


def test_on_policy_ratio_one_gives_minus_mean_advantage_and_gradient():
    # ratio 1 everywhere: loss = -mean(A) = -(2 - 1)/2 = -0.5, nothing clipped; d loss/d logp_i = -A_i / 2
    log_probs = torch.tensor([-1.0, -2.0], requires_grad=True)
    loss, m = objective(0.2).policy_term(
        log_probs, log_probs.detach(), loss_inputs(torch.tensor([2.0, -1.0]), torch.ones(2))
    )
    loss.backward()
    assert close(loss, -0.5) and close(m["pg_clipfrac"], 0.0) and close(m["ppo_kl"], 0.0)
    assert close(log_probs.grad, [-1.0, 0.5])


def test_token_mean_ignores_masked_tokens():
    # ratio 1 → per-token loss -A = (-1, -1000, -3); the middle token is masked, so its huge
    # advantage must not leak into the loss nor into the denominator.
    adv = torch.tensor([1.0, 1000.0, 3.0])
    loss, m = objective(0.2).policy_term(
        torch.zeros(3), torch.zeros(3), loss_inputs(adv, torch.tensor([1.0, 0.0, 1.0]))
    )
    # (-1 + -3) / 2 = -2
    assert close(loss, -2.0)


def test_global_token_count_makes_micro_batches_add_up():
    # one step, 5 loss tokens split 3 + 2 over two micro-batches: passing num_tokens=5 to each
    # makes the sum of the two losses equal the token mean of the whole step.
    log_probs = lp(1.1, 0.9, 1.3, 0.6, 1.0)
    adv = torch.tensor([1.0, -2.0, 0.5, -1.0, 3.0])
    ppo = objective(0.2)
    full, mf = ppo.policy_term(log_probs, torch.zeros(5), loss_inputs(adv, torch.ones(5)))
    a, ma = ppo.policy_term(log_probs[:3], torch.zeros(3), loss_inputs(adv[:3], torch.ones(3)), num_tokens=5)
    b, mb = ppo.policy_term(log_probs[3:], torch.zeros(2), loss_inputs(adv[3:], torch.ones(2)), num_tokens=5)
    assert close(a + b, full)
    assert close(ma["pg_clipfrac"] + mb["pg_clipfrac"], mf["pg_clipfrac"])
    # by hand, max(-A r, -A clip(r, 0.8, 1.2)) per token:
    #   A=1 r=1.1 → -1.1; A=-2 r=0.9 → max(1.8, 1.8) = 1.8; A=0.5 r=1.3 → max(-0.65, -0.6) = -0.6;
    #   A=-1 r=0.6 → max(0.6, 0.8) = 0.8; A=3 r=1 → -3.  (-1.1 + 1.8 - 0.6 + 0.8 - 3) / 5 = -0.42
    assert close(full, -0.42)


def test_sample_mean_by_hand():
    # two samples, 1 and 3 loss tokens (a fourth token masked): (2 + (1 + 3 + 5) / 3) / 2 = 2.5;
    # the token mean would be (2 + 1 + 3 + 5) / 4 = 2.75
    values = torch.tensor([2.0, 1.0, 3.0, 5.0, 100.0])
    mask = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0])
    weights = torch.tensor([1.0, 1 / 3, 1 / 3, 1 / 3, 1 / 3])
    assert close(aggregate(values, mask, "sample_mean", const=2, weights=weights), 2.5)
    assert close(aggregate(values, mask, "token_mean"), 2.75)
    # split at any token, the shares add up to the whole
    parts = [
        aggregate(values[s], mask[s], "sample_mean", const=2, weights=weights[s]) for s in (slice(0, 2), slice(2, 5))
    ]
    assert close(sum(parts), 2.5)
    with pytest.raises(ValueError, match="sample_mean aggregation needs"):
        aggregate(values, mask, "sample_mean", const=2)


def test_dr_grpo_seq_sum_const():
    # two sequences, max response length 4 → const = 4 × 2 = 8; ratio 1 so per-token loss = -A
    # seq 1: 3 tokens with A = 1 → -3; seq 2: 1 token with A = -2 → +2; sum = -1; -1 / 8 = -0.125
    adv = torch.tensor([1.0, 1.0, 1.0, -2.0])
    dr_grpo = objective(0.2, agg="seq_sum_const")
    loss, _ = dr_grpo.policy_term(torch.zeros(4), torch.zeros(4), loss_inputs(adv, torch.ones(4)), const=8)
    assert close(loss, -0.125)
    with pytest.raises(ValueError):
        dr_grpo.policy_term(torch.zeros(4), torch.zeros(4), loss_inputs(adv, torch.ones(4)))


def test_tis_weight_truncated_and_detached():
    # old - rollout = ln 3 → weight 3 truncated to 2; ln 0.5 → weight 0.5 kept.
    # ratio 1, A = 1: per-token loss -1 × weight → (-2, -0.5), mean -1.25
    log_probs = torch.zeros(2, requires_grad=True)
    old = torch.zeros(2)
    rollout = torch.tensor([-math.log(3.0), -math.log(0.5)])
    loss, m = objective(0.2, correction=TIS).policy_term(
        log_probs, old, loss_inputs(torch.ones(2), torch.ones(2), rollout)
    )
    assert close(loss, -1.25)
    assert close(m["tis"], 1.25) and close(m["tis_clipfrac"], 0.5)
    loss.backward()
    assert close(log_probs.grad, [-1.0, -0.25])  # weights scale the gradient but carry none themselves
    # a sample the engine sent no log-probs for has no weight to correct by: refused before its step
    from vime.rollout.types import Sample
    from vime.trainer.step_loss import StepLoss

    with pytest.raises(ValueError, match="need the engine's log-probs on every sample"):
        StepLoss(
            objective(0.2, correction=TIS),
            [Sample(response_length=2)],
            torch.ones(1),
            None,
            None,
            None,
            "cpu",
            2,
            False,
        )


def rollout_for(*weights: float) -> torch.Tensor:
    """Engine log-probs that make w = π_old / π_rollout the given values against old log-probs of 0."""
    return torch.tensor([-math.log(w) for w in weights])


def test_tis_with_a_lower_bound_by_hand():
    # w = (3, 0.5, 0.1) clamped to [0.2, 2] → (2, 0.5, 0.2); ratio 1, A = 1 → per-token -w,
    # mean -(2 + 0.5 + 0.2) / 3 = -0.9; two of three weights were outside the band
    log_probs = torch.zeros(3, requires_grad=True)
    correction = make_correction(use_tis=True, tis_clip=2.0, tis_clip_low=0.2)
    loss, m = objective(0.2, correction=correction).policy_term(
        log_probs, torch.zeros(3), loss_inputs(torch.ones(3), torch.ones(3), rollout_for(3, 0.5, 0.1))
    )
    assert close(loss, -0.9)
    assert close(m["tis"], 0.9) and close(m["tis_clipfrac"], 2 / 3)
    loss.backward()
    assert close(log_probs.grad, [-2 / 3, -0.5 / 3, -0.2 / 3])  # d(-A r w / 3)/d log π at r = 1


def test_tis_mask_mode_is_icepop():
    # band [0.5, 2]: w = (3, 0.6, 0.1, 1.5) → (0, 0.6, 0, 1.5): out-of-band tokens weigh nothing,
    # in-band ones keep their weight; loss -(0.6 + 1.5) / 4 = -0.525, denominator still 4 tokens
    correction = make_correction(use_tis=True, tis_mode="mask", tis_clip=2.0, tis_clip_low=0.5)
    loss, m = objective(0.2, correction=correction).policy_term(
        torch.zeros(4), torch.zeros(4), loss_inputs(torch.ones(4), torch.ones(4), rollout_for(3, 0.6, 0.1, 1.5))
    )
    assert close(loss, -0.525)
    assert close(m["tis"], 2.1 / 4) and close(m["tis_clipfrac"], 0.5)


def test_decoupled_ppo_clip_against_the_proximal_policy_weight_against_the_behaviour():
    # proximal log-probs 0; two tokens:
    #   A = +1, π/π_prox = 1.5, π_prox/π_behav = 0.5: clip term max(-1.5, -1.2) = -1.2, × 0.5 = -0.6
    #   A = -1, π/π_prox = 0.5, π_prox/π_behav = 4:   clip term max(0.5, 0.8) = 0.8
    # TIS truncates 4 to 2: (−0.6 + 1.6) / 2 = 0.5; AReaL's cap-5 mask keeps 4: (−0.6 + 3.2) / 2 = 1.3;
    # with weight 6 instead of 4 the cap drops the token: −0.6 / 2 = −0.3
    log_probs, old, adv, mask = lp(1.5, 0.5), torch.zeros(2), torch.tensor([1.0, -1.0]), torch.ones(2)
    tis, _ = objective(0.2, correction=make_correction(use_tis=True, tis_clip=2.0)).policy_term(
        log_probs, old, loss_inputs(adv, mask, rollout_for(0.5, 4))
    )
    capped = objective(0.2, correction=make_correction(use_tis=True, tis_mode="mask", tis_clip=5.0))
    kept, m = capped.policy_term(log_probs, old, loss_inputs(adv, mask, rollout_for(0.5, 4)))
    dropped, _ = capped.policy_term(log_probs, old, loss_inputs(adv, mask, rollout_for(0.5, 6)))
    assert close(tis, 0.5) and close(kept, 1.3) and close(dropped, -0.3)
    assert close(m["pg_clipfrac"], 1.0)  # both tokens on the clipped side: the clip acts on π/π_prox


def test_m2po_masks_the_largest_second_moments_until_the_mean_is_in_bounds():
    # (log w)² of the loss tokens: 0.01, 0.25, 0.0025, 4.0, 0.09 (the 6th token is no loss token).
    # Sorted: 0.0025, 0.01, 0.09, 0.25, 4.0; prefix means 0.0025, 0.00625, 0.034, 0.088, 0.87:
    # at 0.04 the three smallest stay, at 0.1 four, at 1 all five, at 1e-4 none
    log_w = torch.tensor([0.1, -0.5, 0.05, 2.0, 0.3, 0.7])
    mask = torch.tensor([1.0, 1, 1, 1, 1, 0])
    assert second_moment_mask(log_w, mask, 0.04).tolist() == [1, 0, 1, 0, 1, 0]
    assert second_moment_mask(log_w, mask, 0.1).tolist() == [1, 1, 1, 0, 1, 0]
    assert second_moment_mask(log_w, mask, 1.0).tolist() == [1, 1, 1, 1, 1, 0]
    assert second_moment_mask(log_w, mask, 1e-4).tolist() == [0] * 6
    # in the loss: masked tokens weigh 0, kept ones 1 (no reweighting), the denominator stays
    correction = make_correction(m2_threshold=0.04)
    assert correction.active and correction.per_sequence  # the mask needs the whole micro-batch
    loss, m = objective(0.2, correction=correction).policy_term(
        torch.zeros(6), torch.zeros(6), loss_inputs(torch.ones(6), mask, -log_w)
    )
    assert close(loss, -3 / 5)
    assert close(m["m2_maskfrac"], 2 / 5) and close(m["m2"], (0.01 + 0.25 + 0.0025 + 4.0 + 0.09) / 5)
    with pytest.raises(ValueError):
        make_correction(m2_threshold=0.0)


def test_token_rejection_drops_without_reweighting():
    # band [0.5, 2]: w = (3, 1, 0.4, 1.2) → keep (0, 1, 0, 1); kept tokens weigh 1, not w:
    # loss -(1 + 1) / 4 = -0.5; half the tokens dropped
    correction = make_correction(use_rs=True, rs_lower_bound=0.5, rs_upper_bound=2.0)
    loss, m = objective(0.2, correction=correction).policy_term(
        torch.zeros(4), torch.zeros(4), loss_inputs(torch.ones(4), torch.ones(4), rollout_for(3, 1, 0.4, 1.2))
    )
    assert close(loss, -0.5) and close(m["rs_dropfrac"], 0.5)
    assert "tis" not in m


def test_sequence_and_geometric_rejection_by_hand():
    # seq 0: w = (1.5, 1.5)        product 2.25 (> 2: dropped), geometric mean 1.5 (kept)
    # seq 1: w = (1.5, 0.8, [10])  the third token is masked out of the loss and of the product:
    #        product 1.2, geometric mean sqrt(1.2) = 1.095: kept either way
    # ratio 1, A = 1, 4 loss tokens: sequence level -(1 + 1) / 4 = -0.5 (2 of 4 dropped); geometric -4 / 4 = -1
    rollout = rollout_for(1.5, 1.5, 1.5, 0.8, 10)
    mask = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0])
    seq_ids = torch.tensor([0, 0, 1, 1, 1])
    out = {}
    for level in ("sequence", "geometric"):
        correction = make_correction(use_rs=True, rs_level=level, rs_lower_bound=0.5, rs_upper_bound=2.0)
        out[level] = objective(0.2, correction=correction).policy_term(
            torch.zeros(5), torch.zeros(5), loss_inputs(torch.ones(5), mask, rollout, seq_ids)
        )
    assert close(out["sequence"][0], -0.5) and close(out["sequence"][1]["rs_dropfrac"], 0.5)
    assert close(out["geometric"][0], -1.0) and close(out["geometric"][1]["rs_dropfrac"], 0.0)
    factor, _ = behaviour_weights(
        torch.zeros(5), rollout, mask, make_correction(use_rs=True, rs_level="sequence"), seq_ids
    )
    assert factor.tolist() == [0.0, 0.0, 1.0, 1.0, 1.0]
    with pytest.raises(ValueError, match="seq_ids"):
        behaviour_weights(torch.zeros(5), rollout, mask, make_correction(use_rs=True, rs_level="sequence"))


def test_sequence_rejection_does_not_overflow_on_long_sequences():
    # 200 tokens of w = e: the product e^200 overflows float32, its log (200) does not
    rollout = torch.full((200,), -1.0)
    factor, sums = behaviour_weights(
        torch.zeros(200),
        rollout,
        torch.ones(200),
        make_correction(use_rs=True, rs_level="sequence", rs_upper_bound=1e30),
        torch.zeros(200, dtype=torch.long),
    )
    assert factor.sum() == 0 and float(sums["rs_dropfrac"]) == 200


def test_bad_corrections_are_refused():
    with pytest.raises(ValueError):
        make_correction(use_tis=True, tis_clip=2.0, tis_clip_low=3.0)
    with pytest.raises(ValueError):
        make_correction(rs_level="batch")


# ---- KL, entropy, aggregation --------------------------------------------------------


@pytest.mark.parametrize("kind", ["low_var_kl", "k1", "k2", "k3"])
def test_kl_zero_at_equal_distributions(kind):
    x = torch.tensor([-0.1, -2.0, -7.5])
    assert close(kl_penalty(x, x.clone(), kind), torch.zeros(3))


def test_kl_values_by_hand():
    # policy p = 0.5, reference q = 0.25: log r = ln 2 = 0.693147
    # k1 = 0.693147; k2 = ½·0.480453 = 0.240227; k3 = 1/r − 1 + log r = 0.5 − 1 + 0.693147 = 0.193147
    p, q = torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)])
    assert close(kl_penalty(p, q, "k1"), [0.693147])
    assert close(kl_penalty(p, q, "k2"), [0.240227])
    assert close(kl_penalty(p, q, "low_var_kl"), [0.193147])
    assert close(kl_penalty(p, q, "k3"), [0.193147])
    # log r = 50: k3 = e^-50 − 1 + 50 = 49.0; low_var_kl clamps it, k3 does not
    assert float(kl_penalty(torch.tensor([0.0]), torch.tensor([-50.0]), "low_var_kl")) == 10.0
    assert float(kl_penalty(torch.tensor([0.0]), torch.tensor([-50.0]), "k3")) == pytest.approx(49.0)
    with pytest.raises(ValueError):
        kl_penalty(p, q, "k4")


def test_unbiased_kl_weights_by_the_ratio_to_the_old_policy_by_hand():
    # p = 0.5, q = 0.25 (log r = ln 2) as above, sampled by π_old = 1/3: ρ = π/π_old = 1.5
    p, q, old = torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)]), torch.tensor([math.log(1 / 3)])
    assert close(kl_penalty(p, q, "k1", old), [1.5 * 0.693147])  # 1.039721
    assert close(kl_penalty(p, q, "k2", old), [1.5 * 0.240227])  # 0.360340
    assert close(kl_penalty(p, q, "k3", old), [1.5 * 0.193147])  # 0.289721
    assert close(kl_penalty(p, q, "low_var_kl", old), [0.289721])
    # low_var_kl clamps the weighted value, as slime does: log r = 50 (k3 = 49.0) with ρ = 0.1 is
    # 4.9 (clamping first would give 1.0); with ρ = 10 it is 490, clamped to 10
    zero, ref = torch.tensor([0.0]), torch.tensor([-50.0])
    assert close(kl_penalty(zero, ref, "low_var_kl", torch.tensor([math.log(10.0)])), [4.9])
    assert close(kl_penalty(zero, ref, "low_var_kl", torch.tensor([math.log(0.1)])), [10.0])


def test_unbiased_kl_gradient_is_the_kl_gradient():
    """ρ = π/π_old carries gradient (not detached, as in slime): d(ρ·k3)/d log π = ρ·k3 + ρ(1 − 1/r)
    = ρ log r, the reverse KL's own per-token gradient. Here ρ = 1.5, log r = ln 2: 1.039721. At
    ρ = 1 (π_old the current weights, detached) it is ln 2 = 0.693147, where plain k3 gives
    1 − 1/r = 0.5."""
    q, old = torch.tensor([math.log(0.25)]), torch.tensor([math.log(1 / 3)])
    p = torch.tensor([math.log(0.5)], requires_grad=True)
    (grad,) = torch.autograd.grad(kl_penalty(p, q, "k3", old).sum(), p)
    assert close(grad, [1.5 * math.log(2)])
    (grad,) = torch.autograd.grad(kl_penalty(p, q, "low_var_kl", p.detach()).sum(), p)
    assert close(grad, [math.log(2)])
    (grad,) = torch.autograd.grad(kl_penalty(p, q, "k3").sum(), p)
    assert close(grad, [0.5])


def test_aggregate_token_mean_defaults_and_errors():
    v, mask = torch.tensor([1.0, 2.0, 4.0]), torch.tensor([1.0, 0.0, 1.0])
    assert close(aggregate(v, mask), 2.5)  # (1 + 4) / 2
    assert close(aggregate(v, mask, num_tokens=10), 0.5)  # (1 + 4) / 10
    assert close(aggregate(v, torch.zeros(3)), 0.0)  # no tokens: 0, not NaN
    with pytest.raises(ValueError):
        aggregate(v, mask, "seq_mean")


# ---- chunked log-probs -----------------------------------------------------------------


@pytest.mark.parametrize("with_entropy", [True, False])
def test_chunked_log_probs_equal_full_logits_and_gradients(with_entropy):
    from vime.trainer.logprobs import chunked_log_probs

    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(10, 16, generator=g, requires_grad=True)
    weight = torch.randn(50, 16, generator=g, requires_grad=True)
    targets = torch.randint(0, 50, (10,), generator=g)
    up_lp, up_ent = torch.randn(10, generator=g), torch.randn(10, generator=g)  # upstream gradients

    # reference: the full [10, 50] logits at temperature 0.7
    log_p = torch.log_softmax(hidden @ weight.t() / 0.7, -1)
    ref_lp = log_p.gather(-1, targets[:, None])[:, 0]
    ref_ent = -(log_p.exp() * log_p).sum(-1)
    ref_loss = (ref_lp * up_lp).sum() + ((ref_ent * up_ent).sum() if with_entropy else 0)
    ref_gh, ref_gw = torch.autograd.grad(ref_loss, [hidden, weight])

    lp, ent = chunked_log_probs(
        hidden, weight, targets, temperature=0.7, with_entropy=with_entropy, chunk_size=3
    )  # 4 chunks, last of 1
    assert close(lp, ref_lp)
    loss = (lp * up_lp).sum()
    if with_entropy:
        assert close(ent, ref_ent)
        loss = loss + (ent * up_ent).sum()
    else:
        assert ent is None
    gh, gw = torch.autograd.grad(loss, [hidden, weight])
    assert close(gh, ref_gh) and close(gw, ref_gw)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_loss_takes_the_gradient_of_log_probs_then_loss_bit_for_bit(dtype):
    """The loss's gradient taken chunk by chunk in the head's forward equals the one autograd
    finds through `chunked_log_probs` and the same loss afterwards, exactly: each token's
    d loss / d log p is the same arithmetic either way, and so is everything downstream of it.
    A factor on the loss (3 here, as three ranks' backward has) goes inside the loss."""
    from vime.trainer.logprobs import chunked_log_probs, chunked_loss

    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(10, 16, generator=g).to(dtype).requires_grad_()
    weight = torch.randn(50, 16, generator=g).to(dtype).requires_grad_()
    targets = torch.randint(0, 50, (10,), generator=g)
    old, adv = torch.randn(10, generator=g) - 3, torch.randn(10, generator=g)
    mask = (torch.rand(10, generator=g) > 0.2).float()

    def loss_of(lp: torch.Tensor, ent: torch.Tensor, rows: slice) -> torch.Tensor:
        pg, _ = objective(0.2).policy_term(lp, old[rows], loss_inputs(adv[rows], mask[rows]), num_tokens=7.0)
        return pg - 0.01 * aggregate(ent, mask[rows], num_tokens=7.0)

    lp, ent = chunked_log_probs(hidden, weight, targets, temperature=0.7, with_entropy=True, chunk_size=3)
    ref = torch.autograd.grad(3 * loss_of(lp, ent, slice(None)), [hidden, weight])
    calls = []

    def counted(lp: torch.Tensor, ent: torch.Tensor, rows: slice) -> torch.Tensor:
        calls.append(rows)
        return 3 * loss_of(lp, ent, rows)

    loss = chunked_loss(hidden, weight, targets, counted, temperature=0.7, with_entropy=True, chunk_size=3)
    assert calls == [slice(0, 3), slice(3, 6), slice(6, 9), slice(9, 12)]  # 4 chunks, last of 1
    assert close(loss, 3 * loss_of(lp, ent, slice(None)))
    got = torch.autograd.grad(loss, [hidden, weight])
    assert all(torch.equal(a, b) for a, b in zip(got, ref))
    assert all(a.abs().sum() > 0 for a in got)
    # and the backward scales by its upstream gradient
    again = chunked_loss(hidden, weight, targets, counted, temperature=0.7, with_entropy=True, chunk_size=3)
    assert all(torch.equal(2 * a, b) for a, b in zip(got, torch.autograd.grad(2 * again, [hidden, weight])))
    with torch.no_grad(), pytest.raises(RuntimeError, match="autograd on"):
        chunked_loss(hidden, weight, targets, counted)


@pytest.mark.slow
def test_compiled_head_kernels_equal_eager():
    """The head's per-chunk math as CUDA runs it (torch.compile, dynamic rows) equals the eager
    math the test above checks, on chunks of two lengths and one compile each."""
    import torch._dynamo.utils

    from vime.trainer.logprobs import _grad_logits, _stats

    stats, grad = torch.compile(_stats, dynamic=True), torch.compile(_grad_logits, dynamic=True)
    g = torch.Generator().manual_seed(1)
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for rows in (7, 5):
        logits, targets = torch.randn(rows, 50, generator=g) * 3, torch.randint(0, 50, (rows,), generator=g)
        g_lp, g_ent = torch.randn(rows, generator=g), torch.randn(rows, generator=g)
        eager = _stats(logits, targets, 1 / 0.7, True)
        compiled = stats(logits, targets, 1 / 0.7, True)
        assert all(close(a, b) for a, b in zip(eager, compiled))
        assert close(
            grad(logits, targets, *eager[1:], g_lp, g_ent, 1 / 0.7),
            _grad_logits(logits, targets, *eager[1:], g_lp, g_ent, 1 / 0.7),
        )
    assert (
        torch._dynamo.utils.counters["stats"]["unique_graphs"] - before == 2
    )  # one graph each, reused for the second length


# ---- custom hooks: a fault is one line naming the hook, the step and the original error ------


def test_a_custom_hook_that_raises_or_answers_the_wrong_shape_is_one_line_naming_it_and_the_step():
    from functools import partial

    import custom_algorithms as ca

    from vime.algorithms.credit import group_advantages
    from vime.algorithms.hooks import apply_custom_tis
    from vime.algorithms.objective import LossInputs, Objective
    from vime.config import parse_args
    from vime.plugins import PluginError, at_step
    from vime.rollout.types import Sample

    groups = [[Sample(reward=1.0, response_length=1), Sample(reward=0.0, response_length=1)]]
    with pytest.raises(PluginError) as e, at_step(3):
        group_advantages(groups, custom=ca.advantages_that_divide_by_zero)
    assert str(e.value) == (
        "step 3: --custom-advantage-function-path custom_algorithms.advantages_that_divide_by_zero raised "
        "ZeroDivisionError: division by zero (VIME_DEBUG=1 shows its traceback)"
    )
    assert isinstance(e.value.__cause__, ZeroDivisionError)

    pg, seq_ids = torch.ones(3, requires_grad=True), torch.tensor([0, 0, 1])
    for hook, fault in (
        (ca.tis_one_mask_short, "returned 1 loss_masks for 2 sequences"),
        (ca.tis_summed, r"returned a pg_loss Tensor of shape \(\) for 3 tokens"),
        (ca.tis_pair, r"returned a tuple of 2: it must return \(pg_loss, loss_masks, metrics\)"),
        # a RuntimeError of its own: named as the hook's, not taken for another trainer rank's end
        (ca.tis_that_raises, "raised RuntimeError: expected rollout log-probs in float64"),
    ):
        with pytest.raises(PluginError, match=f"^--custom-tis-function-path custom_algorithms.{hook.__name__} {fault}"):
            apply_custom_tis(
                partial(hook, None),
                pg,
                torch.zeros(3),
                loss_inputs(torch.ones(3), torch.ones(3), torch.zeros(3), seq_ids),
            )

    base = ["--hf-checkpoint", "tiny", "--prompt-data", "p.jsonl", "--num-rollout", "1", "--loss-type", "custom_loss"]
    log_probs = torch.full((3,), -1.0, requires_grad=True)
    t = LossInputs(
        mask=torch.ones(3), advantages=torch.ones(3), rollout_lp=torch.full((3,), -1.0), has_rollout=torch.ones(3),
        seq_ids=seq_ids, old=None, ref=None,
    )  # fmt: skip
    for name, fault in (
        ("loss_without_seq_ids", "raised TypeError: .*unexpected keyword argument 'seq_ids'"),
        ("detached_loss", "returned a per-token loss with no gradient"),
        ("loss_one_short", r"returned a per-token loss Tensor of shape \(2,\) for 3 tokens"),
    ):
        objective = Objective.of(parse_args([*base, "--custom-loss-function-path", f"custom_algorithms.{name}"]))
        line = f"^step 2: --custom-loss-function-path custom_algorithms.{name} {fault}"
        with pytest.raises(PluginError, match=line), at_step(2):
            objective(log_probs, torch.zeros(3), t, num_tokens=3.0, const=2.0)
