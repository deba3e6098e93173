"""Rollout routing replay (R3, issue 70) in the trainer, against routing transformers computes:
the replaying router is transformers' router bit for bit when it replays nothing; routing taken
from one forward and replayed in another scores the same log-probs bit for bit; a replay of other
routing changes them while the router still learns; the mismatch, the log-prob gaps and the
load-balancing loss are logged, the latter equal to transformers' own function."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from unit.trainer.actors import make_args, make_samples
from unit.trainer.moe_models import make_tiny_moe
from vime.models import ModelError
from vime.trainer.actor import Actor
from vime.trainer.model import decoder_states
from vime.trainer.moe import MoeShape
from vime.trainer.packing import pack, register_packed_attention
from vime.trainer.routing import Routing, sample_routing

ADVANTAGES = [1.0, -0.5, 0.25, -1.0]
ALONE = 1  # --max-tokens-per-gpu 1: every sequence is a micro-batch of its own, as `hf_routing` runs it


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral"])
def moe_model(request, tmp_path_factory) -> Path:
    return make_tiny_moe(tmp_path_factory.mktemp(request.param) / "model", request.param)


def hf_model(model_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation=register_packed_attention()
    )


def hf_routing(model_dir: Path, tokens: list[int], every_layer: bool = False, pick: str = "top") -> torch.Tensor:
    """The expert ids transformers' own routers choose for each position but the last, packed as
    the trainer packs one sequence, in `Sample.rollout_routed_experts`' layout ([positions,
    layers × top_k] int32): MoE layers only, or (`every_layer`, SGLang's) every decoder layer, a
    dense one's ids 0. `pick` "bottom": the experts they would choose last, in place of their own."""
    hf = hf_model(model_dir)
    layers = hf.get_decoder().layers
    found: dict[int, torch.Tensor] = {}
    hooks = []
    for i, layer in enumerate(layers):
        if hasattr(layer.mlp, "experts"):

            def keep(module, args, out, i=i):
                logits, _, ids = out
                found[i] = ids if pick == "top" else torch.topk(-logits, ids.shape[-1], dim=-1).indices

            hooks.append(layer.mlp.gate.register_forward_hook(keep))
    with torch.no_grad():
        decoder_states(hf, pack([tokens], [1], [0], torch.device("cpu")))
    k = next(iter(found.values())).shape[-1]
    rows = [found.get(i, torch.zeros(len(tokens), k, dtype=torch.long)) for i in range(len(layers))]
    rows = [r for i, r in enumerate(rows) if every_layer or i in found]
    return torch.stack(rows, dim=1)[: len(tokens) - 1].reshape(len(tokens) - 1, -1).to(torch.int32)


def with_routing(samples, model_dir: Path, **kw):
    for s in samples:
        s.rollout_log_probs = [-1.0] * s.response_length  # an engine's, for the gap metrics
        s.rollout_routed_experts = hf_routing(model_dir, s.tokens, **kw)
    return samples


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_router_that_replays_nothing_is_transformers_router_bit_for_bit(moe_model, dtype):
    plain, patched = hf_model(moe_model).to(dtype), hf_model(moe_model).to(dtype)
    Routing.install(MoeShape.of(patched), patched, replay=True)  # nothing to replay: its own choice
    hidden = torch.randn(37, plain.config.hidden_size, dtype=dtype)
    for a, b in zip(plain.model.layers, patched.model.layers):
        for x, y in zip(a.mlp.gate(hidden), b.mlp.gate(hidden)):
            assert x.dtype == y.dtype and torch.equal(x, y)


def test_routing_replayed_from_another_forward_scores_the_same_bit_for_bit(moe_model):
    samples = with_routing(make_samples(4), moe_model)
    replayed = Actor(make_args(use_rollout_routing_replay=True, max_tokens_per_gpu=ALONE), moe_model)
    plain = Actor(make_args(max_tokens_per_gpu=ALONE), moe_model)
    for a, b in zip(replayed.compute_log_probs(samples), plain.compute_log_probs(samples)):
        assert torch.equal(a, b)


def test_every_decoder_layers_routing_as_sglang_sends_it(tmp_path):
    """SGLang's rows hold every decoder layer (a dense one's ids are zeros): the MoE layers' are
    replayed, as from rows of the MoE layers alone."""
    model_dir = make_tiny_moe(tmp_path / "m", "qwen3_moe", num_hidden_layers=3, mlp_only_layers=[1])
    samples = make_samples(2)
    every = [hf_routing(model_dir, s.tokens, every_layer=True) for s in samples]
    moe_only = [hf_routing(model_dir, s.tokens) for s in samples]
    assert every[0].shape[1] == 3 * 2 and moe_only[0].shape[1] == 2 * 2
    moe = Actor(make_args(), model_dir).policy.moe
    for e, m, s in zip(every, moe_only, samples):
        assert torch.equal(sample_routing(e, len(s.tokens), moe), sample_routing(m, len(s.tokens), moe))
        assert (sample_routing(m, len(s.tokens), moe)[-1] == -1).all()  # the last token: the trainer's own
    four_layers = torch.cat([every[0], every[0][:, :2]], dim=1)  # an engine of another model
    with pytest.raises(ModelError, match=r"have 8 ids per position, where this model routes 2 MoE layers \(of 3\)"):
        sample_routing(four_layers, len(samples[0].tokens), moe)


def test_other_routing_replayed_changes_the_log_probs_and_the_router_still_learns(moe_model):
    """The engine's routing taken as the experts the trainer would choose last: replayed, every
    log-prob moves, every scored position × layer counts as a mismatch, the gap with replay is
    the replayed forward's and the gap without it the trainer's own; the router's weights still
    move (its gate weights are the trainer's softmax at the replayed experts)."""
    samples = with_routing(make_samples(4), moe_model, pick="bottom")
    replayed = Actor(make_args(use_rollout_routing_replay=True, max_tokens_per_gpu=ALONE), moe_model)
    plain = Actor(make_args(max_tokens_per_gpu=ALONE), moe_model)
    ours, theirs = plain.compute_log_probs(samples), replayed.compute_log_probs(samples)
    assert all(not torch.allclose(a, b) for a, b in zip(ours, theirs))
    router = "model.layers.0.mlp.gate.weight"
    before = dict(replayed.model.named_parameters())[router].detach().clone()
    m = replayed.train_step(samples, ADVANTAGES)
    assert not torch.equal(before, dict(replayed.model.named_parameters())[router])
    assert m["train/routing_mismatch"] == 1.0  # bottom-2 and top-2 of 4 experts never meet
    gap = lambda lps: sum(float((lp + 1.0).abs().sum()) for lp in lps) / sum(s.response_length for s in samples)  # noqa: E731
    assert m["train/logprob_gap_replay"] == pytest.approx(gap(theirs), rel=1e-5)
    assert m["train/logprob_gap_no_replay"] == pytest.approx(gap(ours), rel=1e-5)


def test_recorded_routing_is_measured_without_being_replayed(moe_model):
    """--record-routed-experts: the training forward keeps the trainer's routing (the same update
    as a run without routing), and the same metrics come: no mismatch and one gap when the
    engine routed as the trainer does."""
    samples = with_routing(make_samples(4), moe_model)
    recorded = Actor(make_args(record_routed_experts=True, max_tokens_per_gpu=ALONE), moe_model)
    plain = Actor(make_args(max_tokens_per_gpu=ALONE), moe_model)
    m = recorded.train_step(samples, ADVANTAGES)
    plain.train_step([s for s in samples], ADVANTAGES)
    assert m["train/routing_mismatch"] == 0.0
    assert m["train/logprob_gap_replay"] == pytest.approx(m["train/logprob_gap_no_replay"], abs=1e-6)
    ours, theirs = dict(recorded.named_weights()), dict(plain.named_weights())  # each read to its end
    assert all(torch.equal(t, theirs[n]) for n, t in ours.items())


def test_replay_without_routing_on_a_sample_is_refused(moe_model):
    replayed = Actor(make_args(use_rollout_routing_replay=True), moe_model)
    with pytest.raises(ValueError, match="2 of the step's 2 samples carry no routed experts"):
        replayed.train_step(make_samples(2), [1.0, -1.0])


def test_the_balance_loss_is_transformers_per_layer_and_moves_the_router(moe_model):
    """train/moe_aux_loss is Switch's loss summed over the MoE layers: transformers'
    load_balancing_loss_func of each layer's logits over top-k (it counts each token's k
    choices against the token count) — and --moe-aux-loss-coeff puts it in the gradient."""
    from transformers import AutoModelForCausalLM

    sample = make_samples(1)[0]
    hf = AutoModelForCausalLM.from_pretrained(moe_model, dtype=torch.float32)
    module = __import__(type(hf).__module__, fromlist=["load_balancing_loss_func"])
    with torch.no_grad():
        logits = hf(torch.tensor([sample.tokens]), output_router_logits=True).router_logits
    k, e = hf.config.num_experts_per_tok, logits[0].shape[-1]
    expected = sum(float(module.load_balancing_loss_func((lg,), e, k)) for lg in logits) / k

    no_weight = Actor(make_args(clip_grad=0.0), moe_model)  # no clip: a norm of all gradients would mix them
    weighted = Actor(make_args(clip_grad=0.0, moe_aux_loss_coeff=0.5), moe_model)
    m0, m1 = no_weight.train_step([sample], [1.0]), weighted.train_step([sample], [1.0])
    assert m0["train/moe_aux_loss"] == pytest.approx(expected, rel=1e-5) == m1["train/moe_aux_loss"]
    w0, w1 = dict(no_weight.named_weights()), dict(weighted.named_weights())
    routers = [n for n in w0 if n.endswith(".gate.weight")]
    assert routers and all(not torch.equal(w0[n], w1[n]) for n in routers)
    assert torch.equal(w0["lm_head.weight"], w1["lm_head.weight"])  # the head is upstream of no router
