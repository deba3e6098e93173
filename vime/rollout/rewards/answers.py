"""Reading the answer a response commits to: pure string work, shared by rewards and eval.

One parser everywhere (the last `\\boxed{}`, else an `Answer:` line, else the trailing number),
so a training reward and an eval accuracy read a response the same way. A number followed only
by words (`Answer: 48 marbles.`) is that number, unless a word could change or hedge it (`48 or
49`, `48 thousand`, `3 and a half`).
"""

from __future__ import annotations

import re
from decimal import Decimal

_BOX_RE = re.compile(r"\\(?:boxed|fbox)\s*\{")
_ANSWER_RE = re.compile(r"answer[*_\s]*:", re.IGNORECASE)
# A number: optional sign (not when it is a binary minus, as in `5-3`), digits with optional
# thousands separators, decimals, and an optional `/denominator`.
_NUMBER_RE = re.compile(r"(?:(?<![\w)\]}])-)?(?<![\w.])(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?(?![\d])")


def boxed_contents(text: str) -> list[str]:
    """Contents of every complete `\\boxed{...}` / `\\fbox{...}`, balanced braces, in order."""
    found = []
    for m in _BOX_RE.finditer(text):
        depth, i = 1, m.end()
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        if depth == 0:  # an unclosed box is a truncated response, not an answer
            found.append(text[m.end() : i - 1].strip())
    return [f for f in found if f]


# A sentence ends at . ! or ? followed by a capital: `8. I double checked` ends after 8, while
# `3.5` does not end, and neither do `48. or 49` and `48. Or 49`, which must stay ambiguous.
_SENTENCE_END_RE = re.compile(
    r"[.!?][*_]*\s+(?=[A-Z])(?!(?:Or|Maybe|Perhaps|Possibly|Alternatively|Otherwise|Unless|But|Either)\b)"
)


def _strip_markup(s: str) -> str:
    s = s.strip(" \t*_")  # `**Answer:** **8**`: bold around the marker and the answer alike
    return s[:-1].rstrip() if s.endswith(".") else s


def _answer_line(text: str) -> str | None:
    """What follows the last `Answer:` marker, up to the end of its first sentence: a model
    that adds `I double checked...` after its answer has still committed to the answer."""
    lines = text.splitlines()
    for i in range(len(lines) - 1, -1, -1):
        matches = list(_ANSWER_RE.finditer(lines[i]))
        if not matches:
            continue
        rest = lines[i][matches[-1].end() :]
        if not rest.strip().strip("*_"):  # "**Answer:**" on its own line, the answer below it
            rest = next((line for line in lines[i + 1 :] if line.strip()), "")
        rest = _strip_markup(_SENTENCE_END_RE.split(rest.strip(), maxsplit=1)[0])
        if rest:
            return rest
    return None


_TEXT_RE = re.compile(r"\\(?:text|textbf|mathrm|mbox)\s*\{([^{}]*)\}")
# A number as an answer opens with it: an optional `$` or `\$` (currency, or an opening math
# delimiter that may then close after the number), the number, an optional `%` or `\%`.
_LEADING_NUMBER_RE = re.compile(
    r"(?:(\$)|\\\$)?\s*-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?(?:\s*\\?%)?(?(1)\$?)"
)
# Words after the number: letters only, joined by spaces and light punctuation; the first word
# of two letters or more unless punctuation comes first (so `5 x` or `2 i` are not read as
# units, while `8, I checked` is a remark).
_TRAILING_WORDS_RE = re.compile(r"(?:[.,;:]\s+[^\W\d_]+|\s+[^\W\d_]{2,})(?:[\s'’/,.;:-]+[^\W\d_]+)*[.,!]?")
_LATEX_SPACE_RE = re.compile(r"\\[ ,;:!]|~")
# Words that change the number before them (`48 thousand`, `3 and a half`, `4 squared`),
# offer another (`48 or 49`, `48 to fifty`) or hedge it (`48 or more`, `48 at least`).
_VALUE_WORDS = frozenset(
    [
        "or",
        "nor",
        "and",
        "to",
        "than",
        "not",
        "no",
        "more",
        "less",
        "fewer",
        "least",
        "most",
        "over",
        "under",
        "above",
        "below",
        "about",
        "around",
        "approximately",
        "roughly",
        "nearly",
        "almost",
        "between",
        "plus",
        "minus",
        "negative",
        "positive",
        "divided",
        "squared",
        "cubed",
        "power",
        "root",
        "sqrt",
        "pi",
        "point",
        "hundred",
        "hundreds",
        "thousand",
        "thousands",
        "million",
        "millions",
        "billion",
        "billions",
        "trillion",
        "trillions",
        "dozen",
        "dozens",
        "half",
        "halves",
        "third",
        "thirds",
        "quarter",
        "quarters",
        "fourth",
        "fourths",
        "fifth",
        "fifths",
        "sixth",
        "sixths",
        "seventh",
        "sevenths",
        "eighth",
        "eighths",
        "ninth",
        "ninths",
        "tenth",
        "tenths",
        "hundredth",
        "hundredths",
        "thousandth",
        "thousandths",
        "zero",
        "one",
        "two",
        "three",
        "four",
        "five",
        "six",
        "seven",
        "eight",
        "nine",
        "ten",
        "eleven",
        "twelve",
        "thirteen",
        "fourteen",
        "fifteen",
        "sixteen",
        "seventeen",
        "eighteen",
        "nineteen",
        "twenty",
        "thirty",
        "forty",
        "fifty",
        "sixty",
        "seventy",
        "eighty",
        "ninety",
        "maybe",
        "perhaps",
        "possibly",
    ]
)


