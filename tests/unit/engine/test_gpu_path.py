"""The engine's GPU code path (Triton kernels, static decode buffers, CUDA graphs): on CPU under
the Triton interpreter, where Triton is installed, by running this file as a script
(`interpreted_checks`); on a GPU (marked `gpu`, `make test-gpu`), CUDA graphs against eager, the
CUDA-IPC weight update, memory release and fp8, against HF.

Tolerance: as the server's tests, ATOL = 1e-4 against a teacher-forced HF forward; an fp8
engine's log-probs within FP8_ATOL (tests/unit/engine/test_fp8.py says why).
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

from unit.engine.reference import (
    ATOL,
    FP8_ATOL,
    PROMPTS,
    check_sampler,
    generate_many,
    greedy,
    hf_greedy,
    hf_logprobs,
    perturbed,
    torch_sample,
)
from unit.engine.triton_interpreter import patch_triton_interpreter
from vime.backends.builtin.launch import launch_engine
from vime.backends.client import EngineClient


@torch.no_grad()
def next_after_update(hf, hf2, prompt: list[int], n_old: int) -> list[int]:
    """Greedy tokens when weights change after `n_old` generated tokens, updated in place: the
    cached keys/values so far stay those of the old weights; the next token's forward (over the
    last generated token) runs the new ones. Returns the n_old + 1 tokens."""
    old = hf_greedy(hf, prompt, n_old)
    past = hf(torch.tensor([prompt + old[:-1]]), use_cache=True).past_key_values
    nxt = hf2(torch.tensor([old[-1:]]), past_key_values=past, use_cache=True).logits[0, -1].argmax()
    return old + [int(nxt)]


# ---- the GPU code path under the Triton interpreter ----------------------------------


def test_triton_path_in_interpreter(model_dir):
    """Kernels, static decode buffers and the one-pass sampler, on CPU tensors (a subprocess:
    the interpreter is chosen when Triton kernels are defined)."""
    pytest.importorskip("triton")
    env = {
        **os.environ,
        "TRITON_INTERPRET": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [os.getcwd(), "tests", os.environ.get("PYTHONPATH")])),
    }
    # a hang guard, not a speed bound: interpreted, it took ~60 s alone and 120+ s beside vLLM
    # servers on two cores (CI)
    proc = subprocess.run(
        [sys.executable, __file__, str(model_dir)], env=env, capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]


def interpreted_checks(model_dir: str) -> None:
    """One check per kernel module of vime/engine/core/kernels/, on CPU tensors."""
    from vime.engine.core import kernels

    patch_triton_interpreter()
    assert kernels.enabled(torch.device("cpu"))
    engine_kernel_checks(model_dir)
    attention_kernel_checks()
    sampler_kernel_checks()
    quant_kernel_checks(model_dir)


def engine_kernel_checks(model_dir: str) -> None:
    """The whole engine on the kernel path (fused.py's kernels in every layer), against HF."""
    from transformers import AutoModelForCausalLM

    from vime.engine.core.engine import EngineConfig, LLMEngine
    from vime.engine.core.sampler import SamplingParams

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    # The whole engine on the kernel path: greedy = HF, log-probs = teacher-forced HF.
    eng = LLMEngine(EngineConfig(model_dir, block_size=4, num_kv_blocks=64, max_num_batched_tokens=16, max_num_seqs=8))
    prompts = PROMPTS[1:]
    for i, p in enumerate(prompts):
        eng.add_request(str(i), p, SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True))
    eng.add_request("t", PROMPTS[2], SamplingParams(max_new_tokens=6, temperature=0.7, ignore_eos=True))
    # OpenAI's penalties count a decode step's newest token, still on the device, once
    penalized = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True, presence_penalty=1.5)
    eng.add_request("pen", PROMPTS[1], replace(penalized, frequency_penalty=0.5))
    outs, kinds = {}, set()
    while eng.has_work():
        outs.update((o.rid, o.outputs[0]) for o in eng.step())
        kinds.add(eng.runner.last_step.kind)
    assert kinds == {"eager", "decode"}
    for i, p in enumerate(prompts):
        assert outs[str(i)].output_ids == hf_greedy(hf, p, 6)
        assert torch.allclose(
            torch.tensor(outs[str(i)].logprobs), hf_logprobs(hf, p, outs[str(i)].output_ids), atol=ATOL
        )
    assert torch.allclose(
        torch.tensor(outs["t"].logprobs), hf_logprobs(hf, PROMPTS[2], outs["t"].output_ids, 0.7), atol=ATOL
    )
    assert (
        outs["pen"].output_ids
        == hf_greedy(hf, PROMPTS[1], 6, presence=1.5, frequency=0.5)
        != hf_greedy(hf, PROMPTS[1], 6)
    )

    # A weight update lands between two decode steps and shows in the very next token.
    hf2 = perturbed(hf)
    eng.add_request("w", PROMPTS[1], SamplingParams(max_new_tokens=5, temperature=0.0, ignore_eos=True))
    while len(eng.requests["w"].seqs[0].output_ids) < 4:
        eng.step()
    eng.update_weights(hf2.state_dict().items())
    while eng.has_work():
        outs.update((o.rid, o.outputs[0]) for o in eng.step())
    assert outs["w"].output_ids[:5] == next_after_update(hf, hf2, PROMPTS[1], 4)

    overlap_checks(model_dir)


