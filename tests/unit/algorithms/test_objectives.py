"""The objectives beside GRPO (issue 31): each checked by hand, and against the public reference
formula (computed here from the paper's definition, not from anyone's code) where one exists."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import loss_inputs, make_correction, objective

from vime.algorithms.corrections import behaviour_weights
from vime.algorithms.credit import compute_advantages, group_advantages, whiten
from vime.rollout.types import Sample


def close(a, b, atol=1e-5) -> bool:
    return torch.allclose(torch.as_tensor(a, dtype=torch.float32), torch.as_tensor(b, dtype=torch.float32), atol=atol)


# ---- advantages ------------------------------------------------------------------------


def test_gspo_and_cispo_take_grpos_advantages_reinforce_takes_the_reward():
    rewards = torch.tensor([[1.0, 0.0, 1.0, 0.0], [1.0, 2.0, 3.0, 2.0]])
    grpo = compute_advantages(rewards, "grpo")
    assert close(compute_advantages(rewards, "gspo"), grpo) and close(compute_advantages(rewards, "cispo"), grpo)
    assert close(compute_advantages(rewards, "reinforce_plus_plus"), rewards)
    # the group mean only, never the std: (0.5, -0.5, ...), (-1, 0, 1, 0)
    assert close(compute_advantages(rewards, "reinforce_plus_plus_baseline"), [[0.5, -0.5, 0.5, -0.5], [-1, 0, 1, 0]])


def test_whitening_is_over_tokens_by_hand():
    # samples with advantages 1, -1, 3 on 2, 1 and 1 loss tokens: tokens (1, 1, -1, 3)
    # mean 1, unbiased variance (0 + 0 + 4 + 4) / 3 = 8/3 → (a - 1) / sqrt(8/3)
    out = whiten(torch.tensor([1.0, -1.0, 3.0]), torch.tensor([2.0, 1.0, 1.0]))
    s = math.sqrt(8 / 3)
    assert close(out, [0.0, -2 / s, 2 / s])


def test_reinforce_plus_plus_matches_the_reference_returns_whitened_per_token():
    """REINFORCE++ (Hu 2025): token rewards r_t = R at the response's last token, returns
    G_t = Σ_{k≥t} γ^{k-t} r_k (γ = 1, no KL in the reward), whitened over all loss tokens of the
    batch. Computed here token by token and compared with vime's per-sample path."""
    groups = [
        [Sample(reward=1.0, response_length=3, loss_mask=[1, 1, 1]), Sample(reward=0.0, response_length=2)],
        [Sample(reward=0.5, response_length=4, loss_mask=[1, 0, 1, 1]), Sample(reward=1.0, response_length=1)],
    ]
    samples = [s for g in groups for s in g]
    for estimator, base in (("reinforce_plus_plus", lambda g, s: s.reward), ("reinforce_plus_plus_baseline", None)):
        token_adv, token_mask = [], []
        for g in groups:
            mean = sum(s.reward for s in g) / len(g)
            for s in g:
                r = s.reward - (mean if base is None else 0.0)
                mask = s.effective_loss_mask()
                last = max(i for i, m in enumerate(mask) if m)
                rewards = [r if i == last else 0.0 for i in range(s.response_length)]
                token_adv += [sum(rewards[t:]) for t in range(s.response_length)]  # G_t with γ = 1
                token_mask += mask
        adv, mask = torch.tensor(token_adv), torch.tensor(token_mask, dtype=torch.bool)
        ref = (adv - adv[mask].mean()) / adv[mask].var(correction=1).sqrt()
        _, ours = group_advantages(groups, estimator)
        expanded = torch.cat([ours.flatten()[i].repeat(s.response_length) for i, s in enumerate(samples)])
        assert close(expanded[mask], ref[mask], atol=1e-4), estimator


