"""The built-in rollout engine as a server process on a tiny float32 Qwen3, with HF transformers
as the reference for tokens and log-probs: generation (greedy, penalties, sampled log-probs, n,
seeds, stop tokens and strings), control (abort, a client hanging up, weight updates in place
and from disk, refused updates, memory release, concurrent aborts and pauses) and the protocol's
errors and OpenAI routes.

Tolerance: log-probs must match a teacher-forced HF forward within ATOL = 1e-4 (float32 on CPU;
the observed difference is ~1e-6, the gap covers summation-order differences).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import socket
import time
import urllib.error
import urllib.request
import uuid

import pytest
import torch

from unit.engine.reference import (
    ATOL,
    PROMPTS,
    engine_metrics,
    generate_many,
    greedy,
    hf_greedy,
    hf_logprobs,
    perturbed,
)
from vime.backends.builtin.launch import launch_engine
from vime.backends.client import EngineClient, EngineError

EOS_IDS = (3, 1)  # <|im_end|> (config) and <|endoftext|> (generation_config)


async def wait_for_tokens(url: str, at_least: float) -> None:
    """Wait until the engine has generated `at_least` tokens in total (a request is mid-way)."""
    deadline = time.monotonic() + 30
    while (await asyncio.to_thread(engine_metrics, url))["generated_tokens_total"] < at_least:
        assert time.monotonic() < deadline, "engine made no progress"
        await asyncio.sleep(0.005)


def post_raw(url: str, body: bytes) -> tuple[int, str]:
    req = urllib.request.Request(url, data=body, method="POST", headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


@pytest.fixture(scope="module")
def engine(model_dir, tmp_path_factory):
    # Small blocks and token budget so that tests cross block boundaries and chunk prefills.
    args = ["--num-threads", "1", "--block-size", "4", "--max-num-batched-tokens", "32", "--seed", "0"]
    proc = launch_engine(str(model_dir), extra_args=args, log_path=tmp_path_factory.mktemp("logs") / "engine.log")
    yield proc
    proc.shutdown()


@pytest.fixture(scope="module")
def client(engine) -> EngineClient:
    return EngineClient(engine.url)


# ---- correctness against HF ------------------------------------------------------------


def test_greedy_matches_hf_generate(client, hf):
    outs = generate_many(client, [{"input_ids": p, "sampling_params": greedy(24)} for p in PROMPTS])
    for p, out in zip(PROMPTS, outs):
        ref = hf.generate(
            torch.tensor([p]),
            attention_mask=torch.ones(1, len(p), dtype=torch.long),
            do_sample=False,
            max_new_tokens=24,
        )[0, len(p) :].tolist()
        assert out["output_ids"] == ref
        meta = out["meta_info"]
        assert meta["finish_reason"]["type"] == ("stop" if ref[-1] in EOS_IDS else "length")
        assert meta["prompt_tokens"] == len(p) and meta["completion_tokens"] == len(ref)
        # Greedy log-probs are the raw log-softmax.
        assert torch.allclose(torch.tensor(meta["output_token_logprobs"]), hf_logprobs(hf, p, ref), atol=ATOL)

    # Again: full prompt blocks now come from the prefix cache, and nothing changes.
    hits = engine_metrics(client.url)["prefix_cache_hit_tokens_total"]
    again = generate_many(client, [{"input_ids": p, "sampling_params": greedy(24)} for p in PROMPTS])
    assert [o["output_ids"] for o in again] == [o["output_ids"] for o in outs]
    assert engine_metrics(client.url)["prefix_cache_hit_tokens_total"] - hits >= 36  # PROMPTS[3]: 9 blocks of 4


def test_repetition_penalty_greedy_matches_hf_with_the_same_penalty(client, hf):
    """vLLM's repetition penalty (vllm-project/vime's tau-bench agent samples at 1.1): greedy decoding
    with it is HF's greedy with every seen token's logit penalized, prompt and output alike, and
    it changes what the engine says."""
    params = greedy(12, ignore_eos=True, repetition_penalty=3.0)
    penalized = generate_many(client, [{"input_ids": p, "sampling_params": params} for p in PROMPTS])
    plain = generate_many(client, [{"input_ids": p, "sampling_params": greedy(12, ignore_eos=True)} for p in PROMPTS])
    for p, out in zip(PROMPTS, penalized):
        assert out["output_ids"] == hf_greedy(hf, p, 12, repetition_penalty=3.0)
    assert [o["output_ids"] for o in penalized] != [o["output_ids"] for o in plain]


def test_presence_and_frequency_penalties_greedy_match_hf_with_the_same_penalties(client, hf):
    """OpenAI's presence and frequency penalties, as vLLM applies them: on the response's tokens
    only, the frequency one times each token's count; and they change what the engine says."""
    plain = generate_many(client, [{"input_ids": p, "sampling_params": greedy(12, ignore_eos=True)} for p in PROMPTS])
    for presence, frequency in ((1.5, 0.0), (0.0, 0.7), (-0.5, 0.3)):
        params = greedy(12, ignore_eos=True, presence_penalty=presence, frequency_penalty=frequency)
        outs = generate_many(client, [{"input_ids": p, "sampling_params": params} for p in PROMPTS])
        for p, out in zip(PROMPTS, outs):
            assert out["output_ids"] == hf_greedy(hf, p, 12, presence=presence, frequency=frequency)
        assert [o["output_ids"] for o in outs] != [o["output_ids"] for o in plain]


