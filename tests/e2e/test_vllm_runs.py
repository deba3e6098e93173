"""Training runs and evaluation with `--rollout-backend vllm`, against real vLLM servers on CPU
(`make test-vllm`; no mocks): sync and fully-async runs whose every push shows in what the
server computes, a decoupled run of a model that calls the calculator, a server started by hand, two launched engines with one killed and restarted,
and the one-line refusals. The server-level tests (a launched server's death with its launcher
among them) are in tests/unit/backends/test_vllm_server.py.

Model: a random Qwen3 with head_dim 32 (vLLM's CPU attention refuses the default tiny model's
head_dim 16), float32.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import run_cli, train_here
from unit.backends.vllm_support import ATOL, SHAPE32, needs_vllm
from vllm_plugins import servers_on

from vime.backends.vllm.client import VLLMClient


@pytest.fixture(scope="session")
def model32(tmp_path_factory) -> Path:
    from vime.models import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny32") / "qwen3", seed=0, **SHAPE32)


# ---- train.py / train_async.py / vime eval with --rollout-backend vllm; their plug-ins are
# tests/plugins/vllm_plugins.py ----------------------------------------------------------------


def _train_args(model: Path, data: Path, run_dir: Path, name: str) -> list[str]:
    return [
        "--hf-checkpoint",
        str(model),
        "--prompt-data",
        str(data),
        "--rollout-backend",
        "vllm",
        "--rollout-batch-size",
        "4",
        "--n-samples-per-prompt",
        "4",
        "--rollout-max-response-len",
        "6",
        "--lr",
        "1e-2",
        "--num-rollout",
        "3",
        "--custom-rm-path",
        "varied_reward.last_token_parity",
        "--custom-generate-function-path",
        "vllm_plugins.recording_generate",
        "--runs-dir",
        str(run_dir),
        "--run-name",
        name,
    ]


def _check_run(run_dir: Path, record: Path, sync: bool) -> None:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "perf/step_time" in r]
    assert [r["train/weight_version"] for r in steps] == list(range(1, len(steps) + 1)) and len(steps) >= 3
    for r in steps:
        assert "rollout/staleness_mean" in r and r["perf/update_weights_time"] > 0
        if sync:  # the engine sampled with exactly the weights the trainer holds: each push landed
            assert r["rollout/staleness_max"] == 0 and r["train/train_rollout_logprob_abs_diff"] < 1e-3
    recs = [json.loads(line) for line in record.read_text().splitlines()]
    assert all(isinstance(v, int) for r in recs for v in r["versions"]) and all(len(r["versions"]) > 0 for r in recs)
    by_version: dict[int, list[float]] = {}
    for r in recs:
        by_version.setdefault(r["probe_version"], []).append(r["probe_logprob"])
    versions = sorted(by_version)
    assert versions == ([0, 1, 2] if sync else versions) and len(versions) >= 2, versions
    for v in versions:  # one version, one output …
        assert max(by_version[v]) - min(by_version[v]) < ATOL
    for u, v in zip(versions, versions[1:]):  # … and each push changes it
        assert abs(by_version[u][0] - by_version[v][0]) > 10 * ATOL


def _launched_servers_left(run_dir: Path) -> list[int]:
    """vLLM processes still up of the servers a finished run launched (their ports are in its log)."""
    text = (run_dir / "log.txt").read_text()
    ports = [part.split()[0] for part in text.split("vLLM server ready at http://127.0.0.1:")[1:]]
    assert ports, "the run launched no vLLM server"
    return [pid for port in ports for pid in servers_on(port)]


@needs_vllm
def test_sync_lora_run_pushes_adapters_every_step(model32, addition_data, tmp_path, monkeypatch, fresh_user_server):
    """A LoRA run against the shared server started by hand from other weights (a launched
    server's whole life is the two-engine test's): the frozen base goes in once before step 1
    (without it, step 1 was sampled from the other weights, a log-prob gap of ~0.5), then the
    adapters alone after every step, merged by the server into what the trainer computes (the
    sync run's log-prob gap). The full-weight push is the fully-async run's below."""
    record = tmp_path / "record.jsonl"
    monkeypatch.setenv("VIME_TEST_RECORD", str(record))
    lora = ["--lora-rank", "4", "--lora-alpha", "8"]
    train_here("sync", *_train_args(model32, addition_data[0], tmp_path, "sync"), *lora, *fresh_user_server)
    _check_run(tmp_path / "sync", record, sync=True)
    rows = [json.loads(line) for line in (tmp_path / "sync" / "metrics.jsonl").read_text().splitlines()]
    pushes = [r["perf/update_weights_bytes"] for r in rows if "perf/update_weights_bytes" in r]
    # rank 4 on every linear layer of a 64-wide model: adapters are a small part of its bytes
    model_bytes = (model32 / "model.safetensors").stat().st_size
    assert len(pushes) >= 3 and len(set(pushes)) == 1 and pushes[0] < model_bytes / 4


@needs_vllm
def test_fully_async_run_records_token_versions(model32, addition_data, tmp_path, monkeypatch, fresh_user_server):
    record = tmp_path / "record.jsonl"
    monkeypatch.setenv("VIME_TEST_RECORD", str(record))
    args = _train_args(model32, addition_data[0], tmp_path, "fa") + fresh_user_server
    # one batch in flight at most, five steps: later batches are generated after pushes, so the
    # recorded versions span several pushes whatever the timing
    args[args.index("--num-rollout") + 1] = "5"
    train_here(
        "async",
        *args,
        "--rollout-concurrency",
        "4",
        "--rollout-function-path",
        "vime.rollout.fully_async_rollout.generate_rollout_fully_async",
    )
    _check_run(tmp_path / "fa", record, sync=False)


@needs_vllm
def test_a_slime_generate_posts_sglang_requests_through_the_router_to_vllm(
    model32, addition_data, tmp_path, fresh_user_server
):
    """slime's plug-ins post SGLang's native /generate to args.sglang_router_ip:port; in front of
    vLLM the router translates both ways. retool's way (input_ids, return_logprob, a tool's answer
    between two turns) trains, and in a sync run the log-probs vLLM sent back through the router
    are the trainer's (the same weights: each push landed)."""
    args = _train_args(model32, addition_data[0], tmp_path, "sg") + fresh_user_server
    args[args.index("--custom-generate-function-path") + 1] = "slime_sglang_plugins.generate_with_tool"
    args[args.index("--custom-rm-path") + 1] = "slime_sglang_plugins.response_parity"
    args[args.index("--num-rollout") + 1] = "2"
    train_here("sync", *args)
    rows = [json.loads(line) for line in (tmp_path / "sg" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "perf/step_time" in r]
    assert len(steps) == 2 and any(r["train/grad_norm"] > 0 for r in steps), steps
    assert all(r["train/train_rollout_logprob_abs_diff"] < 1e-3 for r in steps), steps


@needs_vllm
def test_a_tool_run_through_vllm(tmp_path, monkeypatch, fresh_user_server):
    """The multi-turn generate through vLLM, decoupled with --partial-rollout: the checks every
    mode passes with the built-in engine in test_tool_runs.py, from the tool-calling tiny model
    in model32's shape. A push cutting a conversation mid-turn happens here by timing only:
    alone, each step outlasted the generation the worker may start, so the pushes found no
    request in flight; in CI, beside another test, one cut every conversation of a step inside
    its `</tool_call>`, and (before `generate.cut_at_stop`) none of them called the tool."""
    from tool_model import tool_model

    from e2e.test_tool_runs import TOOL_MODES, check_tool_run, tool_run

    model = tool_model(**{k: v for k, v in SHAPE32.items() if k != "arch"})
    script, extra = TOOL_MODES["decoupled"]
    extra = [*extra, "--rollout-backend", "vllm", *fresh_user_server]
    steps, samples = tool_run(script, extra, tmp_path, monkeypatch, model)
    check_tool_run(steps, samples)
    assert all(r["rollout/staleness_max"] <= 1 for r in steps)


@needs_vllm
def test_eval_matches_the_builtin_engine(model32, addition_data, tmp_path, fresh_user_server, capfd):
    """`vime eval --rollout-backend vllm` (vllm-project/vime's eval path): greedy, thinking off through
    the chat-template kwargs; the same responses as the built-in engine, from a server the user
    started with other weights (eval pushes --hf-checkpoint into it first). Eval places its
    engines with the backend's own placement, which the training runs here launch with. Both
    evals in this process (`vime eval`'s eval_main), their output read by capfd."""
    from vime.cli import eval_main

    responses = {}
    url = fresh_user_server
    for name, backend, extra in (("vime", "vime", []), ("url", "vllm", url)):
        capfd.readouterr()
        code = eval_main(
            [
                "--hf-checkpoint",
                str(model32),
                "--eval-prompt-data",
                str(addition_data[1]),
                "--eval-limit",
                "8",
                "--eval-max-response-len",
                "8",
                "--apply-chat-template",
                "--apply-chat-template-kwargs",
                '{"enable_thinking": false}',
                "--rollout-backend",
                backend,
                *extra,
                "--runs-dir",
                str(tmp_path),
                "--run-name",
                name,
            ]
        )
        assert code == 0
        assert json.loads(capfd.readouterr().out.strip().splitlines()[-1])["eval/total"] == 8
        rows = [json.loads(line) for line in (tmp_path / name / "eval.jsonl").read_text().splitlines()]
        responses[name] = [(r["index"], r["response"], r["response_length"]) for r in rows]
    assert responses["vime"] == responses["url"]


# ---- several engines, one killed and back; engine arguments; a server the user started ---------


@needs_vllm
def test_two_engines_share_a_run_and_a_killed_one_comes_back(model32, addition_data, tmp_path):
    """Two launched vLLM engines; one killed mid-rollout: its requests finish on the other, it is
    started again, re-synced by the next push, and gets work again; every step's samples come
    from exactly the trainer's weights (sync: log-probs equal), and --vllm-* reaches every server."""
    args = _train_args(model32, addition_data[0], tmp_path, "two")
    args[args.index("--num-rollout") + 1] = "5"
    args[args.index("--custom-generate-function-path") + 1] = "vllm_plugins.kill_engine_one"
    # in this process (its servers are its children, as a run's are): the test reads what it wrote
    train_here("sync", *args, "--rollout-num-engines", "2", "--vllm-max-model-len", "512")
    run_dir = tmp_path / "two"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "perf/step_time" in r]
    assert [r["rollout/engines_up"] for r in steps] == [2, 1, 2, 2, 2]
    assert [r["rollout/engine_restarts"] for r in steps] == [0, 1, 1, 1, 1]
    for r in steps:  # the restarted engine too held exactly the pushed weights
        assert r["rollout/staleness_max"] == 0 and r["train/train_rollout_logprob_abs_diff"] < 1e-3, r
    served = [r["rollout/engine1_requests"] for r in steps]
    assert served[0] > 0 and served[4] > served[3] > served[2], served  # both engines take work, before and after
    lens = [json.loads(line) for line in (run_dir / "max_model_len.jsonl").read_text().splitlines()]
    assert {tuple(r["lens"]) for r in lens} == {(512, 512)} and {r["step"] for r in lens} == {1, 5}
    log_text = (run_dir / "log.txt").read_text()
    assert "engine 1 is back at" in log_text and "holds the current weights again" in log_text
    assert (run_dir / "engine1.1.log").exists()  # the restarted engine's log beside the first
    assert not _launched_servers_left(run_dir)  # the restarted one included


