"""slime's launch on one machine, for real: `ray start --head`, then `ray job submit -- python3
train_async.py ...`, with vime as the job's entrypoint (vime starts its own processes; Ray only
runs the command). Run by `make test-ray` in .venv-ray; skipped where ray is not installed.

The head listens on loopback ports of its own (Ray itself turns `--node-ip-address 127.0.0.1`
into this machine's address, which stays on the machine) and is stopped by its process group,
not `ray stop --force`, which would end every Ray process of the machine.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from importlib.util import find_spec
from pathlib import Path

import pytest
from conftest import PLUGINS, ROOT
from fault_plugins import check_engine_one_came_back

pytestmark = [
    pytest.mark.ray,
    pytest.mark.skipif(find_spec("ray") is None, reason="ray is not installed (make test-ray)"),
]

BIN = Path(sys.executable).parent  # `ray` and the `python3` the job runs: this environment's
# as vllm-project/vime's scripts pass it: env_vars Ray sets for the job, PYTHONPATH replaced (vime still imports)
RUNTIME_ENV = {"env_vars": {"PYTHONPATH": "/root/Megatron-LM/", "CUDA_DEVICE_MAX_CONNECTIONS": "1"}}
TINY = [
    *("--hf-checkpoint", "tiny", "--prompt-data", "examples/data/addition/train.jsonl", "--rm-type", "math"),
    *("--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--rollout-max-response-len", "4"),
]
START_S = 180  # the head's start, on 2 busy cores ~15 s
JOB_S = 300  # a tiny run as a job, ~30 s


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict[str, str]:
    """The head's environment, which its jobs inherit: this environment's bin first on PATH (so
    the job's `python3` is ours); no PYTHONUNBUFFERED, so the job's log streams only if Ray sees
    to it; no usage stats, no W&B error reports."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONUNBUFFERED", "RAY_ADDRESS")}
    path = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    return dict(env, PATH=path, RAY_USAGE_STATS_ENABLED="0", WANDB_ERROR_REPORTING="false")


@dataclass
class Cluster:
    dashboard: str  # the head's dashboard, for `ray job submit` and the state API
    gcs: str  # the head's GCS address, where other nodes join
    temp: Path


@contextlib.contextmanager
def _node(cmd: list[str], log: Path) -> Iterator[None]:
    """A `ray start --block` process in its own group until "Ray runtime started"; at the end, as
    `ray stop --force` would but only for this node: SIGKILL to its group, then to whatever else
    it started (workers have groups of their own; they end with the raylet)."""
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + START_S
        while "Ray runtime started" not in log.read_text():
            assert proc.poll() is None, f"ray start exited {proc.returncode}:\n{log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"no Ray node within {START_S} s:\n{log.read_text()[-3000:]}"
            time.sleep(0.5)
        yield
    finally:
        started = {pid: _start_time(pid) for pid in _descendants(proc.pid)}
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        deadline = time.monotonic() + 30
        while _alive(list(started)) and time.monotonic() < deadline:
            time.sleep(0.2)
        for pid, start in started.items():
            if _start_time(pid) == start is not None:  # still that process, not a pid used again
                os.kill(pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    """A Ray head started as vllm-project/vime's scripts start it, from the repository root (where their
    `python3 train.py` is found), with no CPUs of its own to give: jobs' drivers run on it, and
    actors (vime's engines with --launcher ray) only on the nodes that join it."""
    temp = Path(tempfile.mkdtemp(prefix="vray-"))  # short: Ray's socket paths must stay under 108 bytes
    dashboard, gcs = _free_port(), _free_port()
    cmd = [
        *(str(BIN / "ray"), "start", "--head", "--block", "--node-ip-address", "127.0.0.1", "--num-gpus", "0"),
        *("--num-cpus", "0", "--disable-usage-stats", "--temp-dir", str(temp), "--port", str(gcs)),
        *("--dashboard-host", "127.0.0.1", "--dashboard-port", str(dashboard)),
        *("--dashboard-agent-listen-port", str(_free_port()), "--ray-client-server-port", str(_free_port())),
    ]
    try:
        with _node(cmd, temp / "head.log"):
            yield Cluster(f"http://127.0.0.1:{dashboard}", f"127.0.0.1:{gcs}", temp)
    finally:
        shutil.rmtree(temp, ignore_errors=True)


@pytest.fixture(scope="module")
def head(cluster) -> str:
    return cluster.dashboard


@pytest.fixture(scope="module")
def second_node(cluster) -> Iterator[str]:
    """A second Ray node joined to the head: where --launcher ray's engines and trainer ranks go
    (four CPUs in Ray's books, for two engines and a rank; the machine has two). Yields its node id."""
    from ray.util.state import list_nodes

    cmd = [
        *(str(BIN / "ray"), "start", "--block", f"--address={cluster.gcs}", "--node-ip-address", "127.0.0.1"),
        *("--num-cpus", "4", "--num-gpus", "0", "--disable-usage-stats"),
        *("--dashboard-agent-listen-port", str(_free_port()), "--metrics-export-port", str(_free_port())),
    ]
    with _node(cmd, cluster.temp / "node2.log"):
        deadline = time.monotonic() + START_S
        while len(nodes := [n for n in list_nodes(address=cluster.dashboard) if n.state == "ALIVE"]) < 2:
            assert time.monotonic() < deadline, "the second node did not join the head"
            time.sleep(1)
        yield next(n.node_id for n in nodes if not n.is_head_node)


def ray(*argv: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(BIN / "ray"), *argv], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=timeout
    )