@pytest.mark.parametrize("temperature,top_k", [(1.0, 0), (0.7, 0), (1.0, 5)])
def test_sampled_logprobs_match_teacher_forced_hf(client, hf, temperature, top_k):
    params = {"max_new_tokens": 16, "temperature": temperature, "top_k": top_k or -1, "ignore_eos": True}
    outs = generate_many(client, [{"input_ids": p, "sampling_params": params} for p in PROMPTS[1:3]])
    for p, out in zip(PROMPTS[1:3], outs):
        ids, lps = out["output_ids"], torch.tensor(out["meta_info"]["output_token_logprobs"])
        assert len(ids) == 16 and lps.shape == (16,)
        ref = hf_logprobs(hf, p, ids, temperature, top_k)
        assert torch.isfinite(ref).all()  # with top-k: every sampled token was inside the top k
        assert torch.allclose(lps, ref, atol=ATOL), (lps - ref).abs().max()


def test_n_samples_differ(client):
    out = generate_many(
        client,
        [
            {
                "input_ids": PROMPTS[1],
                "sampling_params": {"max_new_tokens": 12, "temperature": 1.0, "n": 4, "ignore_eos": True},
            }
        ],
    )[0]
    assert isinstance(out, list) and len(out) == 4
    assert len({tuple(o["output_ids"]) for o in out}) == 4
    assert all(len(o["output_ids"]) == 12 and o["meta_info"]["finish_reason"]["type"] == "length" for o in out)


def test_sampling_seed_fixes_the_draws_whatever_the_batch(client):
    """A seeded request gets the same tokens alone or among others (async runs are
    reproducible only if a sample does not depend on which requests share its steps)."""

    def seeded(seed: int, n: int = 1) -> dict:
        sampling = {"max_new_tokens": 10, "temperature": 1.0, "ignore_eos": True, "sampling_seed": seed, "n": n}
        return {"input_ids": PROMPTS[2], "sampling_params": sampling}

    crowd = [
        {"input_ids": p, "sampling_params": {"max_new_tokens": 14, "temperature": 1.0, "ignore_eos": True}}
        for p in PROMPTS
    ]
    alone = generate_many(client, [seeded(123)])[0]["output_ids"]
    together = generate_many(client, crowd + [seeded(123)] + crowd)[len(crowd)]["output_ids"]
    assert together == alone
    other = generate_many(client, [seeded(124)])[0]["output_ids"]
    assert other != alone
    pair = generate_many(client, [seeded(123, n=2)])[0]
    assert pair[0]["output_ids"] == alone and pair[1]["output_ids"] != alone  # sample j of n has its own stream
    status, text = post_raw(
        client.url + "/generate", json.dumps({"input_ids": [1], "sampling_params": {"sampling_seed": 1.5}}).encode()
    )
    assert status == 400 and "sampling_seed must be an integer" in text


