"""The engine on CUDA: the NCCL weight push into an engine on another GPU against loading from
disk, Qwen3-4B's head layout against HF, memory release keeping addresses and graphs (with VMM and
without), LoRA adapters by CUDA IPC, scoring beside overlapped steps, logit bias, streamed tokens
and top log-probs. The CUDA-graph, CUDA-IPC and fp8 checks of the engine's own tests are
tests/unit/engine/test_gpu_path.py's (marked `gpu` as well). Run on a GPU machine with `make test-gpu` (never in CI, which has no GPU; here every test
skips)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from gpu.marks import two_gpus
from vime.backends.builtin.launch import launch_engine
from vime.backends.client import EngineClient
from vime.engine.core.safetensors_io import iter_safetensors
from vime.models import make_tiny_model

pytestmark = pytest.mark.gpu

PROMPTS = [[40, 41, 42], [50, 60, 70, 80, 90], list(range(10, 33))]


def greedy(url: str, n: int = 16) -> list[tuple[list[int], list[float]]]:
    client = EngineClient(url)

    async def main():  # one request at a time: the same batches in both engines
        try:
            return [
                await client.generate(p, {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True}) for p in PROMPTS
            ]
        finally:
            await client.close()

    return [(o["output_ids"], o["meta_info"]["output_token_logprobs"]) for o in asyncio.run(main())]


@two_gpus
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_nccl_push_equals_loading_from_disk(tmp_path, dtype):
    """Trainer tensors on GPU 0 (float32, as FSDP2's master copy) → engine on GPU 1 over NCCL,
    cast to the engine's dtype on the way; the engine then generates what an engine loaded
    from those weights on disk (on the same GPU) generates."""
    from vime.transport.push import WeightPusher

    a = make_tiny_model(tmp_path / "a", arch="qwen3", seed=0, vocab_size=4096)
    b = make_tiny_model(tmp_path / "b", arch="qwen3", seed=1, vocab_size=4096)
    pushed = launch_engine(
        str(a), device="cuda:1", dtype=dtype, extra_args=["--num-kv-blocks", "512"], log_path=tmp_path / "pushed.log"
    )
    try:
        reference = launch_engine(
            str(b), device="cuda:1", dtype=dtype, extra_args=["--num-kv-blocks", "512"], log_path=tmp_path / "ref.log"
        )
        try:
            expected = greedy(reference.url)
        finally:
            reference.shutdown()
        client = EngineClient(pushed.url)
        assert greedy(pushed.url) != expected
        pusher = WeightPusher([client], "nccl", bucket_bytes=256 * 1024, timeout=60)
        pusher.connect("cuda:0")
        weights = [(n, t.to("cuda:0", torch.float32)) for n, t in iter_safetensors(b)]
        m = pusher.push(iter(weights), version=3)
        assert m["perf/update_weights_buckets"] > 1
        assert client.model_info()["weight_version"] == 3
        got = greedy(pushed.url)
        for (t1, lp1), (t2, lp2) in zip(got, expected):
            assert t1 == t2
            assert torch.allclose(torch.tensor(lp1), torch.tensor(lp2), atol=1e-5)
        pusher.close()
    finally:
        pushed.shutdown()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_qwen3_4b_head_layout_matches_hf_in_float32(tmp_path):
    """Qwen3-4B's attention layout (32 query heads over 8 KV heads of 128, hidden 2560, ffn
    9728), two layers: in float32 the engine (CUDA graphs on) gives HF's greedy tokens and its
    log-probs. The whole 4B shape's bf16 gap to HF is rounding (bench/RESULTS.md); this keeps
    the layout's kernels exact."""
    import random

    from transformers import AutoModelForCausalLM

    from vime.engine.core.engine import EngineConfig, LLMEngine
    from vime.engine.core.sampler import SamplingParams

    model_dir = make_tiny_model(
        tmp_path / "m", hidden_size=2560, num_layers=2, num_heads=32, num_kv_heads=8, head_dim=128,
        intermediate_size=9728, vocab_size=4096, max_position_embeddings=2048, tie_word_embeddings=True,
    )  # fmt: skip
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).cuda().eval()
    hf.generation_config.eos_token_id = None  # the engine ignores EOS here too
    engine = LLMEngine(EngineConfig(str(model_dir), device="cuda", dtype="float32", max_num_seqs=8))
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 4096) for _ in range(n)] for n in (5, 37, 130, 600)]
    n_new = 24
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(max_new_tokens=n_new, temperature=0.0, ignore_eos=True))
    outs = {}
    while engine.has_work():
        outs.update((o.rid, o.outputs[0]) for o in engine.step())
    for i, p in enumerate(prompts):
        out = outs[str(i)]
        with torch.no_grad():
            ids = torch.tensor([p], device="cuda")
            ref = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n_new)
            logits = hf(torch.tensor([p + out.output_ids], device="cuda")).logits[0, len(p) - 1 : -1]
        assert out.output_ids == ref[0, len(p) :].tolist(), f"prompt {i}"
        lp = torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(out.output_ids, device="cuda")[:, None])
        assert torch.allclose(lp[:, 0].cpu(), torch.tensor(out.logprobs), atol=1e-4), f"prompt {i}"
    engine.release_memory()


