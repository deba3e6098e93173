"""vime report's text parts: the reward sparkline and the tables, on a hand-written run directory."""

from __future__ import annotations

import json
import math
import re

import pytest
import yaml

from vime.report import SPARK_BLOCKS, accuracy_table, main, reward_curve, sparkline, summarize


def _run_dir(tmp_path, rewards, evals=((0, 40, 200), (4, 70, 200))):
    d = tmp_path / "run-a"
    d.mkdir()
    rows = [
        {
            "step": i + 1,
            "rollout/reward_mean": r,
            "perf/step_time": 2.0,
            "perf/train_wait_time": 1.0,
            "perf/wall_clock": 2.0 * (i + 1),
        }
        for i, r in enumerate(rewards)
    ]
    rows += [{"step": s, "eval/accuracy": c / t, "eval/correct": c, "eval/total": t} for s, c, t in evals]
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (d / "config.yaml").write_text(yaml.safe_dump({"mode": "sync"}))
    return d


def test_sparkline_scales_between_bounds():
    assert sparkline([0.0, 0.5, 1.0], 0.0, 1.0) == SPARK_BLOCKS[0] + SPARK_BLOCKS[4] + SPARK_BLOCKS[-1]
    assert sparkline([2.0, 3.0]) == SPARK_BLOCKS[0] + SPARK_BLOCKS[-1]  # default: the values' own range
    assert sparkline([5.0, -1.0], 0.0, 1.0) == SPARK_BLOCKS[-1] + SPARK_BLOCKS[0]  # clamped
    assert sparkline([0.3, 0.3, 0.3]) == SPARK_BLOCKS[3] * 3  # flat
    assert sparkline([0.0, math.nan, 1.0]) == SPARK_BLOCKS[0] + " " + SPARK_BLOCKS[-1]
    assert sparkline([]) == "" and sparkline([math.inf]) == " "


def test_reward_curve_and_accuracy_table(tmp_path):
    run = summarize(_run_dir(tmp_path, [0.0, 0.25, 0.5, 1.0]))
    line = reward_curve(run)
    assert sparkline([0.0, 0.25, 0.5, 1.0], 0.0, 1.0) in line
    assert "first 1 steps 0.000" in line and "last 1 steps 1.000" in line
    table = accuracy_table([run])
    assert "| baseline | before training | 20.0% | 40/200 | |" in table
    assert "| run-a | sync | 35.0% | 70/200 | +15.0 |" in table


def test_reward_curve_scale_widens_for_negative_rewards(tmp_path):
    line = reward_curve(summarize(_run_dir(tmp_path, [-1.0, 1.0])))
    assert "scale -1…1" in line and SPARK_BLOCKS[0] + SPARK_BLOCKS[-1] in line


def test_report_main_prints_reward_line(tmp_path, capsys):
    d = _run_dir(tmp_path, [0.1, 0.2])
    assert main([str(d), "--no-plots"]) == 0
    out = capsys.readouterr().out
    assert "training reward per step" in out and "run-a: steps 1–2" in out


def test_plots_where_nothing_can_be_written_are_one_line_before_any_table(tmp_path, capsys):
    """`--plots /proc/nope` ended in a FileNotFoundError traceback after the tables."""
    from vime.errors import VimeError

    d = _run_dir(tmp_path, [0.1, 0.2])
    with pytest.raises(VimeError) as e:
        main([str(d), "--plots", "/proc/nope"])
    assert str(e.value) == (
        "--plots /proc/nope: cannot write there (No such file or directory): pick a directory you can write to, "
        "or pass --no-plots"
    )
    assert "speed" not in capsys.readouterr().out


def test_paired_change_and_eval_results(tmp_path):
    from vime.report import eval_results, paired_change

    assert paired_change({0: False, 1: False, 2: True, 3: True}, {0: True, 1: False, 2: True, 3: True}) == (25.0, 25.0)
    change, se = paired_change({i: False for i in range(10)}, {i: True for i in range(10)})
    assert change == 100.0 and se == 0.0
    assert math.isnan(paired_change({0: True}, {0: True})[1])
    d = tmp_path / "run" / "eval"
    d.mkdir(parents=True)
    for step, ok in ((0, [True, False]), (20, [True, True])):
        (d / f"{step}.jsonl").write_text(
            "".join(json.dumps({"index": i, "correct": c}) + "\n" for i, c in enumerate(ok))
        )
    assert eval_results(tmp_path / "run") == {0: {0: True, 1: False}, 20: {0: True, 1: True}}


