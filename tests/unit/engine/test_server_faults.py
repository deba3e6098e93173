"""The engine server under faults (issue 12), against real server processes on the tiny model:
a control plane that runs no code sent to it and answers only to its key, weight loads that are
all or nothing, and a port in use, a silent engine, engines lost while paused and a reset
connection, each one line and nothing held up."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import pickle
import signal
import socket
import struct
import threading
import time
from pathlib import Path

import pytest
import torch

from vime.backends.builtin.launch import launch_engine
from vime.backends.client import EngineClient, EngineError
from vime.engine.flags import parse_args as engine_args
from vime.transport import cuda_ipc


def post(url: str, body: bytes, headers: dict | None = None) -> tuple[int, str]:
    import urllib.error
    import urllib.request

    req = urllib.request.Request(
        url, data=body, method="POST", headers={"Content-Type": "application/json", **(headers or {})}
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def greedy(client: EngineClient) -> list[int]:
    async def main() -> list[int]:
        try:
            return (await client.generate([40, 41, 42], {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}))[
                "output_ids"
            ]
        finally:
            await client.close()

    return asyncio.run(main())


# ---- the control plane -------------------------------------------------------------------

KEY = "test-key-not-secret"


@pytest.fixture(scope="module")
def engine(tiny_model, tmp_path_factory):
    e = launch_engine(str(tiny_model), api_key=KEY, log_path=tmp_path_factory.mktemp("logs") / "engine.log")
    yield e
    e.shutdown()


@pytest.fixture(scope="module")
def client(engine) -> EngineClient:
    return EngineClient(engine.url, api_key=KEY)


def test_the_engine_runs_nothing_sent_to_it(engine, client, tmp_path):
    """A pickle that would run a command when loaded is a 400, and nothing ran; so is a well-typed
    handle sent to a CPU engine."""
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    auth = {"Authorization": f"Bearer {KEY}"}
    evil = json.dumps(
        {"transport": "cuda_ipc", "handles": base64.b64encode(pickle.dumps(Payload())).decode(), "weight_version": 9}
    ).encode()
    status, body = post(engine.url + "/update_weights_from_tensor", evil, auth)
    assert status == 400 and "handles" in body
    handle = cuda_ipc.IpcHandle(
        "lm_head.weight", (4,), (1,), 0, "float32", 0, b"h", 16, 0, b"r", 0, None, False
    ).to_json()
    status, body = post(
        engine.url + "/update_weights_from_tensor",
        json.dumps({"transport": "cuda_ipc", "handles": [handle]}).encode(),
        auth,
    )
    assert status == 400 and "needs a GPU engine" in body
    time.sleep(0.5)
    assert not marker.exists()
    assert client.model_info()["weight_version"] == 0


def _raw_request(url: str, head: bytes) -> bytes:
    """The status line the engine answers a request of these bytes with (a client that sends
    what no HTTP library would)."""
    host, port = url.split("//")[1].split(":")
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(head + b"\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}")
        return s.recv(200).split(b"\r\n")[0]


def test_no_header_bytes_make_the_auth_check_raise_and_no_bad_request_writes_a_traceback(engine):
    """One byte that is not UTF-8 in Authorization was a 500 and a full traceback in the engine's
    log, per request, without any key; a byte no URL may hold was aiohttp's traceback."""
    before = engine.log_path.read_text().count("Traceback")
    for auth in (b"Bearer \xff", b"Bearer \xc3\x28", b"\xe9t\xe9", f"Bearer {KEY}\x80".encode()):
        status = _raw_request(engine.url, b"POST /generate HTTP/1.1\r\nAuthorization: " + auth)
        assert status.endswith(b"401 Unauthorized"), (auth, status)
    assert _raw_request(engine.url, b"POST /gen\xffrate HTTP/1.1").endswith(b"400 Bad Request")
    key = f"Authorization: Bearer {KEY}\r\nContent-Type: application/json; charset=\xff".encode()
    assert _raw_request(engine.url, b"POST /generate HTTP/1.1\r\n" + key).endswith(b"400 Bad Request")
    time.sleep(0.2)  # the engine's log is written by another process
    assert engine.log_path.read_text().count("Traceback") == before


