"""The trainer on CUDA: FSDP2 on two ranks over NCCL against one rank, the Triton LM head,
deferred gradient reduction, gradient checkpointing, the head-forward gradient, a non-finite
gradient in the fused step, checkpoints resumed, KL to a reference, LoRA compiled under FSDP2,
and FlashAttention-4 against FlashAttention-2 and float32 attention. Run on a GPU machine with `make test-gpu` (never in CI, which has no GPU; here every test
skips)."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

from gpu.marks import two_gpus
from vime.models import make_tiny_model

pytestmark = pytest.mark.gpu


@two_gpus
def test_fsdp2_two_ranks_match_one_rank(tmp_path):
    """The same GRPO step on FSDP2 over 1 and 2 NCCL ranks: same loss and log-probs within
    bfloat16 tolerance (bf16 compute, float32 master weights on both)."""
    from unit.trainer.actors import make_args, make_samples

    from vime.trainer.distributed import launch_actor

    model = make_tiny_model(tmp_path / "m", arch="qwen3", seed=0)
    samples = make_samples(6)
    advantages = [1.0, -0.5, 0.25, -1.0, 2.0, -0.75]
    results = []
    for gpus in (1, 2):
        actor = launch_actor(
            make_args(actor_num_gpus_per_node=gpus, global_batch_size=6, max_tokens_per_gpu=64), model, "cuda:0"
        )
        try:
            lp = [t.float().cpu() for t in actor.compute_log_probs(samples)]
            m = actor.train_step(samples, advantages)
            w = {n: t.float().cpu() for n, t in actor.named_weights()}
        finally:
            actor.close()
        results.append((lp, m, w))
    (lp1, m1, w1), (lp2, m2, w2) = results
    for x, y in zip(lp1, lp2):
        assert torch.allclose(x, y, atol=2e-2)
    for k in ("train/loss", "train/pg_loss", "train/grad_norm"):
        assert abs(m1[k] - m2[k]) <= 2e-2 * max(1.0, abs(m1[k])), (k, m1[k], m2[k])
    moved = [n for n in w1 if not torch.equal(w1[n], w2[n])]
    assert sorted(w1) == sorted(w2)
    # float32 master weights after one AdamW step of lr 1e-3: within a step's size of each other
    for n in w1:
        assert torch.allclose(w1[n], w2[n], atol=2.5e-3), (n, moved[:3])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_triton_chunked_head_equals_eager_on_cuda(monkeypatch):
    """The LM head's Triton chunk kernels (what training runs on CUDA) against the same math in
    PyTorch on the same bf16 inputs: log-probs, entropies and both gradients."""
    from vime.trainer import logprobs

    g = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(3000, 64, device="cuda", generator=g).bfloat16().requires_grad_()
    weight = (torch.randn(5000, 64, device="cuda", generator=g) / 4).bfloat16().requires_grad_()
    targets = torch.randint(0, 5000, (3000,), device="cuda", generator=g)
    up_lp, up_ent = torch.randn(3000, device="cuda", generator=g), torch.randn(3000, device="cuda", generator=g)

    def run():
        lp, ent = logprobs.chunked_log_probs(
            hidden, weight, targets, temperature=0.7, with_entropy=True, chunk_size=1024
        )  # last chunk 952 rows
        return (lp, ent, *torch.autograd.grad((lp * up_lp).sum() + (ent * up_ent).sum(), [hidden, weight]))

    triton_ = run()
    monkeypatch.setattr(logprobs, "_fused", lambda device: (logprobs._stats, logprobs._grad_logits))
    eager = run()
    assert torch.allclose(triton_[0], eager[0], atol=1e-4) and torch.allclose(triton_[1], eager[1], atol=1e-4)
    for c, e in zip(triton_[2:], eager[2:]):  # bf16 gradients: 1-ulp flips of dz add up, so compare as a whole
        assert float((c.float() - e.float()).norm() / e.float().norm()) < 1e-3
    # and the whole head (chunking, recompute, float32 accumulation of the weight's gradient over
    # chunks) against plain autograd through full float32 logits of the same bf16 inputs
    h32, w32 = hidden.detach().float().requires_grad_(), weight.detach().float().requires_grad_()
    log_p = torch.log_softmax(h32 @ w32.t() / 0.7, dim=-1)
    lp, ent = log_p.gather(-1, targets[:, None])[:, 0], -(log_p.exp() * log_p).sum(-1)
    reference = (lp, ent, *torch.autograd.grad((lp * up_lp).sum() + (ent * up_ent).sum(), [h32, w32]))
    for c, r in zip(triton_, reference):  # bf16 logits (as training has them) against float32 ones
        assert float((c.float() - r).norm() / r.norm()) < 1e-2, float((c.float() - r).norm() / r.norm())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_one_rank_defers_gradient_reduction_exactly(tmp_path):
    """One FSDP2 rank accumulates gradients unsharded in float32 and reduces once after the last
    micro-batch (no cast-and-copy per layer per micro-batch): the accumulated gradients are bit
    for bit those of reducing after every micro-batch. The reference arm runs twice first, so a
    nondeterministic kernel would show as such rather than as a difference between the arms.
    The deferred arm accumulates with the trainer's Triton add (`model.accumulate`), set on
    every parameter."""
    from unit.trainer.actors import make_args, make_samples

    from vime.trainer import model as model_mod
    from vime.trainer.distributed import launch_actor

    model = make_tiny_model(tmp_path / "m", arch="qwen3", seed=0)
    samples = make_samples(6)
    advantages = [1.0, -0.5, 0.25, -1.0, 2.0, -0.75]
    actor = launch_actor(make_args(global_batch_size=6, max_tokens_per_gpu=24), model, "cuda:0")
    local = actor.local
    try:
        assert local.optimizer_step.defer_grad_sync and len(local.batches.plan(samples)) >= 3
        params = model_mod.fsdp_params(local.policy.scorer)
        assert len(params) == len(list(local.model.parameters())) and all(
            p.accumulate_unsharded_grad_if_needed.__func__ is model_mod._accumulate_unsharded for p in params
        )

        def grads(defer: bool) -> dict[str, torch.Tensor]:
            local.optimizer_step.defer_grad_sync = defer
            local.optimizer_step.optimizer.zero_grad(set_to_none=True)
            local.accumulate_gradients(samples, advantages, None)
            return {n: p.grad.full_tensor().cpu() for n, p in local.model.named_parameters()}

        per_mb, again, deferred = grads(False), grads(False), grads(True)
    finally:
        actor.close()
    assert all(torch.equal(per_mb[n], again[n]) for n in per_mb), "kernels are not deterministic here"
    assert all(per_mb[n].dtype == torch.float32 for n in per_mb)
    assert all(torch.equal(per_mb[n], deferred[n]) for n in per_mb)
    assert any(per_mb[n].abs().sum() > 0 for n in per_mb)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_gradient_checkpointing_on_cuda_keeps_less_and_gives_the_gradients_of_none(tmp_path, compiled):
    """--gradient-checkpointing on CUDA (bf16, the varlen FlashAttention that `auto` settles on,
    one FSDP2 rank), eager and compiled: on 400-token sequences the forward keeps under half of
    what it keeps without checkpointing, and the gradients are those without it within bf16 rounding (FlashAttention's
    backward adds dQ up across key blocks in no fixed order; compiled, the two are different
    graphs). On short sequences (one key block) the eager gradients are equal bit for bit.
    Eagerly the recomputation is a second Python forward of each layer; compiled, it is part of
    the compiled backward, which the warm-up compiled. The attention kernel was settled at load
    (`packing.choose_kernel`), so no kernel is tried inside a checkpointed forward."""
    import torch._dynamo.utils
    from unit.trainer.actors import long_samples, make_args, make_samples, relative_gap, saved_bytes_and_grads

    from vime.trainer import packing
    from vime.trainer.distributed import launch_actor

    model = make_tiny_model(tmp_path / "m", arch="qwen3", seed=0)
    long, short = (long_samples(3), [1.0, -0.5, 2.0]), (make_samples(6), [1.0, -0.5, 0.25, -1.0, 2.0, -0.75])
    args = make_args(max_tokens_per_gpu=1024, micro_batch_size=2, gradient_checkpointing=True, compile=compiled)
    actor = launch_actor(args, model, "cuda:0")
    local = actor.local
    try:
        local.ready()
        layers = local.model.get_decoder().layers
        calls = [0]
        layers[0].mlp.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
        assert packing.packed_attention_backend(layers[0].self_attn, local.ranks.device, torch.bfloat16) in (
            "fa4",
            "fa2",
        )
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        checkpointed = {"short": saved_bytes_and_grads(local, *short), "long": saved_bytes_and_grads(local, *long)}
        if compiled:
            assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs
        else:  # forward + recompute
            assert calls[0] == 2 * (len(local.batches.plan(short[0])) + len(local.batches.plan(long[0])))
        for layer in layers:
            layer.gradient_checkpointing = False
        plain = {"short": saved_bytes_and_grads(local, *short), "long": saved_bytes_and_grads(local, *long)}
    finally:
        actor.close()
    (kept, grads), (kept_plain, grads_plain) = checkpointed["long"], plain["long"]
    assert kept < kept_plain / 2, (kept, kept_plain)
    assert relative_gap(grads, grads_plain) < 1e-2, relative_gap(grads, grads_plain)
    if not compiled:
        (_, grads), (_, grads_plain) = checkpointed["short"], plain["short"]
        assert all(torch.equal(grads[n], grads_plain[n]) for n in grads_plain)
    assert any(grads_plain[n].abs().sum() > 0 for n in grads_plain)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_gradient_taken_in_the_head_forward_is_exact_on_cuda(tmp_path):
    """On CUDA (Triton head kernels, bf16 compute, one FSDP2 rank) the loss's gradient taken
    per head chunk in the forward (`chunked_loss`, the default) equals bit for bit the one
    through log-probs first and the loss after, over several micro-batches and chunks. The
    reference arm runs twice first, so a nondeterministic kernel would show as such."""
    from unit.trainer.actors import make_args, make_samples

    from vime.trainer.distributed import launch_actor

    model = make_tiny_model(tmp_path / "m", arch="qwen3", seed=0)
    samples = make_samples(6)
    advantages = [1.0, -0.5, 0.25, -1.0, 2.0, -0.75]
    args = make_args(global_batch_size=6, max_tokens_per_gpu=24, logprob_chunk_size=5, entropy_coef=0.01)
    actor = launch_actor(args, model, "cuda:0")
    local = actor.local
    try:
        assert local.optimizer_step.grad_in_forward and len(local.batches.plan(samples)) >= 3

        def grads(in_forward: bool) -> dict[str, torch.Tensor]:
            local.optimizer_step.grad_in_forward = in_forward
            local.optimizer_step.optimizer.zero_grad(set_to_none=True)
            local.accumulate_gradients(samples, advantages, None)
            return {n: p.grad.full_tensor().cpu() for n, p in local.model.named_parameters()}

        after, again, in_forward = grads(False), grads(False), grads(True)
    finally:
        actor.close()
    assert all(torch.equal(after[n], again[n]) for n in after), "kernels are not deterministic here"
    assert all(torch.equal(after[n], in_forward[n]) for n in after)
    assert any(after[n].abs().sum() > 0 for n in after)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_non_finite_gradient_skips_the_fused_step_on_the_device(tmp_path):
    """On CUDA the fused AdamW skips a step with a non-finite gradient norm itself (`found_inf`),
    so the host never waits for the norm before the step. A skipped step must leave the weights
    and AdamW's state as they were: the clean step after it gives bit for bit the weights of a
    clean step taken first."""
    from unit.trainer.actors import make_args, make_samples

    from vime.trainer.distributed import launch_actor

    model = make_tiny_model(tmp_path / "m", arch="qwen3", seed=0)
    samples = make_samples(4)
    advantages = [1.0, -0.5, 0.25, -1.0]
    actor = launch_actor(make_args(global_batch_size=4, max_tokens_per_gpu=64), model, "cuda:0")
    local = actor.local
    params = list(local.model.parameters())

    def snapshot() -> list[torch.Tensor]:
        return [p.detach().full_tensor().clone() for p in params]

    def step(poison: bool) -> dict[str, float]:
        local.optimizer_step.optimizer.zero_grad(set_to_none=True)
        local.accumulate_gradients(samples, advantages, None)
        if poison:
            with torch.no_grad():
                params[0].grad.to_local().view(-1)[0] = float("inf")
        return local.optimizer_step.clip_and_step()

    try:
        assert local.optimizer_step.optimizer.defaults["fused"]
        start = snapshot()
        clean = step(poison=False)
        after_clean = snapshot()
        with torch.no_grad():  # back to the start: weights and a fresh AdamW state
            for p, w in zip(params, start):
                p.to_local().copy_(w)
        local.optimizer_step.optimizer.state.clear()
        skipped = step(poison=True)
        after_skip = snapshot()
        steps = [float(s["step"]) for s in local.optimizer_step.optimizer.state.values()]
        again = step(poison=False)
        after_again = snapshot()
    finally:
        actor.close()
    assert clean["train/skipped_steps"] == 0 and again["train/skipped_steps"] == 0
    assert skipped["train/skipped_steps"] == 1 and not math.isfinite(skipped["train/grad_norm"])
    assert all(torch.equal(a, b) for a, b in zip(start, after_skip))
    assert steps and all(s == 0 for s in steps)  # AdamW's step counts were rolled back too
    assert any(not torch.equal(a, b) for a, b in zip(start, after_clean))
    assert all(torch.equal(a, b) for a, b in zip(after_clean, after_again))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_a_checkpoint_saved_on_cuda_resumes_exactly(tmp_path, optimizer):
    """Save and load on CUDA (FSDP2's DTensors, float32 weights under bf16 compute; the fused
    AdamW's step counts on the device, or --optimizer sgd's momentum buffers): a fresh trainer
    that loads the checkpoint holds the saved weights, optimizer state and RNG bit for bit, and
    its next step, on samples other than the first step's (so a lost optimizer state would
    show), gives bit for bit the weights of the trainer that saved it taking that step. The
    resumed step runs twice first, so a nondeterministic kernel shows as such."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
    from unit.trainer.actors import make_args, make_samples

    from vime.trainer.distributed import launch_actor

    model = make_tiny_model(tmp_path / "m", arch="qwen3", seed=0)
    args = make_args(optimizer=optimizer, sgd_momentum=0.9, lr=1e-2, max_tokens_per_gpu=64, compile=False)
    first, second, advantages = make_samples(4, seed=0), make_samples(4, seed=1), [1.0, -0.5, 0.25, -1.0]

    def weights(actor) -> dict[str, torch.Tensor]:
        return {n: p.detach().full_tensor().cpu() for n, p in actor.local.model.named_parameters()}

    def rng_states() -> tuple:
        return random.getstate(), np.random.get_state()[1], torch.get_rng_state(), torch.cuda.get_rng_state()

    def same_rng_states(a: tuple, b: tuple) -> bool:
        return a[0] == b[0] and np.array_equal(a[1], b[1]) and torch.equal(a[2], b[2]) and torch.equal(a[3], b[3])

    def optimizer_state(actor) -> dict[str, dict]:
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        state = get_optimizer_state_dict(actor.local.model, actor.local.optimizer_step.optimizer, options=options)[
            "state"
        ]
        return {n: {k: v.clone() if torch.is_tensor(v) else v for k, v in e.items()} for n, e in state.items()}

    saver = launch_actor(args, model, "cuda:0")
    try:
        saver.train_step(first, advantages)
        ckpt = saver.save(tmp_path / "ckpt" / "1", {"step": 1})
        saved, saved_state = weights(saver), optimizer_state(saver)
        rng = rng_states()
        saver.train_step(second, advantages)
        stepped = weights(saver)
    finally:
        saver.close()
    resumed = []
    for _ in range(2):
        random.seed(7), np.random.seed(7), torch.manual_seed(7)  # the RNGs moved on; load brings them back
        loader = launch_actor(args, model, "cuda:0")
        try:
            assert loader.load(ckpt) == {"step": 1}
            loaded, loaded_state = weights(loader), optimizer_state(loader)
            assert same_rng_states(rng_states(), rng)
            loader.train_step(second, advantages)
            resumed.append(weights(loader))
        finally:
            loader.close()
    assert all(torch.equal(loaded[n], saved[n]) for n in saved)
    assert saved_state.keys() == loaded_state.keys() and saved_state  # SGD with momentum keeps buffers too
    for name, entries in saved_state.items():
        for key, value in entries.items():
            got = loaded_state[name][key]
            assert torch.equal(got.cpu(), value.cpu()) if torch.is_tensor(value) else got == value, (name, key)
    assert any(not torch.equal(stepped[n], saved[n]) for n in saved)
    assert all(torch.equal(resumed[0][n], resumed[1][n]) for n in saved), "kernels are not deterministic here"
    assert all(torch.equal(resumed[0][n], stepped[n]) for n in saved)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_kl_to_a_reference_with_two_optimizer_steps_per_rollout_on_cuda(tmp_path):
    """The old and reference log-probs are computed on the GPU before the steps; packing them into
    a micro-batch once pinned them as if they were host tensors, which crashed every CUDA run with
    --kl-loss-coef > 0 or several optimizer steps per rollout. Both at once, from a separate
    --ref-load directory, with the lr schedule stepping: the weights move, the KL is finite and
    positive once the policy has left the reference."""
    from unit.trainer.actors import make_args, make_samples

    from vime.trainer.distributed import launch_actor

    model = make_tiny_model(tmp_path / "m", arch="qwen3", seed=0)
    ref = make_tiny_model(tmp_path / "ref", arch="qwen3", seed=1)
    samples = make_samples(4)
    args = make_args(
        global_batch_size=2, max_tokens_per_gpu=64, kl_loss_coef=0.1, ref_load=str(ref), lr=1e-3,
        lr_warmup_iters=1, num_rollout=2,
    )  # fmt: skip
    actor = launch_actor(args, model, "cuda:0")
    try:
        before = [p.detach().full_tensor().clone() for p in actor.local.model.parameters()]
        metrics = actor.train_step(samples, [1.0, -0.5, 0.25, -1.0])
        after = [p.detach().full_tensor() for p in actor.local.model.parameters()]
    finally:
        actor.close()
    assert math.isfinite(metrics["train/kl_loss"]) and metrics["train/kl_loss"] > 0
    assert metrics["train/lr"] == pytest.approx(0.5e-3)  # steps 0 and 1 of a 1-step warm-up: lr 0, then 1e-3
    assert any(not torch.equal(a, b) for a, b in zip(before, after))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_lora_trains_only_adapters_compiled_under_fsdp2_on_cuda(tmp_path):
    """LoRA's forward hooks inside the per-layer compiled, FSDP2-wrapped (bf16 compute) decoder:
    the adapters move, the base stays bit for bit, and the merged weights (what is pushed)
    score the samples as the LoRA model does, within bf16's rounding, where the base weights
    alone are far off."""
    from unit.trainer.actors import make_args, make_samples

    from vime.trainer.actor import Actor
    from vime.trainer.distributed import launch_actor

    model = make_tiny_model(tmp_path / "m", arch="qwen3", seed=0)
    samples = make_samples(4)
    args = make_args(lora_rank=4, lora_alpha=8.0, lr=5e-2, max_tokens_per_gpu=64, compile=True)
    actor = launch_actor(args, model, "cuda:0")
    try:
        named = dict(actor.local.model.named_parameters())
        base = {n: p.detach().full_tensor().clone() for n, p in named.items() if "lora_" not in n}
        for _ in range(3):
            assert actor.train_step(samples, [1.0, -0.5, 0.25, -1.0])["train/grad_norm"] > 0
        assert all(torch.equal(p.detach().full_tensor(), base[n]) for n, p in named.items() if n in base)
        weights = dict(actor.named_weights())
        lora_lp = actor.compute_log_probs(samples)
    finally:
        actor.close()
    plain = Actor(make_args(compile=False), model, "cuda:0")  # float32, no adapters

    def gap() -> float:
        return max(float((a.cpu() - b.cpu()).abs().max()) for a, b in zip(lora_lp, plain.compute_log_probs(samples)))

    from_base = gap()
    plain.model.load_state_dict({n: t.to("cuda:0") for n, t in weights.items()}, strict=False)
    from_merged = gap()
    assert from_merged < 5e-2 and from_merged < from_base / 2, (from_merged, from_base)