def engine_greedy(engine) -> list[tuple[list[int], list[float]]]:
    """16 greedy tokens and their log-probs for each of PROMPTS, all in flight together (prefill
    eagerly, then decode through the captured graphs)."""
    from vime.engine.core.sampler import SamplingParams

    for i, p in enumerate(PROMPTS):
        engine.add_request(str(i), p, SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True))
    outs, kinds = {}, set()
    while engine.has_work():
        outs.update((o.rid, o.outputs[0]) for o in engine.step())
        kinds.add(engine.runner.last_step.kind)
    assert "graph" in kinds
    return [(outs[str(i)].output_ids, outs[str(i)].logprobs) for i in range(len(PROMPTS))]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_memory_release_keeps_addresses_graphs_and_output(tmp_path):
    """With CUDA VMM a release gives the KV pool and the weights back to the device, and a resume
    maps them again at the same addresses: the decode graphs captured at start are replayed, not
    captured again, and greedy tokens and log-probs are bit for bit those before. A weight update
    after the resume shows as in an engine that never released, and one pushed while released
    lands in the host copy and comes back with it."""
    from vime.engine.core.engine import EngineConfig, LLMEngine

    a = make_tiny_model(tmp_path / "a", arch="qwen3", seed=0, vocab_size=4096, tie_word_embeddings=True)
    g = torch.Generator().manual_seed(1)
    trained = {n: t + 0.5 * torch.randn(t.shape, generator=g) for n, t in iter_safetensors(a)}  # the pushed policy
    cfg = dict(device="cuda", dtype="float32", max_num_seqs=8, kv_cache_gb=1.0)
    engine = LLMEngine(EngineConfig(str(a), **cfg))
    model, kv = engine.model, engine.kv_cache
    assert engine.packed is not None and kv.buffer is not None, "no VMM on this GPU: the fallback path runs"
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied: one slice under both names
    params = list(model.parameters())
    pointers = [p.data_ptr() for p in params] + [kv.k.data_ptr(), kv.v.data_ptr()]
    graphs = {bs: graph for bs, (graph, _) in engine.runner.graphs.items()}
    mapped = kv.buffer.reserved + engine.packed.buffer.reserved
    assert kv.buffer.reserved >= 2**30
    before = engine_greedy(engine)
    sums = engine.weight_checksums()

    weights = sum(p.nbytes for p in params)
    kv_bytes = 2 * kv.k.numel() * kv.k.element_size()
    free = torch.cuda.mem_get_info()[0]
    assert engine.release_memory() == weights + kv_bytes  # what the colocated run logs
    released = torch.cuda.mem_get_info()[0]
    assert released - free >= mapped
    assert not kv.allocated and all(p.device.type == "cpu" for p in params)
    assert engine.weight_checksums() == sums  # the host copy
    engine.resume_memory()
    assert released - torch.cuda.mem_get_info()[0] >= mapped
    assert [p.data_ptr() for p in params] + [kv.k.data_ptr(), kv.v.data_ptr()] == pointers
    assert engine.runner.graphs.keys() == graphs.keys()
    assert all(engine.runner.graphs[bs][0] is graph for bs, graph in graphs.items())
    assert engine_greedy(engine) == before

    reference = LLMEngine(EngineConfig(str(a), **cfg))
    reference.update_weights((n, t.cuda()) for n, t in trained.items())
    expected = engine_greedy(reference)
    del reference
    engine.update_weights((n, t.cuda()) for n, t in trained.items())
    got = engine_greedy(engine)
    assert [t for t, _ in got] == [t for t, _ in expected] != [t for t, _ in before]
    for (_, lp1), (_, lp2) in zip(got, expected):
        assert torch.allclose(torch.tensor(lp1), torch.tensor(lp2), atol=1e-5)

    engine.release_memory()
    engine.update_weights(iter_safetensors(a))  # from disk into the host copy
    engine.resume_memory()
    assert engine.weight_checksums() == sums
    assert engine_greedy(engine) == before


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_memory_release_without_vmm_captures_graphs_again(tmp_path, monkeypatch):
    """Where the driver offers no VMM the engine falls back to moving the weights to host memory
    and reallocating the KV pools, and captures its decode graphs again on resume."""
    from vime.engine.core import vmem
    from vime.engine.core.engine import EngineConfig, LLMEngine

    monkeypatch.setattr(vmem, "supported", lambda device: False)
    a = make_tiny_model(tmp_path / "a", arch="qwen3", seed=0, vocab_size=4096, tie_word_embeddings=True)
    engine = LLMEngine(EngineConfig(str(a), device="cuda", dtype="float32", max_num_seqs=8, kv_cache_gb=1.0))
    assert engine.packed is None and engine.kv_cache.buffer is None
    graphs = {bs: graph for bs, (graph, _) in engine.runner.graphs.items()}
    before = engine_greedy(engine)
    kv_bytes = 2 * engine.kv_cache.k.numel() * engine.kv_cache.k.element_size()
    free = torch.cuda.mem_get_info()[0]
    engine.release_memory()
    assert torch.cuda.mem_get_info()[0] - free >= kv_bytes and not engine.runner.graphs
    engine.resume_memory()
    assert engine.runner.graphs.keys() == graphs.keys()
    assert all(engine.runner.graphs[bs][0] is not graph for bs, graph in graphs.items())
    after = engine_greedy(engine)
    assert [t for t, _ in after] == [t for t, _ in before]
    for (_, lp1), (_, lp2) in zip(after, before):
        assert torch.allclose(torch.tensor(lp1), torch.tensor(lp2), atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_lora_adapters_by_cuda_ipc_survive_a_release_and_give_the_trainers_log_probs(tmp_path):
    """A LoRA trainer on the GPU pushes the base once, then adapters alone, by CUDA IPC into an
    engine on the same GPU; the engine releases and resumes its memory (the base copies go to
    the host and back) between two adapter pushes. After each, the engine's greedy tokens
    score under the trainer's LoRA model to the engine's own log-probs (float32 on both
    sides), and every byte of an adapter push is adapter."""
    from unit.trainer.actors import make_args, make_samples
    from unit.trainer.test_lora import ADVANTAGES

    from vime.rollout.types import Sample
    from vime.trainer import weights
    from vime.trainer.actor import Actor
    from vime.transport.push import WeightPusher

    model = make_tiny_model(tmp_path / "m", arch="qwen3", seed=0, vocab_size=4096)
    actor = Actor(make_args(lora_rank=4, lora_alpha=8.0, lr=5e-2, compile=False), model, "cuda:0")
    engine = launch_engine(
        str(model), device="cuda:0", dtype="float32", extra_args=["--num-kv-blocks", "512"], log_path=tmp_path / "e.log"
    )
    try:
        client = EngineClient(engine.url)
        pusher = WeightPusher([client], "cuda_ipc", timeout=60)
        pusher.push(actor.named_weights(merge=False), version=0)
        freed = [client.release_memory_occupation()["released_bytes"]]  # no adapter merged yet
        client.resume_memory_occupation()
        for version in (1, 2):
            actor.train_step(make_samples(4), ADVANTAGES)
            m = pusher.push(actor.adapter_weights(), version=version)  # checked: the engine merged what was sent
            assert m["perf/update_weights_bytes"] == sum(
                4 * t.numel() for t in weights.adapter_tensors(actor.policy).values()
            )
            got = greedy(engine.url, n=8)
            samples = [
                Sample(index=i, tokens=p + t, response_length=len(t)) for i, (p, (t, _)) in enumerate(zip(PROMPTS, got))
            ]
            for (_, lp), mine in zip(got, actor.compute_log_probs(samples)):
                assert torch.allclose(mine.cpu(), torch.tensor(lp), atol=1e-3), (mine, lp)
            freed.append(client.release_memory_occupation()["released_bytes"])
            client.resume_memory_occupation()
        # each merged layer's float32 base copy goes to the host too, and is counted
        adapters = weights.adapter_tensors(actor.policy)
        base = sum(
            4 * a.shape[1] * adapters[n[: -len("lora_A")] + "lora_B"].shape[0]
            for n, a in adapters.items()
            if n.endswith("lora_A")
        )
        assert base > 0 and freed[1] - freed[0] == freed[2] - freed[0] == base, (freed, base)
    finally:
        engine.shutdown()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_scoring_on_cuda_matches_hf_and_leaves_overlapped_steps_alone(tmp_path):
    """Scoring (scoring.py) through the Triton attention kernels, between overlapped steps (one
    step in flight while it runs): HF's teacher-forced log-probs within 1e-4 in float32, and a
    greedy generation scored beside gives the tokens and log-probs it gives alone."""
    import random

    from transformers import AutoModelForCausalLM

    from vime.engine.core.engine import EngineConfig, LLMEngine
    from vime.engine.core.sampler import SamplingParams
    from vime.engine.core.scoring import score

    model_dir = make_tiny_model(tmp_path / "m", seed=3)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).cuda().eval()
    rng = random.Random(0)
    text = [rng.randrange(5, 90) for _ in range(300)]
    with torch.no_grad():
        logits = hf(torch.tensor([text], device="cuda")).logits[0, :-1].float()
    want = logits.log_softmax(-1).gather(1, torch.tensor(text[1:], device="cuda")[:, None])[:, 0].cpu()

    def generate(interleave: bool) -> tuple[list[int], list[float], list[list[float]]]:
        cfg = EngineConfig(str(model_dir), device="cuda", dtype="float32", max_num_seqs=8, max_num_batched_tokens=128)
        engine = LLMEngine(cfg)
        assert engine.overlap
        engine.add_request("g", text[:20], SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True))
        outs, scores = [], []
        while engine.has_work():
            outs += engine.step()
            if interleave:
                scores.append(score(engine, text, 0)[1:])
        engine.release_memory()
        return outs[0].outputs[0].output_ids, outs[0].outputs[0].logprobs, scores

    alone, mixed = generate(False), generate(True)
    assert mixed[:2] == alone[:2]
    assert mixed[2] and all(torch.allclose(torch.tensor(s), want, atol=1e-4) for s in mixed[2])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_logit_bias_streamed_tokens_and_top_logprobs_on_cuda(tmp_path):
    """The OpenAI routes' engine parts on the CUDA path (graphs, overlapped steps): a request's
    logit_bias moves only its own row (its neighbour gives the tokens it gives alone), what a
    stream reads after each step (`Request.booked`) is never a pending placeholder and ends as the
    output, and score_top's alternatives are HF's top-k."""
    from transformers import AutoModelForCausalLM

    from vime.engine.core.engine import EngineConfig, LLMEngine
    from vime.engine.core.sampler import SamplingParams
    from vime.engine.core.scheduler import PENDING
    from vime.engine.core.scoring import score_top

    model_dir = make_tiny_model(tmp_path / "m", seed=3)
    z = 90  # an ordinary character of the tiny vocabulary
    plain = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
    biased = SamplingParams(max_new_tokens=24, temperature=1.0, ignore_eos=True, logit_bias=((z, 100.0),))

    def run(requests: dict[str, SamplingParams]) -> tuple[dict[str, list[int]], dict[str, list[int]], LLMEngine]:
        engine = LLMEngine(EngineConfig(str(model_dir), device="cuda", dtype="float32", max_num_seqs=8))
        assert engine.overlap and engine.runner.graphs
        for rid, params in requests.items():
            engine.add_request(rid, PROMPTS[1], params)
        done, streamed = {}, {rid: [] for rid in requests}
        while engine.has_work():
            done.update({o.rid: o.outputs[0].output_ids for o in engine.step()})
            for rid, req in engine.requests.items():
                streamed[rid] += req.booked([len(streamed[rid])])[0]
        return done, streamed, engine

    alone, _, first = run({"a": plain})
    first.release_memory()
    both, streamed, engine = run({"a": plain, "b": biased})
    assert both["a"] == alone["a"] and both["b"] == [z] * 24
    assert all(PENDING not in ids and ids == both[rid][: len(ids)] for rid, ids in streamed.items())
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).cuda().eval()
    ids = PROMPTS[1] + alone["a"]
    with torch.no_grad():
        want = hf(torch.tensor([ids], device="cuda")).logits[0, :-1].float().log_softmax(-1).topk(3)
    _, tops = score_top(engine, ids, 1, 3)
    assert [[t for t, _ in row] for row in tops] == want.indices.tolist()
    assert torch.allclose(torch.tensor([[lp for _, lp in row] for row in tops]), want.values.cpu(), atol=1e-4)
    engine.release_memory()