def test_stop_token_and_length(client, hf):
    ref = hf_greedy(hf, PROMPTS[2], 12)
    stop_tok = ref[5]
    stopped, capped, empty = generate_many(
        client,
        [
            {"input_ids": PROMPTS[2], "sampling_params": greedy(12, stop_token_ids=[stop_tok], ignore_eos=True)},
            {"input_ids": PROMPTS[2], "sampling_params": greedy(7, ignore_eos=True)},
            {"input_ids": PROMPTS[2], "sampling_params": greedy(0)},
        ],
    )
    assert stopped["output_ids"] == ref[: ref.index(stop_tok) + 1]  # the stop token is kept
    assert stopped["meta_info"]["finish_reason"]["type"] == "stop"
    assert capped["output_ids"] == ref[:7] and capped["meta_info"]["finish_reason"]["type"] == "length"
    assert empty["output_ids"] == [] and empty["meta_info"]["finish_reason"]["type"] == "length"


def test_stop_strings_end_the_response_right_after_their_first_occurrence(client, model_dir):
    from vime.models import load_tokenizer

    tok = load_tokenizer(model_dir)
    text = lambda ids: tok.decode(ids, skip_special_tokens=True)  # noqa: E731  (as the rollout reads a response)
    prompt = PROMPTS[1]
    ref = generate_many(client, [{"input_ids": prompt, "sampling_params": greedy(40, ignore_eos=True)}])[0][
        "output_ids"
    ]
    full = text(ref)
    assert len(full) >= 12, full
    stop = full[8:11]  # from the greedy continuation: it occurs, maybe earlier than at 8 too
    end = next(k for k in range(1, len(ref) + 1) if stop in text(ref[:k]))  # the token that completes it
    never = "\x07never\x07"
    reqs = [
        greedy(40, ignore_eos=True, stop=[stop]),
        greedy(40, ignore_eos=True, stop=stop),  # a single string works too
        greedy(40, ignore_eos=True, stop=[never, stop]),
        greedy(40, ignore_eos=True, stop=[never]),
        greedy(3, ignore_eos=True, stop=[full[20:23]]),  # the length cap comes first
    ]
    outs = generate_many(client, [{"input_ids": prompt, "sampling_params": r} for r in reqs])
    for out in outs[:3]:
        assert out["output_ids"] == ref[:end] and out["meta_info"]["finish_reason"]["type"] == "stop"
        assert text(out["output_ids"]).endswith(stop) and stop not in text(out["output_ids"][:-1])
        assert len(out["meta_info"]["output_token_logprobs"]) == end == out["meta_info"]["completion_tokens"]
    assert outs[3]["output_ids"] == ref and outs[3]["meta_info"]["finish_reason"]["type"] == "length"
    assert outs[4]["output_ids"] == ref[:3] and outs[4]["meta_info"]["finish_reason"]["type"] == "length"
    # sampled, n > 1: each sample ends at its own first occurrence, or runs to the cap without one
    one = full[9]
    group = generate_many(
        client,
        [
            {
                "input_ids": prompt,
                "sampling_params": {
                    "max_new_tokens": 30,
                    "temperature": 1.0,
                    "n": 4,
                    "stop": [one],
                    "ignore_eos": True,
                },
            }
        ],
    )[0]
    for out in group:
        ids, reason = out["output_ids"], out["meta_info"]["finish_reason"]["type"]
        assert one not in text(ids[:-1]) and (one in text(ids)) == (reason == "stop") and len(ids) <= 30
    for bad in ([""], [1], "", 5):
        status, body = post_raw(
            client.url + "/generate", json.dumps({"input_ids": [5], "sampling_params": {"stop": bad}}).encode()
        )
        assert status == 400 and "stop must be a non-empty string or a list of them" in body, (bad, body)


