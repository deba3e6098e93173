"""Fault injection: nothing lost, nothing hung, nothing run that should not be (issue 12).

The engine's side, against a real engine server and the tiny model: a control plane that runs
no code sent to it and answers only to its key; weight loads that are all or nothing; a client
that turns a dropped connection into one line. Killing an engine in the middle of a broadcast
push is test_weight_sync.py's.
"""
from __future__ import annotations

import asyncio
import base64
import json
import os
import pickle
import socket
import struct
import threading
import time
from pathlib import Path

import pytest
import torch

from vime.engine import cuda_ipc
from vime.engine.client import EngineClient, EngineError
from vime.engine.server import launch_engine
from vime.engine.server import parse_args as engine_args


def post(url: str, body: bytes, headers: dict | None = None) -> tuple[int, str]:
    import urllib.error
    import urllib.request

    req = urllib.request.Request(url, data=body, method="POST", headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def greedy(client: EngineClient) -> list[int]:
    async def main() -> list[int]:
        try:
            return (await client.generate([40, 41, 42], {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}))["output_ids"]
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


def test_cuda_ipc_handles_travel_as_plain_data():
    """The trainer's side of a CUDA tensor's handle (the arguments reduce_tensor gives
    rebuild_cuda_tensor, written here as it would for a GPU tensor) survives JSON exactly."""
    args = (torch.Tensor, torch.Size([4, 8]), (8, 1), 2, torch.storage.TypedStorage, torch.bfloat16, 0, b"\x01" * 66, 128, 64, False, b"\x02" * 66, 3, None, False)
    handle = cuda_ipc.from_reduce_args("model.norm.weight", args)
    wire = json.loads(json.dumps([handle.to_json()]))
    assert cuda_ipc.parse(wire) == [handle]
    with pytest.raises(ValueError, match="dtype int64"):
        cuda_ipc.from_reduce_args("x", (*args[:5], torch.int64, *args[6:]))


@pytest.mark.parametrize(
    "change, match",
    [
        ({"storage_cls": "os.system"}, "unknown fields"),
        ({"dtype": "object"}, "dtype 'object'"),
        ({"shape": [4, "8"]}, "shape must be a list of integers"),
        ({"offset": -1}, "offset must be an integer >= 0"),
        ({"handle": "not base64!"}, "handle is not valid base64"),
        ({"storage_size_bytes": 63}, "reach past the 63-byte storage"),
        ({"event_sync_required": "yes"}, "true or false"),
    ],
)
def test_a_malformed_ipc_handle_is_refused(change, match):
    good = cuda_ipc.IpcHandle("w", (4, 8), (8, 1), 0, "float16", 0, b"h", 64, 0, b"r", 0, None, False).to_json()
    with pytest.raises(ValueError, match=match):
        cuda_ipc.parse([{**good, **change}])


def test_the_engine_runs_nothing_sent_to_it(engine, client, tmp_path):
    """A pickle that would run a command when loaded is a 400, and nothing ran; so is a well-typed
    handle sent to a CPU engine."""
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    auth = {"Authorization": f"Bearer {KEY}"}
    evil = json.dumps({"transport": "cuda_ipc", "handles": base64.b64encode(pickle.dumps(Payload())).decode(), "weight_version": 9}).encode()
    status, body = post(engine.url + "/update_weights_from_tensor", evil, auth)
    assert status == 400 and "handles" in body
    handle = cuda_ipc.IpcHandle("lm_head.weight", (4,), (1,), 0, "float32", 0, b"h", 16, 0, b"r", 0, None, False).to_json()
    status, body = post(engine.url + "/update_weights_from_tensor", json.dumps({"transport": "cuda_ipc", "handles": [handle]}).encode(), auth)
    assert status == 400 and "needs a GPU engine" in body
    time.sleep(0.5)
    assert not marker.exists()
    assert client.model_info()["weight_version"] == 0


def test_every_route_but_health_needs_the_key(engine, client):
    assert KEY not in " ".join(engine.proc.args)  # through the environment: the process list shows no key
    for route, body in [("/generate", {"input_ids": [5]}), ("/update_weights_from_disk", {"model_path": "/"}), ("/pause_generation", {})]:
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            status, text = post(engine.url + route, json.dumps(body).encode(), headers)
            assert status == 401 and "API key" in text, (route, headers)
    with pytest.raises(EngineError, match="HTTP 401"):
        EngineClient(engine.url).model_info()
    assert EngineClient(engine.url).health() == {"status": "ok"}
    assert len(greedy(client)) == 8  # vime's client sends the key
    with pytest.raises(ValueError, match="--host 0.0.0.0 .* --api-key"):
        engine_args(["--model-path", "tiny", "--host", "0.0.0.0"])
    assert engine_args(["--model-path", "tiny", "--host", "0.0.0.0", "--api-key", "k"]).api_key == "k"
    status, text = post(engine.url + "/generate", json.dumps({"input_ids": [5], "sampling_params": {"temperature": float("nan")}}).encode(), {"Authorization": f"Bearer {KEY}"})
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
        write("part", {**{k: (t + 1).to(torch.bfloat16) for k, t in weights.items()}, last: torch.zeros(3)}): f"'{last}' has shape",
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
    from vime.engine.core.model import iter_safetensors
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
    assert engine.weights_incomplete is None and engine.add_request("r", [5, 6], SamplingParams(max_new_tokens=2)) is None
    # a bucketed update whose sender leaves before the last bucket
    engine.update_weights(list(iter_safetensors(tiny_model))[:5], 3, flush=False)
    engine.abandon_update("weight group closed")
    assert "before its last bucket" in engine.weights_incomplete and engine.weight_version == 3


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