def submit(
    address: str, entrypoint: list[str], *flags: str, timeout: float = JOB_S, env: dict | None = None
) -> subprocess.CompletedProcess:
    """`ray job submit` as vllm-project/vime's scripts call it (it waits for the job and tails its log)."""
    return ray(
        *(
            "job",
            "submit",
            f"--address={address}",
            f"--runtime-env-json={json.dumps(env or RUNTIME_ENV)}",
            *flags,
            "--",
        ),
        *entrypoint,
        timeout=timeout,
    )


def status(address: str, job: str) -> str:
    """PENDING, RUNNING, SUCCEEDED, FAILED or STOPPED."""
    from ray.job_submission import JobSubmissionClient

    return str(JobSubmissionClient(address).get_job_status(job).value)


def logs(address: str, job: str) -> str:
    from ray.job_submission import JobSubmissionClient

    return JobSubmissionClient(address).get_job_logs(job)


def wait_for_status(address: str, job: str, states: tuple[str, ...], timeout: float = JOB_S) -> str:
    deadline = time.monotonic() + timeout
    while (state := status(address, job)) not in states:
        assert time.monotonic() < deadline, f"job {job} still {state} after {timeout} s"
        time.sleep(1)
    return state


def test_launcher_auto_is_local_on_a_one_node_cluster_and_off_ray(cluster, monkeypatch):
    """Before any test adds the second node: inside a Ray job of a one-node cluster, --launcher
    auto keeps engines and ranks on this machine (the one-machine `ray job submit` of
    vllm-project/vime's scripts, as before), and so it does outside a job, or where Ray cannot place the engines."""
    from vime.config import Config
    from vime.launch.ray import resolve_launcher

    monkeypatch.setenv("RAY_ADDRESS", cluster.gcs)
    assert resolve_launcher(Config()) == "local"  # not a Ray job
    monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", "{}")
    assert resolve_launcher(Config(rollout_backend="vllm")) == "local"
    assert resolve_launcher(Config(colocate=True)) == "local"
    assert resolve_launcher(Config()) == "local"  # joined the cluster: one node