def _fa4_or_skip(device: torch.device, heads: int, kv_heads: int, head_dim: int) -> None:
    """Skip where flash-attn-4 is not installed (it is optional: carried as wheels by
    bench/fa4_prep.sh); anything else that keeps it from running here fails the test."""
    from vime.trainer import flash4

    why = flash4.unusable(device, heads, kv_heads, head_dim)
    if why is not None and why.startswith(flash4.NOT_INSTALLED):
        pytest.skip(why)
    assert why is None, why


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fa4_is_as_close_to_float32_attention_as_fa2_on_a_grpo_micro_batch():
    """FlashAttention-4 (`--attention-kernel fa4`) against float32 attention per sequence, the
    output and the three gradients, on one packed micro-batch of GRPO-like lengths (a
    one-token sequence among them) at Qwen3-0.6B's heads (16 query, 8 key/value, head dim 128):
    no further off than torch's FlashAttention-2 on the same row, doubled (bf16 rounding: FA2
    is ~6e-3 off on bench_attention.py's batch), and its forward the same on a second call."""
    import itertools

    from torch.nn.attention.varlen import varlen_attn

    from vime.trainer import flash4, packing

    dev = torch.device("cuda:0")
    _fa4_or_skip(dev, 16, 8, 128)
    lengths = [1800, 412, 95, 2600, 1, 733]
    cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=dev)
    gen = torch.Generator(device=dev).manual_seed(0)
    q, k, v = (
        torch.randn(sum(lengths), n, 128, device=dev, dtype=torch.bfloat16, generator=gen).requires_grad_()
        for n in (16, 8, 8)
    )
    grad = torch.randn(q.shape, device=dev, dtype=torch.bfloat16, generator=gen)
    scale, longest = 128**-0.5, max(lengths)
    leaves = [x.detach().float().requires_grad_() for x in (q, k, v)]
    ref = flash4.reference(*leaves, cu, scale)
    want = (ref, *torch.autograd.grad(ref, leaves, grad.float()))

    def errors(out: torch.Tensor) -> list[float]:
        got = (out, *torch.autograd.grad(out, (q, k, v), grad))
        return [flash4.relative_error(g, w) for g, w in zip(got, want)]

    fa4_out = flash4.fa4_varlen(q, k, v, cu, longest, scale)[0]
    fa4 = errors(fa4_out)
    fa2 = errors(varlen_attn(q, k, v, cu, cu, longest, longest, scale=scale, **packing._VARLEN))
    assert all(e4 <= max(2 * e2, 1e-2) for e4, e2 in zip(fa4, fa2)), (fa4, fa2)
    with torch.no_grad():  # the same inputs (FA4 reads requires_grad when it picks its kernel)
        again = flash4.fa4_varlen(q, k, v, cu, longest, scale)[0]
    assert torch.equal(again, fa4_out.detach())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_compiled_trainer_on_fa4_scores_and_accumulates_gradients_as_one_on_fa2(tmp_path, monkeypatch):
    """Two compiled one-rank trainers (bf16 compute under FSDP2), `--attention-kernel fa4` and
    `fa2`, against a float32 trainer without FSDP2 (per-sequence SDPA): fa4's log-probs and
    gradients on 400-token sequences are no further from float32's than fa2's, doubled, plus
    1e-3, and its compiled layers call FA4's kernels (counted in the ops' bodies, which run
    outside the compiled graphs), forward and backward, where fa2's call none."""
    from unit.trainer.actors import long_samples, make_args, relative_gap, saved_bytes_and_grads

    from vime.trainer import flash4, packing
    from vime.trainer.actor import Actor
    from vime.trainer.distributed import launch_actor

    dev = torch.device("cuda:0")
    # head dim 64, not the tiny model's 16: by its source, FA4 b40's Hopper backward lays its
    # float32 accumulators out in steps of 32 but writes them in steps of 16, so off multiples of
    # 32 its gradients are wrong; its own tests run the backward at 64 and up
    model = make_tiny_model(tmp_path / "m", arch="qwen3", seed=0, head_dim=64)
    _fa4_or_skip(dev, 4, 2, 64)
    samples, advantages = long_samples(3), [1.0, -0.5, 2.0]

    def scores_and_grads(local: Actor) -> tuple[torch.Tensor, dict]:
        local.ready()
        scores = torch.cat([x.float().cpu() for x in local.compute_log_probs(samples)])
        return scores, saved_bytes_and_grads(local, samples, advantages)[1]

    fp32 = Actor(make_args(max_tokens_per_gpu=1024, compile=False), model, "cuda:0")
    want = scores_and_grads(fp32)
    fp32.close()
    got, calls = {}, {}
    module = flash4._fa4()
    for kernel in ("fa2", "fa4"):
        actor = launch_actor(make_args(max_tokens_per_gpu=1024, attention_kernel=kernel), model, "cuda:0")
        try:
            attention = actor.local.model.get_decoder().layers[0].self_attn
            assert (
                actor.local.policy.compiled
                and packing.packed_attention_backend(attention, dev, torch.bfloat16) == kernel
            )
            actor.local.ready()
            counted: list[int] = []
            monkeypatch.setattr(flash4, "_fa4", lambda counted=counted: counted.append(1) or module)
            got[kernel] = scores_and_grads(actor.local)
            calls[kernel] = len(counted)
        finally:
            actor.close()
    layers = 2  # make_tiny_model's default; each layer's attention runs forward (scoring, training) and backward
    assert calls["fa2"] == 0 and calls["fa4"] >= 3 * layers, calls
    score_gap = {n: float((s - want[0]).abs().max()) for n, (s, _) in got.items()}
    grad_gap = {n: relative_gap(g, want[1]) for n, (_, g) in got.items()}
    assert score_gap["fa4"] <= 2 * score_gap["fa2"] + 1e-3, score_gap
    assert grad_gap["fa4"] <= 2 * grad_gap["fa2"] + 1e-3, grad_gap
    assert 0 < grad_gap["fa2"] < 0.1, grad_gap  # bf16 against float32: near, not equal
