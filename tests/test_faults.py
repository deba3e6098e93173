"""Fault injection: nothing lost, nothing hung, nothing run that should not be (issue 12).

Every class of fault on CPU, against the real parts (engine server, tiny model, reward pool,
train loop): a control plane that runs no code sent to it and answers only to its key; weight
loads that are all or nothing; non-finite numbers that never reach the weights or a checkpoint;
rewards that hang or fail without holding anything up; every input checked before anything
starts; resumes that keep the record; and runs that end within seconds on a signal or a dead
engine, in one line, with their checkpoints intact and no process left behind. Killing an
engine in the middle of a broadcast push is test_weight_sync.py's.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import os
import pickle
import re
import resource
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import yaml
from conftest import PLUGINS, ROOT, run_cli, train_here

from vime.backends.builtin.launch import launch_engine
from vime.backends.client import EngineClient, EngineError
from vime.config import Config
from vime.engine.server import parse_args as engine_args
from vime.metrics import progress_postfix
from vime.rollout.generate import rollout_metrics
from vime.rollout.rewards import Rewards
from vime.rollout.types import Sample
from vime.transport import cuda_ipc

TINY = ["--config", "examples/tiny.yaml", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2"]
FULLY_ASYNC = ["--rollout-function-path", "vime.rollout.fully_async_rollout.generate_rollout_fully_async"]
# Seconds a run may take to stop after a fault, on a machine as fast as a quiet one (observed:
# 2-3 s). A loaded machine stretches every step of a stop (signals handled, engines and workers
# ended, processes reaped) as it stretched the run's start, so the bound grows with the ratio of
# the run's own time from its command to the fault over a quiet machine's (QUIET_START_S; a fixed
# 30 s failed once under heavy load). Which path stopped the run is asserted by its last line (the
# signal, the health probe's "no answer ... within 2s", "unreachable after 3 tries"), and the slow
# paths these tests guard against wait 120 s (a push), 600 s (a request) or for ever: still caught.
EXIT_BOUND_S = 30
QUIET_START_S = 15  # the tiny run's command to its first steps on a quiet machine (observed: 10-12 s)


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


def test_cuda_ipc_handles_travel_as_plain_data():
    """The trainer's side of a CUDA tensor's handle (the arguments reduce_tensor gives
    rebuild_cuda_tensor, written here as it would for a GPU tensor) survives JSON exactly."""
    args = (
        torch.Tensor,
        torch.Size([4, 8]),
        (8, 1),
        2,
        torch.storage.TypedStorage,
        torch.bfloat16,
        0,
        b"\x01" * 66,
        128,
        64,
        False,
        b"\x02" * 66,
        3,
        None,
        False,
    )
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


# ---- rewards -------------------------------------------------------------------------------

HANG_RM = """
import threading
release = threading.Event()
calls = []

def hang_first_20(args, sample):
    calls.append(sample.index)
    if sample.index < 20:
        release.wait()
    return 1.0

def not_finite(args, sample):
    return [float("inf"), float("-inf"), float("nan"), 0.5, 1e300][sample.index]
"""


@pytest.fixture
def fault_rm(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "fault_rm.py").write_text(HANG_RM)
    import importlib

    import fault_rm

    module = importlib.reload(fault_rm)
    yield module
    module.release.set()


def rm_args(**kw) -> Config:
    return Config(**{"rm_type": "math", "custom_rm_path": None, "reward_timeout": 10.0, **kw})


def test_non_finite_rewards_score_zero_and_are_counted(fault_rm):
    samples = [Sample(index=i) for i in range(5)]
    metrics = asyncio.run(Rewards(rm_args(custom_rm_path="fault_rm:not_finite")).score(samples))
    # 1e300 is finite, but inf in the float32 advantages: an error too, and said to be too large
    assert [s.reward for s in samples] == [0.0, 0.0, 0.0, 0.5, 0.0]
    assert metrics == {"rollout/reward_errors": 4.0, "rollout/reward_timeouts": 0.0}
    assert rollout_metrics([samples])["rollout/reward_errors"] == 4  # what reaches metrics.jsonl


def test_hung_sync_rewards_are_abandoned_counted_and_starve_nothing(fault_rm):
    """20 calls that never return (more than the reward threads) time out and are counted; the
    calls after them run at once, and the hung threads cannot keep the process alive."""
    rewards = Rewards(rm_args(custom_rm_path="fault_rm:hang_first_20", reward_timeout=0.5))
    hung = [Sample(index=i) for i in range(20)]
    metrics = asyncio.run(rewards.score(hung))
    assert metrics == {"rollout/reward_errors": 0.0, "rollout/reward_timeouts": 20.0}
    assert all(s.reward == 0.0 and s.reward_error == "timeout" for s in hung)
    later = [Sample(index=i) for i in range(20, 30)]
    # had they queued behind the hung calls for a thread, they would have timed out too
    assert asyncio.run(rewards.score(later)) == {"rollout/reward_errors": 0.0, "rollout/reward_timeouts": 0.0}
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
from vime.config import Config
from vime.rollout.rewards import Rewards
from vime.rollout.types import Sample
rewards = Rewards(Config(rm_type="math", custom_rm_path=None, reward_timeout=10.0))  # held, as a run holds it
if __name__ == "__main__":
    print(asyncio.run(rewards.score([Sample(index=0, response="\\\\boxed{2}", label="2")])), flush=True)
    time.sleep(600)
"""


def test_reward_workers_ignore_ctrl_c_and_die_with_their_parent(tmp_path):
    """A Ctrl-C reaches the pool workers too: they go on grading (the trainer decides); a
    SIGKILLed trainer takes them and multiprocessing's resource tracker along within seconds."""
    script = tmp_path / "pool_user.py"
    script.write_text(POOL_USER)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, text=True, env=env, start_new_session=True
    )
    try:
        assert select.select([proc.stdout], [], [], 120)[0], "the pool never graded"
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


def test_a_reward_worker_that_dies_mid_sample_costs_that_sample_only():
    """A grading worker killed (OOM, say) while it grades: that sample scores 0 as an error, at
    once, and the next one is graded by a fresh pool."""
    from fault_plugins import SLOW_TO_GRADE

    rewards = Rewards(rm_args(reward_timeout=60.0))

    async def main() -> tuple[dict, list[Sample]]:
        slow = [Sample(index=0, response=SLOW_TO_GRADE, label="3")]
        task = asyncio.create_task(rewards.score(slow))
        while not (
            workers := [
                pid for pid in _children(os.getpid()) if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()
            ]
        ):
            await asyncio.sleep(0.05)
        await asyncio.sleep(1)  # grading (seconds for this response) is under way
        for pid in workers:
            os.kill(pid, signal.SIGKILL)
        return await asyncio.wait_for(task, 30), slow

    metrics, slow = asyncio.run(main())
    assert metrics == {"rollout/reward_errors": 1.0, "rollout/reward_timeouts": 0.0} and slow[0].reward_error == "error"
    fine = [Sample(index=1, response="\\boxed{2}", label="2")]
    assert asyncio.run(rewards.score(fine)) == {"rollout/reward_errors": 0.0, "rollout/reward_timeouts": 0.0}
    assert fine[0].reward == 1.0
    rewards.close()


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

    args = Config(lr=1e-2, global_batch_size=None, max_tokens_per_gpu=512, rollout_temperature=1.0)
    return Actor(args, tiny_model)


def _batch() -> list[Sample]:
    return [
        Sample(index=i, tokens=[5, 6, 7, 8 + i, 9], response_length=2, rollout_log_probs=[-1.0, -1.0]) for i in range(4)
    ]


def _weights(actor) -> dict[str, torch.Tensor]:
    return {n: t.clone() for n, t in actor.named_weights()}


