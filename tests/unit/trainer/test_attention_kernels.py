"""The trainer's packed attention kernels as `--attention-kernel` chooses them
(vime/trainer/packing.py, vime/trainer/flash4.py).

FlashAttention-4's kernels run on Hopper and Blackwell GPUs only: `make test-gpu` checks them
against FlashAttention-2 and float32 attention, and a trainer's log-probs with each. Here, on CPU,
vime's FA4 ops run over a float32 stand-in for the package's two entry points, called by the
package's own parameter names, which checks what vime adds around the kernels: the custom ops'
registration (schema, fake shapes, autograd, compile), the layouts and GQA, and the choice's
refusals."""

from __future__ import annotations

import pytest
import torch

from unit.trainer.actors import make_args
from vime.errors import ConfigError
from vime.trainer import flash4, packing
from vime.trainer.actor import Actor


def _lse(q: torch.Tensor, k: torch.Tensor, cu: torch.Tensor, scale: float) -> torch.Tensor:
    """log-sum-exp of each query's causal scores, [H, T] (what FA4 returns beside its output)."""
    groups = q.shape[1] // k.shape[1]
    bounds = cu.tolist()
    parts = []
    for a, b in zip(bounds, bounds[1:]):
        qs, ks = q[a:b].float().transpose(0, 1), k[a:b].float().transpose(0, 1).repeat_interleave(groups, dim=0)
        scores = qs @ ks.transpose(1, 2) * scale
        mask = torch.ones(b - a, b - a, dtype=torch.bool).tril()
        parts.append(scores.masked_fill(~mask, float("-inf")).logsumexp(-1))
    return torch.cat(parts, dim=1)


class Fa4StandIn:
    """`flash_attn.cute.interface`'s `_flash_attn_fwd` and `_flash_attn_bwd`, computed in float32
    by `flash4.reference`, with the parameters (names and positions) vime passes them; where the
    package is installed, `test_vimes_calls_bind_to_fa4s_own_signatures` binds the recorded calls
    to the real ones."""

    calls: list[tuple[str, tuple, dict]] = []

    @staticmethod
    def _flash_attn_fwd(q, k, v, qv=None, cu_seqlens_q=None, cu_seqlens_k=None, *, max_seqlen_q, max_seqlen_k, softmax_scale, causal, return_lse):  # fmt: skip
        assert causal and return_lse and cu_seqlens_q is cu_seqlens_k and qv is None
        assert max_seqlen_q == max_seqlen_k == int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
        kwargs = dict(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q)
        kwargs.update(max_seqlen_k=max_seqlen_k, softmax_scale=softmax_scale, causal=causal, return_lse=return_lse)
        Fa4StandIn.calls.append(("fwd", (q, k, v), kwargs))
        out = flash4.reference(q, k, v, cu_seqlens_q, softmax_scale).to(q.dtype)
        return out, _lse(q, k, cu_seqlens_q, softmax_scale), None, None, None

    @staticmethod
    def _flash_attn_bwd(q, k, v, out, dout, lse, softmax_scale, causal, *, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):  # fmt: skip
        assert causal and cu_seqlens_q is cu_seqlens_k and lse.shape == (q.shape[1], q.shape[0])
        kwargs = dict(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q)
        Fa4StandIn.calls.append(
            ("bwd", (q, k, v, out, dout, lse, softmax_scale, causal), kwargs | {"max_seqlen_k": max_seqlen_k})
        )
        # by formula, as a kernel would (an op's body runs below autograd): the CPU path's own
        # backward (`packing._sdpa_per_sequence_backward`, [1, H, T, D] with keys and values per
        # query head), the key and value gradients then summed over the query heads that share them
        groups = q.shape[1] // k.shape[1]
        per_head = [
            x.transpose(0, 1)[None] for x in (dout, q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1))
        ]
        gq, gk, gv = (
            g[0].transpose(0, 1) for g in packing._sdpa_per_sequence_backward(*per_head, cu_seqlens_q, softmax_scale)
        )
        return gq, *(g.unflatten(1, (k.shape[1], groups)).sum(2) for g in (gk, gv))


@pytest.fixture
def stand_in(monkeypatch) -> type[Fa4StandIn]:
    monkeypatch.setattr(flash4, "_fa4", lambda: Fa4StandIn)
    Fa4StandIn.calls = []
    return Fa4StandIn


