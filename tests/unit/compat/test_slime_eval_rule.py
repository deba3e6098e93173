"""Eval is graded by slime's rule: a set's own rm type (--eval-rm-type, an --eval-config set's
rm_type), else the run's --rm-type; math's reading only where the rm type is no rule of answers.
Start-up names the rule of each set."""

from __future__ import annotations

import json

import pytest
from conftest import run_cli

from vime.compat import parse_args
from vime.eval import grade_sample
from vime.eval_sets import grading_line
from vime.rollout.types import Sample

BOXED_NO_THINKING = "2+2 is \\boxed{4}"


def cfg(*flags: str):
    return parse_args(["--hf-checkpoint", "tiny", "--prompt-data", "x.jsonl", "--num-rollout", "1", *flags])


def graded(config, response: str, label: str = "4") -> bool:
    return grade_sample(Sample(response=response, label=label), config.eval.rule(config.rollout.rm_type), False)[1]


@pytest.mark.parametrize(
    "flags, rule",
    [
        (["--rm-type", "deepscaler"], "deepscaler"),
        (["--rm-type", "boxed_math"], "boxed_math"),
        (["--rm-type", "dapo"], "dapo"),
        (["--rm-type", "exact"], "exact"),
        ([], "math"),
        (["--rm-type", "deepscaler", "--eval-rm-type", "math"], "math"),
        (["--rm-type", "remote_rm", "--rm-url", "http://127.0.0.1:1"], "math"),  # a reward model reads no answer
    ],
)
def test_eval_takes_the_runs_rm_type_unless_an_eval_rm_type_is_given(flags, rule):
    config = cfg(*flags)
    assert config.eval.rule(config.rollout.rm_type) == rule


def test_a_deepscaler_run_grades_eval_as_its_rewards_do():
    # the run: math's reading took these two answers for right, slime's deepscaler rule does not
    deepscaler, math = cfg("--rm-type", "deepscaler"), cfg("--rm-type", "deepscaler", "--eval-rm-type", "math")
    for response in (BOXED_NO_THINKING, "The answer is 4"):
        assert graded(math, response) and not graded(deepscaler, response)
    assert graded(deepscaler, "<think>2 and 2</think> so \\boxed{4}")
    assert not graded(deepscaler, "<think>2 and 2</think> so \\boxed{5}")


def test_the_start_up_line_names_each_sets_rule_and_where_it_comes_from(tmp_path):
    data = tmp_path / "e.jsonl"
    data.write_text('{"input": "2+2=", "label": "4"}\n')
    one = cfg("--rm-type", "deepscaler", "--eval-prompt-data", str(data))
    assert grading_line(one) == "eval graded by deepscaler's rule (the run's --rm-type)"
    assert grading_line(cfg("--eval-prompt-data", str(data), "--eval-rm-type", "gpqa")) == (
        "eval graded by gpqa's rule (--eval-rm-type)"
    )
    remote = cfg("--rm-type", "remote_rm", "--rm-url", "http://127.0.0.1:1", "--eval-prompt-data", str(data))
    assert grading_line(remote) == (
        "eval graded by math's rule (--rm-type remote_rm is no rule of answers; --eval-rm-type picks one)"
    )
    custom = cfg("--custom-rm-path", "m.f", "--eval-prompt-data", str(data))
    assert grading_line(custom) == (
        "eval graded by math's rule (--custom-rm-path scores training only; --eval-rm-type picks eval's rule)"
    )
    sets = tmp_path / "sets.yaml"
    sets.write_text(
        f"eval:\n  datasets:\n    - name: aime\n      path: {data}\n      rm_type: boxed_math\n"
        f"    - name: gsm\n      path: {data}\n"
    )
    several = cfg("--rm-type", "deepscaler", "--eval-config", str(sets))
    assert grading_line(several) == (
        "eval graded by: aime boxed_math (its rm_type), gsm deepscaler (the run's --rm-type)"
    )
    assert grading_line(cfg()) is None


def test_vime_eval_of_a_deepscaler_run_reports_what_slime_would(tmp_path):
    data = tmp_path / "e.jsonl"
    data.write_text('{"input": "2+2=", "label": "4"}\n{"input": "1+3=", "label": "4"}\n')
    results = {}
    for rm_type in ("deepscaler", "math"):
        out = run_cli(
            "-m", "vime", "eval", "--hf-checkpoint", "tiny", "--eval-prompt-data", str(data), "--rm-type", rm_type,
            "--custom-generate-function-path", "slime_eval_plugins.boxed_answer", "--eval-max-response-len", "4",
            "--runs-dir", str(tmp_path), "--run-name", rm_type, timeout=120,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr[-2000:]
        assert f"eval graded by {rm_type}'s rule (the run's --rm-type)" in out.stderr
        results[rm_type] = json.loads(out.stdout.strip().splitlines()[-1])
    assert (results["deepscaler"]["eval/correct"], results["math"]["eval/correct"]) == (0, 2)
