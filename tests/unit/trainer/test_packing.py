"""How the trainer packs a step's samples into micro-batches (vime/trainer/packing.py): plans
that keep to the token budget and the samples cap, rows built sequence by sequence, ranks
balanced by tokens, and a packed batch that gives a padded HF forward's log-probs and gradients."""

from __future__ import annotations

import random

import pytest
import torch

from unit.trainer.actors import make_args, make_samples
from vime.trainer.actor import Actor
from vime.trainer.packing import PAD_SEGMENT, pack, plan_packed_micro_batches, shard_by_tokens


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