def test_a_body_that_does_not_decode_or_nests_too_deep_is_a_400_and_no_traceback(engine):
    """A gzip Content-Encoding over plain bytes wrote aiohttp's traceback to the engine's log per
    request, key or not (the unread body of the refused request is decoded after the 401), and was
    a 500 with the key; JSON nested 100,000 deep (the body, or a tool call's arguments) a 500."""
    before = engine.log_path.read_text().count("Traceback")
    gzip = b"Content-Encoding: gzip\r\nContent-Length: 4\r\n\r\nabcd"
    host, port = engine.url.split("//")[1].split(":")
    for auth in (b"", f"Authorization: Bearer {KEY}\r\n".encode()):
        with socket.create_connection((host, int(port)), timeout=30) as s:
            s.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nConnection: close\r\n" + auth + gzip)
            status = s.recv(200).split(b"\r\n")[0]
        assert status.endswith(b"401 Unauthorized" if not auth else b"400 Bad Request"), (auth, status)
    auth = {"Authorization": f"Bearer {KEY}"}
    deep = "[" * 100_000 + "]" * 100_000
    status, body = post(engine.url + "/generate", deep.encode(), auth)
    assert status == 400 and "nested too deeply" in body
    call = {"type": "function", "function": {"name": "f", "arguments": deep}}
    messages = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "", "tool_calls": [call]}]
    chat = json.dumps({"max_tokens": 2, "messages": messages}).encode()
    status, body = post(engine.url + "/v1/chat/completions", chat, auth)
    assert status == 400 and "are not JSON" in body
    time.sleep(0.2)  # the engine's log is written by another process
    assert engine.log_path.read_text().count("Traceback") == before


@pytest.mark.parametrize(
    "flag, value, says",
    [
        ("--kv-cache-gb", "nan", "--kv-cache-gb nan: give a size in GB above 0"),  # a ValueError's traceback
        ("--num-kv-blocks", "-1", "--num-kv-blocks -1: give at least 1"),  # "no room for a single block", traceback
        ("--max-model-len", "0", "--max-model-len 0: give at least 1"),  # taken as "not given"
        ("--num-threads", "0", "--num-threads 0: give at least 1"),  # taken as "not given"
        ("--kv-cache-memory-fraction", "5", "--kv-cache-memory-fraction 5.0: a share of the free GPU memory"),
    ],
)
def test_engine_sizes_out_of_range_are_one_line_before_the_model_loads(flag, value, says, capsys):
    with pytest.raises(SystemExit) as refused:
        engine_args(["--model-path", "tiny", flag, value])
    assert refused.value.code == 2 and says in capsys.readouterr().err.strip().splitlines()[-1]


def test_every_route_but_health_needs_the_key(engine, client, capsys):
    assert KEY not in " ".join(engine.proc.args)  # through the environment: the process list shows no key
    for route, body in [
        ("/generate", {"input_ids": [5]}),
        ("/update_weights_from_disk", {"model_path": "/"}),
        ("/pause_generation", {}),
    ]:
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            status, text = post(engine.url + route, json.dumps(body).encode(), headers)
            assert status == 401 and "API key" in text, (route, headers)
    with pytest.raises(EngineError, match="HTTP 401"):
        EngineClient(engine.url).model_info()
    assert EngineClient(engine.url).health() == {"status": "ok"}
    assert len(greedy(client)) == 8  # vime's client sends the key
    with pytest.raises(SystemExit) as refused:  # argparse's exit: usage, then one line
        engine_args(["--model-path", "tiny", "--host", "0.0.0.0"])
    assert refused.value.code == 2
    assert "error: --host 0.0.0.0 would let anyone" in capsys.readouterr().err.strip().splitlines()[-1]
    assert engine_args(["--model-path", "tiny", "--host", "0.0.0.0", "--api-key", "k"]).api_key == "k"
    with pytest.raises(SystemExit) as refused:
        engine_args(["--model-path", "tiny", "--port", "99999"])
    assert refused.value.code == 2 and "error: --port 99999: give 0-65535" in capsys.readouterr().err
    status, text = post(
        engine.url + "/generate",
        json.dumps({"input_ids": [5], "sampling_params": {"temperature": float("nan")}}).encode(),
        {"Authorization": f"Bearer {KEY}"},
    )
    assert status == 400 and "temperature" in text


# ---- weight loads --------------------------------------------------------------------------