def test_discounted_returns_match_the_reference_per_token():
    """--gamma < 1: G_t = Σ_{k≥t} γ^{k−t} r_k with the reward at the last loss token (a masked
    token before it counts in the distance, tokens after it get 0), whitened over loss tokens."""
    from vime.algorithms.credit import discounted_returns

    gamma = 0.9
    groups = [
        [Sample(reward=1.0, response_length=4, loss_mask=[1, 0, 1, 0]), Sample(reward=0.0, response_length=2)],
        [Sample(reward=0.5, response_length=3), Sample(reward=2.0, response_length=1)],
    ]
    ref, mask = [], []
    for g in groups:
        for s in g:
            m = s.effective_loss_mask()
            last = max(i for i, x in enumerate(m) if x)
            r = [s.reward if i == last else 0.0 for i in range(s.response_length)]
            ref += [sum(gamma ** (k - t) * r[k] for k in range(t, s.response_length)) for t in range(s.response_length)]
            mask += m
    ref_t, mask_t = torch.tensor(ref), torch.tensor(mask, dtype=torch.bool)
    expect = (ref_t - ref_t[mask_t].mean()) / ref_t[mask_t].var(correction=1).sqrt()
    ours = torch.cat(discounted_returns(groups, gamma))
    assert close(ours, expect, atol=1e-4)
    assert close(ours[:4][3], expect[3]) and ref[3] == 0.0  # after the last loss token: no return


def test_per_token_advantages_equal_to_per_sample_ones_train_the_same_weights(tiny_model):
    """The per-token path (REINFORCE++ discounted) and the per-sample path are one computation
    when every token of a sample carries its sample's advantage: weights equal bit for bit."""
    from unit.trainer.actors import make_args, make_samples
    from vime.trainer.actor import Actor

    samples = make_samples(4)
    adv = [1.0, -0.5, 0.25, -1.0]
    one, two = Actor(make_args(global_batch_size=2), tiny_model), Actor(make_args(global_batch_size=2), tiny_model)
    one.train_step(samples, adv)
    two.train_step(samples, [torch.full((s.response_length,), a) for s, a in zip(samples, adv)])
    w1, w2 = dict(one.named_weights()), dict(two.named_weights())
    assert all(torch.equal(w1[n], w2[n]) for n in w1)
    with pytest.raises(ValueError, match="per-token advantages"):
        two.train_step(samples, [torch.zeros(1) for _ in samples])


def test_a_custom_advantage_function_replaces_the_estimator_and_a_wrong_shape_is_one_line():
    groups = [[Sample(reward=1.0, response_length=1), Sample(reward=0.0, response_length=1)]]
    _, adv = group_advantages(groups, "grpo", custom=lambda args, g, r: 2 * r, args=None)
    assert close(adv, [[2.0, 0.0]])
    with pytest.raises(ValueError, match=r"shape \(2,\), the rollout's rewards are \(1, 2\)") as e:
        group_advantages(groups, "grpo", custom=lambda args, g, r: r.flatten(), args=None)
    assert "\n" not in str(e.value)


# ---- GSPO and CISPO ----------------------------------------------------------------------


def test_gspo_takes_one_ratio_per_sequence_by_hand():
    """GSPO (Zheng et al. 2025): s_i = exp(mean_t (log π − log π_old)) on every token of
    sequence i, clipped like PPO's ratio. Sequence 0: log-ratios (0.1, 0.3) → s = e^0.2;
    sequence 1: (−0.5) → s = e^−0.5, below the band's 0.7, but with A > 0 the unclipped −A s
    is the larger (pessimistic) term, so it stays. Token mean over 3 tokens."""
    old = torch.zeros(3)
    log_probs = torch.tensor([0.1, 0.3, -0.5], requires_grad=True)
    adv = torch.tensor([-1.0, -1.0, 2.0])
    seq = torch.tensor([0, 0, 1])
    loss, m = objective(0.3, kind="gspo").policy_term(log_probs, old, loss_inputs(adv, torch.ones(3), seq_ids=seq))
    s0, s1 = math.exp(0.2), math.exp(-0.5)
    # seq 0 (A = −1): max(s0, clip(s0) = min(s0, 1.3)) = s0 per token; seq 1 (A = 2): max(−2 s1, −2·0.7) = −2 s1
    assert close(loss, (2 * s0 - 2 * s1) / 3)
    loss.backward()
    # d/dlp_t of Σ_i n_i (−A_i s_i) / 3: every token of sequence i gets −A_i s_i / 3 (s_i's mean spreads n_i back)
    assert close(log_probs.grad, [s0 / 3, s0 / 3, -2 * s1 / 3])
    assert close(m["pg_clipfrac"], 0.0)
    # a tight clip, as GSPO uses, with the advantages' signs flipped: both ratios have moved the way their
    # advantage pulls, past [1 − 4e-4, 1 + 4e-4], so both sequences' clipped terms are active and carry no gradient
    lp2 = log_probs.detach().requires_grad_()
    loss2, m2 = objective(4e-4, kind="gspo").policy_term(lp2, old, loss_inputs(-adv, torch.ones(3), seq_ids=seq))
    assert close(loss2, (2 * -(1 + 4e-4) + 2 * (1 - 4e-4)) / 3) and close(m2["pg_clipfrac"], 1.0)
    loss2.backward()
    assert close(lp2.grad, [0.0, 0.0, 0.0])


