"""Fault injection: nothing lost, nothing hung, nothing run that should not be (issue 12).

Against the real parts (engine server, tiny model, reward pool, actor): a control plane that
runs no code sent to it and answers only to its key; weight loads that are all or nothing; a
client that turns a dropped connection into one line; rewards that hang or fail without holding
anything up; reward workers that ignore Ctrl-C and end with the trainer; a rollout loop that a
stray KeyboardInterrupt cannot kill; a non-finite loss that never reaches the weights. Killing
an engine in the middle of a broadcast push is test_weight_sync.py's.
"""
from __future__ import annotations

import asyncio
import base64
import json
import os
import pickle
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from conftest import ROOT
from vime.engine import cuda_ipc
from vime.engine.client import EngineClient, EngineError
from vime.engine.server import launch_engine
from vime.engine.server import parse_args as engine_args
from vime.rollout.rewards import score_samples
from vime.rollout.types import Sample
from vime.rollout.vllm_rollout import rollout_metrics


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


# ---- rewards -------------------------------------------------------------------------------

HANG_RM = '''
import threading
release = threading.Event()
calls = []

def hang_first_20(args, sample):
    calls.append(sample.index)
    if sample.index < 20:
        release.wait()
    return 1.0

def not_finite(args, sample):
    return [float("inf"), float("-inf"), float("nan"), 0.5][sample.index]
'''


@pytest.fixture
def fault_rm(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "fault_rm.py").write_text(HANG_RM)
    import importlib

    import fault_rm

    module = importlib.reload(fault_rm)
    yield module
    module.release.set()


def rm_args(**kw) -> SimpleNamespace:
    return SimpleNamespace(**{"rm_type": "math", "custom_rm_path": None, "reward_timeout": 10.0, **kw})


def test_non_finite_rewards_score_zero_and_are_counted(fault_rm):
    samples = [Sample(index=i) for i in range(4)]
    metrics = asyncio.run(score_samples(rm_args(custom_rm_path="fault_rm:not_finite"), samples))
    assert [s.reward for s in samples] == [0.0, 0.0, 0.0, 0.5]
    assert metrics == {"rollout/reward_errors": 3.0, "rollout/reward_timeouts": 0.0}
    assert rollout_metrics([samples])["rollout/reward_errors"] == 3  # what reaches metrics.jsonl


def test_hung_sync_rewards_are_abandoned_counted_and_starve_nothing(fault_rm):
    """20 calls that never return (more than the reward threads) time out and are counted; the
    calls after them run at once, and the hung threads cannot keep the process alive."""
    args = rm_args(custom_rm_path="fault_rm:hang_first_20", reward_timeout=0.5)
    hung = [Sample(index=i) for i in range(20)]
    metrics = asyncio.run(score_samples(args, hung))
    assert metrics == {"rollout/reward_errors": 0.0, "rollout/reward_timeouts": 20.0}
    assert all(s.reward == 0.0 and s.reward_error == "timeout" for s in hung)
    later = [Sample(index=i) for i in range(20, 30)]
    # had they queued behind the hung calls for a thread, they would have timed out too
    assert asyncio.run(score_samples(args, later)) == {"rollout/reward_errors": 0.0, "rollout/reward_timeouts": 0.0}
    assert all(s.reward == 1.0 for s in later)
    threads = [t for t in threading.enumerate() if t.name == "vime-reward"]
    assert len(threads) >= 20 and all(t.daemon for t in threads)  # the hung ones, which exit cannot wait for


def _children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[1] == str(pid) and fields[0] != "Z":
            out.append(int(stat.parent.name))
    return out


def _alive(pids: list[int]) -> list[int]:
    alive = []
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            alive.append(pid)
    return alive


POOL_USER = """
import asyncio, os, sys, time
from types import SimpleNamespace
from vime.rollout.rewards import score_samples
from vime.rollout.types import Sample
args = SimpleNamespace(rm_type="math", custom_rm_path=None, reward_timeout=10.0)
if __name__ == "__main__":
    print(asyncio.run(score_samples(args, [Sample(index=0, response="\\\\boxed{2}", label="2")])), flush=True)
    time.sleep(600)
"""


def test_reward_workers_ignore_ctrl_c_and_die_with_their_parent(tmp_path):
    """A Ctrl-C reaches the pool workers too: they go on grading (the trainer decides); a
    SIGKILLed trainer takes them and multiprocessing's resource tracker along within seconds."""
    script = tmp_path / "pool_user.py"
    script.write_text(POOL_USER)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, env=env, start_new_session=True)
    try:
        assert proc.stdout.readline().strip() == "{'rollout/reward_errors': 0.0, 'rollout/reward_timeouts': 0.0}"
        children = _children(proc.pid)  # multiprocessing's resource tracker and the worker(s) started so far
        assert len(children) >= 2, children
        for pid in children:
            os.kill(pid, signal.SIGINT)
        time.sleep(1)
        assert _alive(children) == children
        proc.kill()
        deadline = time.monotonic() + 10
        while _alive(children) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _alive(children) == []
    finally:
        proc.kill()
        proc.wait()


def test_the_rollout_loop_outlives_a_task_that_raises_keyboard_interrupt():
    """asyncio lets KeyboardInterrupt escape run_forever; the loop used to die with it and every
    later call (closing the clients) waited for ever."""
    from vime.rollout import async_loop

    async def interrupted():
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        async_loop.submit(interrupted()).result(timeout=10)
    assert async_loop.submit(asyncio.sleep(0, result=7)).result(timeout=10) == 7
    pending = async_loop.submit(asyncio.sleep(600))
    async_loop.cancel_all(timeout=5)
    assert pending.cancelled()


# ---- non-finite numbers and the weights ----------------------------------------------------


@pytest.fixture
def actor(tiny_model):
    from vime.trainer.actor import Actor

    args = SimpleNamespace(lr=1e-2, global_batch_size=None, max_tokens_per_gpu=512, rollout_temperature=1.0)
    return Actor(args, tiny_model)


def _batch() -> list[Sample]:
    return [Sample(index=i, tokens=[5, 6, 7, 8 + i, 9], response_length=2, rollout_log_probs=[-1.0, -1.0]) for i in range(4)]


def _weights(actor) -> dict[str, torch.Tensor]:
    return {n: t.clone() for n, t in actor.named_weights()}


def test_a_non_finite_loss_skips_the_step_and_the_weights_stay(actor):
    before = _weights(actor)
    m = actor.train_step(_batch(), [1.0, float("nan"), -1.0, 0.0])
    assert m["train/skipped_steps"] == 1
    assert all(torch.equal(before[n], t) for n, t in actor.named_weights())
    assert not actor.optimizer.state  # AdamW's moments never saw the NaN
    m = actor.train_step(_batch(), [1.0, -1.0, 1.0, -1.0])
    assert m["train/skipped_steps"] == 0 and any(not torch.equal(before[n], t) for n, t in actor.named_weights())
