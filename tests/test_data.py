"""Prompt loading, the data source (order, epochs, re-queue, resume), bad data, and `vime data`."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import re
from pathlib import Path

import pytest

from vime.config import Config
from vime.datagen import TASKS, write_dataset
from vime.datagen import main as datagen_main
from vime.models import make_tiny_tokenizer
from vime.rollout.data.prompts import load_eval_samples
from vime.rollout.data.rows import DataError, load_prompts
from vime.rollout.data.source import DataSource
from vime.rollout.types import Sample, Status


@pytest.fixture(scope="module")
def tokenizer():
    return make_tiny_tokenizer()


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def numbered(path: Path, n: int = 10) -> Path:
    return write_jsonl(path, [{"input": f"q{i}", "label": str(i), "metadata": {"i": i}} for i in range(n)])


def make_args(prompt_data, **kw) -> Config:
    base = dict(
        prompt_data=str(prompt_data),
        input_key="input",
        label_key="label",
        metadata_key="metadata",
        label_format="text",
        apply_chat_template=False,
        apply_chat_template_kwargs={},
        rollout_shuffle=False,
        rollout_seed=42,
        n_samples_per_prompt=2,
    )
    return Config(**{**base, **kw})


def labels(groups: list[list[Sample]]) -> list[str]:
    return [g[0].label for g in groups]


# ---------------------------------------------------------------- loading


def test_load_jsonl_and_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"q": "1+1=", "a": 2, "meta": {"src": "x"}}, {"q": "2+2=", "a": 4, "meta": None}]
    chats = [{"q": [{"role": "user", "content": "hi"}], "a": "b"}]
    write_jsonl(tmp_path / "d.jsonl", rows)
    write_jsonl(tmp_path / "c.jsonl", chats)
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    pq.write_table(pa.Table.from_pylist(chats), tmp_path / "c.parquet")
    for ext in ["jsonl", "parquet"]:
        got = load_prompts(tmp_path / f"d.{ext}", input_key="q", label_key="a", metadata_key="meta")
        assert got == [
            {"input": "1+1=", "label": "2", "metadata": {"src": "x"}},
            {"input": "2+2=", "label": "4", "metadata": {}},
        ]
        got = load_prompts(tmp_path / f"c.{ext}", input_key="q", label_key="a")
        assert got == [{"input": [{"role": "user", "content": "hi"}], "label": "b", "metadata": {}}]


def test_row_slices(tmp_path):
    f = numbered(tmp_path / "d.jsonl")
    ids = lambda spec: [r["label"] for r in load_prompts(spec)]  # noqa: E731
    assert ids(f"{f}@[2:5]") == ["2", "3", "4"]
    assert ids(f"{f}@[:2]") == ["0", "1"]
    assert ids(f"{f}@[8:]") == ["8", "9"]
    assert ids(f"{f}@[-3:-1]") == ["7", "8"]
    assert len(ids(f"{f}@[:]")) == 10


@pytest.mark.parametrize("suffix", ["@[a:b]", "@[1:2:3]", "@[3]", "@[1:2"])
def test_bad_slice(tmp_path, suffix):
    f = numbered(tmp_path / "d.jsonl")
    with pytest.raises(DataError, match="slice"):
        load_prompts(f"{f}{suffix}")


def test_error_missing_file(tmp_path):
    with pytest.raises(DataError, match="nope.jsonl.*not found"):
        load_prompts(tmp_path / "nope.jsonl")


def test_error_unknown_extension(tmp_path):
    (tmp_path / "d.csv").write_text("input,label\n")
    with pytest.raises(DataError, match="extension '.csv'"):
        load_prompts(tmp_path / "d.csv")


def test_error_missing_key_names_key_file_row_and_keys(tmp_path):
    f = write_jsonl(tmp_path / "d.jsonl", [{"input": "a", "label": "1"}, {"question": "b", "label": "2"}])
    with pytest.raises(DataError) as e:
        load_prompts(f)
    msg = str(e.value)
    assert (
        "'input'" in msg and "d.jsonl" in msg and "row 1" in msg and "question, label" in msg and "--input-key" in msg
    )
    with pytest.raises(DataError, match="'answer'"):
        load_prompts(f, label_key="answer")
    assert len(load_prompts(f"{f}@[:1]")) == 1  # only rows inside the slice are checked


@pytest.mark.parametrize(
    "row, said",
    [
        # a JSON escape of half a surrogate pair: the tokenizer raised a TypeError on it mid-run
        (
            {"input": "3+4=\ud800", "label": "7"},
            r"row 0 \(line 1\): 'input' holds '\\ud800' at character 4, half of a surrogate pair, which is no text",
        ),
        (
            {"input": [{"role": "user", "content": "hi \udcff"}], "label": "7"},
            r"'input\[0\].content' holds '\\udcff' at character 3, half of a surrogate pair",
        ),
        ({"input": "1+1=", "label": "\ud800"}, r"'label' holds '\\ud800' at character 0"),
        (
            {"input": [], "label": "7"},
            r"'input' is an empty list of messages: every row needs a prompt",
        ),  # was "got list"
    ],
)
def test_a_row_that_is_no_text_or_no_conversation_is_one_line(tmp_path, row, said):
    f = tmp_path / "d.jsonl"
    f.write_text(json.dumps(row) + "\n")
    with pytest.raises(DataError, match=said) as e:
        load_prompts(f)
    assert "\n" not in str(e.value)


def test_error_empty_dataset(tmp_path):
    (tmp_path / "e.jsonl").write_text("\n")
    with pytest.raises(DataError, match="empty"):
        load_prompts(tmp_path / "e.jsonl")
    with pytest.raises(DataError, match="empty after slicing"):
        load_prompts(f"{numbered(tmp_path / 'd.jsonl')}@[20:30]")


def test_error_malformed_json_names_the_line(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text('{"input": "1+1=", "label": "2"}\n\n{"input": "2+2=", "label": \n')
    with pytest.raises(DataError, match=r"d\.jsonl.*line 3"):
        load_prompts(f)


def test_error_bad_input_type(tmp_path):
    f = write_jsonl(tmp_path / "d.jsonl", [{"input": 5.5, "label": "1"}])
    with pytest.raises(DataError, match="a string, an integer or a list of chat messages"):
        load_prompts(f)
    # a task's number (the seed's tau-bench prompts are indices) is its text; no label is needed
    # when nothing grades against one
    f = write_jsonl(tmp_path / "t.jsonl", [{"index": 5}])
    assert load_prompts(f, input_key="index", grader=None)[0]["input"] == "5"
    with pytest.raises(DataError, match="has no key 'label'"):
        load_prompts(f, input_key="index", grader="--rm-type math")


# ---------------------------------------------------------------- chat template


def test_chat_template_and_kwargs(tmp_path, tokenizer):
    f = write_jsonl(
        tmp_path / "d.jsonl",
        [
            {"input": "1+1=", "label": "2"},
            {"input": [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}], "label": "x"},
        ],
    )
    ds = DataSource(
        make_args(f, apply_chat_template=True, apply_chat_template_kwargs={"enable_thinking": False}), tokenizer
    )
    plain, chat = ds.get_samples(2)
    assert plain[0].prompt == "<|im_start|>user\n1+1=<|im_end|>\n<|im_start|>assistant\n"
    assert plain[0].tokens == tokenizer.encode(plain[0].prompt, add_special_tokens=False)
    assert chat[0].prompt.startswith("<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU")
    # the tiny template ignores kwargs; a template that reads one shows they arrive
    tok = make_tiny_tokenizer()
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}{% if enable_thinking is defined and not enable_thinking %} /no_think{% endif %}"
    for kwargs, want in [({"enable_thinking": False}, "1+1= /no_think"), ({}, "1+1=")]:
        ds = DataSource(make_args(f, apply_chat_template=True, apply_chat_template_kwargs=kwargs), tok)
        assert ds.get_samples(1)[0][0].prompt == want


def test_chat_template_errors(tmp_path, tokenizer):
    f = write_jsonl(tmp_path / "d.jsonl", [{"input": [{"role": "user", "content": "hi"}], "label": "1"}])
    with pytest.raises(DataError, match="--apply-chat-template"):
        DataSource(make_args(f), tokenizer)  # chat messages need a template
    tok = make_tiny_tokenizer()
    tok.chat_template = None
    with pytest.raises(DataError, match="no chat template"):
        DataSource(make_args(f, apply_chat_template=True), tok)


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


# ---------------------------------------------------------------- vime data


def test_datagen_deterministic_and_disjoint(tmp_path):
    for task in TASKS:
        a = write_dataset(task, tmp_path / "a" / task, n_train=300, n_test=100, seed=3)
        b = write_dataset(task, tmp_path / "b" / task, n_train=300, n_test=100, seed=3)
        assert [p.read_text() for p in a] == [p.read_text() for p in b]
        train, test = (load_prompts(p) for p in a)
        assert (len(train), len(test)) == (300, 100)
        train_q, test_q = {r["input"] for r in train}, {r["input"] for r in test}
        assert len(train_q) == 300 and len(test_q) == 100 and not train_q & test_q
        assert all(r["metadata"] == {"task": task} for r in train)
        if task != "list_range":  # whose label is the list itself
            assert all(r["label"] == str(int(r["label"])) for r in train)  # an integer
        if task != "addition":
            assert all(r["input"].endswith("Give the final answer after 'Answer:'.") for r in train)
    c = write_dataset("chain_sum", tmp_path / "c", n_train=300, n_test=100, seed=4)
    assert c[0].read_text() != (tmp_path / "a" / "chain_sum" / "train.jsonl").read_text()


def test_datagen_answers_are_right(tmp_path):
    rows = load_prompts(write_dataset("addition", tmp_path, n_train=50, n_test=0, seed=0, digits=3)[0])
    for r in rows:
        a, b = r["input"].rstrip("=").split("+")
        assert int(a) + int(b) == int(r["label"]) and max(int(a), int(b)) <= 999
    rows = load_prompts(write_dataset("chain_sum", tmp_path / "cs", n_train=50, n_test=0, seed=0)[0])
    for r in rows:
        expr = r["input"].removeprefix("Calculate ").split(".")[0]
        assert eval(expr) == int(r["label"])  # noqa: S307 — our own generated arithmetic
    sums = load_prompts(
        write_dataset("chain_sum", tmp_path / "s", n_train=50, n_test=0, seed=0, ops="+", max_terms=2)[0]
    )
    for r in sums:
        expr = r["input"].removeprefix("Calculate ").split(".")[0]
        assert "-" not in expr and eval(expr) == int(r["label"])  # noqa: S307


def test_list_range_asks_for_whole_lists_of_varied_length(tmp_path):
    rows = load_prompts(write_dataset("list_range", tmp_path, n_train=400, n_test=0, seed=0, max_len=64)[0])
    lengths = []
    for r in rows:
        a, b = (
            int(x) for x in r["input"].split(" in increasing")[0].removeprefix("List the integers from ").split(" to ")
        )
        assert r["label"] == ", ".join(str(i) for i in range(a, b + 1))
        lengths.append(b - a + 1)
    # log-uniform in [2, 64]: most lists short, a tail of long ones
    assert min(lengths) == 2 and max(lengths) >= 60 and sorted(lengths)[len(lengths) // 2] <= 14


def test_datagen_cli_and_too_small_task(tmp_path, capsys):
    assert (
        datagen_main(
            ["--task", "gsm_symbolic", "--out", str(tmp_path / "g"), "--n-train", "20", "--n-test", "5", "--seed", "0"]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "train.jsonl" in out and "20 rows" in out and "test.jsonl" in out and "5 rows" in out
    with pytest.raises(DataError, match="distinct questions"):
        write_dataset("addition", tmp_path / "x", n_train=100, n_test=10, seed=0, digits=1)  # only 100 exist
    (tmp_path / "afile").write_text("keep me")
    with pytest.raises(DataError, match=r"--out .*afile is a file: give a directory"):
        datagen_main(["--task", "addition", "--out", str(tmp_path / "afile")])
    assert (tmp_path / "afile").read_text() == "keep me"


# ---------------------------------------------------------------- common math sets, by key flags

DAPO_ROWS = [  # slime's dapo-math-17k: a chat-message prompt and a plain label
    {"prompt": [{"role": "user", "content": "Solve 2x = 68. Answer: $Answer"}], "label": "34"},
    {"prompt": [{"role": "user", "content": "What is 3^4?"}], "label": "81"},
]
DAPO_ORIGINAL_ROWS = [  # BytedTsinghua-SIA/DAPO-Math-17k: the answer nested in reward_model
    {
        "data_source": "math_dapo",
        "prompt": [{"role": "user", "content": "What is 3^4?"}],
        "reward_model": {"ground_truth": "81", "style": "rule"},
    },
]
GSM8K_ROWS = [
    {
        "question": "Ann has 3 pens and buys 4 more. How many pens?",
        "answer": "She has 3 + 4 = <<3+4=7>>7 pens.\n#### 7",
    },
    {
        "question": "A farm sells 1,200 eggs a day. How many in 2 days?",
        "answer": "1,200 * 2 = <<1200*2=2400>>2,400\n#### 2,400",
    },
]


def write_both(tmp_path: Path, name: str, rows: list[dict]) -> list[Path]:
    """The same rows as JSONL and as Parquet."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), tmp_path / f"{name}.parquet")
    return [write_jsonl(tmp_path / f"{name}.jsonl", rows), tmp_path / f"{name}.parquet"]


