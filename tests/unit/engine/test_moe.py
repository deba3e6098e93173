"""The built-in engine on mixture-of-experts models: a tiny Qwen3-MoE (4 experts, top-2,
renormalised, its middle layer dense through mlp_only_layers) and a tiny Mixtral (4 experts,
top-2), random weights, float32 on CPU, with HF transformers as the reference for tokens,
log-probs and the experts each position was routed to.

Tolerance: log-probs within ATOL = 1e-4 of a teacher-forced HF forward (observed: ~5e-7, the
summation order of two matmul libraries); routed experts equal, id for id. The routers are
scaled up (std 0.5) so that no two experts' probabilities tie within float32 rounding: near a
tie, two correct implementations may pick different experts.

The GPU path (the grouped Triton kernel of `kernels/moe.py` and the engine's kernel path) is
checked on CPU under the Triton interpreter where Triton is installed, by running this file
as a script (`interpreted_checks`), and on a GPU by the `gpu` test at the end.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch

from unit.trainer.moe_models import make_tiny_moe

ATOL = 1e-4
PROMPTS = [[40], [50, 60, 70, 80, 90], list(range(10, 33)), [7, 8, 9] * 13]  # 1, 5, 23, 39 tokens
ARCHS = ("qwen3_moe", "mixtral")


# ---- tiny models and HF references -----------------------------------------------------


def make_moe(out: Path, arch: str, seed: int = 0, **overrides) -> Path:
    """The tiny MoE of the MoE tests with a third layer for Qwen3-MoE (the middle one dense) and
    decided routers (module docstring); `overrides`: config fields."""
    if arch == "qwen3_moe":
        overrides = {"num_hidden_layers": 3, "intermediate_size": 96, "mlp_only_layers": [1], **overrides}
    return make_tiny_moe(out, arch, seed, router_std=0.5, **overrides)


def load_hf(model_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@torch.no_grad()
def hf_routes(hf, tokens: list[int]) -> np.ndarray:
    """HF's top-k experts [len(tokens) - 1, MoE layers, K] over `tokens`: every position but the last."""
    out = hf(torch.tensor([tokens]), output_router_logits=True)
    k = hf.config.num_experts_per_tok
    ids = [torch.softmax(r.float(), dim=-1).topk(k, dim=-1).indices for r in out.router_logits]  # [T, K] each
    return torch.stack(ids, dim=1)[: len(tokens) - 1].numpy().astype(np.int32)


@torch.no_grad()
def hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(int(hf(torch.tensor([tokens])).logits[0, -1].argmax()))
    return tokens[len(prompt) :]


@torch.no_grad()
def hf_logprobs(hf, prompt: list[int], output: list[int], temperature: float = 1.0) -> torch.Tensor:
    logits = hf(torch.tensor([prompt + output])).logits[0, len(prompt) - 1 : -1].float() / temperature
    return torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(output)[:, None])[:, 0]


def engine_for(model_dir: Path, **kw):
    from vime.engine.core.engine import EngineConfig, LLMEngine

    # small blocks and token budget: prompts cross block boundaries and prefills are chunked
    settings = {"block_size": 4, "num_kv_blocks": 64, "max_num_batched_tokens": 16, "max_num_seqs": 8, **kw}
    return LLMEngine(EngineConfig(str(model_dir), **settings))


def run(eng) -> dict:
    """Step until idle; rid → the first sample's SeqOutput."""
    outs = {}
    while eng.has_work():
        outs.update((o.rid, o.outputs[0]) for o in eng.step())
    return outs


def greedy(n: int):
    from vime.engine.core.sampler import SamplingParams

    return SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)


