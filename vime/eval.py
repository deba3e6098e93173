"""Greedy held-out evaluation with the math answer parser.

Accuracy is always graded the same way (last `\\boxed{}` → `Answer:` line → trailing number,
then math-verify / normalized match), whatever `--rm-type` trains with, so numbers from
different runs and reward functions stay comparable.
"""
from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

from vime.models import context_length
from vime.rollout import async_loop
from vime.rollout.data_source import load_eval_samples
from vime.rollout.rewards import extract_answer, grade
from vime.rollout.types import RolloutOutput, Sample
from vime.rollout.vllm_rollout import generate_fn, sampling_params, tokenizer_for


async def _run(args, samples: list[Sample]) -> list[Sample]:
    fn, params = generate_fn(args), sampling_params(args, evaluation=True)
    if args.n_samples_per_eval_prompt > 1:
        params["temperature"] = args.rollout_temperature
    return list(await asyncio.gather(*(fn(args, s, params) for s in samples)))


def evaluate(args, step: int, out_path: Path | None = None) -> RolloutOutput:
    """Generate on the eval prompts and grade; writes one JSON line per sample to out_path."""
    base = load_eval_samples(args, tokenizer_for(args), args.eval_prompt_data, limit=args.eval_limit, max_prompt_len=context_length(args.model_dir) - 1)
    n = args.n_samples_per_eval_prompt
    samples = [Sample(**{**s.__dict__, "index": s.index * n + k, "tokens": list(s.tokens), "metadata": dict(s.metadata)}) for s in base for k in range(n)]
    t0 = time.perf_counter()
    samples = async_loop.run(_run(args, samples))
    correct = 0
    rows = []
    for s in samples:
        pred = extract_answer(s.response)
        ok = pred is not None and s.label is not None and grade(pred, str(s.label))
        s.reward = 1.0 if ok else 0.0
        correct += ok
        rows.append({"index": s.index, "prompt": s.prompt, "label": s.label, "response": s.response, "pred": pred, "correct": bool(ok), "response_length": s.response_length, "status": s.status.value})
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
    }
    groups = [samples[i : i + n] for i in range(0, total, n)]
    return RolloutOutput(samples=groups, metrics=metrics)