# ---- control: abort, pause, weight updates, memory -------------------------------------


def test_abort_long_request_returns_partial(client, engine):
    rid = uuid.uuid4().hex

    async def main():
        before = (await asyncio.to_thread(engine_metrics, engine.url))["generated_tokens_total"]
        task = asyncio.create_task(client.generate(PROMPTS[1], {"max_new_tokens": 500, "ignore_eos": True}, rid=rid))
        await wait_for_tokens(engine.url, before + 5)
        await asyncio.to_thread(client.abort_request, rid)
        try:
            return await task
        finally:
            await client.close()

    out = asyncio.run(main())
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    assert 5 <= len(out["output_ids"]) < 500
    assert len(out["meta_info"]["output_token_logprobs"]) == len(out["output_ids"])


def test_client_hanging_up_aborts_its_request(client, engine):
    async def main():
        m0 = await asyncio.to_thread(engine_metrics, engine.url)
        task = asyncio.create_task(client.generate(PROMPTS[1], {"max_new_tokens": 500, "ignore_eos": True}))
        await wait_for_tokens(engine.url, m0["generated_tokens_total"] + 5)
        task.cancel()
        await client.close()
        deadline = time.monotonic() + 10
        while (m := await asyncio.to_thread(engine_metrics, engine.url))["requests_aborted_total"] == m0[
            "requests_aborted_total"
        ]:
            assert time.monotonic() < deadline, "the engine kept generating for a client that left"
            await asyncio.sleep(0.01)
        return m

    m = asyncio.run(main())
    assert m["num_running"] == 0 and m["kv_blocks_free"] == m["kv_blocks_total"]


def test_weight_update_in_place_and_from_disk(client, engine, hf, model_dir):
    from safetensors.torch import save_file

    v0 = client.model_info()["weight_version"]
    hf2 = perturbed(hf)
    shm = f"/dev/shm/vime-test-{os.getpid()}.safetensors"
    save_file({k: v.contiguous() for k, v in hf2.state_dict().items()}, shm)

    async def main():
        before = (await asyncio.to_thread(engine_metrics, engine.url))["generated_tokens_total"]
        task = asyncio.create_task(client.generate(PROMPTS[1], greedy(400, ignore_eos=True)))
        await wait_for_tokens(engine.url, before + 5)
        await asyncio.to_thread(client.pause_generation, "in_place")
        res = await asyncio.to_thread(
            client.update_weights_from_tensor, {"transport": "shm", "path": shm, "weight_version": v0 + 1}
        )
        await asyncio.to_thread(client.continue_generation)
        try:
            return res, await task
        finally:
            await client.close()

    try:
        res, inflight = asyncio.run(main())
    finally:
        os.unlink(shm)
    assert res["weight_version"] == v0 + 1 and res["num_tensors"] == len(hf2.state_dict())
    versions = inflight["meta_info"]["output_weight_versions"]
    assert inflight["meta_info"]["finish_reason"]["type"] == "length" and len(versions) == 400
    assert versions == sorted(versions) and versions[0] == v0 and versions[-1] == v0 + 1  # continued in place
    assert inflight["meta_info"]["weight_version"] == v0 + 1

    p = PROMPTS[2]
    new = generate_many(client, [{"input_ids": p, "sampling_params": greedy(12, ignore_eos=True)}])[0]
    assert new["output_ids"] == hf_greedy(hf2, p, 12) != hf_greedy(hf, p, 12)
    assert new["meta_info"]["output_weight_versions"] == [v0 + 1] * 12

    client.update_weights_from_disk(str(model_dir), v0 + 2)
    back = generate_many(client, [{"input_ids": p, "sampling_params": greedy(12, ignore_eos=True)}])[0]
    assert back["output_ids"] == hf_greedy(hf, p, 12)
    assert back["meta_info"]["output_weight_versions"] == [v0 + 2] * 12
    assert client.model_info()["weight_version"] == v0 + 2