@pytest.mark.slow
def test_trainer_ranks_that_fall_out_of_step_end_in_seconds_in_one_line(tiny_model, monkeypatch):
    """Two gloo ranks. Rank 0 interrupted inside a step (Ctrl-C or SIGTERM between two of its
    collectives) leaves rank 1 waiting in the next one, where a "close" never matches: close
    ends it instead, within seconds (it used to wait out the 30-minute collective timeout). And
    a rank killed between steps makes the next call one line naming it, not gloo's error."""
    import vime.algorithms.objective as loss_module
    from vime.trainer.distributed import TrainerRankError, launch_actor

    args = Config(lr=1e-2, global_batch_size=None, max_tokens_per_gpu=512, rollout_temperature=1.0, actor_num_procs=2)
    adv = [1.0, -1.0, 0.5, -0.5]

    two = launch_actor(args, tiny_model, "cpu")
    try:
        two.train_step(_batch(), adv)  # in step once

        def interrupted(*a, **k):
            raise KeyboardInterrupt  # here only: rank 1 computes its loss and waits for the gradients

        monkeypatch.setattr(loss_module.Objective, "policy_term", interrupted)
        with pytest.raises(KeyboardInterrupt):
            two.train_step(_batch(), adv)
    finally:
        t0 = time.monotonic()
        two.close()
        assert time.monotonic() - t0 < 15 and not any(p.is_alive() for p in two.procs)
    monkeypatch.undo()

    two = launch_actor(args, tiny_model, "cpu")
    try:
        two.train_step(_batch(), adv)
        os.kill(two.procs[0].pid, signal.SIGKILL)
        two.procs[0].join(10)
        with pytest.raises(
            TrainerRankError, match=r"^trainer rank 1 ended \(killed by signal 9\) during train_step: resume"
        ):
            two.train_step(_batch(), adv)
        with pytest.raises(TrainerRankError, match="during named_weights"):
            dict(two.named_weights())
    finally:
        t0 = time.monotonic()
        two.close()
        assert time.monotonic() - t0 < 15


RANK_FAULTS = """
import os, signal, sys
from vime.config import Config
from vime.rollout.types import Sample
from vime.trainer.distributed import TrainerRankError, launch_actor

def main(model):
    batch = [Sample(index=i, tokens=[5, 6, 7, 8 + i, 9], response_length=2, rollout_log_probs=[-1.0, -1.0]) for i in range(4)]
    common = dict(lr=1e-2, global_batch_size=None, max_tokens_per_gpu=512, rollout_temperature=1.0, actor_num_procs=2)
    two = launch_actor(Config(**common, loss_type="custom_loss", custom_loss_function_path="fault_plugins.fail_on_rank_one"), model)
    try:
        two.train_step(batch, [1.0, -1.0, 0.5, -0.5])
    except TrainerRankError as e:
        print(e, flush=True)
    two.close()
    two = launch_actor(Config(**common), model)
    two.train_step(batch, [1.0, -1.0, 0.5, -0.5])
    print(os.getpid(), two.procs[0].pid, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)  # rank 0 gone (OOM, a kill -9) while rank 1 waits for its next call

if __name__ == "__main__":
    main(sys.argv[1])
"""


def test_a_trainer_rank_that_fails_or_loses_rank_0_is_one_line_naming_it(tiny_model, tmp_path):
    """Two spawned gloo ranks. Rank 1 failing on its own (a loss hook that raises there) printed
    its traceback and rank 0 said only "exit code 1"; rank 0 killed left rank 1 printing gloo's
    traceback. Now rank 0's error gives rank 1's cause, and rank 1 whose rank 0 is gone says so
    in one line, and neither prints a traceback."""
    script = tmp_path / "rank_faults.py"
    script.write_text(RANK_FAULTS)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(PLUGINS), str(ROOT)]), OMP_NUM_THREADS="1")
    out = subprocess.run(
        [sys.executable, str(script), str(tiny_model)], env=env, capture_output=True, text=True, timeout=300
    )  # returns once rank 1 too has closed the pipes
    assert out.returncode == -signal.SIGKILL, out.stderr[-3000:]
    failed, pids = out.stdout.splitlines()
    rank_zero, rank_one = map(int, pids.split())
    assert failed == (
        "trainer rank 1 ended (exit code 1: PluginError: --custom-loss-function-path fault_plugins.fail_on_rank_one "
        "raised ValueError: the loss hook broke on this rank (VIME_DEBUG=1 shows its traceback)) during train_step: "
        "resume the run with --load from its last checkpoint"
    )
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    assert out.stderr.strip().splitlines()[-1] == f"trainer rank 1 stops: rank 0 (pid {rank_zero}) is gone"
    assert not _alive([rank_one])


def test_a_non_finite_loss_skips_the_step_and_the_weights_stay(actor):
    before = _weights(actor)
    m = actor.train_step(_batch(), [1.0, float("nan"), -1.0, 0.0])
    assert m["train/skipped_steps"] == 1
    assert all(torch.equal(before[n], t) for n, t in actor.named_weights())
    assert not actor.optimizer_step.optimizer.state  # AdamW's moments never saw the NaN
    m = actor.train_step(_batch(), [1.0, -1.0, 1.0, -1.0])
    assert m["train/skipped_steps"] == 0 and any(not torch.equal(before[n], t) for n, t in actor.named_weights())


def test_the_fused_optimizer_skips_a_non_finite_step_without_the_host_checking_first(tiny_model):
    """With a fused AdamW (as on CUDA) the loss and the norm are checked on the device and the
    optimizer skips itself (`found_inf`), the step queued before any metric is read. A skipped
    step must leave weights and AdamW's state as they were: the clean step after it gives bit
    for bit the weights of a clean step taken first. (CPU's AdamW has the fused kernel too.)"""
    from vime.trainer.actor import Actor

    def fused_actor() -> Actor:
        a = Actor(Config(lr=1e-2, global_batch_size=None, max_tokens_per_gpu=512, rollout_temperature=1.0), tiny_model)
        a.optimizer_step.optimizer = torch.optim.AdamW(a.model.parameters(), lr=1e-2, fused=True)
        return a

    clean, poisoned = fused_actor(), fused_actor()
    start = _weights(poisoned)
    assert clean.train_step(_batch(), [1.0, -1.0, 1.0, -1.0])["train/skipped_steps"] == 0
    m = poisoned.train_step(_batch(), [1.0, float("nan"), -1.0, 0.0])
    assert m["train/skipped_steps"] == 1 and poisoned.optimizer_step.optimizer.found_inf.item() == 1.0
    assert all(torch.equal(start[n], t) for n, t in poisoned.named_weights())
    assert all(
        float(st["step"]) == 0 for st in poisoned.optimizer_step.optimizer.state.values()
    )  # rolled back on the device
    assert poisoned.train_step(_batch(), [1.0, -1.0, 1.0, -1.0])["train/skipped_steps"] == 0
    after = _weights(clean)
    assert any(not torch.equal(start[n], after[n]) for n in start)
    assert all(torch.equal(after[n], t) for n, t in poisoned.named_weights())