def _number_and_words(s: str) -> tuple[str, set[str]] | None:
    """(the number, the lower-cased words) when `s` is one number followed only by words;
    `\\text{}` wrappers and LaTeX spaces count as plain text. None otherwise."""
    plain = _LATEX_SPACE_RE.sub(" ", _TEXT_RE.sub(r" \1", s)).strip()
    m = _LEADING_NUMBER_RE.match(plain)
    if not m or not _TRAILING_WORDS_RE.fullmatch(plain, m.end()):
        return None
    return m.group(0).strip(), set(re.findall(r"[^\W\d_]+", plain[m.end() :].lower()))


def _drop_trailing_words(s: str) -> str:
    """`48 marbles` -> `48`, `\\$100 dollars` -> `\\$100`, `5\\text{ cm}` -> `5`; anything else unchanged.

    A number followed only by words is a number with its unit or a short remark, but graders
    read the words as variables (`100 dollars` is not 100 to math-verify). The words are dropped
    only when none can change the value (see _VALUE_WORDS). Units are not checked: a right
    number in a unit the label does not use is still credited.
    """
    split = _number_and_words(s)
    return split[0] if split and not split[1] & _VALUE_WORDS else s


def hedged(s: str) -> bool:
    """A number qualified by a word that changes or hedges it (`48 or more`, `48 thousand`).
    math-verify reads such text leniently (`48 or more` parses as 48), so grade() does not ask it."""
    split = _number_and_words(s)
    return bool(split and split[1] & _VALUE_WORDS)


def extract_answer(text: str | None) -> str | None:
    """The answer a response commits to: last `\\boxed{}`, else last `Answer:` line, else last
    number; a number with words after it is the number (see _drop_trailing_words)."""
    if not text:
        return None
    boxes = boxed_contents(text)
    if boxes:
        return _drop_trailing_words(boxes[-1])
    line = _answer_line(text)
    if line is not None:
        return _drop_trailing_words(line)
    numbers = _NUMBER_RE.findall(text)
    return numbers[-1].replace(",", "") if numbers else None


def extract_line_answer(text: str | None) -> str | None:
    """The answer of a response whose answer is not one number (a list, a word): the last
    `\\boxed{}`, else the last `Answer:` line, else the last non-empty line (the trailing
    number of a list would be its last item, not the answer)."""
    if not text:
        return None
    boxes = boxed_contents(text)
    if boxes:
        return boxes[-1]
    line = _answer_line(text)
    if line is not None:
        return line
    lines = [x for x in text.splitlines() if x.strip()]
    return _strip_markup(lines[-1]) if lines else None


_THOUSANDS_RE = re.compile(r"(?<![\d.])\d{1,3}(?:,\d{3})+(?![\d])")
_SCIENTIFIC_RE = re.compile(r"[+-]?\d+(?:\.\d+)?[eE][+-]?\d+")


def normalize(s: str) -> str:
    """Canonical string form of an answer for the exact-match fallback.

    Labels go through it too, so a label written `\\$18.90`, `100 dollars` or `4.2e1` matches
    the plain number. `\\$` goes before `$`: the other order left `\\18.90`.
    """
    s = s.strip()
    boxes = boxed_contents(s)
    if boxes:
        s = boxes[-1]
    s = _drop_trailing_words(s)
    s = _TEXT_RE.sub(r"\1", s)
    s = s.replace("\\left", "").replace("\\right", "").replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = s.replace("\\!", "").replace("\\,", "").replace("\\;", "").replace("\\$", "").replace("$", "")
    s = _THOUSANDS_RE.sub(lambda m: m.group(0).replace(",", ""), s)
    s = re.sub(r"\s+", "", s).rstrip(".")
    if _SCIENTIFIC_RE.fullmatch(s):  # a float label written by a program: 4.2e1 -> 42
        s = format(Decimal(s).normalize(), "f")
    s = re.sub(r"(\d)\.0+(?!\d)", r"\1", s)  # 5.0 -> 5, 5.50 stays
    return s


THINK_END, RESPONSE_MARK = "</think>", "###Response"


def final_section(response: str) -> str | None:
    """The part of a response that holds its final answer when the model reasons first
    (slime's deepscaler rule): the text after the last `</think>`, else the text after the
    first `###Response` (up to a second one); None when neither marker is there, i.e. the
    reasoning never ended, so a box inside it is not an answer."""
    if THINK_END in response:
        return response.rpartition(THINK_END)[2]
    if RESPONSE_MARK in response:
        return response.split(RESPONSE_MARK, 2)[1]
    return None