def test_cispo_clips_the_weight_and_keeps_every_tokens_gradient_by_hand():
    """CISPO (MiniMax-M1): −sg(clip(r, 1 − ε_low, 1 + ε_high)) · A · log π. Ratios 2.0 and 0.5
    with a band [0.8, 1.2]: weights 1.2 and 0.8. PPO would give the first token (A > 0, clipped)
    no gradient; CISPO gives it −1.2·A."""
    old = torch.zeros(2)
    log_probs = torch.tensor([math.log(2.0), math.log(0.5)], requires_grad=True)
    adv = torch.tensor([1.0, -1.0])
    loss, m = objective(0.2, kind="cispo").policy_term(log_probs, old, loss_inputs(adv, torch.ones(2)))
    assert close(loss, (-1.2 * math.log(2.0) + 0.8 * math.log(0.5)) / 2)
    loss.backward()
    assert close(log_probs.grad, [-1.2 / 2, 0.8 / 2]) and close(m["pg_clipfrac"], 1.0)
    ppo = torch.tensor([math.log(2.0), math.log(0.5)], requires_grad=True)
    objective(0.2).policy_term(ppo, old, loss_inputs(adv, torch.ones(2)))[0].backward()
    assert close(ppo.grad, [0.0, 0.0])  # PPO drops both clipped tokens' gradients


# ---- corrections per sequence, the veto, OPSM -----------------------------------------------


def test_tis_per_sequence_and_geometric_by_hand():
    # log w per token: seq 0 (0.2, 0.4), seq 1 (−0.3); sequence: e^0.6 and e^−0.3; geometric: e^0.3 and e^−0.3
    old = torch.tensor([0.2, 0.4, -0.3])
    rollout = torch.zeros(3)
    seq = torch.tensor([0, 0, 1])
    for level, w0, w1 in (("sequence", math.exp(0.6), math.exp(-0.3)), ("geometric", math.exp(0.3), math.exp(-0.3))):
        c = make_correction(use_tis=True, tis_level=level, tis_clip=1.5)
        factor, sums = behaviour_weights(old, rollout, torch.ones(3), c, seq)
        assert close(factor, [min(w0, 1.5), min(w0, 1.5), w1]), level
    # truncation at 1.5 cuts e^0.6 = 1.82 only: 2 of 3 tokens outside the band
    factor, sums = behaviour_weights(
        old, rollout, torch.ones(3), make_correction(use_tis=True, tis_level="sequence", tis_clip=1.5), seq
    )
    assert close(sums["tis_clipfrac"], 2.0)


def test_the_veto_drops_a_whole_sequence_for_one_catastrophic_token():
    # seq 0 holds a token with w = e^−12 < 1e-4 (the rest ordinary); seq 1 is ordinary. A masked
    # catastrophic token (a tool's answer) vetoes nothing.
    old = torch.tensor([0.0, -12.0, 0.1, 0.0, -12.0])
    rollout = torch.zeros(5)
    mask = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0])
    seq = torch.tensor([0, 0, 0, 1, 1])
    factor, sums = behaviour_weights(old, rollout, mask, make_correction(rs_veto_threshold=1e-4), seq)
    assert close(factor, [0, 0, 0, 1, 1]) and close(sums["rs_veto_frac"], 3.0)


