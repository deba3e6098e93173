"""The collective weight push into real vLLM servers on CPU (`make test-vllm`; no mocks), against
servers started from the same weights: the pushed server computes what the trainer does, LoRA
adapters alone make it compute the merged model, callers without the key or naming another model
are refused, and a model vLLM cannot run is refused at start with vLLM's reason. Marked `vllm`.

Models: tiny tied and untied Llamas, head_dim 32, float32.

Tolerance: the log-probs vLLM returns (processed, i.e. after temperature) must match the
trainer's recomputation (`Actor.compute_log_probs`) within ATOL = 1e-4, as for the built-in
engine (float32 on CPU; the observed gap is ~1e-6).
"""

from __future__ import annotations

import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch
from vllm_plugins import PROBE

from unit.backends.vllm_support import ATOL, actor_for, needs_vllm, run
from vime.backends.client import EngineError
from vime.backends.vllm.client import VLLMClient
from vime.config import Config
from vime.rollout.types import Sample

# ---- the collective push, against servers started from the same weights ------------------------


# random Llama-style models: SmolLM2's layout (tied embeddings) and an untied one
PAIR_SHAPE = dict(arch="llama", hidden_size=64, num_heads=2, num_kv_heads=1, head_dim=32, num_layers=2)


def trainer_weights(model_dir: Path) -> list[tuple[str, torch.Tensor]]:
    """What the trainer pushes (Actor.named_weights): each tensor once, a tied one under
    model.embed_tokens.weight only."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return [(n, p.detach()) for n, p in model.named_parameters()]


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """For a tied and an untied model: weights A and B, and a server started from A (the two
    launched at once). B's reference is the trainer's own log-probs, as in a run."""
    from vime.backends.placement import launch_all
    from vime.backends.vllm.launch import launch_vllm
    from vime.models import make_tiny_model

    root = tmp_path_factory.mktemp("pairs")
    dirs = {}
    for kind, tied in (("tied", True), ("untied", False)):
        for w, seed in (("A", 0), ("B", 1)):
            dirs[kind, w] = make_tiny_model(root / f"{kind}{w}", seed=seed, tie_word_embeddings=tied, **PAIR_SHAPE)
    kinds = ["tied", "untied"]
    servers = launch_all(
        lambda i: launch_vllm(str(dirs[kinds[i], "A"]), max_num_seqs=8, log_path=root / f"{kinds[i]}-A.log"),
        len(kinds),
    )
    yield {(k, w): (dirs[k, w], srv if w == "A" else None) for k, srv in zip(kinds, servers) for w in "AB"}
    for srv in servers:
        srv.shutdown()


def _sampled(srv) -> tuple[list[int], list[float]]:
    """A seeded sampled continuation of a fixed prompt: its tokens and the server's log-probs."""
    (out,) = run(
        VLLMClient(srv.url, api_key=srv.api_key),
        {"input_ids": PROBE, "sampling_params": {"max_new_tokens": 12, "temperature": 1.0, "sampling_seed": 3, "ignore_eos": True}},
    )  # fmt: skip
    return out["output_ids"], out["meta_info"]["output_token_logprobs"]


def _gap(model_dir: Path, ids: list[int], logprobs: list[float]) -> float:
    """Largest difference between a server's log-probs of `ids` after PROBE and the trainer's,
    holding the weights of `model_dir`."""
    sample = Sample(index=0, tokens=PROBE + ids, response_length=len(ids))
    (ref,) = actor_for(model_dir, 1.0).compute_log_probs([sample])
    return (torch.tensor(logprobs) - ref.float()).abs().max().item()


@needs_vllm
@pytest.mark.parametrize("kind", ["tied", "untied"])
def test_a_collective_push_makes_the_server_compute_what_the_trainer_does(pairs, kind):
    """Weights B pushed by broadcast (gloo: the code NCCL runs on GPUs) into a server of A: its
    log-probs are then the trainer's for B, tied output layer included; the trainer's checksums
    match the server's; and a push back by disk restores A's outputs."""
    from vime.transport.push import WeightPusher

    (a_dir, a), (b_dir, _) = pairs[kind, "A"], pairs[kind, "B"]
    client = VLLMClient(a.url, api_key=a.api_key)
    before = _sampled(a)
    assert _gap(b_dir, *before) > 100 * ATOL and _gap(a_dir, *before) < ATOL
    pusher = WeightPusher([client], transport="gloo", timeout=60)
    try:
        metrics = pusher.push(trainer_weights(b_dir), version=5)
        assert _gap(b_dir, *_sampled(a)) < ATOL  # every weight arrived and is used
        assert metrics["perf/update_weights_buckets"] >= 1 and "perf/update_weights_check_time" in metrics
        assert client.model_info()["weight_version"] == 5
        # the proof is the server's: a checksum the trainer did not send is a one-line error
        sent = pusher._sent[torch.float32]
        name = next(iter(sent))
        sent[name] = [sent[name][0] + 1, sent[name][1]]  # one bit of one element
        with pytest.raises(
            EngineError, match=f"does not hold what the trainer sent, 1 of {len(sent)} tensors differ: {name}"
        ):
            pusher.verify(5)
        # a push that leaves a layer out is refused, naming it, and the next whole push works
        partial = [(n, t) for n, t in trainer_weights(b_dir) if ".layers.1.mlp.down_proj" not in n]
        with pytest.raises(EngineError, match=r"reached no weight of 1 layer\(s\).*layers\.1\.mlp\.down_proj"):
            pusher.push(partial, version=6)
        # and so is one holding a NaN (the group is unusable after a failure: by disk), before any
        # of that file is loaded
        poisoned = [(n, t.clone()) for n, t in trainer_weights(b_dir)]
        poisoned[-1][1].view(-1)[0] = float("nan")
        with pytest.raises(EngineError, match=f"weight '{poisoned[-1][0]}' holds non-finite values"):
            WeightPusher([client], transport="disk").push(poisoned, version=6)
        WeightPusher([client], transport="disk").push(trainer_weights(a_dir), version=7)
        after = _sampled(a)
        assert after[0] == before[0] and max(abs(x - y) for x, y in zip(after[1], before[1])) < ATOL
    finally:
        pusher.close()
        client.update_weights_from_disk(str(a_dir), 0)