def test_a_job_whose_training_fails_fails(head, tmp_path):
    """A run that stops on a user's mistake fails its Ray job, `ray job submit` exits non-zero
    (a script running it under `set -e` stops), and the job's log ends with vime's one line."""
    job = "vime-bad-flag"
    argv = ["python3", "train.py", *TINY, "--prompt-data", "missing.jsonl", "--num-rollout", "1"]
    out = submit(head, [*argv, "--runs-dir", str(tmp_path)], f"--submission-id={job}", timeout=120)
    assert out.returncode != 0, out.stdout[-3000:]
    assert status(head, job) == "FAILED"
    log = logs(head, job)
    last = log.strip().splitlines()[-1]
    assert last.startswith("error: ") and "missing.jsonl" in last and "Traceback" not in log, log[-3000:]


def _descendants(pid: int) -> list[int]:
    """`pid` and every process below it, now."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def _alive(pids: list[int]) -> list[str]:
    alive = []
    for pid in pids:
        try:
            text = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        if text.rsplit(")", 1)[1].split()[0] != "Z":
            alive.append(text.split(")")[0])
    return alive


def _start_time(pid: int) -> str | None:
    """When `pid` started (clock ticks since boot), or None once it is gone or a zombie."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] == "Z" else fields[19]


def _trainer_pid(marker: str) -> int | None:
    """The job's python3 process: the one whose command line holds `marker` (its --runs-dir)."""
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            argv = cmdline.read_bytes().split(b"\0")
        except OSError:
            continue
        if argv[0].endswith(b"python3") and b"train_async.py" in argv and marker.encode() in argv:
            return int(cmdline.parent.name)
    return None


def test_ray_job_stop_stops_the_run_and_everything_it_started(cluster, second_node, tmp_path):
    """`ray job stop` (SIGTERM to every process of the job at once, SIGKILL to those left 3 s
    later) of a fully-async run (the mode with the most of its own to stop: the worker) whose
    engine is a Ray actor on the other node (--launcher ray): the job is STOPPED, the trainer,
    its reward workers and W&B's service are all gone within seconds, and so are the engine's
    actor and server; nothing prints a traceback, and the rows of the steps it finished are
    intact, each after a push the run checked landed (--check-weight-push, on by default). (vime
    unwinds a SIGTERM in 2-3 s here, so the run's last line is "terminated", an engine error when
    it met its engine already gone, or none when Ray's SIGKILL came first.)"""
    from fault_plugins import server_pids

    head, job = cluster.dashboard, "vime-stop-fully-async"
    extra = ["--rollout-function-path", "vime.rollout.fully_async_rollout.generate_rollout_fully_async"]
    # W&B too, as vllm-project/vime's scripts log: its service process is signalled with the rest
    wandb = ["--use-wandb", "--wandb-mode", "offline"] if find_spec("wandb") else []
    argv = [
        *("python3", "train_async.py", *TINY, "--launcher", "ray", "--num-rollout", "100000", *extra, *wandb),
        *("--runs-dir", str(tmp_path)),
    ]
    out = submit(head, [*argv, "--run-name", "r"], f"--submission-id={job}", "--no-wait", timeout=60)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    metrics = tmp_path / "r" / "metrics.jsonl"
    deadline = time.monotonic() + JOB_S
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
        assert status(head, job) in ("PENDING", "RUNNING"), logs(head, job)[-3000:]
        assert time.monotonic() < deadline, "no two steps within the time limit"
        time.sleep(0.5)
    trainer = _trainer_pid(str(tmp_path))
    assert trainer is not None
    time.sleep(1)  # reward workers and the fully-async worker are busy now
    started = _descendants(trainer)
    assert len(started) > 1  # at least the reward workers
    actors = _engine_actors(head)
    # the servers this job's engine actor started (another test's engines on the machine are not ours)
    servers = [pid for a in actors for pid in server_pids(a.pid)]
    assert len(servers) == 1 and [a.node_id for a in actors] == [second_node]

    t0 = time.monotonic()
    stop = ray("job", "stop", f"--address={head}", job, timeout=60)
    assert stop.returncode == 0, stop.stdout + stop.stderr
    assert wait_for_status(head, job, ("STOPPED", "FAILED", "SUCCEEDED"), timeout=30) == "STOPPED"
    while (_alive(started) or _alive(servers)) and time.monotonic() - t0 < 15:
        time.sleep(0.2)
    assert not _alive(started + servers), f"left behind after ray job stop: {_alive(started + servers)}"
    log = logs(head, job)
    assert "Traceback" not in log, log[-3000:]
    assert "step 1/100000 |" in log and "Ray actor on node" in log, log[-3000:]
    assert "dropped Ray's OMP_NUM_THREADS=1" in log  # vime's CPU ops are not held to one thread
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert rows and [r["step"] for r in rows] == list(range(1, len(rows) + 1))
    assert all(r["perf/update_weights_time"] > 0 for r in rows)