def test_dapo_math_layout_by_key_flags(tmp_path, tokenizer):
    for path in write_both(tmp_path, "dapo", DAPO_ROWS):
        rows = load_prompts(path, input_key="prompt", label_key="label")
        assert rows == [{"input": r["prompt"], "label": r["label"], "metadata": {}} for r in DAPO_ROWS]
        ds = DataSource(make_args(path, input_key="prompt", apply_chat_template=True), tokenizer)
        assert (
            ds.get_samples(1)[0][0].prompt
            == "<|im_start|>user\nSolve 2x = 68. Answer: $Answer<|im_end|>\n<|im_start|>assistant\n"
        )
    for path in write_both(tmp_path, "dapo_original", DAPO_ORIGINAL_ROWS):
        assert load_prompts(path, input_key="prompt", label_key="reward_model.ground_truth")[0]["label"] == "81"
        with pytest.raises(DataError, match=r"row 0.* has no key 'reward_model\.answer'.*--label-key"):
            load_prompts(path, input_key="prompt", label_key="reward_model.answer")


def test_gsm8k_layout_by_key_flags(tmp_path):
    for path in write_both(tmp_path, "gsm8k", GSM8K_ROWS):
        rows = load_prompts(path, input_key="question", label_key="answer", label_format="gsm8k")
        assert [(r["input"], r["label"]) for r in rows] == [
            (GSM8K_ROWS[0]["question"], "7"),
            (GSM8K_ROWS[1]["question"], "2400"),
        ]
        assert (
            load_prompts(path, input_key="question", label_key="answer")[0]["label"] == GSM8K_ROWS[0]["answer"]
        )  # text: as it is
        with pytest.raises(DataError, match="has no key 'input'.*question, answer.*--input-key"):
            load_prompts(path, label_key="answer")
    bad = write_jsonl(tmp_path / "bad.jsonl", [GSM8K_ROWS[0], {"question": "q", "answer": "no marker here"}])
    with pytest.raises(DataError) as e:
        load_prompts(bad, input_key="question", label_key="answer", label_format="gsm8k")
    msg = str(e.value)
    assert (
        "bad.jsonl row 1" in msg
        and "'answer'" in msg
        and "####" in msg
        and "--label-format gsm8k" in msg
        and "\n" not in msg
    )


