"""FP8 rollouts on the built-in engine (`--quantization fp8`, vime/engine/core/fp8.py), on CPU:
the row quantization, one fp8 projection against the product of its dequantized operands, the
engine against HF, weight pushes (whole, bucketed, LoRA adapters) reaching the fp8 copies, and
the flags from the run to the engine process.

Tolerance: an fp8 engine's log-probs are within FP8_ATOL = 0.05 of a teacher-forced float32 HF
forward over its own tokens, on the tiny model (observed: at most 0.021 in float32, 0.023 in
bfloat16; a bfloat16 engine without fp8 is within 0.0025, a float32 one within 1e-6).

The Triton kernel's check is `tests/unit/engine/test_gpu_path.py::quant_kernel_checks` (under the interpreter); on
CUDA, `test_gpu_path.py::test_gpu_fp8_graphs_match_eager_track_hf_and_see_pushes` (make test-gpu).
"""

from __future__ import annotations

import pytest
import torch

from unit.engine.reference import FP8_ATOL, PROMPTS, hf_logprobs, perturbed
from vime.engine.core import fp8
from vime.engine.core.engine import EngineConfig, LLMEngine
from vime.engine.core.kernels.quant import FP8_MAX, MIN_SCALE
from vime.engine.core.sampler import SamplingParams


@pytest.fixture(scope="module")
def model_dir(tiny_model):
    return tiny_model


@pytest.fixture(scope="module")
def hf(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def engine(model_dir, quantization: str | None = "fp8", dtype: str = "float32") -> LLMEngine:
    return LLMEngine(
        EngineConfig(str(model_dir), dtype=dtype, block_size=4, num_kv_blocks=64, quantization=quantization)
    )


def greedy_outputs(eng: LLMEngine, n: int = 12) -> list:
    for i, p in enumerate(PROMPTS):
        eng.add_request(str(i), p, SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True))
    outs = {}
    while eng.has_work():
        outs.update((o.rid, o.outputs[0]) for o in eng.step())
    return [outs[str(i)] for i in range(len(PROMPTS))]


def fp8_copies(eng: LLMEngine) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The engine's fp8 weights and scales as they are now (bytes, copied)."""
    return [(w.view(torch.uint8).clone(), s.clone()) for w, s in eng.fp8.tensors]


def same(a: list, b: list) -> bool:
    return all(torch.equal(x, y) for pa, pb in zip(a, b, strict=True) for x, y in zip(pa, pb))


# ---- the arithmetic ----------------------------------------------------------------------


def test_rows_are_quantized_with_their_own_scales_and_a_zero_row_stays_zero():
    torch.manual_seed(0)
    # rows of very different sizes, a row of zeros and one below the scale floor
    x = torch.randn(5, 300) * torch.tensor([1.0, 0.0, 1e-3, 50.0, 1e-6])[:, None]
    q, s = fp8.quantize_rows_torch(x)
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape and s.shape == (5, 1) and s.dtype == torch.float32
    amax = x.abs().amax(1)
    back = q.float() * s
    assert torch.isfinite(back).all()
    for r in (0, 2, 3):  # a row's largest value lands on the top of the fp8 range, its scale amax / 448
        assert q[r].float().abs().max() == FP8_MAX
        assert torch.allclose(s[r, 0], amax[r] / FP8_MAX, rtol=1e-7)
    assert s[1, 0] == MIN_SCALE and q[1].float().abs().max() == 0  # zeros, not 0 / 0
    assert s[4, 0] == MIN_SCALE and 0 < q[4].float().abs().max() < FP8_MAX  # floored: coarser, not overflowing
    # e4m3: 3 mantissa bits, so half a step is 2^-4 of a value; below 2^-6 steps are 2^-9 apart
    assert ((back - x).abs() <= x.abs() * 2**-4 + s * 2**-10).all()
    # the dispatcher writes the same into given tensors (how the weights' copies are kept)
    out, scales = torch.empty_like(q), torch.empty(5)
    fp8.quantize_rows(x, out, scales)
    assert torch.equal(out.view(torch.uint8), q.view(torch.uint8)) and torch.equal(scales, s[:, 0])


def test_an_fp8_projection_is_the_product_of_its_dequantized_operands():
    torch.manual_seed(1)
    x, w, b = torch.randn(7, 64), torch.randn(48, 64) * 0.02, torch.randn(48)
    wq, ws = fp8.quantize_rows_torch(w)
    y = fp8.linear(x, wq, ws.view(1, -1), b)
    xq, xs = fp8.quantize_rows_torch(x)
    ref = (xq.double() * xs.double()) @ (wq.double() * ws.double()).T + b.double()
    assert y.dtype == x.dtype and torch.allclose(y.double(), ref, rtol=1e-5, atol=1e-6)
    exact = x @ w.T + b
    assert 0 < (y - exact).norm() / exact.norm() < 0.05  # fp8's own error: a few percent, not zero


