"""The metrics of one `train_step`: its optimizer steps' metrics as one row (means, a count of
the skipped steps, the engine/trainer log-prob mismatch) and the loss's staleness buckets."""

from __future__ import annotations

from vime.algorithms.objective import STALENESS_BUCKETS, STALENESS_STATS, bucket_label
from vime.rollout.types import Sample


def merge_steps(
    steps: list[dict[str, float]], samples: list[Sample], first_version: int, global_batch_size: int
) -> dict[str, float]:
    """One row of the rollout's optimizer steps' metrics, `first_version` the policy version its
    first step trained."""
    metrics = {k: sum(m[k] for m in steps) / len(steps) for k in steps[0]}
    metrics["train/skipped_steps"] = sum(m["train/skipped_steps"] for m in steps)  # a count, not a mean
    # the engine/trainer mismatch in one number, over all the rollout's tokens: ~0 when both
    # run the same weights in the same precision; what TIS corrects for if not
    diff_sum, diff_count = (sum(m.get(f"train/_lp_diff_{k}", 0.0) for m in steps) for k in ("sum", "count"))
    for k in ("train/_lp_diff_sum", "train/_lp_diff_count"):
        metrics.pop(k, None)
    if diff_count:
        metrics["train/train_rollout_logprob_abs_diff"] = diff_sum / diff_count
    metrics.update(stale_bucket_metrics(metrics, samples, first_version, global_batch_size))
    return metrics


def stale_bucket_metrics(
    metrics: dict[str, float], samples: list[Sample], first_version: int, global_batch_size: int
) -> dict[str, float]:
    """`stale/<b>/<stat>`: the loss's per-token sums of each staleness bucket (popped from
    `metrics`) as means over the bucket's tokens, its share of the step's tokens, and the mean
    response length of the samples whose oldest token falls in it. What stale samples do
    differently from fresh ones shows here: how far the weights moved since they were drawn
    (train_rollout_logprob_abs_diff, log_ratio_sq), how much the correction discounts them,
    their advantages and entropy. Buckets with no token are left out."""
    sums = {
        k.removeprefix("train/_stale"): metrics.pop(k) for k in [k for k in metrics if k.startswith("train/_stale")]
    }
    total = sum(sums.get(f"{b}_n", 0.0) for b in range(STALENESS_BUCKETS))
    out: dict[str, float] = {}
    for b in range(STALENESS_BUCKETS):
        n = sums.get(f"{b}_n", 0.0)
        if n > 0:
            label = bucket_label(b)
            out[f"stale/{label}/token_share"] = n / total
            out.update({f"stale/{label}/{stat}": sums[f"{b}_{stat}"] / n for stat in STALENESS_STATS})
    if total > 0:  # over every trained token: the drift vime/trainer/drift.py watches
        out["train/log_ratio_sq"] = sum(sums.get(f"{b}_log_ratio_sq", 0.0) for b in range(STALENESS_BUCKETS)) / total
    lengths: dict[int, list[int]] = {}
    for i, s in enumerate(samples):
        if s.weight_versions:
            lag = first_version + i // global_batch_size - min(s.weight_versions)
            lengths.setdefault(min(max(lag, 0), STALENESS_BUCKETS - 1), []).append(s.response_length)
    for b, ls in lengths.items():
        out[f"stale/{bucket_label(b)}/response_len"] = sum(ls) / len(ls)
    return out
