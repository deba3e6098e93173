"""Rewards: answer extraction, math grading, built-in rm types and `--custom-rm-path`.

Three rules shape this module:
* one answer parser everywhere (the last `\\boxed{}`, else an `Answer:` line, else the
  trailing number), so training rewards and eval accuracy read a response the same way; a
  number followed only by words (`Answer: 48 marbles.`) is that number, unless a word could
  change or hedge it (`48 or 49`, `48 thousand`, `3 and a half`);
* grading is CPU work (sympy) that must not stall generation: built-in rewards run in a small
  process pool, each with its own timeout;
* a reward never stops a run: one that raises or returns a non-finite number scores 0 and is
  counted in `rollout/reward_errors`, one that takes longer than `--reward-timeout` scores 0
  and is counted in `rollout/reward_timeouts`, and each kind of failure is logged once. The
  one exception is a result that does not fit the settings (a dict without the `--reward-key`
  key, a number where `--reward-key` asks for a dict): every later sample would fail the same
  way, so it stops the run with one line (`RewardKeyError`);
* a reward never holds a run up: a synchronous custom reward runs in a daemon thread of its
  own, abandoned at its timeout (a hung one cannot take the workers of later samples, nor keep
  the process alive at exit); pool workers ignore Ctrl-C (the trainer handles it) and exit
  when the trainer is gone.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import logging
import math
import multiprocessing
import numbers
import os
import re
import signal
import threading
import weakref
from collections.abc import Awaitable, Callable
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from decimal import Decimal
from fractions import Fraction
from functools import lru_cache
from typing import Any, NamedTuple

from vime.errors import VimeError
from vime.lifetime import exit_with_parent
from vime.plugins import load_function
from vime.rollout.types import Sample, Status

log = logging.getLogger("vime")

# A reward function's result: a number, or a dict read at --reward-key (see read_reward).
RewardFn = Callable[[Sample], Awaitable[Any]]

FLOAT32_MAX = 3.4028234663852886e38  # the largest finite float32 (torch.finfo(torch.float32).max)


class RmRule(NamedTuple):
    """How a built-in rm type grades: one row of BUILTIN_RM_TYPES."""

    right: float  # score of a right answer
    wrong: float  # score of a wrong or missing one
    boxed_only: bool = False  # only a `\boxed{}` answer counts
    after_thinking: bool = False  # only the text after the reasoning is graded (final_section)
    partial_credit: bool = False  # a wrong number earns up to 0.5 by its closeness (numeric_credit)


BUILTIN_RM_TYPES: dict[str, RmRule] = {
    "math": RmRule(1.0, 0.0),
    "dapo": RmRule(1.0, -1.0),  # DAPO's verifier: wrong and unanswered both score -1
    "boxed_math": RmRule(1.0, 0.0, boxed_only=True),
    "math_shaped": RmRule(1.0, 0.0, partial_credit=True),
    # DeepScaleR's rule (slime's `deepscaler`): the last box after the reasoning, 1 or 0
    "deepscaler": RmRule(1.0, 0.0, boxed_only=True, after_thinking=True),
}
DEFAULT_REWARD_KEY = "score"  # where a dict reward is read without --reward-key (builtin_result's keys: score, acc)
# rm types defined in a module of their own: name -> "module:factory", factory(args) -> RewardFn
MODULE_RM_TYPES: dict[str, str] = {"reasoning_gym": "vime.rollout.rg:make_reward"}
POOL_WORKERS = 2


class RewardError(VimeError, ValueError):
    """A reward setting that cannot work (`--rm-type`, `--custom-rm-path`); raised at start-up."""


class RewardKeyError(RewardError):
    """A reward result that does not fit `--reward-key`: raised by the first sample that shows
    it, and not absorbed like other reward failures (every sample would score 0)."""


# ---------------------------------------------------------------- answer extraction

_BOX_RE = re.compile(r"\\(?:boxed|fbox)\s*\{")
_ANSWER_RE = re.compile(r"answer[*_\s]*:", re.IGNORECASE)
# A number: optional sign (not when it is a binary minus, as in `5-3`), digits with optional
# thousands separators, decimals, and an optional `/denominator`.
_NUMBER_RE = re.compile(r"(?:(?<![\w)\]}])-)?(?<![\w.])(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?(?![\d])")


def _boxed_contents(text: str) -> list[str]:
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


def _hedged(s: str) -> bool:
    """A number qualified by a word that changes or hedges it (`48 or more`, `48 thousand`).
    math-verify reads such text leniently (`48 or more` parses as 48), so grade() does not ask it."""
    split = _number_and_words(s)
    return bool(split and split[1] & _VALUE_WORDS)


def extract_answer(text: str | None) -> str | None:
    """The answer a response commits to: last `\\boxed{}`, else last `Answer:` line, else last
    number; a number with words after it is the number (see _drop_trailing_words)."""
    if not text:
        return None
    boxes = _boxed_contents(text)
    if boxes:
        return _drop_trailing_words(boxes[-1])
    line = _answer_line(text)
    if line is not None:
        return _drop_trailing_words(line)
    numbers = _NUMBER_RE.findall(text)
    return numbers[-1].replace(",", "") if numbers else None


# ---------------------------------------------------------------- grading

_THOUSANDS_RE = re.compile(r"(?<![\d.])\d{1,3}(?:,\d{3})+(?![\d])")
_SCIENTIFIC_RE = re.compile(r"[+-]?\d+(?:\.\d+)?[eE][+-]?\d+")


def normalize(s: str) -> str:
    """Canonical string form of an answer for the exact-match fallback.

    Labels go through it too, so a label written `\\$18.90`, `100 dollars` or `4.2e1` matches
    the plain number. `\\$` goes before `$`: the other order left `\\18.90`.
    """
    s = s.strip()
    boxes = _boxed_contents(s)
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


class _MathVerifyQuiet(logging.Filter):
    """Drop math-verify's warning that its signal timeouts are off: we turn them off on purpose."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Timeout is disabled")