def test_a_torn_last_row_is_skipped_and_a_bad_middle_row_or_config_is_one_line(tmp_path, caplog):
    import pytest

    from vime.errors import VimeError

    d = _run_dir(tmp_path, [0.1, 0.2])
    good = (d / "metrics.jsonl").read_text()
    (d / "metrics.jsonl").write_text(good + '{"step": 3, "rollout/rew')  # killed mid-write
    run = summarize(d)
    assert run.steps == 2 and "the last row (line 5) is cut short and is skipped" in caplog.text
    (d / "metrics.jsonl").write_text('{"step": 1, "perf/st\n' + good)
    with pytest.raises(VimeError, match=r"metrics.jsonl line 1 is not a metrics row .*: repair or remove that line$"):
        summarize(d)
    (d / "metrics.jsonl").write_text(good)
    (d / "config.yaml").write_bytes(b"mode: \xff\xfe sync\n")
    with pytest.raises(VimeError, match=r"config.yaml is not a config vime wrote \(UnicodeDecodeError\)"):
        summarize(d)


def test_a_value_that_is_not_a_number_is_one_line_and_null_is_a_gap(tmp_path, capsys):
    """Text where the report reads a number (a hand-edited or foreign metrics file) ended `vime
    report` in a traceback; null, which vime writes for a non-finite value, is a gap."""
    from vime.cli import main as vime

    d = _run_dir(tmp_path, [0.1, None, 0.3])
    assert main([str(d), "--no-plots"]) == 0
    assert "run-a: steps 1–3  ▂ ▃" in capsys.readouterr().out
    good = (d / "metrics.jsonl").read_text().splitlines()
    for row, said in [
        ({"step": 2, "perf/step_time": "fast"}, "row 2: perf/step_time is 'fast', not a number"),
        ({"step": 2, "rollout/reward_mean": "0.5"}, "row 2: rollout/reward_mean is '0.5', not a number"),
        ({"step": "two", "perf/step_time": 1.0}, "row 2: step is 'two', not a step number"),
        ({"step": 4, "eval/accuracy": [0.5]}, "row 2: eval/accuracy is \\[0.5\\], not a number"),
    ]:
        (d / "metrics.jsonl").write_text("\n".join([good[0], json.dumps(row), *good[1:]]) + "\n")
        assert vime(["report", str(d), "--no-plots"]) == 2
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and re.search(f"metrics.jsonl {said}: repair or remove that row$", err), err


def test_a_resume_drops_a_torn_last_row_before_it_appends(tmp_path):
    from vime.metrics import MetricsLogger, read_metrics

    d = tmp_path / "run"
    d.mkdir()
    rows = "".join(json.dumps({"step": s, "x": float(s)}) + "\n" for s in (1, 2, 3))
    (d / "metrics.jsonl").write_text(rows + '{"step": 4, "x"')  # the trainer died writing step 4
    logger = MetricsLogger(d, total_steps=5, start_step=2, quiet=True)  # resumed from the step-2 checkpoint
    logger.log(3, {"x": 30.0})
    logger.close()
    assert [(r["step"], r["x"]) for r in read_metrics(d)] == [(1, 1.0), (2, 2.0), (3, 30.0)]
    assert [json.loads(line)["step"] for line in (d / "metrics.superseded.jsonl").read_text().splitlines()] == [3]


def test_a_resume_into_a_run_whose_metrics_cannot_be_read_is_one_line_before_anything_starts(tmp_path, monkeypatch):
    """A metrics.jsonl that is a directory was IsADirectoryError's traceback, and one that is not
    UTF-8 or has a bad middle row was refused only once the engines had started and the trainer
    had resumed; `vime report` of the directory was the same traceback."""
    from conftest import ROOT

    from vime.cli import train_main
    from vime.errors import VimeError

    monkeypatch.chdir(ROOT)
    run = tmp_path / "runs" / "r"
    run.mkdir(parents=True)
    for make, said in [
        (lambda p: p.mkdir(), r"metrics.jsonl cannot be read \(Is a directory\): move it aside"),
        (lambda p: p.write_bytes(b'{"step": 1}\n\xff\xfe\n'), r"metrics.jsonl is not UTF-8 text"),
        (lambda p: p.write_text('garbage\n{"step": 1}\n'), r"metrics.jsonl line 1 is not a metrics row"),
    ]:
        metrics = run / "metrics.jsonl"
        if metrics.is_dir():
            metrics.rmdir()
        make(metrics)
        with pytest.raises(VimeError, match=said):
            train_main(
                ["--config", "examples/tiny.yaml", "--num-rollout", "1", "--runs-dir", str(tmp_path / "runs"),
                 "--run-name", "r", "--load", str(tmp_path / "ck")]
            )  # fmt: skip
        assert sorted(p.name for p in run.iterdir()) == ["metrics.jsonl"]  # no engine log, no log.txt
        with pytest.raises(VimeError, match=said):
            summarize(run)
