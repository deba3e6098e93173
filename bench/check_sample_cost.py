"""What the check of every rollout's samples before training costs (`vime.debug_rollout.check_sample`,
run by `Run` on each step since issue 66's second sweep), beside the per-token Python loop it
replaced, in one process on one machine: seconds per sample of `--tokens` ids with three
per-token lists of `--response` values.

    python bench/check_sample_cost.py --samples 128 --tokens 8192 --response 4096
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from vime.debug_rollout import check_sample
from vime.rollout.types import Sample

VOCAB = 151_936  # Qwen3's


def per_token_loop(s: Sample, vocab_size: int) -> str | None:
    """The check as first merged: a Python loop over every id and every per-token value."""
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in s.tokens):
        return "not ints"
    if [t for t in s.tokens if t < 0 or t >= vocab_size]:
        return "out of range"
    for values in (s.loss_mask, s.rollout_log_probs, s.weight_versions):
        if len(values) != s.response_length or not all(isinstance(v, (int, float)) for v in values):
            return "bad list"
    return None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--samples", type=int, default=128)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--response", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=5, help="the median of this many passes is reported")
    a = p.parse_args()
    rng = random.Random(0)
    samples = []
    for i in range(a.samples):
        s = Sample(prompt="p", tokens=[rng.randrange(VOCAB) for _ in range(a.tokens)], response_length=a.response)
        s.index, s.loss_mask = i, [1] * a.response
        s.rollout_log_probs, s.weight_versions = [-0.5] * a.response, [0] * a.response
        samples.append(s)
    rows = []
    for name, check in (("per-token Python loop", per_token_loop), ("check_sample (array + min/max)", check_sample)):
        passes = []
        for _ in range(a.repeats):
            t = time.perf_counter()
            assert all(check(s, VOCAB) is None for s in samples)
            passes.append(time.perf_counter() - t)
        rows.append((name, statistics.median(passes) / a.samples * 1e3))
    print(f"{a.samples} samples of {a.tokens} ids, 3 lists of {a.response} values (median of {a.repeats} passes)")
    print("| check | ms per sample | vs loop |\n|---|---:|---:|")
    for name, ms in rows:
        print(f"| {name} | {ms:.2f} | {rows[0][1] / ms:.2f}× |")


if __name__ == "__main__":
    main()