def test_a_weight_update_holding_nan_is_refused_and_nothing_is_sampled_until_a_whole_one(client, engine, hf, model_dir):
    from safetensors.torch import save_file

    v0 = client.model_info()["weight_version"]
    bad = {k: v.contiguous().clone() for k, v in hf.state_dict().items()}
    name = next(k for k in bad if k.endswith("mlp.down_proj.weight"))
    bad[name][0, 0] = float("nan")
    shm = f"/dev/shm/vime-test-nan-{os.getpid()}.safetensors"
    save_file(bad, shm)
    try:
        # the refusal says what the engine does now: it was copied before the check found the NaN
        with pytest.raises(
            EngineError,
            match=f"HTTP 400.*weight '{name}' holds non-finite values .*; the update was part-copied, so this "
            r"engine now refuses generation \(HTTP 503\) until a complete update arrives",
        ):
            client.update_weights_from_tensor({"transport": "shm", "path": shm, "weight_version": v0 + 1})
    finally:
        os.unlink(shm)
    assert client.model_info()["weight_version"] == v0  # not taken as a version
    with pytest.raises(EngineError, match="HTTP 503.*weights mix two versions: push a complete update"):
        generate_many(client, [{"input_ids": PROMPTS[2], "sampling_params": greedy(4)}])
    client.update_weights_from_disk(str(model_dir), v0 + 1)  # a whole, finite update restores it
    out = generate_many(client, [{"input_ids": PROMPTS[2], "sampling_params": greedy(6, ignore_eos=True)}])[0]
    assert out["output_ids"] == hf_greedy(hf, PROMPTS[2], 6)


def test_a_negative_weight_version_is_refused_by_every_update_route(client, engine, model_dir):
    v0 = client.model_info()["weight_version"]
    refused = r"HTTP 400.*weight_version -5 is negative: give the policy version \(0 or more\), or leave it out"
    with pytest.raises(EngineError, match=refused):
        client.update_weights_from_disk(str(model_dir), -5)
    with pytest.raises(EngineError, match=refused):
        client.update_weights_from_tensor({"transport": "shm", "path": "/nonexistent", "weight_version": -5})
    body = {"names": ["lm_head.weight"], "dtypes": ["float32"], "shapes": [[1]], "weight_version": -5}
    with pytest.raises(EngineError, match=refused):
        client.update_weights_from_distributed(body)
    assert client.model_info()["weight_version"] == v0


def test_release_and_resume_memory_recomputes_in_flight(client, engine, hf):
    async def main():
        before = (await asyncio.to_thread(engine_metrics, engine.url))["generated_tokens_total"]
        task = asyncio.create_task(client.generate(PROMPTS[3], greedy(60, ignore_eos=True)))
        await wait_for_tokens(engine.url, before + 3)
        freed = [(await asyncio.to_thread(client.release_memory_occupation))["released_bytes"] for _ in range(2)]
        released = await asyncio.to_thread(client.model_info)
        await asyncio.to_thread(client.resume_memory_occupation)
        try:
            return freed, released, await task
        finally:
            await client.close()

    freed, released, out = asyncio.run(main())
    assert released["memory_released"] is True
    assert freed[0] > 0 and freed[1] == 0  # the KV pools (on CPU); a second release has nothing left to give
    assert out["output_ids"] == hf_greedy(hf, PROMPTS[3], 60)


