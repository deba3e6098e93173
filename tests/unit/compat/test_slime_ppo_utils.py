"""`slime.utils.ppo_utils.compute_approx_kl` and `compute_policy_loss`: slime's per-token KL
estimators and PPO clipped loss (with its dual clip), and a --custom-loss-function-path built
from them (tests/plugins/slime_ppo_loss.py) trains."""

from __future__ import annotations

import math

import pytest
import torch
from slime.utils.ppo_utils import compute_approx_kl, compute_policy_loss

from unit.compat.tiny_runs import tiny_run

NEW, BASE = torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -1.0])


@pytest.mark.parametrize(
    ("kind", "expected"),
    [
        ("k1", [0.5, -1.0]),
        ("k2", [0.125, 0.5]),
        ("k3", [math.exp(-0.5) - 1 + 0.5, math.exp(1.0) - 1 - 1.0]),
        ("low_var_kl", [math.exp(-0.5) - 1 + 0.5, math.exp(1.0) - 1 - 1.0]),
    ],
)
def test_kl_estimators(kind, expected):
    assert compute_approx_kl(NEW, BASE, kind).tolist() == pytest.approx(expected)


def test_importance_weighting_comes_before_low_var_kls_clamp():
    far = torch.tensor([-25.0])  # k3 = 24
    assert compute_approx_kl(torch.tensor([0.0]), far, "k3").item() == pytest.approx(24.0)
    # weighted 12, then clamped to 10 (clamped first it would be 5)
    assert compute_approx_kl(torch.tensor([0.0]), far, "low_var_kl", torch.tensor([0.5])).item() == 10.0
    assert compute_approx_kl(NEW, BASE, "k1", torch.tensor([2.0, 0.0])).tolist() == [1.0, 0.0]


def test_policy_loss_clips_the_ratio_and_counts_the_clipped_tokens():
    advantages = torch.tensor([1.0, 1.0, -1.0])
    ratio = torch.tensor([1.5, 1.0, 0.5])  # over 1 + eps_high; inside; under 1 - eps with A < 0
    loss, clipfrac = compute_policy_loss(-ratio.log(), advantages, 0.2, 0.28)
    assert loss.tolist() == pytest.approx([-1.28, -1.0, 0.8])
    assert clipfrac.tolist() == [1.0, 0.0, 1.0]  # where the clipped loss is the larger, as slime counts


def test_dual_clip_caps_a_negative_advantages_loss():
    ratio, advantages = torch.tensor([10.0]), torch.tensor([-1.0])
    assert compute_policy_loss(-ratio.log(), advantages, 0.2, 0.2)[0].item() == pytest.approx(10.0)
    assert compute_policy_loss(-ratio.log(), advantages, 0.2, 0.2, eps_clip_c=3.0)[0].item() == pytest.approx(3.0)
    with pytest.raises(ValueError, match="over 1.0"):
        compute_policy_loss(-ratio.log(), advantages, 0.2, 0.2, eps_clip_c=0.5)


def test_a_loss_built_from_slimes_ppo_utils_trains(tmp_path):
    flags = ("--loss-type", "custom_loss", "--custom-loss-function-path", "slime_ppo_loss.clipped_with_kl")
    steps = [r for r in tiny_run(tmp_path, 2, *flags).rows if "train/loss" in r]
    assert len(steps) == 2
    for r in steps:
        assert math.isfinite(r["train/loss"]) and 0.0 <= r["train/slime_clipfrac"] <= 1.0
        assert r["train/grad_norm"] > 0  # the loss's gradient reached the weights
        assert r["train/slime_kl"] >= 0.0  # k3 is never negative
