"""A rollout function copied from slime's `generate_rollout` (tests/plugins/slime_rollout_copy_style.py)
on vime: it reads `args.over_sampling_batch_size` (slime fills it with --rollout-batch-size when
not given; vime kept None) and the sample-filter flags slime's loop checks (vime refuses those
flags, so they read None), and its batches are logged with the run's reward metrics, which slime
logs for any rollout function (vime logged only what the function returned)."""

from __future__ import annotations

from unit.compat.tiny_runs import tiny_run


def test_a_rollout_function_copied_from_slimes_trains_and_its_batches_are_logged(tmp_path):
    rows = tiny_run(tmp_path, 2, "--rollout-function-path", "slime_rollout_copy_style.generate_rollout").rows
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
