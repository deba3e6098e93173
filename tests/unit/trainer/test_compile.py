"""What the trainer compiles and recomputes: gradient checkpointing of the first n layers
(compiled, it keeps a fraction and changes no gradient), compiled layers against eager, one
compile for any lengths, the warm-up thread and a trainer closed during it, and the LM head's
Triton kernels under the Triton interpreter (this file run as a script, where Triton is
installed: `make test-vllm`'s environment)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from unit.trainer.actors import long_samples, make_args, make_samples, relative_gap, saved_bytes_and_grads
from vime.trainer.actor import Actor


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
    from unit.engine.triton_interpreter import patch_triton_interpreter
    from vime.trainer import logprobs

    patch_triton_interpreter()
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


if __name__ == "__main__":
    _interpreted_head_checks()
    _interpreted_accumulate_checks()