# ---------------------------------------------------------------- vime data --task rg:<name>


def test_rg_task_split_is_deterministic_disjoint_and_keeps_the_entry(tmp_path):
    a = write_dataset("rg:chain_sum", tmp_path / "a", n_train=40, n_test=10, seed=3)
    b = write_dataset("rg:chain_sum", tmp_path / "b", n_train=40, n_test=10, seed=3)
    assert [p.read_text() for p in a] == [p.read_text() for p in b]
    train, test = (load_prompts(p) for p in a)
    assert (len(train), len(test)) == (40, 10)
    train_q, test_q = {r["input"] for r in train}, {r["input"] for r in test}
    assert len(train_q) == 40 and len(test_q) == 10 and not train_q & test_q
    for r in train + test:
        spec = r["metadata"]["reasoning_gym"]
        assert r["metadata"]["task"] == "rg:chain_sum" and spec["task"] == "chain_sum" and spec["config"] == {}
        assert r["input"].startswith(spec["entry"]["question"]) and r["input"].endswith(
            "Give the final answer after 'Answer:'."
        )
        assert r["label"] == spec["entry"]["answer"] and int(r["label"]) == eval(
            spec["entry"]["metadata"]["expression"]
        )  # noqa: S307


def test_rg_task_config_flag(tmp_path, capsys):
    out = tmp_path / "ba"
    argv = [
        "--task",
        "rg:basic_arithmetic",
        "--out",
        str(out),
        "--n-train",
        "6",
        "--n-test",
        "2",
        "--rg-config",
        '{"min_terms": 2, "max_terms": 2}',
    ]
    assert datagen_main(argv) == 0
    assert "6 rows" in capsys.readouterr().out
    rows = load_prompts(out / "train.jsonl")
    assert all(r["metadata"]["reasoning_gym"]["config"] == {"min_terms": 2, "max_terms": 2} for r in rows)
    assert all(r["metadata"]["reasoning_gym"]["entry"]["metadata"]["num_terms"] == 2 for r in rows)


