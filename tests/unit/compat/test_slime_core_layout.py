"""slime's newer module layout on vime: its helpers moved into subpackages
(`slime.utils.core.types`, `.core.misc`, `.core.async_utils`, `slime.utils.network.http_utils`),
and its current examples (fully_async, multi_agent, geo3k multi-turn, on_policy_distillation)
import them there. Each is the module its older name is, and a run whose plug-ins use only the
newer names trains (tests/plugins/slime_core_layout.py)."""

from __future__ import annotations

import importlib

import pytest
import torch
from conftest import run_cli


@pytest.mark.parametrize(
    "newer, older",
    [
        ("slime.utils.core.types", "slime.utils.types"),
        ("slime.utils.core.misc", "slime.utils.misc"),
        ("slime.utils.core.async_utils", "slime.utils.async_utils"),
        ("slime.utils.network.http_utils", "slime.utils.http_utils"),
    ],
)
def test_the_newer_names_are_the_same_modules(newer, older):
    assert importlib.import_module(newer) is importlib.import_module(older)


def test_a_name_the_newer_layout_lacks_is_an_import_error_naming_it():
    with pytest.raises(ModuleNotFoundError, match=r"slime\.utils\.core\.no_such"):
        importlib.import_module("slime.utils.core.no_such")


def test_slimes_fully_async_example_in_the_newer_layout_trains(tmp_path):
    """slime's current fully_async rollout file's shape, with a generate that posts SGLang's
    `/generate` and loads a helper by `load_function`: two steps on groups its own thread
    generated through the router and vime scored."""
    res = run_cli(
        "train.py", "--config", "examples/tiny.yaml", "--num-rollout", "2", "--runs-dir", str(tmp_path),
        "--rollout-function-path", "slime_core_layout.generate_rollout_fully_async",
        "--custom-generate-function-path", "slime_core_layout.generate",
        "--save-debug-rollout-data", str(tmp_path / "rollout_{rollout_id}.pt"),
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-2000:]
    assert "step 2/2" in res.stderr
    for step in (0, 1):
        saved = torch.load(tmp_path / f"rollout_{step}.pt", weights_only=False)["samples"]
        assert len(saved) == 16
        assert all(isinstance(s["reward"], float) and s["response_length"] > 0 for s in saved)
        assert all(len(s["rollout_log_probs"]) == s["response_length"] for s in saved)


def test_slimes_fully_async_script_flags_end_without_errors_from_the_worker_it_leaves_running(tmp_path):
    """examples/fully_async/run-qwen3-4b-fully_async.sh starts train_async.py with --use-tis and
    the rollout file: the file's worker thread outlives the run, and the groups it had in flight
    come back aborted, not as reward failures against the closed reward pool."""
    res = run_cli(
        "train_async.py", "--config", "examples/tiny.yaml", "--num-rollout", "2", "--runs-dir", str(tmp_path),
        "--rollout-function-path", "slime_core_layout.generate_rollout_fully_async",
        "--custom-generate-function-path", "slime_core_layout.generate", "--use-tis", "--rollout-num-gpus", "1",
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-2000:]
    assert "step 2/2" in res.stderr
    assert "reward of sample" not in res.stderr and "Traceback" not in res.stderr, res.stderr[-2000:]
