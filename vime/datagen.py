"""`vime data`: verifiable tasks, generated offline, with a held-out split.

`--task rg:<name>` takes any task of reasoning-gym, a maintained library of procedural
reasoning tasks, each with its own scorer (`--rm-type reasoning_gym` grades with it). The
built-in tasks stay for what needs something smaller or fixed: `addition` is small enough for
a random tiny model to learn in a test, and the demo and benchmarks were calibrated and measured
on basic_arithmetic, chain_sum and gsm_symbolic (look-alikes of reasoning-gym's, with integer
answers computed alongside the question). Generation is deterministic in the seed, and train
and test never share a question.
"""

from __future__ import annotations

import argparse
import json
import math
import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from vime.rollout.data import reasoning_gym as rg
from vime.rollout.data.rows import DataError

INSTRUCTION = "Give the final answer after 'Answer:'."

Question = tuple[str, int | str]  # (question text, answer: an integer, or the exact text of a list)


def basic_arithmetic(rng: random.Random, max_int: int = 100) -> Question:
    """One operation on small integers: a + b, a - b (may go negative) or a × b (factors ≤ 20)."""
    op = rng.choice("+-×")
    if op == "×":
        a, b = rng.randint(2, min(20, max_int)), rng.randint(2, min(20, max_int))
        return f"What is {a} × {b}? {INSTRUCTION}", a * b
    a, b = rng.randint(0, max_int), rng.randint(0, max_int)
    return f"What is {a} {op} {b}? {INSTRUCTION}", a + b if op == "+" else a - b


def chain_sum(
    rng: random.Random, min_terms: int = 2, max_terms: int = 5, max_int: int = 100, ops: str = "+-"
) -> Question:
    """A sum of 2–5 integers joined by the operators in `ops` (+ and -; "+" for sums alone)."""
    terms = [rng.randint(1, max_int) for _ in range(rng.randint(min_terms, max_terms))]
    signs = [rng.choice(ops) for _ in terms[1:]]
    expr, total = str(terms[0]), terms[0]
    for op, t in zip(signs, terms[1:]):
        expr += f" {op} {t}"
        total += t if op == "+" else -t
    return f"Calculate {expr}. {INSTRUCTION}", total


NAMES = ["Ali", "Maria", "Chen", "Fatima", "Liam", "Sofia", "Kenji", "Amara", "Noah", "Priya", "Mateo", "Olga"]
ITEMS = ["apples", "pencils", "stickers", "marbles", "cookies", "books", "shells", "cards"]


def _gsm_buy_more(rng: random.Random) -> Question:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    a, b = rng.randint(2, 50), rng.randint(2, 50)
    return f"{name} has {a} {item} and buys {b} more. How many {item} does {name} have now?", a + b


