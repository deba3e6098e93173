"""The vLLM backend against a real vLLM server on CPU (`make test-vllm`; no mocks): log-probs the
trainer recomputes, the protocol (n, seeds, stop ids, lengths, stop strings), pause and abort,
a disk push, and a launched server's end with the process that launched it. Marked `vllm` and
skipped where vllm is not installed (the main `make test` environment).

Model: a random Qwen3 with head_dim 32 (vLLM's CPU attention refuses the default tiny model's
head_dim 16), float32, wide (~17M parameters, ~140 tokens/s on one core): slow enough that a
pause or an abort lands while a request is still generating.

Tolerance: the log-probs vLLM returns (processed, i.e. after temperature) must match the
trainer's recomputation (`Actor.compute_log_probs`) within ATOL = 1e-4, as for the built-in
engine (float32 on CPU; the observed gap is ~1e-6).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from conftest import ROOT
from vllm_plugins import PROBE

from unit.backends.vllm_support import ATOL, actor_for, needs_vllm, run
from vime.backends.client import EngineError
from vime.backends.vllm.client import VLLMClient
from vime.backends.vllm.launch import _group_alive
from vime.rollout.types import Sample

# Seconds of work for the server tests' model (~10 s on one core), so a pause or abort lands mid-flight.
LONG_TOKENS = 1900

# The server tests' model (~17M parameters): slow enough on CPU that a pause lands mid-request.
MID_MODEL = dict(
    arch="qwen3",
    hidden_size=512,
    num_layers=8,
    num_heads=16,
    num_kv_heads=4,
    head_dim=32,
    intermediate_size=1024,
    max_position_embeddings=2048,
)

LONG = {"max_new_tokens": LONG_TOKENS, "temperature": 1.0, "ignore_eos": True, "sampling_seed": 1}

# ---- fixtures ------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def model_mid(tmp_path_factory) -> Path:
    from vime.models import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("mid") / "qwen3", seed=0, **MID_MODEL)


# A run's trainer, as far as its vLLM server sees: a process that launches the server with
# launch_vllm (the watcher that ends the server with it included), says where the server is, and
# lives until it is killed or its stdin closes (pytest gone).
LAUNCHER = """
import os, sys
from dataclasses import dataclass
from pathlib import Path
from vime.backends.vllm.launch import launch_vllm
server = launch_vllm(sys.argv[1], max_num_seqs=32, log_path=Path(sys.argv[2]))
print(os.getpgid(server.proc.pid), server.url, server.api_key, flush=True)
sys.stdin.read()
"""


@dataclass
class Launched:
    """A server launched by a LAUNCHER process (`trainer`): its process group, address and key."""

    trainer: subprocess.Popen
    pgid: int
    url: str
    api_key: str

    def alive(self) -> bool:
        return self.trainer.poll() is None and _group_alive(self.pgid)

    def end(self) -> None:
        self.trainer.kill()  # the watcher ends the server's group (SIGTERM, then SIGKILL)
        self.trainer.wait()
        deadline = time.monotonic() + 60
        while _group_alive(self.pgid) and time.monotonic() < deadline:
            time.sleep(0.5)
        if _group_alive(self.pgid):
            os.killpg(self.pgid, signal.SIGKILL)


def launch_in_a_process(model: Path, root: Path) -> Launched:
    script = root / "launcher.py"
    script.write_text(LAUNCHER)
    with open(root / "launcher.err", "w") as err:
        trainer = subprocess.Popen(
            [sys.executable, str(script), str(model), str(root / "server.log")],
            cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), text=True,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
        )  # fmt: skip
    line = trainer.stdout.readline()  # once the server answers
    if not line.strip():
        trainer.kill()
        raise AssertionError(
            f"the launcher ended before its server was up: {(root / 'launcher.err').read_text()[-3000:]}"
        )
    pgid, url, key = line.split()
    return Launched(trainer, int(pgid), url, key)


@pytest.fixture(scope="module")
def launched(model_mid, tmp_path_factory):
    """The server tests' server, launched as a run launches one but from a process of its own
    (LAUNCHER), so that the last of them, test_server_dies_with_the_trainer, can kill that
    process and see the server go (one vLLM start fewer than a server of its own)."""
    servers = [launch_in_a_process(model_mid, tmp_path_factory.mktemp("vllm"))]
    yield servers
    for s in servers:
        s.end()


@pytest.fixture()
def server(launched, model_mid, tmp_path_factory) -> Launched:
    """The shared server; a fresh one if a test before this one killed it (only the last test
    of the file does, so in file order the server starts once)."""
    if not launched[-1].alive():
        launched.append(launch_in_a_process(model_mid, tmp_path_factory.mktemp("vllm")))
    return launched[-1]


@pytest.fixture()
def client(server) -> VLLMClient:
    c = VLLMClient(server.url, api_key=server.api_key)
    yield c
    # a failed test must not leave the shared server paused, busy or relabelled
    c.continue_generation()
    c.abort_request(abort_all=True)
    c.set_weight_version(0)


def _brief(out: dict) -> str:
    return f"{out['meta_info']['finish_reason']}, {len(out['output_ids'])} tokens"


# ---- against a real server ---------------------------------------------------------------


@needs_vllm
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampled_log_probs_match_the_trainer(client, model_mid, temperature):
    prompts = [PROBE[:5], PROBE, PROBE[3:20]]
    outs = run(
        client,
        *[
            {"input_ids": p, "sampling_params": {"max_new_tokens": 24, "temperature": temperature, "sampling_seed": i}}
            for i, p in enumerate(prompts)
        ],
    )
    samples = [
        Sample(index=i, tokens=p + o["output_ids"], response_length=len(o["output_ids"]))
        for i, (p, o) in enumerate(zip(prompts, outs))
    ]
    ref = actor_for(model_mid, temperature).compute_log_probs(samples)
    for o, r in zip(outs, ref):
        got = torch.tensor(o["meta_info"]["output_token_logprobs"])
        assert len(got) == len(o["output_ids"]) > 0
        assert torch.allclose(got, r.float(), atol=ATOL), (got - r).abs().max()


@needs_vllm
def test_protocol_n_seeds_stop_ids_and_lengths(client):
    greedy = run(client, {"input_ids": PROBE, "sampling_params": {"max_new_tokens": 30, "temperature": 0.0}})[0]
    ids = greedy["output_ids"]
    assert greedy["meta_info"]["finish_reason"]["type"] in ("stop", "length") and len(ids) >= 2
    seeded = {"max_new_tokens": 12, "temperature": 1.0, "ignore_eos": True, "sampling_seed": 5}
    a, b, group = run(
        client,
        {"input_ids": PROBE, "sampling_params": seeded},
        {"input_ids": PROBE, "sampling_params": seeded},
        {"input_ids": PROBE, "sampling_params": dict(seeded, n=3), "rid": "grp"},
    )
    assert a["output_ids"] == b["output_ids"]  # the seed fixes the draws
    assert (
        isinstance(group, list) and len(group) == 3 and group[0]["output_ids"] == a["output_ids"]
    )  # sample j gets seed + j
    assert len({tuple(g["output_ids"]) for g in group}) == 3
    for g in group:
        m = g["meta_info"]
        assert (
            m["id"] == "grp"
            and m["finish_reason"] == {"type": "length"}
            and m["completion_tokens"] == 12 == len(g["output_ids"])
        )
        assert m["prompt_tokens"] == len(PROBE) and m["output_weight_versions"] == [0] * 12 and m["weight_version"] == 0
    # a stop id ends the response on it (included, as EOS is); max_new_tokens 0 answers at once
    stop, zero = run(
        client,
        {"input_ids": PROBE, "sampling_params": {"max_new_tokens": 30, "temperature": 0.0, "stop_token_ids": [ids[1]]}},
        {"input_ids": PROBE, "sampling_params": {"max_new_tokens": 0}},
    )
    assert stop["output_ids"] == ids[: ids.index(ids[1]) + 1] and stop["meta_info"]["finish_reason"] == {"type": "stop"}
    assert zero["output_ids"] == [] and zero["meta_info"]["finish_reason"] == {"type": "length"}
    with pytest.raises(EngineError, match="min_new_tokens"):
        run(client, {"input_ids": PROBE, "sampling_params": {"min_new_tokens": 3}})


@needs_vllm
def test_stop_strings_end_the_response_after_their_first_occurrence(client, model_mid):
    from vime.models import load_tokenizer

    tok = load_tokenizer(model_mid)
    text = lambda ids: tok.decode(ids, skip_special_tokens=True)  # noqa: E731  (as the rollout reads a response)
    greedy = {"max_new_tokens": 40, "temperature": 0.0, "ignore_eos": True}
    ref = run(client, {"input_ids": PROBE, "sampling_params": greedy})[0]["output_ids"]
    full = text(ref)
    assert len(full) >= 12, full
    stop = full[8:11]
    end = next(k for k in range(1, len(ref) + 1) if stop in text(ref[:k]))  # the token that completes it
    out, never = run(
        client,
        {"input_ids": PROBE, "sampling_params": dict(greedy, stop=[stop])},
        {"input_ids": PROBE, "sampling_params": dict(greedy, stop=["\x07never\x07"])},
    )
    assert out["output_ids"] == ref[:end] and out["meta_info"]["finish_reason"] == {"type": "stop"}
    assert len(out["meta_info"]["output_token_logprobs"]) == end
    assert never["output_ids"] == ref and never["meta_info"]["finish_reason"] == {"type": "length"}


def generated_tokens(client: VLLMClient) -> int:
    """The server's count of tokens generated so far (its Prometheus counter): it tells whether a
    request is still in flight, and that nothing is generated while paused, without timing
    guesses (on a busy 2-core CI machine a fixed sleep let a request finish before the pause)."""
    req = urllib.request.Request(client.url + "/metrics", headers=client.headers)  # every route needs the key
    for line in urllib.request.urlopen(req, timeout=30).read().decode().splitlines():
        if line.startswith("vllm:generation_tokens_total"):
            return int(float(line.rsplit(" ", 1)[1]))
    raise AssertionError(f"{client.url}/metrics has no vllm:generation_tokens_total")


async def until_generating(client: VLLMClient, since: int) -> None:
    """Return once the server has generated a token beyond `since` (a request is mid-flight)."""
    for _ in range(600):
        if await asyncio.to_thread(generated_tokens, client) > since:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"{client.url} generated nothing in 30 s")


@needs_vllm
def test_pause_abort_in_place_and_abort_by_id(client):
    async def main() -> None:
        try:
            # abort: the request returns now, with its partial tokens. On a busy CI machine the
            # server's token counter can lag, and a request may end by its length before the pause
            # lands: such a try says nothing of the abort and is made again (three at most)
            for attempt in range(3):
                base = await asyncio.to_thread(generated_tokens, client)
                t = asyncio.create_task(client.generate(PROBE, LONG, rid=f"p1-{attempt}"))
                await until_generating(client, base)
                await asyncio.to_thread(client.pause_generation, "abort")
                out = await asyncio.wait_for(t, 30)
                await asyncio.to_thread(client.continue_generation)
                if len(out["output_ids"]) < LONG_TOKENS:
                    break
            assert (
                out["meta_info"]["finish_reason"] == {"type": "abort"} and 0 < len(out["output_ids"]) < LONG_TOKENS
            ), _brief(out)
            # in place: nothing is generated and nothing returns while paused (also across a
            # cache flush, which preempts the request); all of it after
            base = await asyncio.to_thread(generated_tokens, client)
            t = asyncio.create_task(client.generate(PROBE, LONG, rid="p2"))
            await until_generating(client, base)
            await asyncio.to_thread(client.pause_generation, "in_place")
            await asyncio.to_thread(client.flush_cache)
            held = await asyncio.to_thread(generated_tokens, client)
            assert held - base < LONG_TOKENS, f"the request finished before the pause landed ({held - base} tokens)"
            await asyncio.sleep(1.0)
            assert await asyncio.to_thread(generated_tokens, client) == held, "tokens were generated while paused"
            assert not t.done(), _brief(t.result())
            await asyncio.to_thread(client.continue_generation)
            out = await asyncio.wait_for(t, 120)
            assert out["meta_info"]["finish_reason"] == {"type": "length"} and len(out["output_ids"]) == LONG_TOKENS, (
                _brief(out)
            )
            # abort by id hits that request only (the other, started with it, goes on generating);
            # abort_all then ends the other
            base = await asyncio.to_thread(generated_tokens, client)
            t1 = asyncio.create_task(client.generate(PROBE, LONG, rid="q1"))
            t2 = asyncio.create_task(client.generate(PROBE[1:], LONG, rid="q2"))
            await until_generating(client, base + 1)  # both are generating
            await asyncio.to_thread(client.abort_request, "q1")
            o1 = await asyncio.wait_for(t1, 30)
            assert o1["meta_info"]["finish_reason"] == {"type": "abort"}, _brief(o1)
            await until_generating(client, await asyncio.to_thread(generated_tokens, client) + 1)
            await asyncio.to_thread(client.abort_request, None, True)
            o2 = await asyncio.wait_for(t2, 30)
            # ended by abort_all, not by its length: it outlived q1 and stopped short of its budget
            assert o2["meta_info"]["finish_reason"] == {"type": "abort"}, _brief(o2)
            assert len(o1["output_ids"]) < len(o2["output_ids"]) < LONG_TOKENS, (_brief(o1), _brief(o2))
        finally:
            await client.close()

    asyncio.run(main())
    with pytest.raises(EngineError, match="pause mode 'wait'"):
        client.pause_generation("wait")


@needs_vllm
def test_disk_push_changes_outputs_flushes_the_cache_and_stamps_versions(client, model_mid, tmp_path):
    """After a push the server generates what the new weights generate (HF greedy as oracle),
    even for a prompt whose KV blocks were cached under the old weights."""
    from transformers import AutoModelForCausalLM

    from vime.models import make_tiny_model
    from vime.transport.push import WeightPusher

    other = make_tiny_model(tmp_path / "other", seed=1, **MID_MODEL)
    greedy = {"max_new_tokens": 16, "temperature": 0.0, "ignore_eos": True}

    def hf_greedy(model_dir: Path) -> list[int]:
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        return hf.generate(
            torch.tensor([PROBE]),
            attention_mask=torch.ones(1, len(PROBE), dtype=torch.long),
            do_sample=False,
            max_new_tokens=16,
            eos_token_id=None,
            pad_token_id=0,
        )[0, len(PROBE) :].tolist()

    base, new = hf_greedy(model_mid), hf_greedy(other)
    assert base != new
    assert (
        run(client, {"input_ids": PROBE, "sampling_params": greedy})[0]["output_ids"] == base
    )  # its blocks are cached now
    weights = AutoModelForCausalLM.from_pretrained(other, dtype=torch.float32).state_dict().items()
    WeightPusher([client], transport="disk").push(weights, version=7)
    out = run(client, {"input_ids": PROBE, "sampling_params": greedy})[0]
    assert out["output_ids"] == new
    assert out["meta_info"]["output_weight_versions"] == [7] * 16 and client.model_info()["weight_version"] == 7
    client.update_weights_from_disk(str(model_mid), 8)
    assert run(client, {"input_ids": PROBE, "sampling_params": greedy})[0]["output_ids"] == base
    with pytest.raises(EngineError, match=r"it receives by nccl, gloo or disk\): leave --weight-transport at auto"):
        client.update_weights_from_tensor({"transport": "shm", "path": "/dev/shm/x"})
    with pytest.raises(EngineError, match="runs on CPU: its weight group must use gloo"):  # never sent
        client.init_weights_update_group(
            {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": 2, "backend": "nccl"}
        )


# ---- a launched server ends with the process that launched it ----------------------------------


@needs_vllm
def test_server_dies_with_the_trainer(server):
    """SIGKILL the process that launched a server (a run's trainer launches them the same way,
    through launch_vllm): the watcher ends the server's whole process group. The server is the
    shared one the server tests above used, up and answering until then."""
    assert server.alive() and urllib.request.urlopen(server.url + "/health", timeout=10).status == 200
    server.trainer.send_signal(signal.SIGKILL)
    server.trainer.wait()
    deadline = time.monotonic() + 60
    while _group_alive(server.pgid):
        assert time.monotonic() < deadline, "the vLLM server outlived its trainer"
        time.sleep(0.5)
