"""Dynamic sampling (DAPO): groups the filter drops never reach the trainer, in every mode."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import MODE_ARGS, run_cli, train_here

from vime.plugins import PluginError
from vime.rollout.filters import (
    check_reward_nonzero_std,
    dropped_metrics,
    load_filter,
)
from vime.rollout.types import Sample

TINY = ["--config", "examples/tiny.yaml"]
FILTER = ["--dynamic-sampling-filter-path", "vime.rollout.filters.check_reward_nonzero_std"]
MODES = MODE_ARGS


def group(*rewards: float) -> list[Sample]:
    return [Sample(index=i, reward=r) for i, r in enumerate(rewards)]


def test_the_built_in_filter_keeps_groups_whose_rewards_differ():
    assert check_reward_nonzero_std(None, group(0.0, 1.0, 0.0)).keep
    out = check_reward_nonzero_std(None, group(1.0, 1.0, 1.0))
    assert not out.keep and out.reason == "zero_std_1.0"
    assert check_reward_nonzero_std(None, group(0.0, 0.0)).reason == "zero_std_0.0"
    assert dropped_metrics(["zero_std_0.0", "zero_std_0.0", None]) == {
        "rollout/dynamic_filter/dropped": 3.0,
        "rollout/dynamic_filter/drop_zero_std_0.0": 2.0,
    }


class _Args:
    def __init__(self, path: str | None) -> None:
        self.dynamic_sampling_filter_path = path


def test_slime_filter_paths_load_vimes_filters_and_a_bad_answer_is_one_line():
    for name in ("check_reward_nonzero_std", "check_reward_nonzero_std_with_fallback"):
        judge = load_filter(_Args(f"slime.rollout.filter_hub.dynamic_sampling_filters.{name}"))
        assert judge(group(0.0, 1.0)).keep and not judge(group(0.5, 0.5)).keep
        assert judge(group(0.5, 0.5)).keep_when_insufficient == name.endswith("fallback")
    assert load_filter(_Args(None)) is None
    assert load_filter(_Args("varied_reward.float_filter")) is not None  # any callable loads ...
    with pytest.raises(PluginError, match=r"on group 0 returned 0\.0: it must return a bool") as e:
        load_filter(_Args("varied_reward.float_filter"))(group(1.0))  # ... and a float answer is refused
    assert "\n" not in str(e.value)
    # slime's filters compute keep as a tensor comparison: a one-element bool tensor or numpy bool counts
    judge = load_filter(_Args("varied_reward.tensor_filter"))
    assert judge(group(0.0, 1.0)).keep and not judge(group(1.0, 1.0)).keep
    assert load_filter(_Args("varied_reward.numpy_filter"))(group(0.0, 1.0)).keep
    with pytest.raises(PluginError, match="returned Tensor"):  # two answers for one group
        load_filter(_Args("varied_reward.two_bools_filter"))(group(1.0))


def test_a_filter_that_raises_or_cannot_take_a_group_is_one_line_naming_it_the_group_and_the_step():
    from vime.plugins import at_step

    judge = load_filter(_Args("varied_reward.filter_reading_a_missing_key"))
    with pytest.raises(PluginError) as e, at_step(3):
        judge([Sample(index=8, group_index=2, reward=1.0)])
    assert str(e.value) == (
        "step 3: --dynamic-sampling-filter-path varied_reward.filter_reading_a_missing_key on group 2 raised "
        "KeyError: 'difficulty' (VIME_DEBUG=1 shows its traceback)"
    )
    assert isinstance(e.value.__cause__, KeyError)  # VIME_DEBUG=1 shows the filter's own traceback
    with pytest.raises(PluginError, match="on group 0 returned a .reason of type int: give a str or None"):
        load_filter(_Args("varied_reward.filter_with_a_numeric_reason"))(group(1.0))
    with pytest.raises(PluginError, match=r"filter_of_one_argument cannot be called as fn\(args, samples\)"):
        load_filter(_Args("varied_reward.filter_of_one_argument"))


def test_a_filter_that_cannot_load_is_refused_at_start_up(tmp_path):
    res = run_cli(
        "train.py", *TINY, "--num-rollout", "1", "--runs-dir", str(tmp_path),
        "--dynamic-sampling-filter-path", "no_such_module.keep",
    )  # fmt: skip
    assert res.returncode == 2
    assert "--dynamic-sampling-filter-path 'no_such_module.keep' cannot be loaded" in res.stderr


def saved_groups(path: Path) -> list[list[list[Sample]]]:
    from vime.debug_rollout import load_rollout

    return [load_rollout(str(path / "{rollout_id}.pt"), i, 4).samples for i in range(len(list(path.iterdir())))]


def rows(run_dir: Path) -> list[dict]:
    return [
        r
        for r in (json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines())
        if "perf/step_time" in r
    ]


def dynamic_run(tmp_path: Path, mode: str) -> tuple[list[dict], list[list[list[Sample]]]]:
    script, extra = MODES[mode]
    train_here(  # in this process: the test reads what the run wrote
        script, *TINY, *FILTER, *extra,
        "--custom-rm-path", "varied_reward.half_constant",
        "--num-rollout", "3", "--runs-dir", str(tmp_path), "--run-name", mode,
        "--save", str(tmp_path / "ckpt"),
        "--save-debug-rollout-data", str(tmp_path / "rollouts" / "{rollout_id}.pt"),
    )  # fmt: skip
    return rows(tmp_path / mode), saved_groups(tmp_path / "rollouts")


def check_dynamic_run(tmp_path: Path, mode: str) -> None:
    import torch
    from safetensors.torch import load_file

    from vime.models import resolve_model

    r, batches = dynamic_run(tmp_path, mode)
    assert [x["step"] for x in r] == [1, 2, 3] and len(batches) == 3
    trained = [g for b in batches for g in b]
    assert all(len(b) == 4 and all(len(g) == 4 for g in b) for b in batches)  # every batch full
    # nothing the filter drops reached the trainer: no odd answer (constant 0.5), no equal rewards
    assert all(int(g[0].label) % 2 == 0 for g in trained)
    assert all(max(s.reward for s in g) > min(s.reward for s in g) for g in trained)
    assert len({g[0].group_index for g in trained}) == len(trained)  # none trained twice
    # ... and the filter had work to do: about half the prompts have odd answers
    assert sum(x.get("rollout/dynamic_filter/dropped", 0) for x in r) > 0
    assert all("rollout/raw_reward_mean" in x for x in r)
    initial = load_file(str(resolve_model("tiny") / "model.safetensors"))
    final = load_file(str(tmp_path / "ckpt" / "3" / "model.safetensors"))
    assert any(not torch.equal(initial[k], final[k]) for k in initial)


def test_dynamic_sampling_trains_only_kept_groups_in_sync(tmp_path):
    check_dynamic_run(tmp_path, "sync")


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["one-step-off", "fully-async", "decoupled"])
def test_dynamic_sampling_trains_only_kept_groups_in_async_modes(tmp_path, mode):
    check_dynamic_run(tmp_path, mode)


@pytest.mark.parametrize("mode", ["sync", pytest.param("fully-async", marks=pytest.mark.slow)])
def test_a_filter_that_drops_everything_stops_the_run_in_one_line(tmp_path, mode):
    script, extra = MODES[mode]
    res = run_cli(
        script, *TINY, *FILTER, *extra,
        "--custom-rm-path", "varied_reward.constant", "--dynamic-sampling-max-epochs", "1",
        "--num-rollout", "2", "--runs-dir", str(tmp_path),
    )  # fmt: skip
    assert res.returncode == 2, res.stderr[-2000:]
    last = res.stderr.strip().splitlines()[-1]
    assert "--dynamic-sampling-filter-path dropped" in last and "in a row (1 pass(es) over the data)" in last
    assert "raise --dynamic-sampling-max-epochs 1" in last


def test_the_fallback_keeps_a_group_rather_than_start_another_round(tmp_path):
    """With keep_when_insufficient a dropped group is kept when the groups kept and in flight
    could not fill the batch without it: with rounds of exactly one batch, that is every group."""
    train_here(
        "train.py", *TINY, "--custom-rm-path", "varied_reward.half_constant",
        "--dynamic-sampling-filter-path",
        "slime.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std_with_fallback",
        "--num-rollout", "3", "--runs-dir", str(tmp_path), "--run-name", "f",
        "--save-debug-rollout-data", str(tmp_path / "rollouts" / "{rollout_id}.pt"),
    )  # fmt: skip
    assert all(x["rollout/dynamic_filter/dropped"] == 0 for x in rows(tmp_path / "f"))
    trained = [g for b in saved_groups(tmp_path / "rollouts") for g in b]
    assert len(trained) == 12 and any(max(s.reward for s in g) == min(s.reward for s in g) for g in trained)
