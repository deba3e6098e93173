"""The data source (vime/rollout/data/source.py): fresh tokenized groups, epochs and the seeded
shuffle, re-queued groups first, its state through a resume and a checkpoint (of groups handed
out but not trained, and of a source a rollout thread shares), eval samples, and prompts too long
for the model left out and counted."""

from __future__ import annotations

import contextlib
import dataclasses

import pytest

from unit.rollout.data_files import make_args, numbered, write_jsonl
from vime.rollout.data.prompts import load_eval_samples
from vime.rollout.data.rows import DataError
from vime.rollout.data.source import DataSource
from vime.rollout.types import Sample, Status


def labels(groups: list[list[Sample]]) -> list[str]:
    return [g[0].label for g in groups]


# ---------------------------------------------------------------- the data source


def test_groups_are_fresh_tokenized_samples(tmp_path, tokenizer):
    ds = DataSource(make_args(numbered(tmp_path / "d.jsonl"), n_samples_per_prompt=3), tokenizer)
    assert len(ds) == 10
    groups = ds.get_samples(2) + ds.get_samples(1)
    assert [s.index for g in groups for s in g] == list(range(9))
    assert [[s.group_index for s in g] for g in groups] == [[0] * 3, [1] * 3, [2] * 3]
    s = groups[1][2]
    assert (s.prompt, s.label, s.metadata, s.status, s.response_length) == ("q1", "1", {"i": 1}, Status.PENDING, 0)
    assert s.tokens == tokenizer.encode("q1")
    s.metadata["x"] = 1
    assert groups[1][0].metadata == {"i": 1}  # samples do not share mutable state


def test_wraps_to_next_epoch(tmp_path, tokenizer):
    ds = DataSource(make_args(numbered(tmp_path / "d.jsonl", 3)), tokenizer)
    assert labels(ds.get_samples(2)) == ["0", "1"]
    assert labels(ds.get_samples(2)) == ["2", "0"]
    assert (ds.epoch, ds.offset) == (1, 1)


def test_shuffle_is_seeded_and_differs_between_epochs(tmp_path, tokenizer):
    f = numbered(tmp_path / "d.jsonl", 20)

    def order(seed: int) -> list[str]:
        return labels(DataSource(make_args(f, rollout_shuffle=True, rollout_seed=seed), tokenizer).get_samples(40))

    a = order(1)
    assert a == order(1)
    assert a != order(2)
    first, second = a[:20], a[20:]
    assert (
        sorted(first, key=int) == sorted(second, key=int) == [str(i) for i in range(20)]
    )  # each epoch is a permutation
    assert first != second
    assert labels(DataSource(make_args(f), tokenizer).get_samples(20)) == [
        str(i) for i in range(20)
    ]  # no shuffle: file order


def test_requeued_groups_come_first_and_restart_from_the_prompt(tmp_path, tokenizer):
    ds = DataSource(make_args(numbered(tmp_path / "d.jsonl")), tokenizer)
    g0, g1 = ds.get_samples(2)
    prompt_ids = list(g0[0].tokens)
    for s in g0 + g1:  # as if partly generated, then aborted
        s.tokens = s.tokens + [5, 6, 7]
        s.response_length, s.response, s.status, s.reward = 3, "abc", Status.ABORTED, 1.0
        s.rollout_log_probs, s.weight_versions, s.loss_mask, s.temperature = [-0.1] * 3, [0] * 3, [1] * 3, 0.7
        s.generation_start, s.remove_sample = 2, True  # a later turn's; a custom generate's verdict
    # a custom generate that returned two samples for one, the second a copy of it
    g0 = g0 + [dataclasses.replace(g0[0])]
    ds.add_samples([g1])
    ds.add_samples([g0])
    out = ds.get_samples(3)
    assert labels(out) == ["1", "0", "2"]  # FIFO re-queue, then the next prompt
    r = out[1][0]
    assert (r.tokens, r.response_length, r.response, r.status, r.reward) == (prompt_ids, 0, "", Status.PENDING, None)
    assert r.rollout_log_probs is None and r.weight_versions is None and r.loss_mask is None and r.temperature is None
    assert (r.generation_start, r.remove_sample) == (0, False)
    assert [s.index for s in out[1]] == [0, 1]  # same samples, not new ones: the group as handed out


def test_state_dict_round_trip_continues_at_same_prompt(tmp_path, tokenizer):
    import torch

    f = numbered(tmp_path / "d.jsonl", 7)
    args = make_args(f, rollout_shuffle=True)
    ds = DataSource(args, tokenizer)
    ds.mark_trained(ds.get_samples(9))  # into the second epoch
    ds.add_samples([ds.get_samples(1)[0]])
    torch.save(ds.state_dict(), tmp_path / "state.pt")
    expected = ds.get_samples(10)
    resumed = DataSource(args, tokenizer)
    resumed.load_state_dict(torch.load(tmp_path / "state.pt", weights_only=True))  # plain values only
    got = resumed.get_samples(10)
    assert labels(got) == labels(expected)
    assert [s.index for g in got for s in g] == [s.index for g in expected for s in g]
    assert (resumed.epoch, resumed.offset) == (ds.epoch, ds.offset)