def test_opsm_masks_drifted_negative_sequences_only():
    """Sequence mean of log π_old − log π: seq 0 drifted 0.5 (> δ) with A < 0: masked; seq 1
    drifted 0.5 with A > 0: kept; seq 2 with A < 0 but no drift: kept."""
    old = torch.zeros(4)
    log_probs = torch.tensor([-0.5, -0.5, -0.5, 0.0], requires_grad=True)
    adv = torch.tensor([-1.0, -1.0, 1.0, -1.0])
    seq = torch.tensor([0, 0, 1, 2])
    loss, m = objective(10.0, use_opsm=True, opsm_delta=1e-4).policy_term(
        log_probs, old, loss_inputs(adv, torch.ones(4), seq_ids=seq)
    )
    r = math.exp(-0.5)
    assert close(loss, (-1.0 * r + 1.0) / 4)  # seq 1: −A r; seq 2: −A·1; seq 0 left out
    assert close(m["opsm_clipfrac"], 0.5)
    loss.backward()
    assert close(log_probs.grad, [0.0, 0.0, -r / 4, 1 / 4])


def test_a_custom_tis_hook_sees_whole_sequences_and_its_masks_and_loss_apply():
    seen = {}

    def hook(*, pg_loss, train_log_probs, rollout_log_probs, loss_masks, total_lengths, response_lengths, **kw):
        seen.update(lengths=response_lengths, n=len(train_log_probs), total=total_lengths)
        masks = [torch.cat([torch.zeros(1), m[1:]]) for m in loss_masks]  # drop each sequence's first token
        return pg_loss * 2, masks, {"hook_mean": torch.full_like(pg_loss, 3.0)}

    log_probs = torch.zeros(3)
    adv = torch.tensor([1.0, 1.0, 1.0])
    c = make_correction(custom=hook)
    loss, m = objective(0.2, correction=c).policy_term(
        log_probs, log_probs, loss_inputs(adv, torch.ones(3), torch.zeros(3), torch.tensor([0, 0, 1]))
    )
    assert seen == {"lengths": [2, 1], "n": 2, "total": None}
    # per token −A·1 = −1, doubled, first token of each sequence dropped: (0 − 2 + 0) / 3
    assert close(loss, -2 / 3) and close(m["hook_mean"], 3.0)


# ---- whole runs: every flag trains the tiny model --------------------------------------------

TINY = ["--config", "examples/tiny.yaml", "--custom-rm-path", "varied_reward.digit_share"]
ASYNC = ("train_async.py", ["--max-staleness", "1"])  # decoupled: stale samples, so the corrections act
RUNS = {
    "gspo": ("train.py", ["--advantage-estimator", "gspo", "--eps-clip", "4e-4", "--eps-clip-high", "4e-4"]),
    "cispo": ("train.py", ["--advantage-estimator", "cispo", "--eps-clip", "1", "--eps-clip-high", "4"]),
    "reinforce_plus_plus_baseline": ("train.py", ["--advantage-estimator", "reinforce_plus_plus_baseline"]),
    # three per-sequence corrections in one run (CI time): each reports its own metric
    "opsm+tis-geometric+veto": (
        ASYNC[0],
        [*ASYNC[1], "--use-opsm", "--tis-level", "geometric", "--rs-veto-threshold", "1e-4"],
    ),
    "custom-loss": (
        "train.py",
        ["--loss-type", "custom_loss", "--custom-loss-function-path", "custom_algorithms.reinforce_loss"],
    ),
    # whitening applies after a custom estimator: both in one run
    "custom-advantage+normalize": (
        "train.py",
        ["--custom-advantage-function-path", "custom_algorithms.doubled_grpo", "--normalize-advantages"],
    ),
    "custom-tis": (ASYNC[0], [*ASYNC[1], "--custom-tis-function-path", "custom_algorithms.halve_tis"]),
    # REINFORCE++ through its discounted per-token returns (gamma 1 is the same estimator, unit-tested)
    "reinforce_plus_plus-gamma": ("train.py", ["--advantage-estimator", "reinforce_plus_plus", "--gamma", "0.9"]),
}
# the metric each run must report, so the flag is known to have acted
METRIC = {
    "opsm+tis-geometric+veto": ("train/opsm_clipfrac", "train/tis", "train/rs_veto_frac"),
    "custom-loss": ("train/custom_ratio",),
    "custom-tis": ("train/custom_mismatch",),
}
FAST = ("gspo", "custom-loss")