def attention_kernel_checks() -> None:
    """attention.py: bfloat16 attention kernels against the PyTorch path (decode, and chunks after
    a cached prefix)."""
    from vime.engine.core import kernels
    from vime.engine.core.attention import AttnMetadata, make_group, paged_attention

    torch.manual_seed(0)
    h, hkv, d, bs = 4, 2, 16, 4
    kc = torch.randn(81, bs, hkv, d).bfloat16()
    vc = torch.randn_like(kc)
    ctx = [37, 5, 70]
    tables = [torch.randperm(80)[: -(-c // bs)].tolist() for c in ctx]
    bt = torch.tensor([t + [0] * (18 - len(t)) for t in tables], dtype=torch.int32)
    none = torch.zeros(0, hkv, d, dtype=torch.bfloat16)
    for q_lens in ([1, 1, 1], [37, 2, 67]):
        offsets = [sum(q_lens[:i]) for i in range(4)]
        q = torch.randn(offsets[-1], h, d).bfloat16()
        if q_lens[0] == 1:
            assert kernels.decode_splits(3, hkv, q.device) == 3  # split into parts and combined, some empty
            out = kernels.decode_attention(q, kc, vc, bt, torch.tensor(ctx, dtype=torch.int32), d**-0.5)
        else:
            out = kernels.prefill_attention(
                q,
                kc,
                vc,
                bt,
                torch.tensor(ctx, dtype=torch.int32),
                torch.tensor(offsets, dtype=torch.int32),
                max(q_lens),
                d**-0.5,
            )
        group = make_group(
            [list(range(offsets[i], offsets[i + 1])) for i in range(3)],
            [list(range(c - n, c)) for c, n in zip(ctx, q_lens)],
            tables,
            bs,
            torch.device("cpu"),
        )
        ref = paged_attention(
            q, none, none, kc, vc, AttnMetadata(torch.zeros(0, dtype=torch.long), [group]), d**-0.5
        ).float()
        assert (out.float() - ref).norm() / ref.norm() < 1e-2


def sampler_kernel_checks() -> None:
    """sampling.py: the one-pass sampler draws from softmax(logits / T) and returns that
    distribution's log-prob. Few draws: the interpreter runs one program per row (the GPU test
    draws more)."""
    from vime.engine.core import kernels

    check_sampler(kernels.sample, rows=48)
    # Both sampler paths draw the same tokens from the same logits and seeds.
    logits = torch.randn(16, 300) * 3
    temps = torch.tensor([1.0, 0.7, 0.0, 1.3] * 4)
    seeds = torch.randint(-(2**31), 2**31 - 1, (16,), dtype=torch.int32)
    a, lp_a = kernels.sample(logits, temps, seeds)
    b, lp_b = torch_sample(logits, temps, seeds)
    assert torch.equal(a, b) and torch.allclose(lp_a, lp_b, atol=1e-5)
    # A vocabulary of three sampler chunks, the last one partial: the chunks' parts combine to
    # the same draw and log-prob as the PyTorch path over the whole row.
    logits = torch.randn(6, 9000) * 3
    temps, seeds = torch.tensor([1.0, 0.7, 0.0] * 2), torch.arange(6, dtype=torch.int32) * 99991
    a, lp_a = kernels.sample(logits, temps, seeds)
    b, lp_b = torch_sample(logits, temps, seeds)
    assert kernels.sampling.triton.cdiv(9000, 1024 * kernels.SAMPLE_CHUNK_BLOCKS) == 3
    assert torch.equal(a, b) and torch.allclose(lp_a, lp_b, atol=1e-5)
    edge = torch.full((1, 4096), -20.0)
    edge[0, 0] = 20.0
    assert kernels.sample(edge, torch.ones(1), torch.tensor([2290], dtype=torch.int32))[0].tolist() == [
        0
    ]  # noise < 1 (see test_sampler_noise_stays_below_one)


def quant_kernel_checks(model_dir: str) -> None:
    """quant.py: FP8 rows byte for byte as the PyTorch path makes them (rows of both model dtypes,
    a zero row, a row below the scale floor, rows longer than one block); then an fp8 engine on
    the kernel path (decodes on the static buffers) within the fp8 tolerance of HF, before and
    after a weight update."""
    from transformers import AutoModelForCausalLM

    from vime.engine.core import fp8, kernels
    from vime.engine.core.engine import EngineConfig, LLMEngine
    from vime.engine.core.kernels.quant import MAX_BLOCK
    from vime.engine.core.sampler import SamplingParams

    torch.manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        for cols in (300, MAX_BLOCK + 904):
            x = (torch.randn(5, cols) * torch.tensor([1.0, 0.0, 1e-3, 100.0, 1e-8])[:, None]).to(dtype)
            q, s = torch.empty(x.shape, dtype=torch.float8_e4m3fn), torch.empty(5, 1)
            kernels.quantize_rows(x, q, s)
            ref_q, ref_s = fp8.quantize_rows_torch(x)
            assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8)) and torch.equal(s, ref_s), (dtype, cols)
            assert q[1].float().abs().max() == 0 and q[0].float().abs().max() == 448

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    eng = LLMEngine(
        EngineConfig(model_dir, block_size=4, num_kv_blocks=64, max_num_batched_tokens=16, quantization="fp8")
    )
    before = None
    for model in (hf, perturbed(hf, scale=0.02)):
        if model is not hf:
            eng.update_weights(model.state_dict().items())
        for i, p in enumerate(PROMPTS[1:]):
            eng.add_request(str(i), p, SamplingParams(max_new_tokens=5, temperature=0.0, ignore_eos=True))
        outs, kinds = {}, set()
        while eng.has_work():
            outs.update((o.rid, o.outputs[0]) for o in eng.step())
            kinds.add(eng.runner.last_step.kind)
        assert "decode" in kinds
        for i, p in enumerate(PROMPTS[1:]):
            gap = (torch.tensor(outs[str(i)].logprobs) - hf_logprobs(model, p, outs[str(i)].output_ids)).abs().max()
            assert 1e-3 < gap < FP8_ATOL, gap  # quantized, and within the tolerance of tests/unit/engine/test_fp8.py
        logprobs = [outs[str(i)].logprobs for i in range(len(PROMPTS) - 1)]
        assert logprobs != before  # the update reached the fp8 copies
        before = logprobs


def overlap_checks(model_dir: str) -> None:
    """Overlapped steps (a step launched before the one before it is booked) give what one step
    at a time gives (tokens and finish reasons exactly, log-probs within 1e-5): through stop
    tokens and stop strings that end sequences a step early, length limits, n > 1 with seeds, a
    request added and one aborted mid-way, preemption for lack of blocks and prefix-cache hits
    on generated text."""
    from vime.engine.core.engine import EngineConfig, LLMEngine
    from vime.engine.core.sampler import SamplingParams
    from vime.engine.core.scheduler import PENDING
    from vime.models import load_tokenizer

    cfg = dict(block_size=4, num_kv_blocks=24, max_num_batched_tokens=32, max_num_seqs=8)
    probe = LLMEngine(EngineConfig(model_dir, **cfg, overlap=False))
    probe.add_request("p", PROMPTS[1], SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True))
    ref = probe.step() or []
    while probe.has_work():
        ref += probe.step()
    ref_ids = ref[0].outputs[0].output_ids
    text = load_tokenizer(model_dir).decode(ref_ids, skip_special_tokens=True)
    assert len(text) >= 6, text
    params = {
        "stop_id": SamplingParams(max_new_tokens=12, temperature=0.0, stop_token_ids=(ref_ids[4],)),
        "stop_str": SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True, stop=(text[4:6],)),
        "n3": SamplingParams(max_new_tokens=9, temperature=1.0, ignore_eos=True, n=3, sampling_seed=5),
        "long": SamplingParams(max_new_tokens=20, temperature=0.8, ignore_eos=True, sampling_seed=9),
        "aborted": SamplingParams(max_new_tokens=20, temperature=0.0, ignore_eos=True),
    }

    def run(overlap: bool) -> tuple[dict, int, bool]:
        eng = LLMEngine(EngineConfig(model_dir, **cfg, overlap=overlap))
        prompts = {"stop_id": PROMPTS[1], "stop_str": PROMPTS[1], "n3": PROMPTS[2], "long": PROMPTS[3]}
        for rid, p in prompts.items():
            eng.add_request(rid, p, params[rid])
        outs, steps, seen_pending = {}, 0, False
        while eng.has_work():
            outs.update((o.rid, o) for o in eng.step())
            steps += 1
            seen_pending |= any(PENDING in s.token_ids for r in eng.requests.values() for s in r.seqs)
            if steps == 3:  # the same prompt again, generated text included: a prefix hit
                eng.add_request("late", PROMPTS[1] + ref_ids[:6], params["long"])
                eng.add_request("aborted", PROMPTS[0], params["aborted"])
            if steps == 7:
                outs.update((o.rid, o) for o in eng.abort("aborted"))
        return outs, eng.scheduler.num_preemptions, seen_pending

    one, pre_one, pending_one = run(False)
    two, pre_two, pending_two = run(True)
    assert pending_two and not pending_one  # the overlap happened, and only where asked for
    assert pre_one > 0 and pre_two > 0, "the workload must preempt"
    assert one.keys() == two.keys() == {"stop_id", "stop_str", "n3", "long", "late", "aborted"}
    for rid in one:
        for a, b in zip(one[rid].outputs, two[rid].outputs, strict=True):
            if rid == "aborted":  # cut where the abort fell, which may differ by the step in flight
                assert a.finish_reason == b.finish_reason == "abort"
                continue
            # Token ids and finish reasons are exact. Log-probs within 1e-5: which rows share a
            # step (and so a GEMM) differs between the two schedules, and how that rounds depends
            # on the CPU (one machine in three saw 1e-6 on one token).
            assert (a.output_ids, a.finish_reason) == (b.output_ids, b.finish_reason), rid
            assert len(a.logprobs) == len(b.logprobs), rid
            assert max((abs(x - y) for x, y in zip(a.logprobs, b.logprobs)), default=0.0) < 1e-5, rid
    assert one["stop_id"].outputs[0].finish_reason == "stop" and one["stop_id"].outputs[0].output_ids[-1] == ref_ids[4]
    # B needs a block in the very step after the one A's length ends: A's blocks come back only
    # when that step is booked, so an overlapped engine books it first instead of preempting B
    for overlap in (False, True):
        eng = LLMEngine(EngineConfig(model_dir, block_size=4, num_kv_blocks=4, max_num_seqs=2, overlap=overlap))
        eng.add_request("a", PROMPTS[3][:4], SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True))
        eng.add_request("b", PROMPTS[2][:5], SamplingParams(max_new_tokens=11, temperature=0.0, ignore_eos=True))
        done = {}
        while eng.has_work():
            done.update((o.rid, o) for o in eng.step())
        assert eng.scheduler.num_preemptions == 0, overlap
        assert [len(done[r].outputs[0].output_ids) for r in "ab"] == [4, 11]
    assert one["stop_str"].outputs[0].finish_reason == "stop" and len(one["stop_str"].outputs[0].output_ids) < 12
    assert [len(o.output_ids) for o in one["n3"].outputs] == [9, 9, 9]