def test_stress_concurrent_aborts_and_pauses(client, engine):
    """Every request returns exactly once, whatever aborts and pauses hit it; nothing leaks."""
    rng = random.Random(0)
    n_req = 40
    reqs = [
        {
            "input_ids": [rng.randrange(4, 100) for _ in range(rng.randint(1, 30))],
            "sampling_params": {
                "max_new_tokens": rng.randint(1, 40),
                "temperature": rng.choice([0.0, 0.8, 1.0]),
                "top_p": rng.choice([1.0, 0.9]),
                "ignore_eos": rng.random() < 0.5,
            },
            "rid": f"stress-{i}",
        }
        for i in range(n_req)
    ]
    m0 = engine_metrics(engine.url)

    async def control():
        for action in ["abort", "pause_in_place", "abort", "pause_abort", "abort", "abort_all", "abort"]:
            await asyncio.sleep(rng.uniform(0.0, 0.05))
            if action == "abort":
                await asyncio.to_thread(client.abort_request, rng.choice(reqs)["rid"])
            elif action == "abort_all":
                await asyncio.to_thread(client.abort_request, None, True)
            else:
                await asyncio.to_thread(client.pause_generation, "in_place" if action == "pause_in_place" else "abort")
                await asyncio.sleep(0.02)
                await asyncio.to_thread(client.continue_generation)

    async def one(r):
        await asyncio.sleep(rng.uniform(0.0, 0.2))  # arrivals spread over the control actions
        return await client.generate(**r)

    async def main():
        try:
            results = await asyncio.gather(*(one(r) for r in reqs), control())
        finally:
            await client.close()
        return results[:n_req]

    outs = asyncio.run(main())
    assert [o["meta_info"]["id"] for o in outs] == [r["rid"] for r in reqs]
    for r, o in zip(reqs, outs):
        meta = o["meta_info"]
        assert meta["finish_reason"]["type"] in ("stop", "length", "abort")
        assert (
            len(o["output_ids"])
            == len(meta["output_token_logprobs"])
            == len(meta["output_weight_versions"])
            <= r["sampling_params"]["max_new_tokens"]
        )
        if meta["finish_reason"]["type"] == "length":
            assert len(o["output_ids"]) == r["sampling_params"]["max_new_tokens"]
    assert any(o["meta_info"]["finish_reason"]["type"] == "abort" for o in outs)
    m1 = engine_metrics(engine.url)
    done = (m1["requests_finished_total"] - m0["requests_finished_total"]) + (
        m1["requests_aborted_total"] - m0["requests_aborted_total"]
    )
    assert done == n_req  # each request ended once: none lost, none both finished and aborted
    assert m1["num_running"] == m1["num_waiting"] == 0 and m1["paused"] == 0
    assert m1["kv_blocks_free"] == m1["kv_blocks_total"]  # every block came back


# ---- protocol errors and OpenAI routes -------------------------------------------------


def test_client_errors(client, engine):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    t0 = time.monotonic()
    with pytest.raises(EngineError, match=f"engine at {dead} unreachable after 3 tries \\(connection refused\\)"):
        EngineClient(dead, retry_backoff=0.01).health()
    with pytest.raises(EngineError, match=f"engine at {dead} unreachable after 3 tries"):
        generate_many(EngineClient(dead, retry_backoff=0.01), [{"input_ids": [5], "sampling_params": {}}])
    assert time.monotonic() - t0 < 5

    with pytest.raises(EngineError, match=f"engine at {engine.url}/generate timed out after 0.05s"):
        generate_many(
            EngineClient(engine.url, timeout=0.05),
            [{"input_ids": [5], "sampling_params": {"max_new_tokens": 500, "n": 4, "ignore_eos": True}}],
        )
    with pytest.raises(EngineError, match="HTTP 400.*unsupported sampling_params"):
        generate_many(client, [{"input_ids": [5], "sampling_params": {"min_new_tokens": 2}}])
    with pytest.raises(EngineError, match="HTTP 400.*can never fit"):
        generate_many(client, [{"input_ids": [5] * 600, "sampling_params": {}}])
    with pytest.raises(EngineError, match="HTTP 400.*pause mode"):
        client.pause_generation("sideways")
    with pytest.raises(
        EngineError, match=r"HTTP 400.*n 1000000 is more samples than this engine runs at once \(--max-num-seqs 64\)"
    ):
        generate_many(client, [{"input_ids": [5], "sampling_params": {"n": 1000000}}])
    assert post_raw(engine.url + "/generate", b"{not json") == (
        400,
        json.dumps({"error": "request body is not valid JSON"}),
    )
    status, body = post_raw(engine.url + "/generate", b'{"sampling_params": {}}')
    assert status == 400 and "missing field 'input_ids'" in body
    status, body = post_raw(engine.url + "/update_weights_from_distributed", b"{}")
    assert status == 400 and "call /init_weights_update_group first" in body


