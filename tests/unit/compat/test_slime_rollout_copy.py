"""A rollout function copied from slime's `generate_rollout` (tests/plugins/slime_rollout_copy_style.py)
on vime: it reads `args.over_sampling_batch_size` (slime fills it with --rollout-batch-size when
not given; vime kept None) and the sample-filter flags slime's loop checks (vime refuses those
flags, so they read None), and its batches are logged with the run's reward metrics, which slime
logs for any rollout function (vime logged only what the function returned)."""

from __future__ import annotations

import json

from conftest import run_cli


def test_a_rollout_function_copied_from_slimes_trains_and_its_batches_are_logged(tmp_path):
    res = run_cli(
        "train.py", "--config", "examples/tiny.yaml", "--num-rollout", "2", "--runs-dir", str(tmp_path),
        "--run-name", "r", "--rollout-function-path", "slime_rollout_copy_style.generate_rollout",
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-2000:]
    rows = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2
    for row in rows:
        assert row["rollout/num_samples"] == 16 and 0 <= row["rollout/reward_mean"] <= 1
        assert row["rollout/response_len_mean"] > 0


def test_slimes_singleton_metaclass_which_a_copied_rollout_module_imports():
    from slime.utils.misc import SingletonMeta

    class State(metaclass=SingletonMeta):
        def __init__(self, n: int) -> None:
            self.n = n

    first = State(1)
    assert State(2) is first and first.n == 1
    State.clear_instances()
    assert State(3).n == 3