# ---- GPU (skipped without CUDA) --------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_greedy_cuda_ipc_update_and_memory_release(model_dir, hf, tmp_path):
    from vime.transport import cuda_ipc

    args = ["--block-size", "4", "--num-kv-blocks", "256"]
    proc = launch_engine(str(model_dir), device="cuda", dtype="float32", extra_args=args, log_path=tmp_path / "gpu.log")
    try:
        gpu = EngineClient(proc.url)
        reqs = [{"input_ids": p, "sampling_params": greedy(16, ignore_eos=True)} for p in PROMPTS]
        for p, out in zip(PROMPTS, generate_many(gpu, reqs)):
            assert out["output_ids"] == hf_greedy(hf, p, 16)
            assert torch.allclose(
                torch.tensor(out["meta_info"]["output_token_logprobs"]),
                hf_logprobs(hf, p, out["output_ids"]),
                atol=ATOL,
            )

        hf2 = perturbed(hf)
        tensors = {k: v.cuda() for k, v in hf2.state_dict().items()}  # the trainer's GPU copies
        res = gpu.update_weights_from_tensor(
            {"transport": "cuda_ipc", "handles": cuda_ipc.share(list(tensors.items())), "weight_version": 7}
        )
        assert res["weight_version"] == 7 and res["num_tensors"] == len(tensors)
        gpu.release_memory_occupation()
        assert gpu.model_info()["memory_released"] is True
        gpu.resume_memory_occupation()
        for p, out in zip(PROMPTS, generate_many(gpu, reqs)):
            assert out["output_ids"] == hf_greedy(hf2, p, 16)
            assert out["meta_info"]["output_weight_versions"] == [7] * 16
    finally:
        proc.shutdown()

    proc = launch_engine(str(model_dir), device="cuda", dtype="bfloat16", log_path=tmp_path / "gpu-bf16.log")
    try:
        out = generate_many(
            EngineClient(proc.url),
            [{"input_ids": PROMPTS[2], "sampling_params": {"max_new_tokens": 16, "n": 3, "ignore_eos": True}}],
        )[0]
        assert all(
            len(o["output_ids"]) == 16 and all(lp <= 0 for lp in o["meta_info"]["output_token_logprobs"]) for o in out
        )
    finally:
        proc.shutdown()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_graphs_match_eager_and_see_weight_updates(model_dir, hf):
    """Replayed decode graphs compute what the eager path does, and weights copied in place
    between two replays show in the next token."""
    from vime.engine.core import kernels
    from vime.engine.core.engine import EngineConfig, LLMEngine
    from vime.engine.core.sampler import SamplingParams

    def run(eng, prompts, n, update_after=None, new_state=None, penalty=1.0):
        for i, p in enumerate(prompts):
            params = SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True, repetition_penalty=penalty)
            eng.add_request(str(i), p, params)
        outs, kinds = {}, set()
        while eng.has_work():
            if update_after is not None and len(eng.requests["0"].seqs[0].output_ids) == update_after:
                eng.update_weights(new_state.items())
                update_after = None
            outs.update((o.rid, o.outputs[0]) for o in eng.step())
            kinds.add(eng.runner.last_step.kind)
        return [outs[str(i)] for i in range(len(prompts))], kinds

    cfg = dict(device="cuda", dtype="float32", block_size=4, num_kv_blocks=256, max_num_seqs=8)
    graphs = LLMEngine(EngineConfig(str(model_dir), **cfg))
    eager = LLMEngine(EngineConfig(str(model_dir), cuda_graphs=False, **cfg))
    a, kinds = run(graphs, PROMPTS, 12)
    b, _ = run(eager, PROMPTS, 12)
    assert "graph" in kinds
    for p, x, y in zip(PROMPTS, a, b):
        assert x.output_ids == y.output_ids == hf_greedy(hf, p, 12)
        assert torch.allclose(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=ATOL)
    check_sampler(
        lambda logits, temps, seeds: [x.cpu() for x in kernels.sample(logits.cuda(), temps.cuda(), seeds.cuda())],
        rows=20000,
    )
    logits = torch.randn(64, 151936, device="cuda") * 3  # a real vocabulary: both paths still agree
    temps = torch.tensor([1.0, 0.7, 0.0, 1.3] * 16, device="cuda")
    seeds = torch.randint(-(2**31), 2**31 - 1, (64,), dtype=torch.int32, device="cuda")
    assert torch.equal(kernels.sample(logits, temps, seeds)[0], torch_sample(logits, temps, seeds)[0])
    # the repetition penalty on the graphs' path, where a decode step's newest token is still on
    # the device when the next step's logits are penalized
    penalized, _ = run(graphs, PROMPTS, 12, penalty=3.0)
    for p, x in zip(PROMPTS, penalized):
        assert x.output_ids == hf_greedy(hf, p, 12, repetition_penalty=3.0)
    assert [x.output_ids for x in penalized] != [x.output_ids for x in a]
    hf2 = perturbed(hf)
    state = {k: v.cuda() for k, v in hf2.state_dict().items()}
    (out, *_), _ = run(graphs, PROMPTS[1:3], 10, update_after=4, new_state=state)
    assert out.output_ids[:5] == next_after_update(hf, hf2, PROMPTS[1], 4)
    graphs.release_memory()
    graphs.resume_memory()  # the same addresses (CUDA VMM), or new storage and the graphs captured again
    (out, *_), kinds = run(graphs, PROMPTS[1:2], 8)
    assert "graph" in kinds and out.output_ids == hf_greedy(hf2, PROMPTS[1], 8)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_fp8_graphs_match_eager_track_hf_and_see_pushes(model_dir, hf, tmp_path):
    """--quantization fp8 on CUDA: the Triton row quantization against the PyTorch one; replayed
    decode graphs compute what the eager fp8 path does; log-probs within FP8_ATOL of HF, as a
    bfloat16 engine's are; a push, and one while the memory is released, reaches the fp8 copies
    the graphs read (byte for byte those of an fp8 engine started from the pushed weights)."""
    from vime.engine.core import fp8
    from vime.engine.core.engine import EngineConfig, LLMEngine
    from vime.engine.core.sampler import SamplingParams

    if torch.cuda.get_device_capability() < fp8.MIN_CAPABILITY:
        pytest.skip("FP8 matmuls need compute capability 8.9 or newer")
    torch.manual_seed(0)
    x = (torch.randn(64, 3000, device="cuda") * torch.logspace(-8, 2, 64, device="cuda")[:, None]).bfloat16()
    x[5] = 0
    q, s = fp8.quantize_rows(x)  # the Triton kernel
    ref_q, ref_s = fp8.quantize_rows_torch(x)
    assert torch.allclose(s, ref_s, rtol=1e-6, atol=0) and q[5].float().abs().max() == 0
    # at most one fp8 step apart (both divide IEEE-rounded, so in practice none)
    assert ((q.float() - ref_q.float()).abs() <= ref_q.float().abs() * 2**-3 + 2**-9).all()

    def run(eng, n=12):
        for i, p in enumerate(PROMPTS):
            eng.add_request(str(i), p, SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True))
        outs, kinds = {}, set()
        while eng.has_work():
            outs.update((o.rid, o.outputs[0]) for o in eng.step())
            kinds.add(eng.runner.last_step.kind)
        return [outs[str(i)] for i in range(len(PROMPTS))], kinds

    def copies(eng):
        return [(w.view(torch.uint8).clone(), sc.clone()) for w, sc in eng.fp8.tensors]

    def same(a, b):
        return all(torch.equal(u, v) for pa, pb in zip(a, b, strict=True) for u, v in zip(pa, pb))

    cfg = dict(device="cuda", dtype="bfloat16", block_size=4, num_kv_blocks=256, max_num_seqs=8)
    graphs = LLMEngine(EngineConfig(str(model_dir), quantization="fp8", **cfg))
    eager = LLMEngine(EngineConfig(str(model_dir), quantization="fp8", cuda_graphs=False, **cfg))
    a, kinds = run(graphs)
    b, _ = run(eager)
    bf16, _ = run(LLMEngine(EngineConfig(str(model_dir), **cfg)))
    assert "graph" in kinds
    for p, x, y, z in zip(PROMPTS, a, b, bf16):
        assert x.output_ids == y.output_ids
        assert torch.allclose(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=1e-3)
        assert (torch.tensor(x.logprobs) - hf_logprobs(hf, p, x.output_ids)).abs().max() < FP8_ATOL
        assert (torch.tensor(z.logprobs) - hf_logprobs(hf, p, z.output_ids)).abs().max() < FP8_ATOL
    assert [x.logprobs for x in a] != [z.logprobs for z in bf16]  # the fp8 engine did run in fp8

    hf2 = perturbed(hf)
    hf2.save_pretrained(tmp_path / "pushed")
    fresh = LLMEngine(EngineConfig(str(tmp_path / "pushed"), quantization="fp8", **cfg))
    graphs.update_weights([(k, v.cuda()) for k, v in hf2.state_dict().items()])  # the trainer's GPU copies
    assert same(copies(graphs), copies(fresh))
    pushed, kinds = run(graphs)
    ref, _ = run(fresh)
    assert "graph" in kinds and [x.output_ids for x in pushed] == [x.output_ids for x in ref]
    assert [x.output_ids for x in pushed] != [x.output_ids for x in a]
    for x, y in zip(pushed, ref):
        assert torch.allclose(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=1e-3)

    # a push while released lands in the host copy of the weights; the resume requantizes from it
    fp8_bytes = sum(w.nbytes + sc.nbytes for w, sc in graphs.fp8.tensors)
    weights = sum(p.nbytes for p in graphs.model.parameters())
    kv = 2 * graphs.kv_cache.k.numel() * graphs.kv_cache.k.element_size()
    assert graphs.release_memory() == weights + kv + fp8_bytes  # the fp8 copies are counted too
    graphs.update_weights(hf.state_dict().items())
    graphs.resume_memory()
    assert same(copies(graphs), copies(eager))
    again, kinds = run(graphs)
    assert "graph" in kinds and [x.output_ids for x in again] == [x.output_ids for x in a]


if __name__ == "__main__":  # run by test_triton_path_in_interpreter under TRITON_INTERPRET=1
    interpreted_checks(sys.argv[1])
