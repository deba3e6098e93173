"""Held-out evaluation with the math answer parser: greedy by default (sampling settings in
`vllm_rollout.sampling_params`, --eval-temperature / --eval-top-p).

Accuracy is always graded the same way (last `\\boxed{}` → `Answer:` line → trailing number,
then math-verify / normalized match), whatever `--rm-type` trains with, so numbers from
different runs and reward functions stay comparable.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path

from vime.metrics import progress
from vime.models import context_length
from vime.rollout import async_loop
from vime.rollout.data_source import load_eval_samples
from vime.rollout.rewards.answers import extract_answer
from vime.rollout.rewards.grading import exact_answer, grade
from vime.rollout.runtime import runtime_of
from vime.rollout.types import MULTI_TURN_STATE, RolloutOutput, Sample
from vime.rollout.vllm_rollout import generate_fn, multi_turn_metrics, sampling_params


async def _run(args, samples: list[Sample], step: int) -> list[Sample]:
    """Every sample at once; a bar counts finished ones on a terminal, and a plain line goes out
    at each quarter elsewhere (eval of hundreds of prompts takes minutes on a CPU)."""
    from tqdm import tqdm

    fn, params = generate_fn(args), sampling_params(args, evaluation=True)
    bar = tqdm(
        total=len(samples),
        desc=f"eval {step}",
        unit="sample",
        leave=False,
        file=sys.stderr,
        disable=True if args.quiet else None,
    )
    quarter = max(1, len(samples) // 4)
    done = 0

    async def one(s: Sample) -> Sample:
        nonlocal done
        out = await fn(args, s, params)
        runtime_of(args).forget_group(s.group_index)  # an eval row needs no engine of its own later
        done += 1
        bar.update(1)
        if bar.disable and done % quarter == 0 and done < len(samples):
            progress.info(f"eval {step}: {done}/{len(samples)} samples")
        return out

    try:
        return list(await asyncio.gather(*(one(s) for s in samples)))
    finally:
        bar.close()


def evaluate(args, step: int, out_path: Path | None = None) -> RolloutOutput:
    """Generate on the eval prompts and grade; writes one JSON line per sample to out_path."""
    base = load_eval_samples(
        args,
        runtime_of(args).tokenizer,
        args.eval_prompt_data,
        limit=args.eval_limit,
        max_prompt_len=context_length(args.model_dir) - 1,
    )
    n = args.n_samples_per_eval_prompt
    samples = [
        Sample(**{**s.__dict__, "index": s.index * n + k, "tokens": list(s.tokens), "metadata": dict(s.metadata)})
        for s in base
        for k in range(n)
    ]
    t0 = time.perf_counter()
    samples = async_loop.run(_run(args, samples, step))
    correct = 0
    rows = []
    for s in samples:
        # `exact` grades what it trains on (a list in full, on its last line); every other rm
        # type is read as the held-out metric always was: boxed, Answer:, trailing number
        exact = args.rm_type == "exact"
        pred = exact_answer(s.final_response, s.label) if exact else extract_answer(s.final_response)
        ok = pred is not None and s.label is not None and grade(pred, str(s.label), exact=exact)
        s.reward = 1.0 if ok else 0.0
        correct += ok
        rows.append(
            {
                "index": s.index,
                "prompt": s.prompt,
                "label": s.label,
                "response": s.response,
                "pred": pred,
                "correct": bool(ok),
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
    groups = [samples[i : i + n] for i in range(0, total, n)]
    return RolloutOutput(samples=groups, metrics=metrics)