@contextlib.contextmanager
def _disk_full_at(size: int):
    """A full disk, as a file size limit (works unprivileged): writes past `size` bytes fail
    with EFBIG, as they would with ENOSPC."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (size, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)


def test_a_full_disk_under_metrics_the_log_or_a_weight_push_is_one_line_and_tears_nothing(
    actor, client, tmp_path, capsys
):
    """metrics.jsonl: the row that does not fit is taken back whole and the run stops in one
    line; log.txt: one warning, not a traceback per record; a push through shared memory: one
    line, and no partial weights file left to fill the disk further."""
    from vime.metrics import MetricsError, MetricsLogger, parse_rows, setup_logging
    from vime.transport.base import WeightWriteError
    from vime.transport.push import WeightPusher

    metrics = MetricsLogger(tmp_path / "run", total_steps=3, quiet=True)
    metrics.log(1, {"rollout/reward_mean": 0.5})
    path = tmp_path / "run" / "metrics.jsonl"
    size = path.stat().st_size
    with _disk_full_at(size + 10), pytest.raises(MetricsError) as e:
        metrics.log(2, {"rollout/reward_mean": 0.25, "note": "x" * 100})
    assert re.fullmatch(
        r"cannot write step 2's metrics to .*metrics.jsonl \(File too large\): make room .*", str(e.value)
    )
    metrics.close()
    assert path.stat().st_size == size and [r["step"] for r in parse_rows(path)] == [1]

    setup_logging(tmp_path / "run" / "log.txt")
    try:
        logging.getLogger("vime").info("a record that does not format: %d", "x")  # its own bug: log.txt stays
        logging.getLogger("vime").info("still written")
        assert "still written" in (tmp_path / "run" / "log.txt").read_text()
        with _disk_full_at((tmp_path / "run" / "log.txt").stat().st_size + 10):
            for _ in range(3):
                logging.getLogger("vime").info("a line longer than the room left " * 3)
    finally:
        setup_logging()
    err = capsys.readouterr().err.split("still written")[-1]
    assert err.count("warning: cannot write") == 1 and "log.txt (File too large)" in err and "Traceback" not in err

    shm = tmp_path / "shm"
    shm.mkdir()
    pusher = WeightPusher([client], transport="shm", tmp_dir=shm)
    with _disk_full_at(64 * 1024), pytest.raises(WeightWriteError) as e:
        pusher.push(actor.named_weights(), 1)
    assert re.fullmatch(
        r"cannot write the weights for the engines to .*shm \(.*File too large.*\): make room .*", str(e.value)
    )
    assert not list(shm.iterdir())


def test_no_checkpoint_from_non_finite_weights_and_a_full_disk_keeps_the_last_one(actor, tmp_path):
    from vime.trainer.checkpoint import CheckpointError, latest_checkpoint, problem
    from vime.trainer.nonfinite import NonFiniteError

    actor.save(tmp_path / "1", {"step": 1})
    with (
        _disk_full_at(64 * 1024),
        pytest.raises(CheckpointError, match="writing checkpoint .*/2 failed \\(.*File too large") as e,
    ):
        actor.save(tmp_path / "2", {"step": 2})
    assert "\n" not in str(e.value)
    with torch.no_grad():
        next(actor.model.parameters())[0] = float("inf")
    with pytest.raises(NonFiniteError, match="not writing checkpoint .*/3: 1 weight tensors hold non-finite values"):
        actor.save(tmp_path / "3", {"step": 3})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["1"]  # no debris of the refused saves
    assert problem(tmp_path / "1") is None and latest_checkpoint(tmp_path) == tmp_path / "1"


# ---- inputs checked before anything starts -------------------------------------------------


def resumable_extra(step: int, policy_version: int) -> dict:
    """The extra state of a checkpoint a run resumes: its step, the optimizer steps taken (the
    actor's count, which the state holds too) and the data source's position."""
    data = {"epoch": 0, "offset": 4 * step, "next_index": 16 * step, "next_group": 4 * step, "requeued": []}
    return {
        "step": step,
        "policy_version": policy_version,
        "weight_pushes": step,
        "data_source": data,
        "wall_clock": 1.0,
    }


def _refused(tmp_path: Path, *argv: str) -> str:
    """Start a run in-process; it must fail with a user error before creating anything."""
    from vime.cli import train_main
    from vime.errors import VimeError

    runs = tmp_path / "runs"
    with pytest.raises(VimeError) as e:
        train_main(
            ["--config", "examples/tiny.yaml", "--num-rollout", "1", "--runs-dir", str(runs), "--run-name", "r", *argv]
        )
    assert not (runs / "r").exists()  # no run directory, no engine log, no locked run name
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_every_input_is_checked_before_anything_starts(tmp_path, tiny_model, monkeypatch):
    monkeypatch.chdir(ROOT)
    broken = tmp_path / "broken"
    shutil.copytree(tiny_model, broken)
    (broken / "config.json").write_text('{"model_type": "qwen3", oops')
    long_rows = tmp_path / "long.jsonl"
    long_rows.write_text(
        "".join(json.dumps({"input": "9" * (600 if i == 3 else 3), "label": "9"}) + "\n" for i in range(6))
    )
    a_file = tmp_path / "file"
    a_file.write_text("")
    damaged = tmp_path / "ckpt" / "1"
    damaged.mkdir(parents=True)
    (damaged / "trainer_state.pt").write_bytes(b"PK\x03\x04 cut short")
    cut_short, unweighted = tmp_path / "cut_short", tmp_path / "unweighted"
    for d in (cut_short, unweighted):
        shutil.copytree(tiny_model, d)
    weights = cut_short / "model.safetensors"
    os.truncate(weights, weights.stat().st_size // 2)  # a copy or download that stopped halfway
    (unweighted / "model.safetensors").unlink()
    moe = tmp_path / "moe"  # transformers reads it; the built-in engine died at its start, a traceback shown
    shutil.copytree(tiny_model, moe)
    (moe / "config.json").write_text((moe / "config.json").read_text().replace('"qwen3"', '"qwen3_moe"'))
    cases = [
        (["--hf-checkpoint", str(broken)], "config.json is not valid JSON"),
        (
            ["--hf-checkpoint", str(cut_short)],
            "cut_short: model.safetensors is damaged .*: give a whole HF model directory",
        ),
        (["--hf-checkpoint", str(unweighted)], "unweighted: no model.safetensors: give a whole HF model directory"),
        (["--rollout-health-check-timeout", "0"], "--rollout-health-check-timeout must be > 0 seconds"),
        (["--eval-limit", "-1"], "--eval-limit -1: give at least 1"),
        (["--rollout-health-check-interval", "-1"], "--rollout-health-check-interval must be >= 0 seconds"),
        (["--n-samples-per-prompt", "0"], "--n-samples-per-prompt must be at least 1"),
        (["--rollout-temperature", "nan"], "--rollout-temperature nan: give a finite number"),
        (
            ["--custom-generate-function-path", "nope.missing"],
            "--custom-generate-function-path 'nope.missing' cannot be loaded",
        ),
        (["--eval-interval", "1", "--eval-prompt-data", str(tmp_path / "nope.jsonl")], "nope.jsonl not found"),
        (["--save", str(a_file / "ckpt")], f"--save {a_file}/ckpt is not writable"),
        (
            ["--prompt-data", str(long_rows)],
            "long.jsonl row 3: the prompt is 600 tokens, the model takes at most 511 .* --skip-overlong-prompts",
        ),
        (["--eval-interval", "1", "--eval-prompt-data", str(long_rows)], "long.jsonl row 3"),
        (["--load", str(tmp_path / "ckpt")], "no intact checkpoint"),
        (
            ["--hf-checkpoint", str(moe)],
            "model_type 'qwen3_moe' in .*moe/config.json is not supported by the vime engine \\(supported: llama, qwen2, "
            "qwen3\\); --rollout-backend vime cannot generate with it",
        ),
        (  # taken unsaid: no response can be longer than the context
            ["--rollout-max-response-len", "10000000"],
            "--rollout-max-response-len 10000000 is not below the model's context \\(config.json\\) of 512 tokens: a "
            "response has at most 511",
        ),
        (
            ["--eval-interval", "1", "--eval-max-response-len", "512"],
            "--eval-max-response-len 512 is not below the model's context",
        ),
    ]
    for argv, match in cases:
        assert re.search(match, _refused(tmp_path, *argv)), argv

    from vime.cli import eval_main
    from vime.errors import VimeError

    with pytest.raises(VimeError, match="cut_short: model.safetensors is damaged") as e:  # `vime eval` of it too
        eval_main(
            ["--config", "examples/tiny.yaml", "--hf-checkpoint", str(cut_short), "--runs-dir", str(tmp_path / "ev")]
        )
    assert "\n" not in str(e.value) and not (tmp_path / "ev").exists()
    if os.geteuid() != 0:  # root writes through file modes
        read_only = tmp_path / "ro"
        read_only.mkdir(mode=0o555)
        assert "is not writable (Permission denied)" in _refused(tmp_path, "--save", str(read_only / "ckpt"))


def _tree(d: Path) -> dict[str, tuple[int, int]]:
    """Every file under `d` with its size and mtime: what "nothing written there" compares."""
    return {str(f.relative_to(d)): (f.stat().st_size, f.stat().st_mtime_ns) for f in sorted(d.rglob("*"))}


def _crafted(ckpt: Path, state=None, weights=None) -> Path:
    """A copy of `ckpt` (a step directory) whose trainer state and model file `state` and
    `weights` rewrite (each a function of the loaded one), in a --save directory of its own."""
    from safetensors.torch import load_file, save_file

    out = ckpt.parent.parent / f"crafted{len(list(ckpt.parent.parent.glob('crafted*')))}" / ckpt.name
    shutil.copytree(ckpt, out)
    if state is not None:
        torch.save(state(torch.load(out / "trainer_state.pt", weights_only=False)), out / "trainer_state.pt")
    if weights is not None:
        save_file(weights(load_file(out / "model.safetensors")), out / "model.safetensors", metadata={"format": "pt"})
    return out.parent


def _set(tree: dict, path: tuple, value) -> dict:
    inner = tree
    for key in path[:-1]:
        inner = inner[key]
    inner[path[-1]] = value
    return tree


def test_a_crafted_or_damaged_checkpoint_is_one_line_before_anything_starts(actor, tiny_model, tmp_path, monkeypatch):
    """Each of these failed in the trainer after the engines had started, with a raw traceback
    (KeyError, TypeError, a size mismatch inside Adam at step 1 or in load_state_dict), or was
    blamed on --global-batch-size; a regular file given as --load started a fresh run."""
    monkeypatch.chdir(ROOT)
    samples = [Sample(index=i, tokens=[5, 6, 7, 8, 9], response_length=2) for i in range(4)]
    actor.train_step(samples, [1.0, 0.0, 1.0, 0.0])  # Adam's moments exist from here
    good = actor.save(tmp_path / "ck" / "1", resumable_extra(1, actor.optimizer_step.count))
    moment = "model.layers.0.mlp.down_proj.weight"  # [64, 128] in the tiny model: transposed is another shape
    file_ = tmp_path / "a-file"
    file_.write_text("not a checkpoint")
    cases = [
        (_crafted(good, state=lambda s: [s]), r"trainer_state.pt: holds a list, where vime writes a dict of optimizer"),
        (
            _crafted(good, state=lambda s: {k: v for k, v in s.items() if k != "optimizer"}),
            r"trainer_state.pt: key 'optimizer' is missing, expected a dict",
        ),
        (
            _crafted(good, state=lambda s: _set(s, ("optimizer", "state", moment, "exp_avg"), torch.zeros(128, 64))),
            rf"optimizer.state\['{moment}'\]\['exp_avg'\] is \[128, 64\], expected a tensor of shape \[64, 128\]",
        ),
        (
            _crafted(
                good, state=lambda s: _set(s, ("optimizer", "state", "lm_head.bias"), {"exp_avg": torch.zeros(3)})
            ),
            r"optimizer names 'lm_head.bias', which is no parameter this run trains",
        ),
        (
            _crafted(good, state=lambda s: _set(s, ("optimizer", "param_groups", 0, "betas"), "x")),
            r"optimizer.param_groups holds betas='x', expected a number \(or a pair of numbers\)",
        ),
        (
            _crafted(good, state=lambda s: _set(s, ("optimizer_steps",), 7)),  # an AssertionError in the run
            r"key 'optimizer_steps' is 7, but extra\['policy_version'\] is 1: they count the same steps",
        ),
        (_crafted(good, state=lambda s: _set(s, ("extra", "step"), -3)), r"extra\['step'\] is -3, expected the step"),
        (_crafted(good, state=lambda s: _set(s, ("extra", "step"), 1.5)), r"extra\['step'\] is 1.5, expected the step"),
        (
            _crafted(good, state=lambda s: _set(s, ("rng", "python"), "seed")),
            r"rng is not the random generators' state vime writes",
        ),
        (
            _crafted(good, weights=lambda w: {**w, moment: w[moment].T.contiguous()}),
            rf"model.safetensors: tensor '{moment}' has shape \[128, 64\], the model's is \[64, 128\]",
        ),
        (file_, rf"--load {file_} is a file: give the --save directory of a vime run"),
    ]
    for load, match in cases:
        said = _refused(tmp_path, "--load", str(load))
        assert re.search(match, said), (load, said)
    # the intact one gets past the check, to the refusal of a run with nothing left to train
    assert "nothing is left to train" in _refused(tmp_path, "--load", str(good.parent))


def test_no_checkpoint_is_written_over_and_load_resumes_only_what_it_names(actor, tiny_model, tmp_path, monkeypatch):
    """--save over another run's checkpoints, --load of an older step into the --save holding newer
    ones, --load of a Megatron checkpoint or an HF model: each used to start (the last two from
    the base model, as if the directory were empty) and write over what was there."""
    from vime.config import parse_args
    from vime.preflight import check_inputs

    monkeypatch.chdir(ROOT)
    ck = tmp_path / "ck"
    for step in (1, 2, 3):  # what a run writes: --load checks the step and data position
        actor.save(ck / str(step), resumable_extra(step, actor.optimizer_step.count))
    mega = tmp_path / "mega"  # slime's --save after 10 iterations
    (mega / "iter_0000010").mkdir(parents=True)
    (mega / "iter_0000010" / "__0_0.distcp").write_bytes(b"shard")
    (mega / "latest_checkpointed_iteration.txt").write_text("10")
    damaged = tmp_path / "other" / "4"
    shutil.copytree(ck / "1", damaged)
    (damaged / "trainer_state.pt").write_bytes(b"PK\x03\x04 cut short")
    before = {d: _tree(d) for d in (ck, mega, damaged)}
    cases = [
        (
            ["--save", str(ck)],
            f"--save {ck} already holds checkpoints \\(steps 1, 2, 3\\) this run would overwrite: resume them with "
            f"--load {ck}, pick another --save, or pass --overwrite-save to replace them",
        ),
        (
            ["--load", str(ck / "1"), "--save", str(ck)],
            f"--load {ck}/1 resumes from step 1, and --save {ck} holds newer checkpoints \\(steps 2, 3\\) this run "
            f"would overwrite: resume from the newest with --load {ck},",
        ),
        (
            ["--load", str(mega), "--save", str(mega)],
            f"--load {mega} holds a Megatron/slime checkpoint \\(iter_0000010/, latest_checkpointed_iteration.txt\\), "
            "which vime cannot resume",
        ),
        (["--load", str(mega / "iter_0000010")], r"holds a Megatron/slime checkpoint \(__0_0.distcp\)"),
        (  # an HF model given as --load: its files are named, it is not taken for an empty directory
            ["--load", str(tiny_model)],
            f"--load {tiny_model} holds no vime checkpoint \\(found .*config.json, .*\\): give the --save directory",
        ),
        (
            ["--load", str(damaged)],
            f"--load {damaged} is a damaged checkpoint \\(.*\\): pass its parent {damaged.parent} to resume",
        ),
    ]
    for argv, match in cases:
        assert re.search(match, _refused(tmp_path, *argv)), argv
    after = {d: _tree(d) for d in (ck, mega, damaged)}
    after[ck].pop(".vime.lock")  # the refused --save's lock, taken before its checks: no checkpoint touched
    assert after == before  # and not even a lock file in the Megatron --load/--save

    # what the flags say is done: a step directory resumes from that step, --overwrite-save replaces
    base = ["--config", "examples/tiny.yaml", "--num-rollout", "5", "--runs-dir", str(tmp_path / "runs")]
    args = parse_args([*base, "--load", str(ck / "3"), "--save", str(ck)])
    inputs = check_inputs(args)
    inputs.rewards.close()
    assert (
        args.load == str(ck / "3")
        and f"--load {ck}/3 is the checkpoint of step 3: resuming from that step" in inputs.notes
    )
    args = parse_args([*base, "--save", str(ck), "--overwrite-save"])
    inputs = check_inputs(args)
    inputs.rewards.close()
    assert (
        f"--overwrite-save: the checkpoints of steps 1, 2, 3 in --save {ck} are replaced as this run saves those steps"
        in inputs.notes
    )


def test_save_needs_room_for_float32_weights_and_the_optimizers_state_whatever_the_files_hold(tmp_path, monkeypatch):
    """A checkpoint holds float32 master weights and AdamW's two moments, 12 bytes a parameter:
    six times a bf16 model's files, where the check once asked for three times the files and let
    a 4B run start on a disk without room for its first save. Asked of the real headers of a
    float32 and a bf16 copy of one model; the free space is the disk's answer, made up."""
    from types import SimpleNamespace

    import torch
    from safetensors.torch import load_file, save_file

    from vime.compat import parameter_count
    from vime.config import ConfigError, parse_args
    from vime.models import make_tiny_model
    from vime.preflight import _room_for_checkpoints

    f32 = make_tiny_model(tmp_path / "f32", arch="qwen3", seed=0)
    bf16 = tmp_path / "bf16"
    shutil.copytree(f32, bf16)
    weights = load_file(str(f32 / "model.safetensors"))
    save_file({k: v.to(torch.bfloat16) for k, v in weights.items()}, str(bf16 / "model.safetensors"))
    params = sum(v.numel() for v in weights.values())
    assert parameter_count(bf16) == parameter_count(f32) == params
    files = (bf16 / "model.safetensors").stat().st_size
    base = ["--hf-checkpoint", "m", "--prompt-data", "d", "--num-rollout", "1"]
    free = 0
    monkeypatch.setattr(shutil, "disk_usage", lambda _: SimpleNamespace(total=1 << 40, used=0, free=free))
    for extra, need in (
        ([], 12 * params),
        (["--optimizer", "sgd"], 8 * params),
        (["--optimizer", "sgd", "--sgd-momentum", "0"], 4 * params),
        (["--lora-rank", "4"], 4 * params),
    ):
        trainer = parse_args([*base, *extra]).trainer
        for model in (f32, bf16):
            free = need - 1
            with pytest.raises(ConfigError, match="a checkpoint of this model takes about"):
                _room_for_checkpoints(tmp_path, model, trainer)
            free = need
            _room_for_checkpoints(tmp_path, model, trainer)
    # room for three times the bf16 files, which the old rule asked for, is refused now
    free = 3 * files
    with pytest.raises(ConfigError, match="a checkpoint of this model takes about"):
        _room_for_checkpoints(tmp_path, bf16, parse_args(base).trainer)


def test_skip_overlong_prompts_leaves_them_out_and_counts_them(tmp_path, tiny_model):
    from vime.config import parse_args
    from vime.models import load_tokenizer
    from vime.rollout.data.rows import DataError
    from vime.rollout.data.source import DataSource

    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"input": "9" * n, "label": "9"}) + "\n" for n in (3, 50, 4, 60)))
    args = parse_args(
        [
            "--hf-checkpoint",
            str(tiny_model),
            "--prompt-data",
            str(rows),
            "--num-rollout",
            "1",
            "--skip-overlong-prompts",
        ]
    )
    ds = DataSource(args, load_tokenizer(tiny_model), max_prompt_len=20)
    assert len(ds) == 2 and ds.skipped_prompts == 2
    assert {g[0].prompt for g in ds.get_samples(2)} == {"999", "9999"}
    args.skip_overlong_prompts = False
    with pytest.raises(DataError, match="row 1: the prompt is 50 tokens"):
        DataSource(args, load_tokenizer(tiny_model), max_prompt_len=20)