# ---- the engine --------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_an_fp8_engine_tracks_hf_within_the_stated_tolerance(model_dir, hf, dtype):
    eng = engine(model_dir, dtype=dtype)
    quantized = {n.rsplit(".", 1)[-1] for n, m in eng.model.named_modules() if getattr(m, "fp8", None) is not None}
    assert quantized == set(fp8.PROJECTIONS) and len(eng.fp8.layers) == 4 * eng.model_config.num_layers
    assert eng.model.lm_head.fp8 is None  # the head stays in the model dtype
    gaps = []
    for p, out in zip(PROMPTS, greedy_outputs(eng)):
        assert len(out.output_ids) == 12
        gaps.append((torch.tensor(out.logprobs) - hf_logprobs(hf, p, out.output_ids)).abs().max().item())
    assert max(gaps) < FP8_ATOL, gaps
    assert max(gaps) > 1e-3, gaps  # the projections really ran in fp8 (float32 alone: 1e-6, bfloat16: 2.5e-3)


def test_a_push_reaches_the_fp8_copies_once_complete(model_dir, hf, tmp_path):
    """After a push the fp8 engine computes what an fp8 engine started from the pushed weights
    computes, byte for byte; a bucketed push changes the copies only with its last bucket."""
    eng = engine(model_dir)
    before, old = greedy_outputs(eng), fp8_copies(eng)
    hf2 = perturbed(hf)
    hf2.save_pretrained(tmp_path / "pushed")
    fresh = engine(tmp_path / "pushed")
    items = list(hf2.state_dict().items())

    eng.update_weights(items[: len(items) // 2], flush=False)  # the first buckets of a push
    assert same(fp8_copies(eng), old)
    eng.update_weights(items[len(items) // 2 :])  # its last
    assert same(fp8_copies(eng), fp8_copies(fresh)) and not same(fp8_copies(eng), old)
    after, ref = greedy_outputs(eng), greedy_outputs(fresh)
    assert [(o.output_ids, o.logprobs) for o in after] == [(o.output_ids, o.logprobs) for o in ref]
    assert [o.logprobs for o in after] != [o.logprobs for o in before]

    eng.update_weights(hf.state_dict().items())  # a whole update back to the first weights
    assert [(o.output_ids, o.logprobs) for o in greedy_outputs(eng)] == [(o.output_ids, o.logprobs) for o in before]


def test_merged_lora_adapters_are_requantized(model_dir):
    eng = engine(model_dir)
    qkv = eng.model.model.layers[0].self_attn.qkv_proj
    index = eng.fp8.layers.index(qkv)
    old = fp8_copies(eng)[index]
    torch.manual_seed(2)
    rank, (out_f, in_f) = 4, eng.model.named_weights()["model.layers.0.self_attn.q_proj.weight"].shape
    layer = "model.layers.0.self_attn.q_proj"
    eng.update_weights([(f"{layer}.lora_A", torch.randn(rank, in_f)), (f"{layer}.lora_B", torch.randn(out_f, rank))])
    w, s = fp8_copies(eng)[index]
    q, scales = fp8.quantize_rows_torch(qkv.weight)  # the merged weight, quantized
    assert torch.equal(w, q.view(torch.uint8)) and torch.equal(s, scales.view(1, -1))
    assert not torch.equal(w, old[0])


# ---- flags -------------------------------------------------------------------------------


def test_a_quantization_the_engine_cannot_run_is_refused_in_one_line(model_dir):
    with pytest.raises(ValueError, match=r"^--quantization int8: use fp8, or leave it out to run in --dtype$"):
        engine(model_dir, quantization="int8")
    # on a GPU (checked before any CUDA call): _scaled_mm's row-wise scales write bfloat16
    with pytest.raises(ValueError, match=r"^--quantization fp8 on a GPU runs with --dtype bfloat16, not float32$"):
        fp8.check("fp8", torch.device("cuda"), torch.float32)
    from vime.engine.flags import parse_args

    with pytest.raises(SystemExit) as e:
        parse_args(["--model-path", str(model_dir), "--quantization", "int8"])
    assert e.value.code == 2


def test_the_run_flag_reaches_the_engine_process(model_dir, tmp_path):
    """--engine-quantization fp8 becomes the server's --quantization fp8 (`engine_args`), and the
    engine process generates what the fp8 engine does in process."""
    from vime.backends.builtin.launch import launch_engine
    from vime.backends.builtin.place import engine_args
    from vime.backends.client import EngineClient
    from vime.config import parse_args

    cfg = parse_args(
        ["--hf-checkpoint", "tiny", "--prompt-data", "x.jsonl", "--num-rollout", "2", "--engine-quantization", "fp8"]
    )
    args = engine_args(cfg.placement, 0, cfg.rollout.rollout_seed)
    assert args[-2:] == ["--quantization", "fp8"]
    proc = launch_engine(
        str(model_dir),
        extra_args=[*args, "--num-threads", "1", "--block-size", "4", "--num-kv-blocks", "64"],
        log_path=tmp_path / "engine.log",
    )
    try:
        client = EngineClient(proc.url)
        assert client.model_info()["quantization"] == "fp8"
        import asyncio

        async def generate() -> dict:
            try:
                return await client.generate(PROMPTS[2], {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True})
            finally:
                await client.close()

        out = asyncio.run(generate())
    finally:
        proc.shutdown()
    ref = greedy_outputs(engine(model_dir), 8)[2]
    assert out["output_ids"] == ref.output_ids
    assert torch.allclose(torch.tensor(out["meta_info"]["output_token_logprobs"]), torch.tensor(ref.logprobs))
