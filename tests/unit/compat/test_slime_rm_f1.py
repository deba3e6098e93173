"""`slime.rollout.rm_hub.f1`: slime's word-overlap F1 for QA rewards (`f1_score`,
`normalize_answer`, also at `slime.rollout.rm_hub`), and a run whose --custom-rm-path scores with
it (tests/plugins/slime_qa_f1.py) trains on those scores."""

from __future__ import annotations

import pytest
from slime.rollout.rm_hub import f1_score as at_package
from slime.rollout.rm_hub.f1 import f1_score, normalize_answer
from slime_qa_f1 import answer_of

from unit.compat.tiny_runs import tiny_run


def test_normalize_drops_case_punctuation_and_articles():
    assert normalize_answer("  The Eiffel-Tower, in  PARIS! ") == "eiffeltower in paris"
    assert normalize_answer("an apple a day") == "apple day"


@pytest.mark.parametrize(
    ("prediction", "truth", "expected"),
    [
        ("Paris", "paris.", (1.0, 1.0, 1.0)),
        ("the city of Paris", "Paris", (0.5, 1 / 3, 1.0)),  # one word of three predicted is right
        ("Paris France", "Paris Texas USA", (0.4, 0.5, 1 / 3)),
        ("London", "Paris", (0, 0, 0)),
        (None, "Paris", (0, 0, 0)),
        ("yes", "no", (0, 0, 0)),
        ("no it is not", "no", (0, 0, 0)),  # a closed answer must match exactly
        ("Yes.", "yes", (1.0, 1.0, 1.0)),
    ],
)
def test_f1_precision_and_recall_over_shared_words(prediction, truth, expected):
    assert f1_score(prediction, truth) == pytest.approx(expected)


def test_repeated_words_count_as_often_as_both_sides_have_them():
    assert f1_score("paris paris paris", "paris")[1] == pytest.approx(1 / 3)


def test_the_package_exports_the_same_function():
    assert at_package is f1_score


def test_a_run_rewarded_by_slimes_f1_trains_on_it(tmp_path):
    saved = tiny_run(tmp_path, 1, "--custom-rm-path", "slime_qa_f1.reward_func").samples
    assert saved
    for s in saved:
        assert s["reward"] == pytest.approx(f1_score(answer_of(s["response"]), str(s["label"]))[0])