# ---- plug-ins: tried at start-up, and their faults in a run -----------------------------------

CUSTOM_LOSS = ["--loss-type", "custom_loss", "--custom-loss-function-path"]
# each plug-in flag with a function that does not fit, and the one line that refuses it
MISFITS = [
    (
        ["--dynamic-sampling-filter-path", "varied_reward.float_filter"],
        "on group 0 returned 0.0: it must return a bool",
    ),
    (
        ["--dynamic-sampling-filter-path", "varied_reward.filter_reading_a_missing_key"],
        "on group 0 raised KeyError: 'difficulty' (VIME_DEBUG=1 shows its traceback)",
    ),
    (["--dynamic-sampling-filter-path", "varied_reward.filter_with_a_numeric_reason"], "a .reason of type int"),
    (
        ["--dynamic-sampling-filter-path", "varied_reward.filter_of_one_argument"],
        "cannot be called as fn(args, samples)",
    ),
    (
        ["--custom-advantage-function-path", "custom_algorithms.advantages_per_group"],
        "returned advantages of shape (2,), the rollout's rewards are (2, 4) (groups × samples)",
    ),
    (
        ["--custom-advantage-function-path", "custom_algorithms.advantages_that_divide_by_zero"],
        "raised ZeroDivisionError: division by zero",
    ),
    (["--custom-advantage-function-path", "custom_algorithms.advantages_as_none"], "returned NoneType: return a"),
    ([*CUSTOM_LOSS, "custom_algorithms.loss_one_short"], "a per-token loss Tensor of shape (6,) for 7 tokens"),
    ([*CUSTOM_LOSS, "custom_algorithms.detached_loss"], "returned a per-token loss with no gradient"),
    (
        [*CUSTOM_LOSS, "custom_algorithms.loss_with_a_scalar_metric_per_sequence"],
        "returned metric 'per_sequence' of shape (2,) for 7 tokens",
    ),
    (
        [*CUSTOM_LOSS, "custom_algorithms.loss_without_seq_ids"],
        "cannot be called as fn(args, *, log_probs, old_log_probs, advantages, loss_mask, rollout_log_probs, seq_ids)",
    ),
    (["--custom-tis-function-path", "custom_algorithms.tis_one_mask_short"], "returned 1 loss_masks for 2 sequences"),
    (["--custom-tis-function-path", "custom_algorithms.tis_summed"], "a pg_loss Tensor of shape () for 7 tokens"),
    (["--custom-tis-function-path", "custom_algorithms.tis_pair"], "returned a tuple of 2: it must return (pg_loss"),
    (["--custom-rm-path", "varied_reward.reward_as_text"], "returned 'right' (str): it must return a number"),
    (["--custom-rm-path", "varied_reward.reward_forgotten"], "returned None (NoneType): it must return a number"),
    (["--custom-rm-path", "varied_reward.reward_of_the_sample_alone"], "cannot be called as fn(args, sample)"),
    (["--custom-generate-function-path", "fault_plugins.generate_not_async"], "is not a coroutine function"),
    (
        ["--custom-generate-function-path", "fault_plugins.generate_of_two_arguments"],
        "cannot be called as async generate(args, sample, sampling_params)",
    ),
    (
        ["--rollout-function-path", "fault_plugins.rollout_of_two_arguments"],
        "cannot be called as generate_rollout(args, rollout_id, data_source, evaluation=False)",
    ),
]


