"""vllm-project/vime's tool examples (retool, search-r1, tau-bench) on vime: the API paths their
Python files take, exercised by plug-ins of ours written its way (tests/plugins/upstream_tool_plugins.py) against
real engines and a local stand-in search engine. The runs are slow; the pieces they rest on
are checked here quickly first."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import ROOT
from safetensors.torch import load_file
from unit.compat.test_plugin_compat import FULLY_ASYNC, run_tiny

from vime.rollout.types import Sample

QUESTIONS = ["capital of France", "capital of Japan", "longest river", "highest mountain"]


def test_the_upstream_names_the_tool_examples_import():
    from vime.compat import SLIME

    SLIME.install()  # as the entry points do (conftest too)
    import slime.utils.types

    import vime.utils.types
    from vime.rollout.rm_hub.math_dapo_utils import compute_score
    from vime.rollout.vllm_rollout import _coerce_flat_int_token_ids, _mm_render_response_to_generate_body

    # one module under vllm-project/vime's names and vime's, which keeps its own
    assert slime.utils.types is vime.utils.types and vime.utils.types.__spec__.name == "vime.compat.utils.types"
    assert compute_score("... Answer: \\boxed{42}", "42", strict_box_verify=True) == {
        "score": 1.0,
        "acc": True,
        "pred": "42",
    }
    assert compute_score("\\boxed{41}", "42", strict_box_verify=True)["score"] == -1.0
    assert compute_score("no answer", "42") == {"score": -1.0, "acc": False, "pred": None}
    assert _mm_render_response_to_generate_body({"token_ids": [1, 2]}, "m") == {"token_ids": [1, 2], "model": "m"}
    assert _mm_render_response_to_generate_body([[], [{"prompt_token_ids": [3]}]], "m")["token_ids"] == [3]
    with pytest.raises(ValueError, match="flat list of integers"):
        _coerce_flat_int_token_ids([1, "2"])


def test_appended_tokens_extend_the_lists_a_plugin_holds():
    """retool keeps `loss_masks = sample.loss_mask` and writes it back after its turns."""
    s = Sample(tokens=[7, 8], loss_mask=[])
    alias = s.loss_mask
    s.append_response_tokens(None, tokens=[1, 2], log_probs=[-0.1, -0.2])
    s.append_response_tokens(None, tokens=[3], trainable=False)
    assert alias == [1, 1, 0] and s.loss_mask is alias
    assert s.tokens == [7, 8, 1, 2, 3] and s.rollout_log_probs == [-0.1, -0.2, 0.0]


def test_repetition_penalty_divides_seen_positive_logits_and_multiplies_negative_ones():
    from vime.engine.core.sampler import SamplingParams, penalize_repeats

    logits = torch.tensor([[2.0, -2.0, 1.0], [2.0, -2.0, 1.0]])
    out = penalize_repeats(logits, [(0, 2.0, [0, 1])], last=torch.tensor([2, 0]))
    assert out.tolist() == [[1.0, -4.0, 0.5], [2.0, -2.0, 1.0]]  # row 0: 0, 1 and the pending 2
    with pytest.raises(ValueError, match="repetition_penalty must be a number > 0"):
        SamplingParams.from_dict({"repetition_penalty": 0})


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def search_url(monkeypatch):
    """examples/search-r1/retrieval_standin.py on a free port, its URL in $VIME_TEST_SEARCH_URL."""
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "examples/search-r1/retrieval_standin.py"), "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                break
        time.sleep(0.1)
    url = f"http://127.0.0.1:{port}/retrieve"
    monkeypatch.setenv("VIME_TEST_SEARCH_URL", url)
    yield url
    proc.terminate()
    proc.wait(timeout=10)


def _write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _run(tmp_path: Path, data: Path, tiny_model: Path, *extra: str):
    """test_plugin_compat's tiny run, each rollout's samples saved for the assertions."""
    debug = ("--save-debug-rollout-data", str(tmp_path / "rollouts/{rollout_id}.pt"))
    run_tiny(tmp_path, data, tiny_model, *debug, *extra)


def _steps(tmp_path: Path) -> list[dict]:
    rows = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "train/loss" in r]


def _saved_samples(tmp_path: Path) -> list[dict]:
    files = sorted((tmp_path / "rollouts").glob("*.pt"))
    return [s for f in files for s in torch.load(f, weights_only=True)["samples"]]


def _weights_moved(tmp_path: Path, tiny_model: Path) -> bool:
    trained = load_file(next((tmp_path / "ckpt").glob("*/model.safetensors")))
    start = load_file(tiny_model / "model.safetensors")
    return any(not torch.equal(trained[k], start[k]) for k in start)


@pytest.mark.slow
@pytest.mark.parametrize("mode", [(), FULLY_ASYNC], ids=["sync", "fully-async"])
def test_a_search_tool_plugin_trains_its_turns_and_not_the_search_results(mode, tmp_path, tiny_model, search_url):
    rows = [{"input": q, "label": {"ground_truth": {"target": [q.split()[-1]]}}} for q in QUESTIONS]
    _run(
        tmp_path, _write(tmp_path / "qa.jsonl", rows), tiny_model, *mode,
        "--custom-generate-function-path", "upstream_tool_plugins.search_then_answer",
        "--custom-rm-path", "upstream_tool_plugins.em_reward", "--reward-key", "score",
    )  # fmt: skip
    steps = _steps(tmp_path)
    assert len(steps) == 2 and all(r["rollout/reward_errors"] == 0 for r in steps)  # dict labels reached it
    assert all("rollout/reward_acc" in r for r in steps)  # DAPO's dict answer: score trained, acc logged
    samples = _saved_samples(tmp_path)
    assert len(samples) == 2 * 2 * 2
    for s in samples:
        mask, n_info = s["loss_mask"], s["metadata"]["information_tokens"]
        assert len(mask) == s["response_length"] and mask.count(0) == n_info > 0  # the search result: untrained
        first = mask.index(0)
        assert all(lp == 0.0 for lp in s["rollout_log_probs"][first : first + n_info])
    assert any(r["train/grad_norm"] > 0 for r in steps) and _weights_moved(tmp_path, tiny_model)


@pytest.mark.slow
@pytest.mark.parametrize("mode", [(), FULLY_ASYNC], ids=["sync", "fully-async"])
def test_a_tau_bench_style_agent_loop_keeps_its_reward_and_trains(mode, tmp_path, tiny_model):
    rows = [{"index": i} for i in range(4)]  # tau-bench's data: task indices, no label
    _run(
        tmp_path, _write(tmp_path / "tasks.jsonl", rows), tiny_model, *mode,
        "--input-key", "index", "--custom-generate-function-path", "upstream_tool_plugins.tau_agent",
    )  # fmt: skip
    steps = _steps(tmp_path)
    assert len(steps) == 2 and all(r["rollout/reward_mean"] >= 1.0 for r in steps)  # the agent's own reward
    for s in _saved_samples(tmp_path):
        assert s["metadata"]["agent_turns"] == 2 and s["reward"] >= 1.0
        assert s["loss_mask"].count(0) > 0 and s["loss_mask"].count(1) > 0  # the tool's answer: untrained
        assert s["tokens"][: len(s["tokens"]) - s["response_length"]] != []  # its prompt: the rendered chat
    assert any(r["train/grad_norm"] > 0 for r in steps) and _weights_moved(tmp_path, tiny_model)


@pytest.mark.slow
@pytest.mark.parametrize("mode", [(), FULLY_ASYNC], ids=["sync", "fully-async"])
def test_a_tau_bench_agent_against_the_standin_package_trains_on_its_reward(mode, tmp_path, tiny_model, monkeypatch):
    """examples/tau-bench/standin's `tau_bench` (what vllm-project/vime's agent runs against locally):
    its env's tools, scripted user and final-state reward, driven by an agent of ours written its way."""
    monkeypatch.syspath_prepend(str(ROOT / "examples/tau-bench/standin"))  # the run is in this process
    rows = [{"index": 0}, {"index": 4}]  # the stand-in's train split: its two cancellations
    _run(
        tmp_path, _write(tmp_path / "tasks.jsonl", rows), tiny_model, *mode, "--n-samples-per-prompt", "4",
        "--input-key", "index", "--custom-generate-function-path", "upstream_tool_plugins.tau_standin_agent",
    )  # fmt: skip
    steps = _steps(tmp_path)
    assert len(steps) == 2
    samples = _saved_samples(tmp_path)
    assert {s["metadata"]["cancelled"] for s in samples} == {True, False}  # both first actions were taken
    for s in samples:
        meta, mask = s["metadata"], s["loss_mask"]
        assert meta["done"] and s["reward"] == (1.0 if meta["cancelled"] else 0.0)  # the database's end state
        response = s["tokens"][len(s["tokens"]) - s["response_length"] :]
        untrained = _decode(tiny_model, [t for t, m in zip(response, mask, strict=True) if m == 0])
        assert meta["tool_observation"] in untrained  # the tool's answer: never trained
        assert mask.count(1) > 0
    assert any(r["train/grad_norm"] > 0 for r in steps) and _weights_moved(tmp_path, tiny_model)