@lru_cache(maxsize=1)
def _math_verify() -> tuple[Callable, Callable]:
    from math_verify import parse, verify

    for name in ("math_verify.parser", "math_verify.grader"):
        logging.getLogger(name).addFilter(_MathVerifyQuiet())
    return parse, verify


def _as_latex(s: str) -> str:
    """math-verify reads delimited LaTeX most reliably; bare text like `1+x` would parse as 1."""
    return s if ("$" in s or "\\boxed" in s or "\\(" in s or "\\[" in s) else f"${s}$"


def grade(pred: str | None, label: str | None) -> bool:
    """Is `pred` the same answer as `label`? Normalized string match, then math-verify.

    The cheap string match runs first only because it is cheap: the result is their OR either
    way. math-verify's own timeouts use signals, which fail outside the main thread, so they
    are off here; callers bound the time instead (the pool's per-sample timeout).
    """
    if pred is None or label is None or not str(pred).strip() or not str(label).strip():
        return False
    pred, label = str(pred), str(label)
    if normalize(pred) == normalize(label):
        return True
    if _hedged(pred):
        return False
    parse, verify = _math_verify()
    # math-verify reads `\\$` as a stray command, so `\\$18.90` would not be 18.9
    gold = parse(_as_latex(label.replace("\\$", "")), parsing_timeout=None)
    target = parse(_as_latex(pred.replace("\\$", "")), parsing_timeout=None)
    return bool(gold and target and verify(gold, target, timeout_seconds=None))