def test_every_plugin_is_tried_at_start_up_and_one_that_does_not_fit_is_one_line(tmp_path, tiny_model, monkeypatch):
    monkeypatch.chdir(ROOT)
    for argv, fault in MISFITS:
        msg = _refused(tmp_path, *argv)
        assert f"{argv[-2]} {argv[-1]}" in msg and fault in msg, (argv, msg)
        # how it is called is checked as it loads; what it answers on made-up input, after the data is read
        assert msg.startswith("start-up check, on made-up input: ") or "cannot be called as" in msg, msg


def test_plugins_that_fit_pass_their_start_up_check_and_a_reward_that_raises_is_a_note(tmp_path, monkeypatch):
    from vime.config import parse_args
    from vime.plugins import Plugin
    from vime.preflight import check_inputs

    monkeypatch.chdir(ROOT)
    args = parse_args(
        [
            "--config", "examples/tiny.yaml", "--num-rollout", "1", "--runs-dir", str(tmp_path),
            "--rollout-function-path", "fault_plugins.inf_rewards_from_step_two",
            "--custom-generate-function-path", "fault_plugins.slow_grading",
            "--dynamic-sampling-filter-path",
            "slime.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std_with_fallback",
            "--custom-advantage-function-path", "custom_algorithms.doubled_grpo",
            *CUSTOM_LOSS, "custom_algorithms.reinforce_loss",
            "--custom-tis-function-path", "custom_algorithms.halve_tis",
            "--custom-rm-path", "varied_reward.reward_that_raises",
        ]
    )  # fmt: skip
    inputs = check_inputs(args)
    assert isinstance(inputs.rollout_fn, Plugin) and isinstance(inputs.custom_advantages, Plugin)
    assert any(
        n.startswith("--custom-rm-path varied_reward.reward_that_raises raised ZeroDivisionError: division by zero")
        and "counts in rollout/reward_errors" in n
        for n in inputs.notes
    ), inputs.notes