def test_weight_updates_are_all_or_nothing(tiny_model, client, tmp_path):
    """Another architecture with matching names, an update that would fail part-way, a file with
    only lm_head, a tensor of integers: each refused before anything is copied, leaving weights
    and version as they were. A complete update then goes through."""
    from safetensors.torch import load_file, save_file

    from vime.models import make_tiny_model

    before, version = greedy(client), client.model_info()["weight_version"]
    weights = load_file(str(tiny_model / "model.safetensors"))
    last = sorted(weights)[-1]

    def write(name: str, tensors: dict) -> Path:
        (tmp_path / name).mkdir()
        save_file(tensors, str(tmp_path / name / "model.safetensors"))
        return tmp_path / name

    cases = {
        make_tiny_model(tmp_path / "llama", arch="llama", seed=3): "lacks 4 of the model's weights",  # no q_norm/k_norm
        # bfloat16 tensors were copied one by one as they came: the bad last one left a mix
        write(
            "part", {**{k: (t + 1).to(torch.bfloat16) for k, t in weights.items()}, last: torch.zeros(3)}
        ): f"'{last}' has shape",
        write("lm_head", {"lm_head.weight": weights["lm_head.weight"] + 1}): "lacks 24",
        write("ints", {**weights, "model.norm.weight": torch.ones(64, dtype=torch.int64)}): "dtype int64",
    }
    for path, match in cases.items():
        with pytest.raises(EngineError, match=f"HTTP 400.*{match}"):
            client.update_weights_from_disk(str(path), version + 1)
        assert client.model_info()["weight_version"] == version
        assert greedy(client) == before, path.name
    shm = write("shm", {k: t + 1 for k, t in weights.items() if k != last}) / "model.safetensors"
    with pytest.raises(EngineError, match="HTTP 400.*lacks 1"):
        client.update_weights_from_tensor({"transport": "shm", "path": str(shm), "weight_version": version + 1})
    assert greedy(client) == before
    res = client.update_weights_from_disk(str(write("whole", {k: t + 0.5 for k, t in weights.items()})), version + 1)
    assert res["weight_version"] == version + 1 and greedy(client) != before
    client.update_weights_from_disk(str(tiny_model), version + 2)
    assert greedy(client) == before


def test_an_update_that_breaks_off_after_copying_stops_generation_until_a_whole_one(tiny_model):
    """What validation cannot see (a read error mid-file, a sender gone between two buckets)
    leaves mixed weights: the engine then generates nothing, in one line, until an update
    completes."""
    from vime.engine.core.engine import EngineConfig, LLMEngine, WeightsIncomplete
    from vime.engine.core.safetensors_io import iter_safetensors
    from vime.engine.core.sampler import SamplingParams

    engine = LLMEngine(EngineConfig(model_path=str(tiny_model), num_kv_blocks=64, cuda_graphs=False))

    def breaks_off():
        for i, item in enumerate(iter_safetensors(tiny_model)):
            if i == 3:
                raise OSError(5, "Input/output error")
            yield item

    with pytest.raises(OSError):
        engine.update_weights(breaks_off(), 1)
    assert engine.weight_version == 0 and "push a complete update" in engine.weights_incomplete
    with pytest.raises(WeightsIncomplete):
        engine.add_request("r", [5, 6], SamplingParams(max_new_tokens=2))
    layout = [(n, tuple(t.shape), t.dtype) for n, t in iter_safetensors(tiny_model)]
    engine.replace_weights(layout, lambda: iter_safetensors(tiny_model), 2)
    assert (
        engine.weights_incomplete is None and engine.add_request("r", [5, 6], SamplingParams(max_new_tokens=2)) is None
    )
    # a bucketed update whose sender leaves before the last bucket
    engine.update_weights(list(iter_safetensors(tiny_model))[:5], 3, flush=False)
    engine.abandon_update("weight group closed")
    assert "before its last bucket" in engine.weights_incomplete and engine.weight_version == 3


def test_requests_wait_while_a_bucketed_update_is_open(tiny_model):
    """Between the buckets of one update (pushed without a pause) the weights are half old, half
    new: the engine takes no step until the last bucket, then every token has the new version."""
    from vime.engine.core.engine import EngineConfig, LLMEngine
    from vime.engine.core.safetensors_io import iter_safetensors
    from vime.engine.core.sampler import SamplingParams

    engine = LLMEngine(EngineConfig(model_path=str(tiny_model), num_kv_blocks=64, cuda_graphs=False))
    assert engine.add_request("r", [5, 6, 7], SamplingParams(max_new_tokens=6, ignore_eos=True)) is None
    engine.step()
    engine.step()
    seq = engine.requests["r"].seqs[0]
    made = len(seq.output_ids)
    assert made >= 1
    weights = [(n, t + 0.01) for n, t in iter_safetensors(tiny_model)]
    engine.update_weights(weights[:3], 1, flush=False)
    assert not engine.has_work()
    for _ in range(3):
        assert engine.step() == []
    assert len(seq.output_ids) == made
    engine.update_weights(weights[3:], 1)
    outs = []
    while engine.has_work():
        outs += engine.step()
    (out,) = outs
    versions = out.outputs[0].weight_versions
    assert len(versions) == 6 and versions[:made] == [0] * made and versions[made:] == [1] * (6 - made)