def test_checkpoint_keeps_groups_handed_out_but_not_trained(tmp_path, tokenizer):
    import torch

    args = make_args(numbered(tmp_path / "d.jsonl", 7), rollout_shuffle=True)
    ds = DataSource(args, tokenizer)
    groups = ds.get_samples(5)  # as a rollout would: some get trained, the rest are still out
    ds.mark_trained([groups[0], groups[2]])
    groups[4][0].tokens = groups[4][0].tokens + [5, 6]  # one is mid-generation
    groups[4][0].response_length, groups[4][0].status = 2, Status.ABORTED
    ds.add_samples([groups[3]])  # re-queued by the rollout: saved once, behind the outstanding ones
    torch.save(ds.state_dict(), tmp_path / "state.pt")

    resumed = DataSource(args, tokenizer)
    resumed.load_state_dict(torch.load(tmp_path / "state.pt", weights_only=True))
    got = resumed.get_samples(4)
    assert [g[0].group_index for g in got] == [
        1,
        4,
        3,
        5,
    ]  # untrained first (hand-out order, then re-queued), then the next prompt
    assert [[s.index for s in g] for g in got[:3]] == [[s.index for s in groups[i]] for i in (1, 4, 3)]
    assert labels(got[:3]) == labels([groups[1], groups[4], groups[3]])
    r = got[1][0]  # saved fresh: the prompt only
    assert (r.tokens, r.response_length, r.status) == (tokenizer.encode(r.prompt), 0, Status.PENDING)
    assert got[3][0].index == 10
    # state_dict left the live object alone: it goes on with the re-queued group, then the same
    # next prompt as the resumed one
    live = ds.get_samples(2)
    assert [g[0].group_index for g in live] == [3, 5] and live[1][0].label == got[3][0].label


def test_checkpoint_of_a_source_shared_with_a_rollout_thread(tmp_path, tokenizer):
    """Train thread (mark_trained, state_dict) and rollout thread (get_samples, add_samples)
    at once, as in the async modes: every snapshot accounts for each group handed out exactly
    once, trained or saved for regeneration. (Under the GIL these short methods rarely
    interleave badly even unlocked, so this checks the accounting, not the lock itself.)"""
    import queue
    import sys
    import threading

    ds = DataSource(make_args(numbered(tmp_path / "d.jsonl", 5), n_samples_per_prompt=1), tokenizer)
    to_train: queue.Queue = queue.Queue(maxsize=8)  # back-pressure, like the worker's: both threads stay busy
    stop = threading.Event()

    def rollout() -> None:
        i = 0
        while not stop.is_set():
            group = ds.get_samples(1)
            i += 1
            ds.add_samples(group) if i % 5 == 0 else to_train.put(group)

    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads interleave inside the methods, where a missing lock would show
    thread = threading.Thread(target=rollout)
    thread.start()
    trained: list[int] = []
    try:
        for _ in range(400):
            group = to_train.get(timeout=10)
            ds.mark_trained(group)
            trained.append(group[0][0].group_index)
            state = ds.state_dict()
            saved = [g[0]["group_index"] for g in state["requeued"]]
            assert sorted(trained + saved) == list(range(state["next_group"]))
    finally:
        sys.setswitchinterval(switch)
        stop.set()
        while thread.is_alive():  # unblock a put waiting on the full queue
            with contextlib.suppress(queue.Empty):
                to_train.get(timeout=0.1)
        thread.join()
    assert len(set(trained)) == len(trained) == 400


def test_load_eval_samples(tmp_path, tokenizer):
    f = numbered(tmp_path / "d.jsonl")
    samples = load_eval_samples(make_args(None), tokenizer, f"{f}@[2:]", limit=3)
    assert [(s.index, s.group_index, s.label) for s in samples] == [(0, 0, "2"), (1, 1, "3"), (2, 2, "4")]
    assert samples[0].tokens == tokenizer.encode("q2")
    assert len(load_eval_samples(make_args(None), tokenizer, f)) == 10


def test_max_prompt_and_context_len_leave_long_prompts_out_and_count_them(tmp_path, tokenizer):
    # the tiny tokenizer is one token per character: prompts of 2, 4, 6 and 8 tokens
    f = write_jsonl(tmp_path / "d.jsonl", [{"input": "q" * n, "label": str(n)} for n in (2, 4, 6, 8)])
    for flags, kept in [
        ({"rollout_max_prompt_len": 4}, ["2", "4"]),  # at most 4 tokens
        ({"rollout_max_context_len": 5}, ["2", "4"]),  # a prompt of 5 or more leaves no room for a response
        ({"rollout_max_context_len": 8, "rollout_max_prompt_len": 10}, ["2", "4", "6"]),  # the tighter one
        ({"rollout_max_context_len": 10, "rollout_max_prompt_len": 2}, ["2"]),
    ]:
        ds = DataSource(make_args(f, n_samples_per_prompt=1, **flags), tokenizer, max_prompt_len=100)
        assert labels(ds.get_samples(len(kept))) == kept and len(ds) == len(kept), flags
        assert ds.skipped_prompts == 4 - len(kept)
        flag = (
            "--rollout-max-prompt-len"
            if flags.get("rollout_max_prompt_len", 99) < flags.get("rollout_max_context_len", 99)
            else "--rollout-max-context-len"
        )
        assert ds.skipped_note.startswith(f"{flag}: left out {4 - len(kept)} of 4 prompts"), ds.skipped_note
    # the flags leave prompts out without --skip-overlong-prompts; the model's own limit still refuses
    ds = DataSource(make_args(f, rollout_max_prompt_len=6), tokenizer, max_prompt_len=7)
    assert len(ds) == 3 and ds.skipped_prompts == 1
    with pytest.raises(DataError, match="row 2: the prompt is 6 tokens, the model takes at most 5"):
        DataSource(make_args(f, rollout_max_prompt_len=7), tokenizer, max_prompt_len=5)
    with pytest.raises(
        DataError, match="every prompt is longer than 1 tokens, the most --rollout-max-prompt-len leaves"
    ):
        DataSource(make_args(f, rollout_max_prompt_len=1), tokenizer, max_prompt_len=100)
    assert DataSource(make_args(f), tokenizer, max_prompt_len=100).skipped_note is None