def _peak_rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return int(next(line.split()[1] for line in f if line.startswith("VmHWM")))


def test_a_body_over_the_limit_is_a_413_unread_and_a_long_text_leaves_health_answering(engine, capsys):
    """Three 10 MB prompts were read and parsed on the engine's event loop (/health stalled for
    seconds, the engine grew by hundreds of MB) and a text prompt was tokenized there (a minute
    for 10 MB). Now a body over the limit (default: room for a prompt of the whole context, at
    least 1 MiB) is a 413 from its stated length alone, naming the limit and the flag; a prompt
    too long for the context is refused before it queues, and a long text is tokenized off the
    loop, /health answering meanwhile."""
    from concurrent.futures import ThreadPoolExecutor

    from vime.engine.flags import parse_args as engine_args

    peak = _peak_rss_kb(engine.proc.pid)
    big = json.dumps({"input_ids": [5] * 3_500_000, "sampling_params": {}}).encode()  # 10.5 MB
    with ThreadPoolExecutor(3) as pool:
        answers = list(pool.map(lambda _: post_raw(engine.url + "/generate", big), range(3)))
    refused = f"request body of {len(big)} bytes is over this engine's limit of 1048576 bytes: send less, or raise --max-request-mb"
    assert answers == [(413, json.dumps({"error": refused}))] * 3
    assert _peak_rss_kb(engine.proc.pid) - peak < 30_000  # never read
    assert post_raw(engine.url + "/v1/completions", json.dumps({"prompt": "1+1=", "max_tokens": 1}).encode())[0] == 200
    text = json.dumps({"prompt": "hello world 12345 " * 16_000, "max_tokens": 1}).encode()  # 288 kB
    with ThreadPoolExecutor(1) as pool:
        start = time.monotonic()
        pending = pool.submit(post_raw, engine.url + "/v1/completions", text)
        waits = []  # each /health's time to answer while the text was tokenized
        while not pending.done():
            t = time.monotonic()
            urllib.request.urlopen(engine.url + "/health", timeout=10).read()
            waits.append(time.monotonic() - t)
            time.sleep(0.01)
        took = time.monotonic() - start
    status, body = pending.result()
    assert status == 400 and re.search(r"prompt of \d+ tokens can never fit", body)
    # tokenized on the loop, one /health would have waited for the whole of it (seconds); off
    # the loop each answers in a fraction of it (a count of answers alone hung on machine speed)
    assert len(waits) >= 3 and max(waits) < took / 3, (waits, took)
    with pytest.raises(SystemExit):
        engine_args(["--model-path", "tiny", "--max-request-mb", "0"])
    assert "error: --max-request-mb 0.0: give a size in MiB above 0" in capsys.readouterr().err


def test_openai_routes(engine):
    body = json.dumps(
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "temperature": 0, "ignore_eos": True}
    ).encode()
    status, text = post_raw(engine.url + "/v1/chat/completions", body)
    chat = json.loads(text)
    assert (
        status == 200
        and chat["object"] == "chat.completion"
        and isinstance(chat["choices"][0]["message"]["content"], str)
    )
    assert chat["usage"]["completion_tokens"] == 5
    body = json.dumps({"messages": [{"role": "wizard", "content": "hi"}], "max_tokens": 5}).encode()
    status, text = post_raw(engine.url + "/v1/chat/completions", body)
    assert status == 400 and "messages[0]: unknown role 'wizard'" in text
    status, text = post_raw(
        engine.url + "/v1/completions", json.dumps({"prompt": "1+1=", "max_tokens": 3, "n": 2}).encode()
    )
    comp = json.loads(text)
    assert status == 200 and len(comp["choices"]) == 2 and all(isinstance(c["text"], str) for c in comp["choices"])
