"""`from slime.rollout.rm_hub.f1 import f1_score, normalize_answer`: the word-overlap F1 that
QA rewards (HotpotQA-style multi-hop search, search-r1's kind) give a short answer, where an
exact match would score a right answer with an extra word as 0.

As slime's: both texts are lower-cased, stripped of punctuation and of the articles a/an/the,
and split on white space; F1 is over the multiset of shared words. A yes/no/noanswer answer on
either side must match exactly (a "yes" sharing no word with "no" is wrong, and sharing one with
a longer answer would be partly right, which it is not). `f1_score` returns
`(f1, precision, recall)`, each 0 for a None prediction or no shared word, so a reward takes
`f1_score(response, label)[0]`.
"""

from __future__ import annotations

import re
import string
from collections import Counter

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = str.maketrans("", "", string.punctuation)
_CLOSED_ANSWERS = frozenset({"yes", "no", "noanswer"})
_ZERO = (0, 0, 0)


def normalize_answer(text: str) -> str:
    """The text as F1 compares it: lower case, no punctuation or articles, single spaces."""
    return " ".join(_ARTICLES.sub(" ", text.lower().translate(_PUNCTUATION)).split())


def f1_score(prediction: str | None, ground_truth: str) -> tuple[float, float, float]:
    """`(f1, precision, recall)` of the prediction's words against the ground truth's."""
    if prediction is None:
        return _ZERO
    predicted, truth = normalize_answer(prediction), normalize_answer(ground_truth)
    if predicted != truth and (predicted in _CLOSED_ANSWERS or truth in _CLOSED_ANSWERS):
        return _ZERO
    predicted_words, truth_words = predicted.split(), truth.split()
    shared = sum((Counter(predicted_words) & Counter(truth_words)).values())
    if shared == 0:
        return _ZERO
    precision, recall = shared / len(predicted_words), shared / len(truth_words)
    return 2 * precision * recall / (precision + recall), precision, recall
