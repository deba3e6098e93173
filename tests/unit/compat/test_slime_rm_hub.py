"""slime's rule helpers under slime's names (`slime.rollout.rm_hub`): `grade_answer_verl`, the last
box of a response against the label, on vime's graders; deepscaler's rule."""

from __future__ import annotations

import pytest
from slime.rollout.rm_hub import get_deepscaler_rule_based_reward, grade_answer_verl
from slime.rollout.rm_hub.math_utils import extract_answer


@pytest.mark.parametrize(
    "response, label, right",
    [
        ("so \\boxed{4}", "4", True),
        ("so 4", "4", False),  # no box: no answer (math's reading would take the trailing 4)
        ("\\boxed{\\frac{1}{2}}", "0.5", True),
        ("\\boxed{5} then \\boxed{6}", "6", True),  # the last box
        ("\\boxed{5} then \\boxed{6}", "5", False),
        ("\\boxed{3}", "\\boxed{3}", True),  # a boxed label is read from its box
        ("\\boxed{3}", "", False),
        ("\\boxed{7}", 7, True),  # a number label
        ("\\boxed{(1,2)}", "(1, 2)", True),
        ("\\boxed{x+1}", "1+x", True),
        ("\\boxed{-7}", "7", False),
    ],
)
def test_grade_answer_verl_reads_the_last_box_against_the_label(response, label, right):
    assert grade_answer_verl(response, label) is right


def test_extract_answer_and_deepscalers_rule():
    assert extract_answer("a \\boxed{1} b \\boxed{\\frac{2}{3}}") == "\\frac{2}{3}" and extract_answer("none") is None
    assert get_deepscaler_rule_based_reward("<think>\\boxed{2}</think> \\boxed{3}", "3") == 1
    assert get_deepscaler_rule_based_reward("\\boxed{3}", "3") == 0  # the reasoning never closed