def numeric_credit(pred: str | None, label: str | None) -> float:
    """Partial credit of a wrong numeric answer: 0.5 × (1 − relative error), floored at 0, so
    any right answer (1) beats every wrong one and an answer off by the label's size or more
    earns nothing; 0 when either side is not a plain number or fraction.

    Why it exists: with exact-match rewards a model that never answers right gets the same
    score on every sample, so GRPO's advantages are all 0 and nothing trains. The closeness of
    a numeric answer differs between samples long before any is right, which gives small or
    random models (the tiny example, tests) a signal; on a real run it is a shaping term."""
    try:
        p, y = Fraction(normalize(str(pred))), Fraction(normalize(str(label)))  # `$1,234` is a number too
    except (TypeError, ValueError, ZeroDivisionError):
        return 0.0
    return 0.5 * max(0.0, 1.0 - float(abs(p - y) / max(abs(y), 1)))


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


def builtin_result(rm_type: str, response: str, label: str | None) -> dict[str, float]:
    """`{"score": ..., "acc": 1.0 or 0.0}` of one response under a built-in rm type (see
    BUILTIN_RM_TYPES): `score` trains (the default --reward-key), `acc` says whether the
    answer was right (it differs from the score for dapo and math_shaped)."""
    rule = BUILTIN_RM_TYPES[rm_type]
    text = final_section(response or "") if rule.after_thinking else response or ""
    if text is None:
        pred = None
    elif rule.boxed_only:
        boxes = _boxed_contents(text)
        pred = boxes[-1] if boxes else None
    else:
        pred = extract_answer(text)
    if grade(pred, label):
        return {"score": rule.right, "acc": 1.0}
    return {"score": numeric_credit(pred, label) if rule.partial_credit else rule.wrong, "acc": 0.0}


def builtin_score(rm_type: str, response: str, label: str | None) -> float:
    """Score of one response under a built-in rm type (see BUILTIN_RM_TYPES)."""
    return builtin_result(rm_type, response, label)["score"]


# ---------------------------------------------------------------- the process pool


class _GradeTimeout(BaseException):
    """Raised by SIGALRM; a BaseException so math-verify's `except Exception` cannot swallow it."""


class GradingTimeout(Exception):
    """A pool worker gave up on one sample. Not a TimeoutError on purpose: a timeout of the
    parent's own wait means a wedged worker and kills the pool, this one does not."""


def _on_alarm(signum: int, frame: Any) -> None:
    raise _GradeTimeout()


def _score_with_timeout(rm_type: str, response: str, label: str | None, timeout: float) -> dict[str, float]:
    """builtin_result bounded by a SIGALRM timer where that is possible (a main thread).

    In a pool worker this is the real timeout: it interrupts sympy and frees the worker for
    the next sample. In the inline fallback (a helper thread) the caller's wait is the bound.
    """
    if threading.current_thread() is not threading.main_thread() or timeout <= 0:
        return builtin_result(rm_type, response, label)
    previous = signal.signal(signal.SIGALRM, _on_alarm)
    signal.setitimer(signal.ITIMER_REAL, timeout)
    try:
        return builtin_result(rm_type, response, label)
    except _GradeTimeout:
        raise GradingTimeout(f"grading took longer than {timeout:g}s (--reward-timeout)") from None
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _init_worker(parent_pid: int) -> None:
    # Ctrl-C reaches the whole process group; a worker interrupted mid-sample returned the
    # KeyboardInterrupt as its result, which killed the rollout loop and hung the trainer
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    exit_with_parent(parent_pid)  # a SIGKILLed trainer runs no cleanup
    _math_verify()  # pay the sympy import once per worker, not inside the first sample's timeout


_pool: ProcessPoolExecutor | None = None
_pool_unavailable = False
_pool_lock = threading.Lock()
# One slot per worker and event loop: a sample's timer starts when a worker is free for it,
# so a long queue never reads as a timeout.
_slots: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore] = weakref.WeakKeyDictionary()
# Synchronous custom rewards running at once, per event loop. An abandoned (timed-out) call
# gives its slot back, so hung calls never starve later ones.
CUSTOM_THREADS = 16
_custom_slots: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore] = weakref.WeakKeyDictionary()