@needs_vllm
@pytest.mark.parametrize("kind", ["tied", "untied"])
def test_lora_adapters_alone_make_the_server_compute_the_trainers_merged_model(pairs, kind):
    """A LoRA trainer on A sends the frozen base once (announced lora_base), then adapters alone:
    by broadcast and by disk, each push only adapter bytes, and the server's log-probs are then
    the trainer's for base + B A (merged by the worker extension into its copy of the base); a
    second adapter push merges into the base, not on top of the first. Adapters with no base
    kept, or mixed with plain weights, are refused in one line."""
    from vime.trainer.actor import Actor
    from vime.transport.push import WeightPusher

    a_dir, a = pairs[kind, "A"]
    client = VLLMClient(a.url, api_key=a.api_key)
    args = Config(lr=1e-2, max_tokens_per_gpu=4096, seed=0, rollout_temperature=1.0, lora_rank=4, lora_alpha=8.0)
    actor = Actor(args, a_dir)
    batch = [Sample(index=i, tokens=PROBE[: 10 + i] + [5, 6, 7], response_length=3) for i in range(2)]

    def gap() -> float:  # the server's sampled log-probs against the trainer's merged model
        ids, logprobs = _sampled(a)
        (ref,) = actor.compute_log_probs([Sample(index=0, tokens=PROBE + ids, response_length=len(ids))])
        return (torch.tensor(logprobs) - ref.float()).abs().max().item()

    gloo = WeightPusher([client], transport="gloo", timeout=60, bucket_bytes=4096)  # pairs split over buckets
    try:
        gloo.push(actor.named_weights(merge=False), version=1, lora_base=True)
        for step, pusher in enumerate((gloo, WeightPusher([client], transport="disk"))):
            actor.train_step(batch, [1.0, -1.0])
            adapters = list(actor.adapter_weights())
            metrics = pusher.push(iter(adapters), version=2 + step)
            assert gap() < ATOL, pusher.transports
            assert _gap(a_dir, *_sampled(a)) > 10 * ATOL  # and that is no longer the base's
            # what travelled is the adapters (float32 on a CPU server) and nothing else
            assert metrics["perf/update_weights_bytes"] == sum(t.numel() * 4 for _, t in adapters)
        assert client.model_info()["weight_version"] == 3
        with pytest.raises(EngineError, match="mixes LoRA adapters with plain weights") as e:
            WeightPusher([client], transport="disk").push(trainer_weights(a_dir)[:1] + adapters[:2], version=4)
        assert "\n" not in str(e.value)
    finally:
        gloo.close()
        client.update_weights_from_disk(str(a_dir), 0)  # plain weights, not a base: none is kept now
    with pytest.raises(EngineError, match="holds no base to merge them into") as e:
        WeightPusher([client], transport="disk").push(iter(adapters), version=5)
    assert "\n" not in str(e.value)
    assert _gap(a_dir, *_sampled(a)) < ATOL  # a refused push changes nothing


@needs_vllm
def test_servers_refuse_callers_without_the_key_and_other_models(pairs):
    """Every route but /health needs the run's key (vLLM's own --api-key leaves the dev routes
    open), and a server of another model is named in one line before anything is pushed."""
    from vime.backends.vllm.place import check_same_model, model_facts

    (a_dir, a), (b_dir, _) = pairs["tied", "A"], pairs["untied", "B"]
    for route, body in (("/collective_rpc", b'{"method": "vime_hello"}'), ("/pause?mode=abort", b"{}")):
        req = urllib.request.Request(
            a.url + route, data=body, method="POST", headers={"Content-Type": "application/json"}
        )
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=10)
        assert e.value.code == 401
    assert urllib.request.urlopen(a.url + "/health", timeout=10).status == 200
    facts = VLLMClient(a.url, api_key=a.api_key).hello()
    check_same_model(model_facts(a_dir), facts, a.url)
    with pytest.raises(EngineError, match="serves another model than --hf-checkpoint: tie_word_embeddings True"):
        check_same_model(model_facts(b_dir), facts, a.url)


@needs_vllm
def test_a_model_vllm_cannot_run_is_refused_at_start_with_vllms_reason(tmp_path):
    """vLLM's CPU attention refuses head_dim 16 only at the first request (the server starts
    fine): launch_vllm generates one token before it returns, so the run stops at start-up with
    vLLM's own reason instead of an HTTP 500 at its first rollout."""
    from vime.backends.vllm.launch import launch_vllm
    from vime.models import make_tiny_model

    model = make_tiny_model(tmp_path / "hd16", arch="qwen3", seed=0, hidden_size=64, num_heads=4, num_kv_heads=2)
    with pytest.raises(EngineError) as e:
        launch_vllm(str(model), max_num_seqs=4, log_path=tmp_path / "server.log")
    msg = str(e.value)
    assert msg.startswith(f"vLLM cannot run {model}: ") and "\n" not in msg, msg
    assert "head" in msg.lower(), msg  # vLLM's reason, from its log