def packed_row(heads: int = 4, kv_heads: int = 2, dim: int = 16) -> tuple[torch.Tensor, ...]:
    """q [T, H, D], k and v [T, Hkv, D] of three packed sequences, and their cu_seqlens."""
    gen = torch.Generator().manual_seed(0)
    cu = torch.tensor([0, 13, 40, 46], dtype=torch.int32)
    q, k, v = (torch.randn(46, n, dim, generator=gen, requires_grad=True) for n in (heads, kv_heads, kv_heads))
    return q, k, v, cu


def test_the_fa4_ops_register_their_fakes_autograd_and_compile_and_give_attentions_gradients(stand_in):
    q, k, v, cu = packed_row()
    # schema, fake shapes (dynamic too), autograd registration, and the op compiled forward + backward
    torch.library.opcheck(flash4.fa4_varlen, (q, k, v, cu, 27, 0.25))
    out, lse = flash4.fa4_varlen(q, k, v, cu, 27, 0.25)
    assert lse.dtype == torch.float32 and lse.shape == (4, 46) and out.requires_grad and not lse.requires_grad
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    got = (out, *torch.autograd.grad(out, (q, k, v), grad))
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    ref = flash4.reference(*leaves, cu, 0.25)
    want = (ref, *torch.autograd.grad(ref, leaves, grad))
    assert all(torch.allclose(g, w, atol=1e-5) for g, w in zip(got, want))
    assert got[2].abs().sum() > 0  # the keys' gradient summed over their two query heads
    assert "bwd" in [name for name, *_ in stand_in.calls]


def test_packed_attention_hands_fa4_its_layout_and_returns_transformers_layout(stand_in, monkeypatch):
    """The fa4 branch of `packed_attention` ([1, H, T, D] in, [1, T, H, D] out) against the
    per-sequence SDPA branch on the same row."""
    q, k, v, cu = packed_row()
    query, key, value = (x.detach().transpose(0, 1)[None] for x in (q, k, v))
    monkeypatch.setattr(packing, "packed_attention_backend", lambda module, device, dtype: "fa4")
    fa4 = packing.packed_attention(None, query, key, value, None, scaling=None, cu_seq_lens_q=cu, max_length_q=27)[0]
    monkeypatch.setattr(packing, "packed_attention_backend", lambda module, device, dtype: "sdpa")
    sdpa = packing.packed_attention(None, query, key, value, None, scaling=None, cu_seq_lens_q=cu, max_length_q=27)[0]
    assert [name for name, *_ in stand_in.calls] == ["fwd"] and fa4.shape == (1, 46, 4, 16)
    assert torch.allclose(fa4, sdpa, atol=1e-5)


@pytest.mark.parametrize("choice", ["fa4", "fa2"])
def test_the_cuda_kernels_are_refused_for_a_cpu_trainer_in_one_line(tiny_model, choice):
    with pytest.raises(ConfigError, match=f"--attention-kernel {choice} runs on CUDA only") as e:
        Actor(make_args(attention_kernel=choice), tiny_model)
    assert "\n" not in str(e.value)
    assert packing.choose_kernel("auto", torch.device("cpu"), 4, 2, 16) == "sdpa"
    assert packing.choose_kernel("sdpa", torch.device("cpu"), 4, 2, 16) == "sdpa"
    with pytest.raises(ConfigError, match="is not one of auto, fa4, fa2, sdpa"):
        packing.choose_kernel("flash", torch.device("cpu"), 4, 2, 16)


def test_vimes_calls_bind_to_fa4s_own_signatures(stand_in):
    """The calls the stand-in recorded, bound to the installed package's functions (they are
    private, hence the exact pin of the `fa4` extra); skipped where flash-attn-4 is not installed,
    as in CI."""
    import inspect

    real = pytest.importorskip("flash_attn.cute.interface")
    q, k, v, cu = packed_row()
    out = flash4.fa4_varlen(q, k, v, cu, 27, 0.25)[0]
    out.sum().backward()
    assert sorted(name for name, *_ in stand_in.calls) == ["bwd", "fwd"]
    for name, args, kwargs in stand_in.calls:
        inspect.signature(getattr(real, f"_flash_attn_{name}")).bind(*args, **kwargs)