@pytest.mark.parametrize(
    "flags, fault",
    [
        (
            ["--dynamic-sampling-filter-path", "fault_plugins.filter_failing_in_step_two"],
            r"step 2: --dynamic-sampling-filter-path fault_plugins.filter_failing_in_step_two on group \d+ raised "
            r"KeyError: 'difficulty' \(VIME_DEBUG=1 shows its traceback\)",
        ),
        (
            [*CUSTOM_LOSS, "fault_plugins.loss_failing_in_step_two"],
            r"step 2: --custom-loss-function-path fault_plugins.loss_failing_in_step_two raised "
            r"ZeroDivisionError: float division by zero \(VIME_DEBUG=1 shows its traceback\)",
        ),
    ],
    ids=["filter", "loss"],
)
def test_a_plugin_that_fails_mid_run_stops_it_in_one_line_and_keeps_the_checkpoints(tmp_path, flags, fault):
    res = run_cli(
        "train.py", *TINY, *flags, "--num-rollout", "3", "--save", str(tmp_path / "ckpt"), "--save-interval", "1",
        "--runs-dir", str(tmp_path), "--run-name", "r",
    )  # fmt: skip
    assert res.returncode == 2, res.stderr[-3000:]
    assert re.fullmatch("error: " + fault, res.stderr.strip().splitlines()[-1]), res.stderr[-2000:]
    assert "Traceback" not in res.stderr
    _intact_checkpoints(tmp_path / "ckpt", at_least=1)
    assert [json.loads(x)["step"] for x in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()] == [1]


def test_a_rollout_function_that_returns_no_rollout_output_stops_the_run_in_one_line(tmp_path):
    res = run_cli(
        "train.py", *TINY, "--rollout-function-path", "fault_plugins.rollout_as_a_list", "--debug-rollout-only",
        "--num-rollout", "2", "--runs-dir", str(tmp_path), "--run-name", "r",
    )  # fmt: skip
    assert res.returncode == 2, res.stderr[-3000:]
    assert res.stderr.strip().splitlines()[-1] == (
        "error: step 1: --rollout-function-path fault_plugins.rollout_as_a_list returned list: it must return "
        "RolloutOutput(samples=[[Sample, ...], ...], metrics={}), one non-empty list per prompt group"
    ), res.stderr[-2000:]


def test_a_custom_generate_that_raises_or_returns_no_sample_names_the_sample_and_the_step():
    from vime.plugins import PluginError, at_step
    from vime.rollout.generate import custom_generate

    for name, fault in (
        ("generate_that_raises", "raised KeyError: 'tool_calls'"),
        ("generate_returning_nothing", "returned NoneType: it must return the Sample it was given"),
    ):
        with pytest.raises(PluginError) as e, at_step(4):
            asyncio.run(custom_generate(f"fault_plugins.{name}")(None, Sample(index=13), {}))
        assert str(e.value).startswith(
            f"step 4: --custom-generate-function-path fault_plugins.{name} on sample 13 {fault}"
        )


# ---- whole runs: faults, signals, resume ---------------------------------------------------