def _get_pool() -> ProcessPoolExecutor | None:
    """The shared grading pool, created on first use; None once creating it has failed."""
    global _pool
    with _pool_lock:
        if _pool is None and not _pool_unavailable:
            try:
                # spawn, not fork: the parent has threads (event loop, torch) that fork would copy
                # mid-state. Like any spawn pool, a driver script needs an `if __name__ == "__main__"` guard.
                _pool = ProcessPoolExecutor(
                    POOL_WORKERS,
                    mp_context=multiprocessing.get_context("spawn"),
                    initializer=_init_worker,
                    initargs=(os.getpid(),),
                )
            except Exception as e:  # e.g. no /dev/shm semaphores in a sandbox
                _mark_pool_unavailable(e)
        return _pool


def _mark_pool_unavailable(e: BaseException) -> None:
    global _pool_unavailable
    _pool_unavailable = True
    log.warning(
        "reward process pool unavailable (%s: %s); grading inline in this process",
        type(e).__name__,
        " ".join(str(e).split())[:200],
    )


def _discard_pool(pool: ProcessPoolExecutor, kill: bool = False) -> None:
    """Drop a broken or wedged pool; the next sample starts a fresh one.

    A wedged worker is killed, or the interpreter would wait for it at exit. Python 3.14 has
    `kill_workers()`; before that the executor's process table is the only handle.
    """
    global _pool
    with _pool_lock:
        if _pool is pool:
            _pool = None
    if kill:
        killer = getattr(pool, "kill_workers", None)
        if killer is not None:
            killer()
        else:
            for p in list((getattr(pool, "_processes", None) or {}).values()):
                p.kill()
    pool.shutdown(wait=False, cancel_futures=True)


def close_pool() -> None:
    """Kill the grading workers (end of a run): at interpreter exit Python would otherwise wait
    for any sample still being graded."""
    with _pool_lock:
        pool = _pool
    if pool is not None:
        _discard_pool(pool, kill=True)


def _submit(pool: ProcessPoolExecutor, call: tuple) -> Future | None:
    """Hand one sample to the pool; None when the pool cannot run at all (grade inline then)."""
    try:
        return pool.submit(_score_with_timeout, *call)
    except BrokenProcessPool:
        _discard_pool(pool)
        raise
    except Exception as e:  # the workers could not be started
        with _pool_lock:
            if _pool is not pool:  # discarded by another caller meanwhile: this sample just fails
                raise
            _mark_pool_unavailable(e)
        return None


async def _score_builtin(rm_type: str, sample: Sample, timeout: float) -> dict[str, float]:
    call = (rm_type, sample.response, sample.label, timeout)
    slots = _slots.setdefault(asyncio.get_running_loop(), asyncio.Semaphore(POOL_WORKERS))
    async with slots:
        pool = _get_pool()
        fut = _submit(pool, call) if pool is not None else None
        if fut is None:
            return await asyncio.wait_for(_in_daemon_thread(_score_with_timeout, *call), timeout)
        try:
            # the worker's own timer fires at `timeout`; this backstop catches a worker stuck
            # where signals cannot reach it (C code), which is then killed
            return await asyncio.wait_for(asyncio.wrap_future(fut), 2 * timeout + 5)
        except BrokenProcessPool:
            _discard_pool(pool)
            raise
        except TimeoutError:
            _discard_pool(pool, kill=True)
            raise
        except (KeyboardInterrupt, SystemExit) as e:  # a worker's, sent back as its result: never the loop's to raise
            raise RuntimeError(f"grading worker stopped by {type(e).__name__}") from None