def test_rg_bad_task_or_config_is_one_line(tmp_path, capsys):
    from vime.cli import main as cli_main

    out = str(tmp_path / "x")
    cases = [
        (
            ["--task", "rg:chain_su"],
            r"unknown reasoning-gym task 'chain_su' \(did you mean rg:chain_sum.*`vime data --list`",
        ),
        (["--task", "chain_su"], r"unknown task 'chain_su'.*rg:<name>.*`vime data --list`"),
        (
            ["--task", "rg:chain_sum", "--rg-config", '{"nope": 1}'],
            r"rg:chain_sum: cannot build the task from --rg-config.*nope",
        ),
        (
            ["--task", "rg:arc_agi", "--n-train", "2", "--n-test", "0"],
            r"rg:arc_agi: its scorer grades the entry differently once it went through JSON",
        ),
    ]
    for argv, match in cases:
        assert cli_main(["data", *argv, "--out", out]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and re.search(match, err), err
    assert cli_main(["data", "--list"]) == 0
    names = capsys.readouterr().out.split()
    assert {"addition", "rg:chain_sum", "rg:basic_arithmetic", "rg:gsm_symbolic"} <= set(names)


# ---------------------------------------------------------------- slime's data flags


TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {}}}}]


def test_tool_key_passes_each_rows_tools_to_the_chat_template(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [
        {"input": "1+1=", "label": "2", "tools": TOOLS},
        {"input": "2+2=", "label": "4", "tools": json.dumps(TOOLS[:0])},  # JSON text, as Parquet often holds it
    ]
    f = write_jsonl(tmp_path / "d.jsonl", rows)
    pq.write_table(
        pa.Table.from_pylist([{**r, "tools": json.dumps(TOOLS[: 1 - i])} for i, r in enumerate(rows)]),
        tmp_path / "d.parquet",
    )
    tok = make_tiny_tokenizer()
    tok.chat_template = (
        "{% if tools is defined and tools is not none %}[{{ tools | map(attribute='function.name') | join(',') }}]{% endif %}"
        "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    )
    for data in (f, tmp_path / "d.parquet"):
        ds = DataSource(make_args(data, apply_chat_template=True, tool_key="tools", n_samples_per_prompt=1), tok)
        with_tools, without = ds.get_samples(2)
        assert (with_tools[0].prompt, without[0].prompt) == ("[add]1+1=", "[]2+2=")
        assert with_tools[0].metadata["tools"] == TOOLS  # rewards see them too, as in slime
    assert (
        DataSource(make_args(f, apply_chat_template=True), tok).get_samples(1)[0][0].prompt == "1+1="
    )  # no flag, no tools
    evals = load_eval_samples(make_args(f, apply_chat_template=True, tool_key="tools"), tok, f)
    assert evals[0].prompt == "[add]1+1="


@pytest.mark.parametrize(
    "row, fragment",
    [
        ({"input": "q", "label": "1"}, "has no key 'tools' (keys: input, label); set --tool-key"),
        ({"input": "q", "label": "1", "tools": {"name": "add"}}, "'tools' must be a list of OpenAI-style tool schemas"),
        ({"input": "q", "label": "1", "tools": ["add"]}, "'tools' must be a list of OpenAI-style tool schemas"),
        ({"input": "q", "label": "1", "tools": "not json"}, "got str; fix the row or set --tool-key"),
    ],
)
def test_tool_key_errors_name_file_row_and_flag(tmp_path, row, fragment):
    f = write_jsonl(tmp_path / "d.jsonl", [{"input": "a", "label": "0", "tools": []}, row])
    with pytest.raises(DataError) as e:
        load_prompts(f, tool_key="tools")
    msg = str(e.value)
    assert fragment in msg and "d.jsonl row 1 (line 2)" in msg and "--tool-key" in msg and "\n" not in msg


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


def test_eval_input_and_label_keys(tmp_path, tokenizer):
    f = write_jsonl(tmp_path / "e.jsonl", [{"problem": "p0", "answer": "a0"}, {"problem": "p1", "answer": "a1"}])
    args = make_args(None, eval_input_key="problem", eval_label_key="answer")
    samples = load_eval_samples(args, tokenizer, f)
    assert [(s.prompt, s.label) for s in samples] == [("p0", "a0"), ("p1", "a1")]
    with pytest.raises(DataError, match="no key 'input'.*--input-key"):  # default: the train keys
        load_eval_samples(make_args(None), tokenizer, f)