# tests/ on the job's path too, for the fault plug-in
PLUGIN_ENV = {"env_vars": {**RUNTIME_ENV["env_vars"], "PYTHONPATH": f"/root/Megatron-LM/:{PLUGINS}"}}
RAY_ENGINES = ["--rollout-num-engines", "2", "--weight-transport", "gloo"]


def _engine_actors(address: str, cls: str = "EngineHost") -> list:
    from ray.util.state import list_actors

    return [a for a in list_actors(address=address, limit=1000) if a.class_name == cls]


def test_ray_engines_on_another_node_train_in_sync_and_a_killed_actor_comes_back(cluster, second_node, tmp_path):
    """A Ray job on a two-node cluster, --launcher left at auto, so ray: two engine actors and the
    trainer's second rank, placed on the node that joined the head (the head gives no CPUs); the engines fed over gloo as engines
    on another host are, the ranks in one gloo group across the nodes (FSDP2). In step 2 engine
    1's actor is SIGKILLed mid-rollout: its server goes with it, its requests finish on engine 0,
    a new actor takes its bundle, and the next push re-syncs it; every step's samples come from
    exactly the trainer's weights (sync: log-probs equal), so each push, gathered from both
    ranks' shards, reached both engines."""
    job = "vime-ray-engines"
    earlier = {a.actor_id for a in _engine_actors(cluster.dashboard)}  # other tests' engines
    argv = [
        *("python3", "train.py", *TINY, *RAY_ENGINES, "--num-rollout", "5", "--lr", "2e-2"),
        *("--actor-num-procs", "2"),
        *("--custom-rm-path", "varied_reward.digit_share", "--custom-generate-function-path"),
        *("fault_plugins.kill_engine_actor_one", "--runs-dir", str(tmp_path), "--run-name", "r"),
    ]
    out = submit(cluster.dashboard, argv, f"--submission-id={job}", env=PLUGIN_ENV)
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    assert wait_for_status(cluster.dashboard, job, ("SUCCEEDED", "FAILED", "STOPPED"), timeout=60) == "SUCCEEDED"
    assert f"run written to {tmp_path / 'r'}" in logs(cluster.dashboard, job)
    check_engine_one_came_back(tmp_path / "r")
    log = (tmp_path / "r" / "log.txt").read_text()
    assert len(re.findall(r"engine \d: Ray actor on node", log)) == 3  # two at the start, engine 1 again
    actors = [a for a in _engine_actors(cluster.dashboard) if a.actor_id not in earlier]
    assert len(actors) == 3 and {a.node_id for a in actors} == {second_node}
    assert all(a.state == "DEAD" for a in actors)  # the run ended them all
    assert "a Ray job on a cluster of 2 nodes: --launcher ray" in log
    assert log.count("trainer rank 1: Ray actor on node") == 1
    (rank,) = [a for a in _engine_actors(cluster.dashboard, "TrainerRank") if a.name.startswith("vime-trainer1-")]
    assert rank.node_id == second_node and rank.state == "DEAD"
    assert (tmp_path / "r" / "trainer1.log").exists()
    assert "Unclosed" not in log  # the replaced engine's client was closed with the others