@pytest.mark.parametrize(
    "error, says",
    [
        (ModuleNotFoundError("No module named 'flash_attn'", name="flash_attn"), "flash-attn-4 is not installed ("),
        (
            ModuleNotFoundError("No module named 'cutlass'", name="cutlass"),
            "flash-attn-4 does not import here (it needs cutlass",
        ),
        (OSError("libcute_dsl_runtime.so: cannot open\nmore"), "flash-attn-4 does not import here (OSError: libcute"),
    ],
)
def test_an_fa4_that_does_not_import_is_refused_in_one_line_that_says_why(monkeypatch, error, says):
    """`--attention-kernel fa4` on a GPU where the package is missing, or installed without a
    module it needs (its CuTe DSL's folder off the path), or without its compiler libraries: a
    one-line refusal that tells these apart and names the other kernel."""

    def fail():
        raise error

    monkeypatch.setattr(flash4, "_fa4", fail)
    monkeypatch.setattr(packing, "_fa4_checked", {})
    with pytest.raises(ConfigError) as e:
        packing.choose_kernel("fa4", torch.device("cuda", 0), 16, 8, 128)
    assert str(e.value).startswith(f"--attention-kernel fa4: {says}") and "\n" not in str(e.value)
    assert str(e.value).endswith("or use --attention-kernel fa2")


def test_auto_takes_fa4_where_it_passes_its_check_and_fa2_where_not(monkeypatch, caplog):
    """The decision alone (a CUDA device named, FA4's check and FA2's stood in for): `auto` takes
    FA4 when its check passes; where FA4 is not installed it takes FA2 without a word, and where
    FA4 fails its check it takes FA2 and says why. `fa2` asked for does not run FA4's check."""
    dev = torch.device("cuda:0")
    checked: list[tuple] = []
    monkeypatch.setattr(packing, "_varlen_usable", lambda device: True)
    cases = [
        (None, "fa4", False),
        (f"{flash4.NOT_INSTALLED} (No module named 'flash_attn')", "fa2", False),
        ("FlashAttention-4 failed on a test row (RuntimeError: x)", "fa2", True),
    ]
    for why, want, warned in cases:
        monkeypatch.setattr(packing, "_fa4_checked", {})
        monkeypatch.setattr(flash4, "unusable", lambda *shape, why=why: checked.append(shape) or why)
        caplog.clear()
        with caplog.at_level("WARNING", logger="vime"):
            assert packing.choose_kernel("auto", dev, 4, 2, 64) == want
        assert ("auto passes FlashAttention-4 over: FlashAttention-4 failed" in caplog.text) == warned, caplog.text
    assert len(checked) == 3
    assert packing.choose_kernel("fa2", dev, 4, 2, 64) == "fa2" and len(checked) == 3
    with pytest.raises(ConfigError, match="--attention-kernel fa4: FlashAttention-4 failed on a test row"):
        packing.choose_kernel("fa4", dev, 4, 2, 64)


def test_each_model_runs_the_kernel_settled_for_it_not_the_last_one_its_device_settled(
    tiny_model, monkeypatch, tmp_path
):
    """A policy and a teacher on one GPU may differ in head shape, so FA4's check may pass for
    one and fail for the other. The kernel was once settled per device, so the model loaded last
    set it for both: the policy could run FA4 at a head shape its check had refused. Now each
    model's attention modules read their own (`mark_kernel`, called by `load_model`)."""
    from vime.models import make_tiny_model
    from vime.trainer.model import load_model

    dev = torch.device("cuda:0")
    monkeypatch.setattr(packing, "_varlen_usable", lambda device: True)
    policy = load_model(tiny_model, torch.device("cpu"))
    teacher = load_model(make_tiny_model(tmp_path / "t", arch="qwen3", seed=1), torch.device("cpu"))
    attention = [m.get_decoder().layers[0].self_attn for m in (policy, teacher)]
    assert [getattr(a, packing.KERNEL_ATTR) for a in attention] == ["sdpa", "sdpa"]  # on a CPU: SDPA
    packing.mark_kernel(policy, "fa2")
    packing.mark_kernel(teacher, "fa4")  # loaded last, as a teacher is
    assert [packing.packed_attention_backend(a, dev, torch.bfloat16) for a in attention] == ["fa2", "fa4"]
    assert packing.packed_attention_backend(attention[1], dev, torch.float32) == "sdpa"  # no kernel takes float32
    assert packing.packed_attention_backend(torch.nn.Linear(1, 1), dev, torch.bfloat16) == "fa2"  # none settled
    # and packed_attention itself asks the module that calls it
    asked: list[torch.nn.Module] = []
    monkeypatch.setattr(packing, "packed_attention_backend", lambda module, *_: asked.append(module) or "sdpa")
    q = torch.randn(1, 4, 6, 16)
    packing.packed_attention(attention[0], q, q[:, :2], q[:, :2], None)
    assert asked == [attention[0]]