@pytest.mark.parametrize(
    "name", [n if n in FAST else pytest.param(n, marks=pytest.mark.slow) for n in RUNS]
)  # fmt: skip
def test_each_objective_trains_the_tiny_model(tmp_path, name):
    import json

    from conftest import train_here
    from safetensors.torch import load_file

    from vime.models import resolve_model

    script, extra = RUNS[name]
    # in this process (the script's run without a fresh interpreter's imports): the test reads what it wrote
    train_here(
        script, *TINY, *extra, "--num-rollout", "3", "--runs-dir", str(tmp_path), "--run-name", "r",
        "--save", str(tmp_path / "ckpt"),
    )  # fmt: skip
    rows = [json.loads(x) for x in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "train/loss" in r]
    assert len(rows) == 3 and all(math.isfinite(r["train/loss"]) and r["train/grad_norm"] > 0 for r in rows)
    for metric in METRIC.get(name, ()):
        assert all(metric in r for r in rows), metric
    initial = load_file(str(resolve_model("tiny") / "model.safetensors"))
    final = load_file(str(tmp_path / "ckpt" / "3" / "model.safetensors"))
    assert any(not torch.equal(initial[k], final[k]) for k in initial)


def test_every_new_flag_reaches_the_objective():
    """The flags' wiring: what the parser reads is what the actor's loss applies."""
    from vime.algorithms.objective import Objective
    from vime.config import parse_args

    base = ["--hf-checkpoint", "tiny", "--prompt-data", "p.jsonl", "--num-rollout", "1"]
    o = Objective.of(parse_args([*base, "--advantage-estimator", "gspo", "--use-opsm", "--opsm-delta", "0.01"]))
    assert o.kind == "gspo" and o.opsm_delta == 0.01 and o.per_sequence
    o = Objective.of(parse_args([*base, "--use-tis", "--tis-level", "geometric", "--rs-veto-threshold", "1e-3"]))
    assert o.correction.settings.tis_level == "geometric" and o.correction.settings.rs_veto_threshold == 1e-3
    assert o.per_sequence
    o = Objective.of(parse_args([*base, "--advantage-estimator", "cispo"]))
    assert o.kind == "cispo" and not o.per_sequence  # token-level: the head's chunked gradient stays on
    o = Objective.of(
        parse_args(
            [*base, "--loss-type", "custom_loss", "--custom-loss-function-path", "custom_algorithms.reinforce_loss"]
        )
    )
    assert o.custom_loss is not None and o.per_sequence


def test_a_rollouts_credit_follows_the_loss_the_estimator_and_the_group_sizes():
    """rollout_credit, the train loop's one call: no advantage for the SFT loss; GRPO within each
    group; a fanned-out rollout (a generate that returned several samples) normalized per prompt
    and trimmed to its optimizer steps; REINFORCE++ under --gamma < 1 one return per token."""
    import dataclasses

    from vime.algorithms.credit import rollout_credit
    from vime.config import parse_args

    al = parse_args(["--config", "examples/tiny.yaml", "--num-rollout", "1"]).algorithm

    def groups(*rewards: list[float]) -> list[list[Sample]]:
        return [[Sample(reward=r, response_length=2) for r in g] for g in rewards]

    sft = rollout_credit(groups([1.0, 0.0]), dataclasses.replace(al, loss_type="sft_loss"), 2, 1)
    assert sft.advantages.tolist() == [0.0, 0.0] and sft.rewards.tolist() == [0.0, 0.0]
    grpo = rollout_credit(groups([1.0, 0.0], [3.0, 3.0]), dataclasses.replace(al, advantage_estimator="grpo"), 2, 1)
    assert grpo.advantages.tolist() == pytest.approx([1.0, -1.0, 0.0, 0.0], abs=1e-5)
    fanned = rollout_credit(
        groups([1.0, 0.0, 1.0], [2.0, 0.0]), dataclasses.replace(al, advantage_estimator="grpo"), 2, 2
    )
    assert len(fanned.samples) == 4 and fanned.rewards.tolist() == [1.0, 0.0, 1.0, 2.0]  # 5 trimmed to 2 steps' 4
    assert fanned.advantages[:3].sum().item() == pytest.approx(0.0, abs=1e-5)  # normalized within its own group
    rpp = dataclasses.replace(al, advantage_estimator="reinforce_plus_plus", gamma=0.5)
    per_token = rollout_credit(groups([1.0, 0.0]), rpp, 2, 1).advantages
    assert isinstance(per_token, list) and [t.shape[0] for t in per_token] == [2, 2]