@pytest.mark.vllm
@pytest.mark.skipif(find_spec("vllm") is None, reason="vllm is not installed (make test-vllm runs this test)")
def test_vllm_engines_on_another_node_as_ray_actors_train_in_sync(cluster, second_node, tmp_path):
    """--rollout-backend vllm in a Ray job on a two-node cluster, --launcher left at auto, so ray:
    the vLLM server starts in an engine actor on the node that joined the head and is fed over
    gloo, as a server on another host is. Sync training, a reward that varies within each group:
    the weights change every step, and every step samples with exactly the trainer's weights
    (staleness 0, log-probs equal), so each push reached the server."""
    from vime.models import make_tiny_model

    job = "vime-ray-vllm"
    earlier = {a.actor_id for a in _engine_actors(cluster.dashboard)}  # other tests' engines
    # head_dim 32: vLLM's CPU attention refuses the tiny model's 16
    model = make_tiny_model(tmp_path / "m", seed=0, hidden_size=64, num_heads=2, num_kv_heads=1, head_dim=32)
    assert TINY[:2] == ["--hf-checkpoint", "tiny"]
    argv = [
        *("python3", "train.py", "--hf-checkpoint", str(model), *TINY[2:], "--rollout-backend", "vllm"),
        *("--num-rollout", "3", "--lr", "2e-2", "--n-samples-per-prompt", "4"),
        *("--custom-rm-path", "varied_reward.last_token_parity", "--runs-dir", str(tmp_path), "--run-name", "r"),
    ]
    out = submit(cluster.dashboard, argv, f"--submission-id={job}", env=PLUGIN_ENV, timeout=2 * JOB_S)
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    log = (tmp_path / "r" / "log.txt").read_text()
    assert "a Ray job on a cluster of 2 nodes: --launcher ray" in log
    assert len(re.findall(r"vLLM engine 0: Ray actor on node", log)) == 1
    assert re.search(r"vLLM engine http://[\d.]+:\d+: weights by gloo", log), log[-3000:]
    (actor,) = [a for a in _engine_actors(cluster.dashboard) if a.actor_id not in earlier]
    assert actor.node_id == second_node and actor.state == "DEAD"  # the run ended it
    rows = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "perf/step_time" in r]
    assert [r["train/weight_version"] for r in steps] == [1, 2, 3]
    # the weights moved (a step whose groups all hold equal rewards has no gradient: here the
    # first), and every step's server sampled with exactly the trainer's weights
    assert sum(r["train/grad_norm"] > 0 for r in steps) >= 2, steps
    for r in steps:
        assert r["rollout/staleness_max"] == 0 and r["train/train_rollout_logprob_abs_diff"] < 1e-3, r


def test_a_killed_trainer_rank_actor_stops_the_run_in_one_line_with_a_checkpoint(cluster, second_node, tmp_path):
    """Trainer rank 1 as a Ray actor on the other node, SIGKILLed in step 3: the run stops (no
    hang until the collective's 30-minute timeout) with one line naming the rank, its node and
    what to do; the job fails, and the checkpoint of step 2 is there to resume from."""
    job = "vime-ray-rank-dies"
    argv = [
        *("python3", "train.py", *TINY, "--launcher", "ray", "--actor-num-procs", "2", "--num-rollout", "5"),
        *("--custom-generate-function-path", "fault_plugins.kill_trainer_rank_one", "--save", str(tmp_path / "ckpt")),
        *("--save-interval", "1", "--runs-dir", str(tmp_path), "--run-name", "r"),
    ]
    t0 = time.monotonic()
    out = submit(cluster.dashboard, argv, f"--submission-id={job}", env=PLUGIN_ENV)
    assert out.returncode != 0 and status(cluster.dashboard, job) == "FAILED", (out.stdout + out.stderr)[-3000:]
    assert time.monotonic() - t0 < JOB_S
    last = logs(cluster.dashboard, job).strip().splitlines()[-1]
    assert last.startswith("error: trainer rank 1 ended (its Ray actor died on node "), last
    assert "resume the run with --load" in last
    assert (tmp_path / "ckpt" / "2" / "model.safetensors").exists()