def check_against_hf(hf, prompt: list[int], out, temperature: float = 0.0) -> None:
    """Tokens (greedy), log-probs and routed experts of one engine output against HF."""
    if temperature == 0.0:
        assert out.output_ids == hf_greedy(hf, prompt, len(out.output_ids))
    ref = hf_logprobs(hf, prompt, out.output_ids, temperature or 1.0)
    assert torch.allclose(torch.tensor(out.logprobs), ref, atol=ATOL), (torch.tensor(out.logprobs) - ref).abs().max()
    routes = out.routed_experts.array()
    assert routes.dtype == np.int32
    np.testing.assert_array_equal(routes, hf_routes(hf, prompt + out.output_ids))


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """Per architecture, two models of one shape and different weights (a: the engines start
    from it; b: what a trainer pushes)."""
    root = tmp_path_factory.mktemp("moe")
    return {arch: (make_moe(root / f"{arch}-a", arch, 0), make_moe(root / f"{arch}-b", arch, 1)) for arch in ARCHS}


# ---- the model against HF ----------------------------------------------------------------


@pytest.mark.parametrize("arch", [*ARCHS, "qwen3_moe-every-2nd"])
def test_engine_matches_hf_tokens_logprobs_and_routing(models, arch, tmp_path):
    """Four prompts batched (chunked prefills beside decodes) and one sampled request: greedy
    tokens are HF's, log-probs HF's teacher-forced ones, and the experts of every position
    (prompt and output) HF's router top-k. A dense layer has no column: Qwen3-MoE's middle layer
    (mlp_only_layers), or every other one (decoder_sparse_step 2, top-k not renormalised)."""
    from vime.engine.core.sampler import SamplingParams

    if arch in models:
        a, layers = models[arch][0], 2
    else:
        a = make_moe(tmp_path / "m", "qwen3_moe", 2, mlp_only_layers=[], decoder_sparse_step=2, norm_topk_prob=False)
        layers = 1
    hf = load_hf(a)
    eng = engine_for(a)
    for i, p in enumerate(PROMPTS):
        eng.add_request(str(i), p, greedy(8), routed_experts=True)
    eng.add_request("t", PROMPTS[2], SamplingParams(max_new_tokens=8, temperature=0.7), routed_experts=True)
    outs = run(eng)
    for i, p in enumerate(PROMPTS):
        check_against_hf(hf, p, outs[str(i)])
        assert outs[str(i)].routed_experts.array().shape == (len(p) + 7, layers, 2)
    check_against_hf(hf, PROMPTS[2], outs["t"], temperature=0.7)


def test_routing_of_cached_prefixes_preempted_and_aborted_sequences(models):
    """A prompt found in the prefix cache is not recomputed, yet its positions come back with
    their experts; sequences preempted for lack of KV blocks, or by a memory release during
    which new weights arrived, are recomputed and return the routing of the final pass; an
    aborted one returns what was computed and -1 for the rest."""
    a, _ = models["qwen3_moe"]
    hf = load_hf(a)
    eng = engine_for(a, num_kv_blocks=64)
    eng.add_request("first", PROMPTS[3], greedy(4), routed_experts=True)
    run(eng)
    eng.add_request("again", PROMPTS[3], greedy(6), routed_experts=True)
    again = run(eng)["again"]
    assert eng.scheduler.num_cached_tokens >= 36  # 9 of the prompt's 10 blocks came from the cache
    check_against_hf(hf, PROMPTS[3], again)

    tight = engine_for(a, num_kv_blocks=14)  # 56 token slots for three sequences of 33-51 tokens
    prompts = [PROMPTS[2], PROMPTS[3], PROMPTS[2][::-1]]
    for i, p in enumerate(prompts):
        tight.add_request(str(i), p, greedy(12), routed_experts=True)
    outs = run(tight)
    assert tight.scheduler.num_preemptions > 0
    for i, p in enumerate(prompts):
        check_against_hf(hf, p, outs[str(i)])

    eng.add_request("cut", PROMPTS[2], greedy(20), routed_experts=True)
    while len(eng.requests["cut"].seqs[0].logprobs) < 3:
        eng.step()
    [cut] = eng.abort("cut")
    out = cut.outputs[0]
    routes = out.routed_experts.array()
    assert out.finish_reason == "abort" and routes.shape[0] == len(PROMPTS[2]) + len(out.output_ids) - 1
    computed = (routes >= 0).all(axis=(1, 2))
    n = int(computed.sum())
    assert n >= len(PROMPTS[2]) and computed[:n].all() and (routes[n:] == -1).all()
    np.testing.assert_array_equal(routes[:n], hf_routes(hf, PROMPTS[2] + out.output_ids)[:n])

    # recomputed after new weights arrived while released: every row is the final pass's (the new weights')
    hf_b = load_hf(models["qwen3_moe"][1])
    eng.add_request("re", PROMPTS[2], greedy(8), routed_experts=True)
    while len(eng.requests["re"].seqs[0].logprobs) < 4:
        eng.step()
    eng.release_memory()
    eng.update_weights(hf_b.state_dict().items())
    eng.resume_memory()
    re = run(eng)["re"]
    np.testing.assert_array_equal(re.routed_experts.array(), hf_routes(hf_b, PROMPTS[2] + re.output_ids))
    assert not (hf_routes(hf, PROMPTS[2] + re.output_ids) == hf_routes(hf_b, PROMPTS[2] + re.output_ids)).all()
    eng.update_weights(hf.state_dict().items())

    # aborted while the memory is released (a colocated trainer's turn): every row -1, no pool read
    eng.add_request("gone", PROMPTS[1], greedy(20), routed_experts=True)
    eng.step()
    eng.release_memory()
    [gone] = eng.abort("gone")
    assert (gone.outputs[0].routed_experts.array() == -1).all()
    eng.resume_memory()