@needs_vllm
def test_a_vllm_arg_vllm_does_not_know_is_one_line(model32, addition_data, tmp_path):
    args = _train_args(model32, addition_data[0], tmp_path, "typo")
    res = run_cli("train.py", *args, "--vllm-max-modle-len", "512", timeout=600)
    assert res.returncode == 2
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("error: vLLM refused its command line (unrecognized arguments: --max-modle-len"), last


def user_server_command(model: Path, port: int) -> list[str]:
    """The README's command for a vLLM server started by hand (section "vLLM as the rollout engine")."""
    return [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--port", str(port),
        "--enable-scale-out", "--logprobs-mode", "processed_logprobs",
        "--worker-extension-cls", "vime.backends.vllm.worker_ext.WeightReceiver",
        "--middleware", "vime.backends.vllm.worker_ext.require_api_key",
        "--dtype", "float32", "--kv-cache-memory-bytes", str(1 << 30),
        "--no-enable-chunked-prefill", "--max-num-batched-tokens", "2048",
    ]  # fmt: skip


@pytest.fixture(scope="module")
def other_weights(tmp_path_factory) -> Path:
    """model32's shape, another seed: weights no run here trains."""
    from vime.models import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("user") / "other", seed=7, **SHAPE32)


@pytest.fixture(scope="module")
def user_server(tmp_path_factory, other_weights):
    """A server started as the README says, from weights the run does not train, with its own
    key; shared by the tests that run against a server given by URL."""
    from vime.backends.vllm.launch import VLLMProcess, _free_port, _wait_ready

    root, other = tmp_path_factory.mktemp("user-server"), other_weights
    port, key = _free_port(), "user-key-123"
    env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", VIME_VLLM_API_KEY=key)
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", str((os.cpu_count() or 2) - 1))  # as launch_vllm picks
    log = root / "server.log"
    with open(log, "w") as f:
        proc = subprocess.Popen(
            [*user_server_command(other, port), "--enforce-eager"],
            stdout=f,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    server = VLLMProcess(f"http://127.0.0.1:{port}", proc, subprocess.Popen(["true"]), log, key)
    try:
        _wait_ready(server, 600)
        yield server
    finally:
        server.shutdown()


@pytest.fixture()
def fresh_user_server(user_server, other_weights) -> list[str]:
    """The flags of a run against the shared server, which holds the other weights again
    afterwards: the next test's start push must change what it computes."""
    yield ["--rollout-engine-urls", user_server.url, "--api-key", user_server.api_key]
    VLLMClient(user_server.url, api_key=user_server.api_key).update_weights_from_disk(str(other_weights), 0)


@needs_vllm
def test_a_wrong_key_for_a_user_started_server_is_one_line(user_server, model32, addition_data, tmp_path):
    args = _train_args(model32, addition_data[0], tmp_path, "wrong-key")
    res = run_cli("train.py", *args, "--rollout-engine-urls", user_server.url, "--api-key", "wrong", timeout=300)
    assert res.returncode == 2 and "401" in res.stderr.strip().splitlines()[-1]
