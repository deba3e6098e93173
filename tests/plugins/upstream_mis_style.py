"""A --custom-tis-function-path hook written the way vllm-project/vime's
train_infer_mismatch_helper writes mis.py, for tests/e2e/test_upstream_script_examples.py: it reads its
bound from a --custom-config-path attribute, gathers and slices with its cp_utils
(imported lazily, as mis.py does), truncates the importance weights and reports the mismatch and
each sequence's prompt length per token."""

import torch


def mismatch_weights(
    args, *, pg_loss, train_log_probs, rollout_log_probs, loss_masks, total_lengths, response_lengths, **kw
):
    from vime.backends.megatron_utils.cp_utils import all_gather_with_cp, slice_log_prob_with_cp

    train = [all_gather_with_cp(t, n, k) for t, n, k in zip(train_log_probs, total_lengths, response_lengths)]
    rollout = [all_gather_with_cp(r, n, k) for r, n, k in zip(rollout_log_probs, total_lengths, response_lengths)]
    weights, metrics = [], {"kl": [], "prompt_len": [], "truncate_fraction": []}
    for t, r, m, n, k in zip(train, rollout, loss_masks, total_lengths, response_lengths):
        w = torch.exp((t - r).clamp(-20, 20))
        metrics["truncate_fraction"].append((w > args.tis_upper_bound).float())
        weights.append(w.clamp(0, args.tis_upper_bound) * m)
        metrics["kl"].append(r - t)
        metrics["prompt_len"].append(torch.full_like(t, float(n - k)))
    flat = {
        f"mis_{name}": torch.cat(
            [slice_log_prob_with_cp(v, n, k) for v, n, k in zip(vs, total_lengths, response_lengths)]
        )
        for name, vs in metrics.items()
    }
    w = torch.cat([slice_log_prob_with_cp(v, n, k) for v, n, k in zip(weights, total_lengths, response_lengths)])
    return pg_loss * w, loss_masks, flat