# ---- weights under both namings ------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_checkpoints_in_either_naming_load_the_same_weights(models, arch, tmp_path):
    """transformers 5 writes a checkpoint's experts one by one (Qwen3-MoE: mlp.experts.{e}.gate_proj;
    Mixtral: block_sparse_moe.experts.{e}.w1/w2/w3 and block_sparse_moe.gate) and holds them
    stacked in memory (mlp.experts.gate_up_proj [E, 2I, H], mlp.experts.down_proj [E, H, I],
    mlp.gate.weight): a directory of either loads the same weights, and the engine's checksum of
    every name equals the sum of that tensor as HF holds or saves it."""
    import shutil

    from safetensors.torch import save_file

    from vime.engine.core.safetensors_io import iter_safetensors
    from vime.transport.checksums import checksums

    a, _ = models[arch]
    hf = load_hf(a)
    stacked = tmp_path / "stacked"
    shutil.copytree(a, stacked)
    state = {n: t.contiguous() for n, t in hf.state_dict().items()}
    save_file(state, stacked / "model.safetensors")
    hub = dict(iter_safetensors(a))
    assert any(".experts.3." in n for n in hub) and not any(n.endswith("gate_up_proj") for n in hub)
    assert "model.layers.0.mlp.experts.gate_up_proj" in state
    one, two = engine_for(a), engine_for(stacked)
    held = one.weight_checksums()
    assert held == two.weight_checksums()
    for name, tensor in [*hub.items(), *state.items()]:
        assert held[name] == checksums([tensor])[0], name
    assert set(held) == set(hub) | set(state)


# ---- HTTP: routed experts in the answer, weight pushes ----------------------------------


