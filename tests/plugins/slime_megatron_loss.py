"""A custom loss written slime's way (its examples/cispo): over Megatron's batch and logits, with
slime's Megatron-side helper for the log-probs. vime has no Megatron trainer, so start-up refuses
it in one line saying so (tests/unit/compat/test_slime_megatron_plugins.py). Ours, not copied."""

from slime.backends.megatron_utils.loss import get_log_probs_and_entropy


def clipped_is_loss(args, batch, logits, sum_of_sample_mean):
    _, out = get_log_probs_and_entropy(logits, args=args, unconcat_tokens=batch["unconcat_tokens"])
    log_probs = out["log_probs"]
    return sum_of_sample_mean(-log_probs), {}
