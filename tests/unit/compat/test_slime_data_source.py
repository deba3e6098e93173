"""`slime.rollout.data_source`: the data source vime hands a rollout function is slime's
`DataSource`/`RolloutDataSource`/`RolloutDataSourceWithBuffer`, with slime's
`get_buffer_length`, `update_metadata`, `get_metadata` beside `get_samples`/`add_samples`;
building one from args, as slime's trainer does, is refused in one line; `pop_first` is slime's
buffer filter. A rollout written as slime's rollout_buffer example trains two rollouts, the
group it handed back going out first (tests/plugins/slime_data_buffer.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from slime.rollout.data_source import DataSource, RolloutDataSource, RolloutDataSourceWithBuffer, pop_first

from unit.compat.tiny_runs import tiny_run
from unit.rollout.data_files import make_args, numbered
from vime.models import make_tiny_tokenizer
from vime.rollout.data.source import DataSource as VimeDataSource


def test_vimes_data_source_is_each_of_slimes():
    for interface in (DataSource, RolloutDataSource, RolloutDataSourceWithBuffer):
        assert issubclass(VimeDataSource, interface)


def test_building_one_from_args_says_vime_builds_it():
    with pytest.raises(TypeError, match="vime builds the run's data source itself"):
        RolloutDataSourceWithBuffer(SimpleNamespace())


def test_notes_and_the_buffer_length_resume_with_the_position(tmp_path):
    source = VimeDataSource(make_args(numbered(tmp_path / "d.jsonl")), make_tiny_tokenizer())
    source.add_samples(source.get_samples(2)[1:])
    source.update_metadata({"0": [0]})
    resumed = VimeDataSource(make_args(numbered(tmp_path / "d.jsonl")), make_tiny_tokenizer())
    assert resumed.get_metadata() == {}
    resumed.load_state_dict(source.state_dict())
    assert resumed.get_metadata() == {"0": [0]} and resumed.get_buffer_length() == 2  # the outstanding group too
    del source.state_dict()["metadata"]  # a copy: the live notes stay
    assert source.get_metadata() == {"0": [0]}


def test_pop_first_takes_the_oldest_groups_out_of_the_buffer():
    buffer = [["a"], ["b"], ["c"]]
    assert pop_first(None, None, buffer, 2) == [["a"], ["b"]] and buffer == [["c"]]
    assert pop_first(None, None, buffer, 5) == [["c"]] and buffer == []


def test_a_rollout_using_slimes_buffer_methods_trains_and_its_notes_are_checkpointed(tmp_path):
    run = tiny_run(
        tmp_path, 2, "--rollout-function-path", "slime_data_buffer.generate_rollout",
        "--save", str(tmp_path / "ckpt"), "--save-interval", "2",
    )  # fmt: skip
    first, second = (step["metrics"] for step in run.saved)
    assert (first["waiting"], second["waiting"]) == (0.0, 1.0)
    assert second["first_group"] == 4.0  # the group rollout 0 handed back
    assert second["noted"] == 2.0
    state = torch.load(tmp_path / "ckpt" / "2" / "trainer_state.pt", weights_only=False)
    assert state["extra"]["data_source"]["metadata"] == {"0": [0, 1, 2, 3], "1": [4, 5, 6, 7]}
