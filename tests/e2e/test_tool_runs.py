"""Whole runs of a tiny model fine-tuned to call the calculator (tests/plugins/tool_model.py), in
every mode: conversations of two turns, the tool's answers out of the loss, the weights moving,
and in decoupled mode conversations cut by a push and resumed. The same run through vLLM is
tests/e2e/test_vllm_runs.py's."""

from __future__ import annotations

from pathlib import Path

import pytest
from unit.rollout.tool_workers import no_tool_workers_left  # noqa: F401 (autouse: no tool worker outlives its test)

# ---- whole runs of a model that calls the calculator, in every mode ----------------------------

FULLY_ASYNC = "vime.rollout.fully_async_rollout.generate_rollout_fully_async"

TOOL_MODES = {
    "sync": ("train.py", []),
    "one-step-off": ("train_async.py", []),
    "fully-async": ("train_async.py", ["--rollout-function-path", FULLY_ASYNC]),
    # each push aborts the requests in flight; they resume from the tokens they have
    "decoupled": ("train_async.py", ["--max-staleness", "1", "--partial-rollout"]),
}


def tool_run(script: str, extra: list[str], tmp_path: Path, monkeypatch, model: Path, steps: int = 3):
    """A run of the tool-calling tiny model (tests/plugins/tool_model.py) with --tools calculator; each
    scored sample's layout recorded by tool_model.recording_reward. (metrics rows, samples)
    lr 1e-4, not tiny.yaml's 1e-3: Adam moves every weight by about lr per step whatever the
    gradient's size, and at 1e-3 the fine-tuned model forgot its tool call within three steps
    (a vLLM run: reward 0.94 → 0.003, no calls from step 4). In this process (train_here)."""
    import json

    from conftest import train_here

    samples = tmp_path / "samples.jsonl"
    monkeypatch.setenv("VIME_TEST_SAMPLES", str(samples))
    train_here(
        script, "--config", "examples/tiny.yaml", "--hf-checkpoint", str(model), "--tools", "calculator",
        "--max-turns", "3", "--rollout-max-response-len", "160", "--rollout-temperature", "0.8",
        "--lr", "1e-4", "--custom-rm-path", "tool_model.recording_reward", "--num-rollout", str(steps), "--runs-dir", str(tmp_path), "--run-name", "r", *extra,
    )  # fmt: skip
    rows = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "perf/step_time" in r], [json.loads(line) for line in samples.read_text().splitlines()]


def check_tool_run(steps: list[dict], samples: list[dict], n_steps: int = 3) -> None:
    """What every mode must show: conversations of two turns, the tool's answers out of the loss
    (mask 0, log-prob 0) and the weights moving."""
    assert [r["step"] for r in steps] == list(range(1, n_steps + 1))
    mean = {k: sum(r[k] for r in steps) / len(steps) for k in ("rollout/tool_call_rate", "rollout/turns_mean")}
    assert mean["rollout/tool_call_rate"] >= 0.5 and mean["rollout/turns_mean"] > 1.4, mean  # calls, then reads
    assert all(r["rollout/masked_token_ratio"] > 0.05 for r in steps)
    assert any(r["train/grad_norm"] > 0 for r in steps)
    # the recording reward scored (and wrote down) every sample: a failure in it is a reward error
    assert all(r["rollout/reward_errors"] == 0 for r in steps)
    assert all(s["lengths_agree"] and s["masked_logprobs_zero"] for s in samples)
    called = [s for s in samples if s["state"]["tool_calls"] > 0]
    assert len(called) >= len(samples) / 2
    # a call answered and followed by another turn: generated runs around masked answers
    # (a call whose answer did not fit ends its sample TRUNCATED in the turn that made it)
    later = [s for s in samples if s["state"]["turns"] > 1]
    assert len(later) >= len(samples) / 2
    assert all(s["masked"] > 0 and len(s["turn_versions"]) == s["state"]["turns"] for s in later)
    assert any(s["final"].startswith("Answer: ") for s in called)


def check_decoupled(steps: list[dict], samples: list[dict]) -> None:
    """Pushes aborted conversations mid-turn and they went on from their tokens: some sample of
    two turns or more has a turn whose tokens came from two weight versions (with
    --partial-rollout only an abort and a resume do that; a push between turns does not)."""
    assert all(r["rollout/staleness_max"] <= 1 for r in steps)
    # batches 1 and 2 are both sampled before push 1, so push 2 is the first that can find
    # requests in flight; each later push gets another chance (5 steps: three)
    assert steps[-1]["rollout/resumed"] > 0
    cut = [s for s in samples if s["state"]["turns"] > 1 and any(len(t) > 1 for t in s["turn_versions"])]
    assert cut, "no conversation was cut by a push and resumed"


@pytest.mark.slow
@pytest.mark.parametrize("mode", TOOL_MODES)
def test_a_model_that_calls_the_calculator_trains_in_every_mode(mode, tmp_path, monkeypatch):
    from tool_model import tool_model

    script, extra = TOOL_MODES[mode]
    n = 5 if mode == "decoupled" else 3
    steps, samples = tool_run(script, extra, tmp_path, monkeypatch, tool_model(), steps=n)
    check_tool_run(steps, samples, n)
    if mode == "sync":  # every token of a step's conversations from the weights of that step
        assert all(r["rollout/staleness_max"] == 0 for r in steps)
        assert all(len(set(v for t in s["turn_versions"] for v in t)) == 1 for s in samples)
    if mode == "decoupled":
        check_decoupled(steps, samples)