def test_a_port_in_use_is_one_line_before_the_model_loads(tiny_model):
    from vime.engine.server import main as serve_main
    from vime.errors import VimeError

    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        t0 = time.monotonic()
        with pytest.raises(
            VimeError, match=rf"^cannot listen on 127.0.0.1:{port} \(Address already in use\): pick another"
        ):
            serve_main(["--model-path", str(tiny_model), "--port", str(port)])
        assert time.monotonic() - t0 < 5


def test_a_silent_engine_fails_its_requests_at_the_health_timeout_and_a_live_one_none(tiny_model, tmp_path):
    """The health watch: requests on an engine that answers (probed many times while they run)
    get their answers; requests on a stopped one (SIGSTOP: its port still takes connections)
    fail one interval + timeout later (EngineSilent: the engine is down without a second probe,
    and with no other engine that ends them), and it is ended at once at shutdown (SIGCONT lets
    it act on the SIGTERM)."""
    from vime.rollout.generate import generate_on_engines
    from vime.rollout.runtime import HealthCheck, RolloutRuntime

    e = launch_engine(str(tiny_model), log_path=tmp_path / "engine.log")
    try:
        rt = RolloutRuntime([EngineClient(e.url)], None, health=HealthCheck(interval=0.01, timeout=1.0))
        params = {"max_new_tokens": 32, "temperature": 1.0, "ignore_eos": True}

        async def generate(n: int) -> list:
            try:
                return await asyncio.gather(*(generate_on_engines(rt, i, [40, 41, 42], params) for i in range(n)))
            finally:
                await rt.engines[0].client.close()

        assert [len(o["output_ids"]) for o in asyncio.run(generate(8))] == [32] * 8

        rt.health = HealthCheck(interval=0.5, timeout=1.0)
        os.kill(e.proc.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(EngineError, match=r"no engine left.* stopped answering \(no answer to /health within 1s\)"):
            asyncio.run(generate(2))
        assert time.monotonic() - t0 < 1.5 + 2.0  # interval + timeout, and slack for this machine
        assert rt.engines[0].state == "down" and "no engine left" in rt.no_engine_message()
    finally:
        e.shutdown(timeout=60)
        # the SIGCONT after the SIGTERM let the stopped engine act on it: without it, only the
        # kill at the timeout ends it (a clock here would measure the machine's load too)
        assert e.proc.returncode != -signal.SIGKILL, e.proc.returncode


def test_engines_lost_while_paused_are_skipped_at_the_continue_and_the_rest_go_on(tiny_model, tmp_path):
    """The pause around a push or a checkpoint write (RolloutRuntime.generation_paused): engine 1
    killed and engine 2 stopped (SIGSTOP) inside it are gone at the continue, the stopped one
    silent at the health timeout with no second wait, and engine 0 is continued and answers. The
    continue's error used to end the run with another engine up (test_an_engine_lost_while_a_
    checkpoint_is_written_comes_back is the whole run)."""
    from concurrent.futures import ThreadPoolExecutor

    from vime.rollout.runtime import HealthCheck, RolloutRuntime

    with ThreadPoolExecutor(3) as pool:
        engines = list(pool.map(lambda i: launch_engine(str(tiny_model), log_path=tmp_path / f"e{i}.log"), range(3)))
    try:
        rt = RolloutRuntime(
            [EngineClient(e.url, timeout=30) for e in engines], None, health=HealthCheck(interval=0.5, timeout=1.0)
        )
        with rt.generation_paused("in_place"):
            engines[1].proc.kill()
            engines[1].proc.wait()
            os.kill(engines[2].proc.pid, signal.SIGSTOP)
        assert [e.state for e in rt.engines] == ["up", "down", "down"]
        assert "connection refused" in rt.engines[1].error
        assert "stopped answering (no answer to /continue_generation within 1s)" in rt.engines[2].error
        assert len(greedy(rt.engines[0].client)) == 8  # continued: a paused engine would hold the request
    finally:
        for e in engines:
            e.shutdown()


def test_a_connection_reset_is_an_engine_error_not_a_traceback():
    """An engine that drops the connection after reading a request (as one killed mid-step does)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)

    def serve() -> None:
        while True:
            conn, _ = server.accept()
            conn.recv(65536)
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close with RST
            conn.close()

    threading.Thread(target=serve, daemon=True).start()
    client = EngineClient(f"http://127.0.0.1:{server.getsockname()[1]}", retry_backoff=0.01)
    with pytest.raises(EngineError, match="unreachable after 3 tries \\(connection reset\\)"):
        greedy(client)
    with pytest.raises(EngineError, match="unreachable after 3 tries \\(connection reset\\)"):
        client.pause_generation()