def post(url: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(url, json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def decode_routes(sample: dict, layers: int, top_k: int) -> np.ndarray:
    """SGLang's encoding: base64 of little-endian int32 [prompt + completion - 1, layers, top_k]."""
    meta = sample["meta_info"]
    flat = np.frombuffer(base64.b64decode(meta["routed_experts"]), dtype="<i4")
    return flat.reshape(meta["prompt_tokens"] + meta["completion_tokens"] - 1, layers, top_k)


def test_server_answers_routed_experts_as_sglang_does(models, tiny_model, tmp_path):
    """/generate with return_routed_experts: each sample's meta_info carries its experts; without
    it, nothing; a dense model refuses the flag in one line (HTTP 400)."""
    from vime.backends.builtin.launch import launch_engine

    a, _ = models["qwen3_moe"]
    hf = load_hf(a)
    moe = launch_engine(str(a), extra_args=["--num-threads", "1", "--block-size", "4"], log_path=tmp_path / "moe.log")
    dense = launch_engine(str(tiny_model), extra_args=["--num-threads", "1"], log_path=tmp_path / "dense.log")
    try:
        params = {"max_new_tokens": 6, "temperature": 1.0, "n": 2, "ignore_eos": True}
        body = {"input_ids": PROMPTS[2], "sampling_params": params, "return_routed_experts": True}
        status, samples = post(moe.url + "/generate", body)
        assert status == 200 and len(samples) == 2
        for s in samples:
            np.testing.assert_array_equal(decode_routes(s, 2, 2), hf_routes(hf, PROMPTS[2] + s["output_ids"]))
        info = json.loads(urllib.request.urlopen(moe.url + "/get_model_info", timeout=10).read())
        assert (info["num_experts"], info["num_experts_per_tok"], info["moe_layers"]) == (4, 2, [0, 2])
        status, plain = post(moe.url + "/generate", {"input_ids": PROMPTS[1], "sampling_params": params})
        assert status == 200 and all("routed_experts" not in s["meta_info"] for s in plain)
        status, err = post(moe.url + "/generate", {**body, "return_routed_experts": "yes"})
        assert status == 400 and err["error"] == "field 'return_routed_experts' has the wrong type (str)"
        status, err = post(dense.url + "/generate", body)
        assert status == 400 and err["error"] == "return_routed_experts: the model has no experts (qwen3 is dense)"
    finally:
        moe.shutdown()
        dense.shutdown()


def test_pushes_of_expert_weights_by_shm_disk_and_gloo(models, tmp_path):
    """A trainer's push of changed experts, by the names it holds them under (stacked) or the
    checkpoint's (per expert), through shared memory, disk and a gloo broadcast in small
    buckets: each is checked by checksum (the pusher's verify), and the engine then gives HF's
    log-probs and routing under the new weights."""
    from vime.backends.builtin.launch import launch_engine
    from vime.backends.client import EngineClient
    from vime.engine.core.safetensors_io import iter_safetensors
    from vime.transport.push import WeightPusher

    a, b = models["qwen3_moe"]
    hf_a, hf_b = load_hf(a), load_hf(b)
    engine = launch_engine(str(a), extra_args=["--num-threads", "1", "--block-size", "4"], log_path=tmp_path / "e.log")
    client = EngineClient(engine.url)

    def check(hf, version: int) -> None:
        body = {"input_ids": PROMPTS[1], "sampling_params": {"max_new_tokens": 6, "temperature": 0.0}}
        status, out = post(engine.url + "/generate", {**body, "return_logprob": True, "return_routed_experts": True})
        assert status == 200 and out["meta_info"]["weight_version"] == version
        assert out["output_ids"] == hf_greedy(hf, PROMPTS[1], len(out["output_ids"]))
        lps = torch.tensor(out["meta_info"]["output_token_logprobs"])
        assert torch.allclose(lps, hf_logprobs(hf, PROMPTS[1], out["output_ids"]), atol=ATOL)
        np.testing.assert_array_equal(decode_routes(out, 2, 2), hf_routes(hf, PROMPTS[1] + out["output_ids"]))

    try:
        check(hf_a, 0)
        stacked_b = [(n, t.detach()) for n, t in hf_b.state_dict().items()]  # as a trainer's named_weights
        for version, (transport, weights, hf) in enumerate(
            [("shm", stacked_b, hf_b), ("disk", list(iter_safetensors(a)), hf_a), ("gloo", stacked_b, hf_b)], 1
        ):
            pusher = WeightPusher([client], transport, tmp_dir=tmp_path, bucket_bytes=16 * 1024, timeout=30)
            pusher.connect("cpu")
            metrics = pusher.push(iter(weights), version=version)  # verify(): every checksum the engine's
            assert metrics["perf/update_weights_check_time"] > 0
            pusher.close()
            check(hf, version)
    finally:
        engine.shutdown()


# ---- what the engine refuses -----------------------------------------------------------


def test_what_the_engine_refuses_about_experts_is_one_line(models, tiny_model, tmp_path):
    from vime.engine.core import fp8
    from vime.engine.core.model_config import unsupported

    a, _ = models["qwen3_moe"]
    assert unsupported(a) is None and unsupported(models["mixtral"][0]) is None
    base = json.loads((a / "config.json").read_text())

    def refusal(**changes) -> str:
        d = tmp_path / str(len(list(tmp_path.iterdir())))
        d.mkdir()
        (d / "config.json").write_text(json.dumps({**base, **changes}))
        return str(unsupported(d))

    assert refusal(model_type="qwen2_moe", shared_expert_intermediate_size=64) == (
        f"model_type 'qwen2_moe' in {tmp_path}/0/config.json is a mixture-of-experts family the vime engine does not "
        "run (its experts: qwen3_moe and mixtral; dense: llama, qwen2, qwen3)"
    )
    assert "shared experts are not supported by the vime engine" in refusal(shared_expert_intermediate_size=64)
    assert "sliding-window attention is not supported" in refusal(model_type="mixtral", sliding_window=4096)
    assert "num_experts_per_tok 5" in refusal(num_experts_per_tok=5)

    with pytest.raises(ValueError, match=r"--quantization fp8 does not cover the experts .* \(qwen3_moe\): leave"):
        fp8.check("fp8", torch.device("cpu"), torch.float32, str(a))
    eng = engine_for(a)
    lora = [("model.layers.0.mlp.experts.0.gate_proj.lora_A", (2, 64), torch.float32)]
    with pytest.raises(ValueError, match="LoRA on experts or routers is not supported by the vime engine"):
        eng.check_weights(lora)
    with pytest.raises(ValueError, match="return_routed_experts: the model has no experts"):
        engine_for(tiny_model).add_request("r", [1, 2], greedy(1), routed_experts=True)


# ---- the GPU code path, under the Triton interpreter and on a GPU -------------------------


def test_moe_kernel_path_in_interpreter(models):
    """The grouped kernel and the engine's kernel path on CPU tensors (a subprocess: the
    interpreter is chosen when Triton kernels are defined)."""
    pytest.importorskip("triton")
    env = {
        **os.environ,
        "TRITON_INTERPRET": "1",
        # the repository and tests/ (the script imports the tiny models' builder as the tests do)
        "PYTHONPATH": os.pathsep.join(
            filter(None, [os.getcwd(), str(Path(__file__).parents[2]), os.environ.get("PYTHONPATH")])
        ),
    }
    a, m = models["qwen3_moe"][0], models["mixtral"][0]
    proc = subprocess.run(
        [sys.executable, __file__, str(a), str(m)], env=env, capture_output=True, text=True, timeout=900
    )  # a hang guard: interpreted, it takes ~30 s
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]


def kernel_checks(device: torch.device, dtype: torch.dtype, rtol: float) -> None:
    """`fused_experts` (the grouped kernel) against `experts_torch`, within `rtol` of the largest
    output: decode-sized and prefill-sized batches, an expert that gets no token, top-1 to
    top-3, blocks of 16 to 64 rows."""
    from vime.engine.core import kernels
    from vime.engine.core.kernels.moe import align_by_expert
    from vime.engine.core.moe import experts_torch

    torch.manual_seed(0)
    for t, e, k in [(1, 4, 2), (37, 4, 2), (5, 8, 3), (70, 2, 1), (300, 3, 2)]:
        x = torch.randn(t, 64, device=device).to(dtype)
        gate_up = (torch.randn(e, 2 * 48, 64, device=device) * 0.2).to(dtype)
        down = (torch.randn(e, 64, 48, device=device) * 0.2).to(dtype)
        logits = torch.randn(t, e, device=device)
        logits[:, -1] = -1e9 if e > k else 0.0  # the last expert idle where it can be
        weights, ids = logits.softmax(-1).topk(k, dim=-1)
        weights = weights.to(dtype)  # as Qwen3-MoE rounds them; the kernel scales in float32
        got = kernels.fused_experts(x, gate_up, down, weights.float(), ids)
        want = experts_torch(x, gate_up, down, weights, ids)
        err = (got.float() - want.float()).abs().max() / want.float().abs().max()
        assert err <= rtol, (t, e, k, err)
    # the sort: every (token, k) pair once, in a block of its own expert
    ids = torch.tensor([[2, 0], [2, 1], [0, 2]], device=device)
    rows, experts = align_by_expert(ids, 4, 16)
    real = rows[rows < 6].tolist()
    assert sorted(real) == list(range(6)) and experts.tolist() == [0, 1, 2, -1, -1]
    blocks = rows.view(-1, 16)
    for b, ex in enumerate(experts.tolist()):
        members = blocks[b][blocks[b] < 6]
        assert all(ids.view(-1)[members] == ex)


def interpreted_checks(qwen_dir: str, mixtral_dir: str) -> None:
    """Under TRITON_INTERPRET=1: the kernel, then the whole engine on the kernel path (fused
    norms, paged attention, the grouped experts, static decode buffers) against HF."""
    from vime.engine.core import kernels

    assert kernels.enabled(torch.device("cpu"))
    kernel_checks(torch.device("cpu"), torch.float32, rtol=1e-6)
    for d in (qwen_dir, mixtral_dir):
        hf = load_hf(Path(d))
        eng = engine_for(Path(d))
        for i, p in enumerate(PROMPTS[1:]):
            eng.add_request(str(i), p, greedy(5), routed_experts=True)
        outs, kinds = {}, set()
        while eng.has_work():
            outs.update((o.rid, o.outputs[0]) for o in eng.step())
            kinds.add(eng.runner.last_step.kind)
        assert kinds == {"eager", "decode"}
        for i, p in enumerate(PROMPTS[1:]):
            check_against_hf(hf, p, outs[str(i)])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("arch", ARCHS)
def test_gpu_path_matches_the_cpu_reference(models, arch):
    """On CUDA: the grouped kernel against the PyTorch path (float32, and bfloat16 within a
    rounding or two), then an engine whose decode steps replay CUDA graphs, its routing
    recorded inside them, against HF (float32), before and after a memory release."""
    cuda = torch.device("cuda")
    kernel_checks(cuda, torch.float32, rtol=1e-5)
    kernel_checks(cuda, torch.bfloat16, rtol=2e-2)  # a bfloat16 rounding or two apart (other summation orders)
    a, _ = models[arch]
    hf = load_hf(a)  # on the CPU: the reference
    eng = engine_for(a, device="cuda")
    for i, p in enumerate(PROMPTS):
        eng.add_request(str(i), p, greedy(8), routed_experts=True)
    outs, kinds = {}, set()
    while eng.has_work():
        outs.update((o.rid, o.outputs[0]) for o in eng.step())
        kinds.add(eng.runner.last_step.kind)
    assert "graph" in kinds
    for i, p in enumerate(PROMPTS):
        check_against_hf(hf, p, outs[str(i)])
    # the experts are in the one weight buffer and the routing pool beside the KV blocks: both
    # leave the GPU on a release and come back at the addresses the graphs replay
    eng.release_memory()
    eng.resume_memory()
    eng.add_request("again", PROMPTS[2], greedy(8), routed_experts=True)
    again = run(eng)["again"]
    assert again.output_ids == outs["2"].output_ids
    np.testing.assert_array_equal(again.routed_experts.array(), outs["2"].routed_experts.array())


if __name__ == "__main__":  # run by test_moe_kernel_path_in_interpreter under TRITON_INTERPRET=1
    interpreted_checks(sys.argv[1], sys.argv[2])