async def _in_daemon_thread(fn: Callable, *args: Any) -> Any:
    """fn(*args) in a daemon thread of its own. Unlike asyncio.to_thread (a shared pool of
    non-daemon threads), a call that never returns can be abandoned: it holds no worker that a
    later call needs, and the interpreter does not wait for it at exit."""
    loop = asyncio.get_running_loop()
    fut = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if fut.done():  # abandoned: the caller timed out
            return
        if error is not None:
            fut.set_exception(
                error if isinstance(error, Exception) else RuntimeError(f"reward stopped by {type(error).__name__}")
            )
        else:
            fut.set_result(result)

    def work() -> None:
        try:
            result, error = fn(*args), None
        except (
            BaseException
        ) as e:  # SystemExit from user code too: it must reach the caller, not end the thread silently
            result, error = None, e
        try:
            loop.call_soon_threadsafe(settle, result, error)
        except RuntimeError:  # the loop is closed: nobody waits any more
            pass

    threading.Thread(target=work, name="vime-reward", daemon=True).start()
    return await fut


# ---------------------------------------------------------------- reward functions


def _is_async(fn: Callable) -> bool:
    # an object whose __call__ is `async def` is awaited too
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__)


def _timeout(args) -> float:
    return float(args.reward_timeout)


def get_reward_fn(args) -> RewardFn:
    """The async per-sample reward `fn(sample) -> number or dict` (read by read_reward); raises
    RewardError on a bad setting.

    Call it once at start-up so a typo fails before any model loads. The returned function
    enforces --reward-timeout, each sample timed from when it starts (a long queue for the
    pool or the threads is not a timeout); error counting is score_samples' job.
    """
    rm_type, custom_rm_path = args.rm_type, args.custom_rm_path
    if custom_rm_path:
        fn = load_function(custom_rm_path, "--custom-rm-path", RewardError, "fn(args, sample) -> float or dict")
        if _is_async(fn):

            async def custom_async(sample: Sample) -> Any:
                return await asyncio.wait_for(fn(args, sample), _timeout(args))

            return custom_async

        async def custom_sync(sample: Sample) -> Any:
            # in a thread, so a slow synchronous reward does not stall every in-flight request
            slots = _custom_slots.setdefault(asyncio.get_running_loop(), asyncio.Semaphore(CUSTOM_THREADS))
            async with slots:
                out = await asyncio.wait_for(_in_daemon_thread(fn, args, sample), _timeout(args))
            return await asyncio.wait_for(out, _timeout(args)) if inspect.isawaitable(out) else out

        return custom_sync
    if rm_type in MODULE_RM_TYPES:
        module_name, _, factory = MODULE_RM_TYPES[rm_type].partition(":")
        return getattr(importlib.import_module(module_name), factory)(args)
    if rm_type not in BUILTIN_RM_TYPES:
        raise RewardError(
            f"unknown --rm-type '{rm_type}': use one of {', '.join([*BUILTIN_RM_TYPES, *MODULE_RM_TYPES])}, or --custom-rm-path module:func"
        )

    timeout = _timeout(args)

    async def builtin(sample: Sample) -> dict[str, float]:
        return await _score_builtin(rm_type, sample, timeout)

    return builtin


def _is_number(v: Any) -> bool:
    return isinstance(v, numbers.Real)  # NumPy scalars too; a bool is an int (slime's dapo `acc` is one)