def _gsm_give_away(rng: random.Random) -> Question:
    name, friend, item = *rng.sample(NAMES, 2), rng.choice(ITEMS)
    a = rng.randint(10, 80)
    b, c = rng.randint(1, a // 2), rng.randint(1, a // 2)
    return f"{name} had {a} {item}. {name} gave {b} to {friend} and then lost {c}. How many {item} are left?", a - b - c


def _gsm_packs(rng: random.Random) -> Question:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    packs, per, given = rng.randint(2, 9), rng.randint(3, 12), rng.randint(1, 10)
    return (
        f"{name} buys {packs} packs of {item} with {per} {item} in each pack, then gives away {given}. How many {item} does {name} keep?",
        packs * per - given,
    )


def _gsm_change(rng: random.Random) -> Question:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    n, price = rng.randint(2, 9), rng.randint(1, 12)
    bill = next(b for b in (10, 20, 50, 100, 200) if b >= n * price)
    return (
        f"{name} buys {n} {item} at ${price} each and pays with a ${bill} bill. How many dollars of change does {name} get?",
        bill - n * price,
    )


def _gsm_share(rng: random.Random) -> Question:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    friends, each = rng.randint(2, 8), rng.randint(2, 15)
    return (
        f"{name} shares {friends * each} {item} equally among {friends} friends. How many {item} does each friend get?",
        each,
    )


def _gsm_distance(rng: random.Random) -> Question:
    name = rng.choice(NAMES)
    speed, hours, back = rng.randint(3, 60), rng.randint(2, 6), rng.randint(1, 20)
    return (
        f"{name} travels at {speed} km per hour for {hours} hours, then walks back {back} km. How many km is {name} from the start?",
        speed * hours - back,
    )


def _gsm_savings(rng: random.Random) -> Question:
    name = rng.choice(NAMES)
    start, weekly, weeks, spent = rng.randint(0, 100), rng.randint(5, 30), rng.randint(2, 10), rng.randint(1, 40)
    return (
        f"{name} has ${start} saved and adds ${weekly} every week for {weeks} weeks, then spends ${spent} on a gift. How many dollars does {name} have now?",
        start + weekly * weeks - spent,
    )


GSM_TEMPLATES = [_gsm_buy_more, _gsm_give_away, _gsm_packs, _gsm_change, _gsm_share, _gsm_distance, _gsm_savings]


def gsm_symbolic(rng: random.Random) -> Question:
    """A templated grade-school word problem with an integer answer."""
    question, answer = rng.choice(GSM_TEMPLATES)(rng)
    return f"{question} {INSTRUCTION}", answer


def addition(rng: random.Random, digits: int = 2) -> Question:
    """Toy `a+b=` with up to `digits` digits per operand and no instruction: for tiny models."""
    hi = 10**digits - 1
    a, b = rng.randint(0, hi), rng.randint(0, hi)
    return f"{a}+{b}=", a + b


def list_range(rng: random.Random, min_len: int = 2, max_len: int = 64, max_start: int = 100) -> Question:
    """`List the integers from a to b`: the answer is the whole list, so its length is set by the
    question and no policy can shorten it. Lengths are log-uniform in [min_len, max_len]: most
    lists are short, a few are long, as in a task with a long tail of long answers. The label
    is the list joined by ", "; grade it with `--rm-type exact` (math-verify reads a list as a
    set, so a wrong order would pass)."""
    length = round(math.exp(rng.uniform(math.log(min_len), math.log(max_len))))
    a = rng.randint(1, max_start)
    items = ", ".join(str(i) for i in range(a, a + length))
    return (
        f"List the integers from {a} to {a + length - 1} in increasing order, separated by commas. {INSTRUCTION}",
        items,
    )


TASKS: dict[str, Callable[..., Question]] = {
    "basic_arithmetic": basic_arithmetic,
    "chain_sum": chain_sum,
    "gsm_symbolic": gsm_symbolic,
    "addition": addition,
    "list_range": list_range,
}


def _builtin_rows(task: str, seed: int, task_kwargs: dict[str, Any]) -> Iterator[dict[str, Any]]:
    make = TASKS[task]
    rng = random.Random(f"{task}:{seed}")  # a string seed hashes the same in every process
    while True:
        question, answer = make(rng, **task_kwargs)
        yield {"input": question, "label": str(answer), "metadata": {"task": task}}


def generate(task: str, n: int, seed: int, **task_kwargs: Any) -> list[dict[str, Any]]:
    """n rows with distinct questions, deterministic in (task, seed, task_kwargs). For an
    `rg:<name>` task, task_kwargs are fields of the task's reasoning-gym config."""
    if task.startswith(rg.PREFIX):
        # twice the entries asked for: room to skip repeated questions in tasks with a fixed list
        candidates = rg.rows(task.removeprefix(rg.PREFIX), seed, 2 * n, task_kwargs, INSTRUCTION)
    elif task in TASKS:
        candidates = _builtin_rows(task, seed, task_kwargs)
    else:
        raise DataError(
            f"unknown task '{task}': use one of {', '.join(TASKS)}, or rg:<name> for a reasoning-gym task (`vime data --list` prints every name)"
        )
    seen: set[str] = set()
    rows: list[dict[str, Any]] = []
    misses = 0
    while len(rows) < n:
        row = next(candidates, None)
        if row is not None and row["input"] not in seen:
            seen.add(row["input"])
            rows.append(row)
            continue
        misses += 1
        if row is None or misses > 100 * n + 1000:  # the task has fewer distinct questions than asked for
            raise DataError(
                f"task '{task}' gave only {len(rows)} distinct questions of the {n} asked; ask for fewer or widen it (e.g. --digits, --rg-config)"
            )
    return rows


def write_dataset(
    task: str, out_dir: str | Path, n_train: int, n_test: int, seed: int = 0, **task_kwargs: Any
) -> tuple[Path, Path]:
    """Write `train.jsonl` and `test.jsonl` into out_dir; no question is in both."""
    if n_train < 1 or n_test < 0:
        raise DataError(f"--n-train must be at least 1 and --n-test at least 0 (got {n_train}, {n_test})")
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise DataError(f"--out {out} is a file: give a directory (train.jsonl and test.jsonl are written into it)")
    rows = generate(task, n_train + n_test, seed, **task_kwargs)
    out.mkdir(parents=True, exist_ok=True)
    paths = out / "train.jsonl", out / "test.jsonl"
    for path, part in zip(paths, (rows[:n_train], rows[n_train:])):
        path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in part), encoding="utf-8")
    return paths


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e.msg}): {text}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"give a JSON object, e.g. '{{\"max_terms\": 3}}', not {text}")
    return value


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="vime data", description="Write a verifiable task's dataset (train.jsonl + held-out test.jsonl)."
    )
    p.add_argument(
        "--task", help=f"a built-in task ({', '.join(TASKS)}) or rg:<name>, a reasoning-gym task (--list prints them)"
    )
    p.add_argument("--out", help="output directory (created if missing)")
    p.add_argument("--list", action="store_true", help="print every task name and exit")
    p.add_argument("--n-train", type=int, default=2000, help="training rows (default 2000)")
    p.add_argument("--n-test", type=int, default=200, help="held-out rows, disjoint from train (default 200)")
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="random seed; same seed, same files (default 0). rg:<name> seeds entry i with seed + i, so nearby seeds share most questions",
    )
    p.add_argument("--digits", type=int, default=None, help="addition only: digits per operand (default 2)")
    p.add_argument(
        "--rg-config",
        type=_json_object,
        default=None,
        help='rg:<name> only: JSON object of the task\'s reasoning-gym config fields, e.g. \'{"min_terms": 2, "max_terms": 3}\'',
    )
    a = p.parse_args(argv)
    if a.list:
        print("\n".join([*TASKS, *(rg.PREFIX + name for name in rg.task_names())]))
        return 0
    if not a.task or not a.out:
        p.error("--task and --out are required (--list prints the task names)")
    kwargs: dict[str, Any] = {}
    if a.digits is not None:
        if a.task != "addition":
            p.error("--digits applies to --task addition only")
        if not 1 <= a.digits <= 1000:  # 100000 was a traceback: Python reads no int of over 4300 digits
            p.error(f"--digits {a.digits}: give 1 to 1000 digits per operand")
        kwargs["digits"] = a.digits
    if a.rg_config is not None:
        if not a.task.startswith(rg.PREFIX):
            p.error("--rg-config applies to --task rg:<name> only")
        kwargs.update(a.rg_config)
    train, test = write_dataset(a.task, a.out, a.n_train, a.n_test, a.seed, **kwargs)
    print(f"{train}  {a.n_train} rows")
    print(f"{test}  {a.n_test} rows")
    return 0
