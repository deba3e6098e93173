"""Held-out evaluation with the math answer parser: greedy by default (sampling settings in
`generate.sampling_params`, --eval-temperature / --eval-top-p / --eval-top-k).

Accuracy is graded the same way (last `\\boxed{}` → `Answer:` line → trailing number, then
math-verify / normalized match) whatever `--rm-type` trains with, so numbers from different
runs and reward functions stay comparable; a set's own rm type (`--eval-rm-type`, `rm_type`
of --eval-config) grades it by that built-in rule instead. Several sets (vime/eval_sets.py)
are evaluated one after another, each with its own settings.

With --custom-generate-function-path, a reward the generate set is the sample's score, as in
training: the sample counts as correct when its reward reaches 1, the score eval gives a right
answer (`FULL_SCORE`), so a 0/1 reward counts as it says and a shaped one counts only its
successes (vllm-project/vime's tau-bench agent scores a solved task 1 plus up to 0.5 for its tool calls,
a failed one only those bonuses, 0.1 or so for one good look-up). `eval/reward_mean` is the
mean of the rewards, slime's eval metric. Samples it left unscored are graded as above (`grade_sample`).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from vime.config import ConfigError
from vime.eval_sets import METADATA_KEY, args_for, set_accuracies
from vime.metrics import progress
from vime.models import context_length
from vime.rollout import async_loop
from vime.rollout.data.prompts import load_eval_samples
from vime.rollout.data.rows import DataError
from vime.rollout.generate import generate_fn, multi_turn_metrics, sampling_params
from vime.rollout.rewards.grading import BUILTIN_RM_TYPES, grade, rule_answer, rule_label
from vime.rollout.runtime import runtime_of
from vime.rollout.types import MULTI_TURN_STATE, RolloutOutput, Sample, flatten

FULL_SCORE = 1.0  # an answer eval grades right; a generate's reward at least this counts as correct


async def _run(args, samples: list[Sample], step: int) -> list[Sample]:
    """Every sample at once; a bar counts finished ones on a terminal, and a plain line goes out
    at each quarter elsewhere (eval of hundreds of prompts takes minutes on a CPU)."""
    from tqdm import tqdm

    fn, params = generate_fn(args, evaluation=True), sampling_params(args, evaluation=True)
    bar = tqdm(
        total=len(samples),
        desc=f"eval {step}",
        unit="sample",
        leave=False,
        file=sys.stderr,
        disable=True if args.output.quiet else None,
    )
    quarter = max(1, len(samples) // 4)
    done = 0

    async def one(s: Sample) -> Sample | list[Sample]:
        nonlocal done
        out = await fn(args, s, params)
        runtime_of(args).forget_group(s.group_index)  # an eval row needs no engine of its own later
        done += 1
        bar.update(1)
        if bar.disable and done % quarter == 0 and done < len(samples):
            progress.info(f"eval {step}: {done}/{len(samples)} samples")
        return out

    try:
        # a generate that returns several samples: each is graded and counted (slime's eval too)
        return flatten(await asyncio.gather(*(one(s) for s in samples)))
    finally:
        bar.close()


def evaluate(args, step: int, out_path: Callable[[str | None], Path | None] | None = None) -> dict[str, float]:
    """Generate on every held-out set and grade; `out_path(set name)` (None for a lone set) is
    where its per-sample JSON lines go (None: not written). The metrics: one set's as they
    always were (`eval/accuracy`, ...); several sets' each under `eval/<name>/`, with
    `eval/accuracy`, `eval/correct`, `eval/total` and `eval/time` of all of them together.
    `args`: the plug-ins' (a custom generate is called with it); evaluation reads `args.eval`."""
    sets = args.eval.eval_sets
    if not sets:  # resolved by Config.validate; a Config that skipped it has none
        raise ConfigError("no held-out set to evaluate: give --eval-prompt-data or --eval-config")
    if len(sets) == 1:
        return evaluate_set(args, sets[0], step, out_path(None) if out_path else None).metrics
    metrics: dict[str, float] = {}
    for eval_set in sets:
        name = eval_set["name"]
        m = evaluate_set(args, eval_set, step, out_path(name) if out_path else None).metrics
        metrics.update({f"eval/{name}/{key.removeprefix('eval/')}": value for key, value in m.items()})
    correct = sum(metrics[f"eval/{s['name']}/correct"] for s in sets)
    total = sum(metrics[f"eval/{s['name']}/total"] for s in sets)
    return {
        "eval/accuracy": correct / total if total else 0.0,
        "eval/correct": correct,
        "eval/total": total,
        "eval/time": sum(metrics[f"eval/{s['name']}/time"] for s in sets),
        **metrics,
    }