def read_reward(args, value: Any) -> tuple[float, dict[str, float]]:
    """(the score, the result's other numeric values) of what a reward function returned.

    A dict is read at `--reward-key` (default "score"), as slime reads it: `--rm-type dapo
    --reward-key score` trains on DAPO's ±1. Its other finite numeric values come back to be
    logged as `rollout/reward_<key>` means (the built-ins' `acc`, 1 when right).

    A number is the score, with one exception: from `--custom-rm-path` while `--reward-key` is
    given. The key then says the function returns a dict; a number means it is not the
    function the flag was written for (slime fails on it too), and quietly training on it
    would hide that. A built-in rm type's number is its `score` (reasoning_gym has no other).

    Raises RewardKeyError (which stops the run) when the result does not fit the settings, and
    ValueError (which scores the sample 0, counted) for a value that is not a number.
    """
    key, custom = args.reward_key, args.custom_rm_path
    source = f"--custom-rm-path {custom}" if custom else f"--rm-type {args.rm_type}"
    name = key or DEFAULT_REWARD_KEY
    if not isinstance(value, dict):
        if custom and key is not None and _is_number(value):
            raise RewardKeyError(
                f"--reward-key {key} reads a dict, but {source} returned the number {value!r}: "
                f"drop --reward-key, or return a dict with the key '{key}'"
            )
        if custom or not _is_number(value):
            return float(value), {}  # a string or None is an error of this sample (ValueError/TypeError)
        if name != DEFAULT_REWARD_KEY:
            raise RewardKeyError(
                f"--reward-key {key}: {source} returns one number, its score: drop --reward-key or set it to score"
            )
        value = {DEFAULT_REWARD_KEY: value}
    if name not in value:
        keys = ", ".join(map(str, value)) or "none"
        fix = "set --reward-key to" if key else "pass --reward-key with"
        raise RewardKeyError(
            f"{source} returned a dict without the key '{name}' (its keys: {keys}): {fix} the key that holds the reward"
        )
    score = value[name]
    if not _is_number(score):
        raise ValueError(f"the reward at key '{name}' is {score!r}, not a number")
    extras = {
        str(k): float(v)
        for k, v in value.items()
        if k != name and _is_number(v) and math.isfinite(v)  # strings (slime's `pred`) are not logged
    }
    return float(score), extras


_logged_error_types: set[str] = set()


async def _safe_reward(args, fn: RewardFn, sample: Sample) -> tuple[float, dict[str, float], str | None]:
    """(score, other values, failure): a failure of any kind scores 0 and is "timeout" or
    "error"; each exception type is logged once. A non-finite score (inf turned every loss of a
    run into NaN) is an error like a raised one. A RewardKeyError is a setting that cannot
    work, so it is raised."""
    try:
        score, extras = read_reward(args, await fn(sample))
        if not math.isfinite(score):
            raise ValueError(f"reward is {score}, not a finite number")
        if abs(score) > FLOAT32_MAX:  # finite here, inf in the float32 tensors advantages are computed in
            raise ValueError(f"reward is {score:g}, beyond float32's range (±{FLOAT32_MAX:.3g}): scale it down")
        return score, extras, None
    except RewardKeyError:
        raise
    except (
        Exception,
        KeyboardInterrupt,
        SystemExit,
    ) as e:  # anything a reward can throw; cancellation still propagates
        timed_out = isinstance(e, (asyncio.TimeoutError, GradingTimeout))
        name = type(e).__name__
        detail = "no result in time, see --reward-timeout" if timed_out else str(e)
        counter = "rollout/reward_timeouts" if timed_out else "rollout/reward_errors"
        if name not in _logged_error_types:
            _logged_error_types.add(name)
            log.warning(
                "reward of sample %d failed (%s: %s); it scores 0, further %s failures are only counted in %s",
                sample.index,
                name,
                detail,
                name,
                counter,
            )
        return 0.0, {}, "timeout" if timed_out else "error"


async def score_samples(args, samples: list[Sample]) -> dict[str, float]:
    """Set `sample.reward`, `sample.reward_error` and `sample.reward_extras` on every sample,
    concurrently; returns `{"rollout/reward_errors": n, "rollout/reward_timeouts": m}`
    (`rollout_metrics` counts the same from the samples, so every rollout function reports them).

    FAILED samples score 0 without calling the reward: they have no trustworthy response.
    """
    fn = get_reward_fn(args)
    todo = [s for s in samples if s.status != Status.FAILED]
    for s in samples:
        if s.status == Status.FAILED:
            s.reward, s.reward_error, s.reward_extras = 0.0, None, {}
    results = await asyncio.gather(*(_safe_reward(args, fn, s) for s in todo))
    for s, (score, extras, failure) in zip(todo, results):
        s.reward, s.reward_extras, s.reward_error = score, extras, failure
    return {
        "rollout/reward_errors": float(sum(f == "error" for _, _, f in results)),
        "rollout/reward_timeouts": float(sum(f == "timeout" for _, _, f in results)),
    }