def _decode(model_dir: Path, ids: list[int]) -> str:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir).decode(ids)


def test_the_standin_tau_bench_env_rewards_the_end_state_and_the_answers(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "examples/tau-bench/standin"))
    from tau_bench.envs import get_env
    from tau_bench.types import RESPOND_ACTION_NAME, Action

    def episode(index: int, first: Action, answer: str) -> float:
        env = get_env("retail", "llm", "any", "train", task_index=index)
        assert env.reset(task_index=index).observation and not env.step(first).done
        said = [env.step(Action(name=RESPOND_ACTION_NAME, kwargs={"content": answer})) for _ in range(2)]
        assert [r.done for r in said] == [False, True] and said[-1].observation == "###STOP###"
        return said[-1].reward

    cancel = Action(name="cancel_pending_order", kwargs={"order_id": "#W1"})
    look = Action(name="get_order_details", kwargs={"order_id": "#W1"})
    assert episode(0, cancel, "done") == 1.0 and episode(0, look, "done") == 0.0  # the database's end state
    assert episode(3, look, "It holds 3 items") == 1.0 and episode(3, look, "no idea") == 0.0  # the answer said
    with pytest.raises(ValueError, match="unknown environment 'shop'"):
        get_env("shop", "llm", "any", "train")


def test_generate_on_a_handed_over_sample_takes_the_data_ids_or_the_prompt_the_plugin_wrote():
    """A custom generate gets its sample without ids; vime's `generate` called on it starts from
    the data's ids while the prompt is the one handed over, and from the prompt the plug-in wrote
    when it rewrote it (as vllm-project/vime's generate tokenizes `sample.prompt`)."""
    from vime.models import load_tokenizer, resolve_model
    from vime.rollout import generate as vllm_rollout

    tokenizer = load_tokenizer(resolve_model("tiny"))
    token = vllm_rollout._PROMPT_IDS.set(("the data's prompt", [5, 6, 7]))
    try:
        assert vllm_rollout._prompt_ids(tokenizer, Sample(prompt="the data's prompt")) == [5, 6, 7]
        rewritten = Sample(prompt="another agent's prompt")
        want = tokenizer("another agent's prompt", add_special_tokens=False)["input_ids"]
        assert vllm_rollout._prompt_ids(tokenizer, rewritten) == want != [5, 6, 7]
    finally:
        vllm_rollout._PROMPT_IDS.reset(token)