def _group_alive(pgid: int) -> list[str]:
    """Processes of a process group that still run (zombies waiting for a reaper do not)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
            fields = text.rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[2] == str(pgid) and fields[0] != "Z":
            out.append(text.split(")")[0])
    return out


def _start(script: str, tmp_path: Path, *argv: str) -> subprocess.Popen:
    env = dict(
        os.environ,
        PYTHONUNBUFFERED="1",
        PYTHONPATH=os.pathsep.join([str(PLUGINS), str(ROOT), os.environ.get("PYTHONPATH", "")]),
    )
    cmd = [
        sys.executable,
        script,
        *TINY,
        "--runs-dir",
        str(tmp_path),
        "--run-name",
        "r",
        "--save",
        str(tmp_path / "ckpt"),
        "--save-interval",
        "1",
        *argv,
    ]
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    proc.started = time.time()  # type: ignore[attr-defined]  # the start-up that scales _ended's bound
    return proc


def _wait_for(proc: subprocess.Popen, path: Path, timeout: float = 120) -> None:
    """Until `path` holds something (a metrics row, a plug-in's marker); the run may end meanwhile."""

    def there() -> bool:
        return path.exists() and path.stat().st_size > 0

    t0 = time.monotonic()
    while not there():
        if proc.poll() is not None and not there():
            pytest.fail(f"the run ended before {path.name}: {proc.stderr.read()[-3000:]}")
        assert time.monotonic() - t0 < timeout, f"{path} never came"
        time.sleep(0.1)


def _ended(proc: subprocess.Popen, since: float | None) -> tuple[int, list[str]]:
    """Exit code and stderr lines of a run that must end within the exit bound of `since` (the
    fault, wall clock: time.time()), leaving no process. `since` None: a run that ends by itself,
    with no claim on how fast (a hang guard only)."""
    if since is None:
        bound, slower = 180.0, 1.0
    else:
        slower = max(1.0, (since - proc.started) / QUIET_START_S)  # type: ignore[attr-defined]
        bound = EXIT_BOUND_S * slower
    try:
        _, err = proc.communicate(timeout=max(1.0, bound - (time.time() - (since or time.time()))))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"still running {bound:.0f} s after the fault (start-up {slower:.1f} x a quiet machine's)")
    if since is not None:
        assert time.time() - since < bound, f"{time.time() - since:.0f} s > {bound:.0f} s"
    deadline = time.monotonic() + 10 * slower  # children notice their parent is gone within a second or two
    while _group_alive(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = _group_alive(proc.pid)
    if left:
        os.killpg(proc.pid, signal.SIGKILL)
    assert not left, f"left behind: {left}"
    assert "Traceback" not in err, err[-3000:]
    # torch's exit-time note that a trainer rank left a collective unwaited (one that SIGTERM cut
    # short in a two-rank run, the other rank then ended): true, and nothing vime can wait on now
    err = re.sub(
        r"\[W\d+ [^\]]*ProcessGroup\.cpp:\d+\] Warning: At the time of process termination.*?~WorkRegistry\)\n?",
        "",
        err,
        flags=re.S,
    )
    # aiohttp may report a session a cancelled request reopened (test_async.py has the story)
    noise = ("Unclosed client session", "Unclosed connector", "client_session:", "connector:", "connections:")
    return proc.returncode, [
        line for line in err.strip().splitlines() if not line.split("asyncio: ")[-1].startswith(noise)
    ]


def _intact_checkpoints(save: Path, at_least: int) -> None:
    """Every checkpoint written is whole and finite, and no half-written one is left."""
    from safetensors.torch import load_file

    from vime.trainer.checkpoint import problem

    written = [p for p in save.glob("*") if p.name.isdigit()]
    assert len(written) >= at_least
    for ckpt in written:
        assert problem(ckpt) is None
        assert all(torch.isfinite(t).all() for t in load_file(str(ckpt / "model.safetensors")).values())
    assert not list(save.glob("*.tmp"))


@pytest.mark.slow
@pytest.mark.parametrize(
    "script, extra, fault, marker",
    [
        ("train.py", [], "SIGTERM", "metrics.jsonl"),
        # Ctrl-C while the pool grades batch 2 (seconds a sample) and step 1 trains
        ("train_async.py", ["--custom-generate-function-path", "fault_plugins.slow_grading"], "SIGINT", "grading"),
        ("train_async.py", FULLY_ASYNC, "SIGTERM", "metrics.jsonl"),
        ("train_async.py", ["--max-staleness", "1"], "SIGINT", "metrics.jsonl"),
        ("train.py", ["--actor-num-procs", "2"], "SIGTERM", "metrics.jsonl"),
    ],
    ids=[
        "sync-sigterm",
        "one-step-off-ctrl-c-while-grading",
        "fully-async-sigterm",
        "decoupled-ctrl-c",
        "two-ranks-sigterm",
    ],
)
def test_a_signal_stops_every_mode_within_seconds(tmp_path, script, extra, fault, marker):
    """SIGTERM to the trainer (what `kill` and schedulers send) or Ctrl-C (SIGINT to the whole
    process group, engine and reward workers included): out within seconds, one line, the
    checkpoint of step 1 intact, no process left."""
    # far more steps than run before the signal: the tiny model's async steps take ~20 ms, and 20
    # of them ended before a signal sent 1 s after the first row (the test then raced the exit)
    proc = _start(script, tmp_path, "--num-rollout", "100000", *extra)
    _wait_for(proc, tmp_path / "r" / marker)
    time.sleep(1)  # the group's generation ends, its grading begins
    if fault == "SIGINT":
        os.killpg(proc.pid, signal.SIGINT)
    else:
        proc.send_signal(signal.SIGTERM)
    code, lines = _ended(proc, time.time())
    assert (code, lines[-1]) == ((130, "interrupted") if fault == "SIGINT" else (143, "terminated")), lines[-5:]
    _intact_checkpoints(tmp_path / "ckpt", at_least=1 if marker == "metrics.jsonl" else 0)


@pytest.mark.slow
def test_bench_ab_stopped_by_sigterm_stops_its_running_arm(tmp_path):
    """bench/bench_ab.py (its CPU smoke settings) stopped by SIGTERM while an arm trains: by the
    time the bench has exited, the arm and everything it started have ended. The arm used to run
    on, holding the bench's output pipe open for minutes."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "bench/bench_ab.py", "--device", "cpu", "--tiny", "--steps", "100000", "--arms", "sync"]
    with open(tmp_path / "out.txt", "w") as out, open(tmp_path / "err.txt", "w") as err:
        proc = subprocess.Popen(
            [*cmd, "--out", str(tmp_path)], cwd=ROOT, env=env, stdout=out, stderr=err, start_new_session=True
        )
    arm: list[int] = []
    try:
        t0 = time.monotonic()
        while not (rows := list((tmp_path / "runs").glob("*-sync/metrics.jsonl"))) or not rows[0].stat().st_size:
            assert proc.poll() is None, (tmp_path / "err.txt").read_text()[-3000:]
            assert time.monotonic() - t0 < 180, "no arm step"
            time.sleep(0.2)
        arm = [p for p in _children(proc.pid) if b"vime.cli" in Path(f"/proc/{p}/cmdline").read_bytes()]
        assert len(arm) == 1
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(EXIT_BOUND_S) == 143
        assert _group_alive(arm[0]) == [] and _group_alive(proc.pid) == []  # nothing outlives the bench
        assert (tmp_path / "err.txt").read_text().strip().splitlines()[-1] == "terminated"
    finally:
        for group in [*arm, proc.pid]:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(group, signal.SIGKILL)
        proc.wait()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_a_signal_during_a_checkpoint_write_waits_for_it(sig, monkeypatch):
    """Every checkpoint is written under `signals_held`: a signal there neither cuts the write
    short (it once failed a save as an I/O error, or hung it, when Ctrl-C landed inside torch's
    writer) nor is lost; the write finishes, then the signal acts as it would have, and the
    handlers are back as they were."""
    import vime.lifetime
    from vime.lifetime import Terminated, signals_held, stop_on_sigterm

    # the SIGTERM sent here is this process's: the flag it sets must not outlive the test (a
    # later test in this worker would read every error as "terminated")
    monkeypatch.setattr(vime.lifetime, "_sigterm_received", False)
    previous = signal.getsignal(signal.SIGTERM)
    stop_on_sigterm()
    steps = []
    try:
        with pytest.raises(KeyboardInterrupt) as raised, signals_held():
            os.kill(os.getpid(), sig)
            time.sleep(0.2)  # a system call the signal would otherwise have interrupted
            steps.append("written")
        assert raised.type is (Terminated if sig == signal.SIGTERM else KeyboardInterrupt)
        assert steps == ["written"]
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGTERM, previous)


@pytest.mark.slow
@pytest.mark.parametrize(
    "plugin",
    [
        "--custom-generate-function-path fault_plugins.kill_engine_mid_step",
        "--rollout-function-path fault_plugins.kill_engine_after_rollout",
    ],
    ids=["mid-generation", "before-the-push"],
)
def test_an_engine_killed_mid_step_ends_the_run_in_one_line(tmp_path, plugin):
    proc = _start("train.py", tmp_path, "--num-rollout", "4", *plugin.split())
    _wait_for(proc, tmp_path / "r" / "engine-killed")
    code, lines = _ended(proc, (tmp_path / "r" / "engine-killed").stat().st_mtime)
    assert code == 2 and lines[-1].startswith("error: ") and "unreachable after 3 tries" in lines[-1], lines[-5:]
    assert (lines[-1].startswith("error: step 2: ")) == ("after" in plugin)  # a failed push names its step
    _intact_checkpoints(tmp_path / "ckpt", at_least=1)


@pytest.mark.slow
@pytest.mark.parametrize(
    "script, extra",
    [
        ("train.py", ["--custom-generate-function-path", "fault_plugins.stop_engine_mid_step"]),
        # fully-async generates through the push, so the stop may land in one: bounded by its own flag
        (
            "train_async.py",
            [*FULLY_ASYNC, "--custom-generate-function-path", "fault_plugins.stop_engine_mid_step"]
            + ["--update-weights-timeout", "5"],
        ),
        # stopped while the trainer trains: the push's pause finds it silent, and no push waits on
        # it for --update-weights-timeout (120 s) after a second probe (the run used to take 181 s
        # at the default health flags)
        (
            "train_async.py",
            [*FULLY_ASYNC, "--custom-advantage-function-path", "fault_plugins.stop_engines_while_training"],
        ),
    ],
    ids=["sync", "fully-async", "fully-async-while-training"],
)
def test_an_engine_that_stops_answering_ends_the_run_in_one_line(tmp_path, script, extra):
    """SIGSTOP leaves the engine's port open and its requests waiting for ever (the run used to
    stall for the 600 s request timeout): the health watch finds it silent within interval +
    timeout, and with no other engine the run stops in one line, its checkpoints intact and the
    stopped engine ended."""
    probes = ["--rollout-health-check-interval", "1", "--rollout-health-check-timeout", "2"]
    proc = _start(script, tmp_path, "--num-rollout", "8", *probes, *extra)
    marker = tmp_path / "r" / "engine-stopped"
    _wait_for(proc, marker)
    code, lines = _ended(proc, marker.stat().st_mtime)
    assert code == 2 and lines[-1].startswith("error: "), lines[-5:]
    assert re.search(r"stopped answering \(no answer to /\w+ within 2s\)|timed out after 5s", lines[-1]), lines[-5:]
    assert "resume the run with --load" in lines[-1]
    _intact_checkpoints(tmp_path / "ckpt", at_least=1)


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "stopped"])
def test_an_engine_lost_while_a_checkpoint_is_written_comes_back(tmp_path, tiny_model, addition_data, monkeypatch, sig):
    """Two engines, fully-async, a checkpoint every step: engine 1 is killed (or stopped) while
    step 2's checkpoint is written, the engines paused for it. The continue after the save finds
    it gone (a stopped one silent within the health timeout) and the run goes on with engine 0,
    nothing lost; engine 1 is started again and a later push re-syncs it. The continue's error
    used to end the run, with or without another engine up."""
    from fault_plugins import engine_server_pid

    import vime.loops
    from vime.config import parse_args
    from vime.loops import train
    from vime.trainer.actor import Actor

    real_save, real_assemble, runs = Actor.save, vime.loops.assemble, []
    monkeypatch.setattr(vime.loops, "assemble", lambda cfg: runs.append(real_assemble(cfg)) or runs[-1])

    def save_and_lose_engine_one(self, final, extra):
        if extra["step"] == 2:
            os.kill(engine_server_pid(args, 1), sig)
        if extra["step"] == 3:  # engine 1 back before the last step, whose push re-syncs it
            deadline = time.monotonic() + 120
            while runs[0].runtime.engines[1].state != "unsynced":
                assert time.monotonic() < deadline, "engine 1 did not come back"
                time.sleep(0.1)
        return real_save(self, final, extra)

    monkeypatch.setattr(Actor, "save", save_and_lose_engine_one)
    argv = ["--hf-checkpoint", str(tiny_model), "--prompt-data", str(addition_data[0]), "--num-rollout", "4"]
    argv += ["--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--rollout-max-response-len", "4"]
    argv += [*FULLY_ASYNC, "--rollout-num-engines", "2", "--device", "cpu", "--quiet"]
    argv += ["--rollout-health-check-interval", "1", "--rollout-health-check-timeout", "2"]
    argv += ["--runs-dir", str(tmp_path), "--run-name", "r", "--save", str(tmp_path / "ckpt"), "--save-interval", "1"]
    args = parse_args(argv, entry="async")
    assert args.mode == "fully-async"
    train(args)
    rows = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "perf/step_time" in r]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert [r["rollout/engines_up"] for r in rows][::3] == [2, 2] and rows[-1]["rollout/engine_restarts"] == 1
    assert "holds the current weights again" in (tmp_path / "r" / "log.txt").read_text()
    _intact_checkpoints(tmp_path / "ckpt", at_least=4)


@pytest.mark.slow
def test_non_finite_rewards_skip_steps_and_stop_the_run_with_finite_checkpoints(tmp_path):
    proc = _start(
        "train.py",
        tmp_path,
        "--num-rollout",
        "6",
        "--max-bad-steps",
        "2",
        "--rollout-function-path",
        "fault_plugins.inf_rewards_from_step_two",
    )
    code, lines = _ended(proc, None)  # the run stops itself: what it says and leaves, not how fast
    assert code == 2 and lines[-1].startswith(
        "error: step 3: 2 steps in a row had non-finite numbers (2 rewards are not finite"
    ), lines[-5:]
    rows = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["train/skipped_steps"]) for r in rows] == [
        (1, 0),
        (2, 1),
    ]  # step 3 stopped the run before its row
    assert progress_postfix(rows[1])["skipped_steps"] == "1"  # and the progress line shows it
    # step 2 skipped its optimizer step: its checkpoint holds step 1's (finite) weights
    _intact_checkpoints(tmp_path / "ckpt", at_least=2)


@pytest.mark.slow
def test_a_resume_keeps_the_record_and_steps_past_a_damaged_checkpoint(tmp_path, capfd):
    """Run 3 steps (checkpoints 2 and 3), cut the newest checkpoint short, resume in the same run
    directory: it starts from step 2 with a warning, each step is in metrics.jsonl once (the
    replaced row kept aside), the wall clock goes on, and no log or config is overwritten."""
    rows_file = tmp_path / "rows.jsonl"
    rows_file.write_text(
        "".join(
            json.dumps({"input": f"{i}+1=" if i != 2 else "9" * 600, "label": str(i + 1)}) + "\n" for i in range(12)
        )
    )
    common = [
        *TINY,
        "--prompt-data",
        str(rows_file),
        "--skip-overlong-prompts",
        "--runs-dir",
        str(tmp_path),
        "--run-name",
        "r",
        "--save",
        str(tmp_path / "ckpt"),
    ]
    # both runs in this process (train_here: train.py's run without its imports); stderr read by capfd
    train_here("sync", *common, "--num-rollout", "3", "--save-interval", "2")
    before = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    newest = tmp_path / "ckpt" / "3" / "model.safetensors"
    with open(newest, "r+b") as f:
        f.truncate(newest.stat().st_size // 2)
    capfd.readouterr()
    train_here("sync", *common, "--num-rollout", "4", "--load", str(tmp_path / "ckpt"))
    err = capfd.readouterr().err
    assert (
        "checkpoint " + str(tmp_path / "ckpt" / "3") + " is damaged" in err
        and "resumed from " + str(tmp_path / "ckpt" / "2") in err
    ), err[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert [
        json.loads(line)["step"] for line in (tmp_path / "r" / "metrics.superseded.jsonl").read_text().splitlines()
    ] == [3]
    clock = [r["perf/wall_clock"] for r in rows]
    assert clock[:2] == [r["perf/wall_clock"] for r in before[:2]] and clock == sorted(clock) and clock[2] > clock[1]
    assert all(r["rollout/skipped_prompts"] == 1 for r in rows)
    files = {p.name for p in (tmp_path / "r").iterdir()}
    assert {"config.yaml", "config.1.yaml", "engine0.log", "engine0.1.log"} <= files
    assert (
        yaml.safe_load((tmp_path / "r" / "config.yaml").read_text())["api_key"] is None
    )  # the key made for the engines is not written


def test_a_plugin_module_that_does_not_import_is_one_line_naming_where(tmp_path, monkeypatch):
    from vime.config import ConfigError
    from vime.plugins import load_function

    (tmp_path / "rm_syntax.py").write_text("def reward(args, sample):\n    return 1 +\n")
    (tmp_path / "rm_raises.py").write_text("import os\nKEY = os.environ['VIME_NO_SUCH_VARIABLE']\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(
        ConfigError, match=r"--custom-rm-path 'rm_syntax:reward': .*rm_syntax.py:2: invalid syntax \(fix the module\)$"
    ) as e:
        load_function("rm_syntax:reward", "--custom-rm-path")
    assert "\n" not in str(e.value)
    with pytest.raises(
        ConfigError, match=r"importing rm_raises raised KeyError: 'VIME_NO_SUCH_VARIABLE' \(fix the module\)$"
    ):
        load_function("rm_raises:reward", "--custom-rm-path")


def test_ctrl_c_during_a_checkpoint_keeps_that_steps_metrics_row(tmp_path, tiny_model, addition_data, monkeypatch):
    """The checkpoint of step 2 and step 2's metrics row are written together: a signal that
    lands while the checkpoint is written acts after the row (it used to act in between, and a
    run resumed from that checkpoint never logged step 2)."""
    from vime.config import parse_args
    from vime.loops import train
    from vime.trainer.actor import Actor

    real_save = Actor.save

    def save_then_interrupt(self, final, extra):
        if extra["step"] == 2:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.1)
        return real_save(self, final, extra)

    monkeypatch.setattr(Actor, "save", save_then_interrupt)
    argv = ["--hf-checkpoint", str(tiny_model), "--prompt-data", str(addition_data[0]), "--num-rollout", "4"]
    argv += ["--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--rollout-max-response-len", "4"]
    argv += ["--runs-dir", str(tmp_path), "--run-name", "r", "--save", str(tmp_path / "ckpt"), "--save-interval", "1"]
    argv += ["--device", "cpu", "--quiet"]
    with pytest.raises(KeyboardInterrupt):
        train(parse_args(argv))
    rows = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "perf/step_time" in r] == [1, 2]
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["1", "2"]


def test_a_cached_model_is_built_once_by_racing_workers_and_never_seen_half_written(tmp_path):
    """Two xdist workers asking for the same cached test model: one builds it while the other
    waits, and neither sees the directory before it is whole."""
    from vime.models import build_once

    built, seen = [], []

    def build(out: Path) -> Path:
        built.append(out)
        out.mkdir(exist_ok=True)
        time.sleep(0.3)  # the other caller arrives while this one writes
        (out / "model.safetensors").write_text("weights")
        return out

    def ask() -> None:
        out = build_once(tmp_path / "m", build)
        seen.append((out / "model.safetensors").read_text())

    threads = [threading.Thread(target=ask) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(built) == 1 and seen == ["weights", "weights"] and (tmp_path / "m").is_dir()
    assert not any(p.name.startswith("m.tmp") for p in tmp_path.iterdir())
