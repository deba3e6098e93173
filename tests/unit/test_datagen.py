"""`vime data` (vime/datagen.py): the built-in tasks' datasets deterministic, disjoint and right,
its command line, and reasoning-gym's tasks (`--task rg:<name>`, `--rg-config`) with their
one-line refusals."""

from __future__ import annotations

import re

import pytest

from vime.datagen import TASKS, write_dataset
from vime.datagen import main as datagen_main
from vime.rollout.data.rows import DataError, load_prompts

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
    with pytest.raises(SystemExit):  # a ValueError's traceback: Python reads no int of over 4300 digits
        datagen_main(["--task", "addition", "--out", str(tmp_path / "big"), "--digits", "100000"])
    assert "--digits 100000: give 1 to 1000 digits per operand" in capsys.readouterr().err


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