def result_line(metrics: dict[str, float], step: int, name: str | None) -> str:
    """The line an eval leaves in the log: `eval aime step 3: accuracy 0.300 (3/10)`, or with
    several sets `eval step 3: aime 0.300 (3/10) | gsm8k 0.600 (6/10) | all 0.450 (9/20)`."""
    per_set = set_accuracies(metrics)
    if not per_set:
        return f"eval{' ' + name if name else ''} step {step}: accuracy {metrics['eval/accuracy']:.3f} ({metrics['eval/correct']}/{metrics['eval/total']})"
    parts = [
        f"{n} {acc:.3f} ({metrics[f'eval/{n}/correct']}/{metrics[f'eval/{n}/total']})" for n, acc in per_set.items()
    ]
    parts.append(f"all {metrics['eval/accuracy']:.3f} ({metrics['eval/correct']}/{metrics['eval/total']})")
    return f"eval step {step}: " + " | ".join(parts)


def evaluate_set(args, eval_set: dict[str, Any], step: int, out_path: Path | None = None) -> RolloutOutput:
    """Generate on one set's prompts with its settings and grade; writes one JSON line per sample to out_path."""
    args = args_for(args, eval_set)
    ev = args.eval  # the set's: its overrides are in the copy
    base = load_eval_samples(
        args,
        runtime_of(args).tokenizer,
        eval_set["path"],
        limit=ev.eval_limit,
        max_prompt_len=context_length(args.rollout.model_dir) - 1,
    )
    n = ev.n_samples_per_eval_prompt
    extra = eval_set.get(METADATA_KEY, {})
    samples = [
        Sample(
            **{**s.__dict__, "index": s.index * n + k, "tokens": list(s.tokens), "metadata": {**s.metadata, **extra}}
        )
        for s in base
        for k in range(n)
    ]
    t0 = time.perf_counter()
    samples = async_loop.run(_run(args, samples, step))
    rule = ev.rule(
        args.rollout.rm_type
    )  # the set's own rm type, the training one where it is a rule of its own kind, else math's
    generate_scores = bool(args.rollout.custom_generate_function_path)  # eval sets cannot name their own
    correct = 0
    rows = []
    for s in samples:
        pred, ok = grade_sample(s, rule, generate_scores)
        correct += ok
        rows.append(
            {
                "index": s.index,
                "prompt": s.prompt,
                "label": s.label,
                "response": s.response,
                "pred": pred,
                "correct": ok,
                "reward": s.reward,
                "response_length": s.response_length,
                "status": s.status.value,
                **({"tools": s.metadata[MULTI_TURN_STATE]} if MULTI_TURN_STATE in s.metadata else {}),
            }
        )
    if out_path is not None:
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    total = len(samples)
    metrics = {
        "eval/accuracy": correct / total if total else 0.0,
        "eval/correct": correct,
        "eval/total": total,
        "eval/response_len_mean": sum(s.response_length for s in samples) / max(total, 1),
        "eval/time": time.perf_counter() - t0,
        **multi_turn_metrics(samples, "eval"),  # with --tools: turns and tool calls per sample, ...
    }
    if generate_scores:  # the rewards of a generate's own: more than right or wrong
        metrics["eval/reward_mean"] = sum(float(s.reward) for s in samples) / max(total, 1)
    groups = [list(g) for _, g in itertools.groupby(samples, key=lambda s: s.group_index)]
    return RolloutOutput(samples=groups, metrics=metrics)


def grade_sample(s: Sample, rule: str, generate_scores: bool) -> tuple[str | None, bool]:
    """(the answer read, whether it is correct) of one eval sample, its reward set to its score.
    `generate_scores` (a custom generate ran): a reward it set stays, and is correct when it
    reaches FULL_SCORE; a sample it left unscored is graded by `rule` against its label, which its row may
    lack (the rows of such a run are read without requiring one): that is one line, since
    grading it wrong would lower the accuracy without a sign."""
    if generate_scores and s.reward is not None:
        if not isinstance(s.reward, (int, float)):
            raise DataError(
                f"eval sample {s.index}: the custom generate set reward {s.reward!r}, not a number: set a float"
            )
        return None, bool(s.reward >= FULL_SCORE)
    if s.label is None or (isinstance(s.label, str) and not s.label.strip()):
        raise DataError(
            f"eval sample {s.index}: the custom generate set no reward and its row has no label to grade it "
            "against: give the row a label (--eval-label-key) or set sample.reward in the generate"
        )
    pred, label = rule_answer(rule, s.final_response, s.label), rule_label(rule, s.label)
    ok = pred is not None and label is not None and grade(pred, str(label), exact=BUILTIN_RM_TYPES[rule].exact)
    s.reward = FULL_SCORE if ok else 0.0
    return pred, bool(ok)
