"""--off-policy-correction: which TIS/rejection fields each choice sets, how `auto` chooses, and
the one line that says what the chosen correction does to a token."""

from __future__ import annotations

from vime.algorithms.settings import ASYNC_CORRECTION, CORRECTIONS
from vime.config.schema import Settings, default_of
from vime.errors import ConfigError
from vime.modes import MODES


def resolve_correction(c: Settings) -> None:
    """Turn --off-policy-correction into the TIS/rejection fields the loss reads, and record
    which one was taken (config.yaml and the start-up line show it). Async runs train on
    samples up to several versions old, and uncorrected they lost ~20 points of held-out
    accuracy on the demo task at staleness 4 (bench/RESULTS.md), so auto corrects wherever a
    sample can be stale; sync and --max-staleness 0 train what sync trains, uncorrected."""
    chosen = c.off_policy_correction
    if chosen == "auto":
        if c.use_tis or c.use_rs or c.m2_threshold is not None:
            chosen = "custom"
        elif (
            not MODES[c.mode].overlaps
            or c.max_staleness == 0
            or c.use_rollout_logprobs
            or c.loss_type == "sft_loss"  # weighs no token by a ratio
        ):
            chosen = "none"
        else:
            chosen = ASYNC_CORRECTION
    if chosen != "custom":
        for name, value in CORRECTIONS[chosen].items():
            if getattr(c, name) not in (value, default_of(name)):
                flag = "--" + name.replace("_", "-")
                raise ConfigError(
                    f"{flag} {getattr(c, name)} contradicts --off-policy-correction {chosen}, which sets it to {value}: "
                    f"give --off-policy-correction custom to use your own {flag}, or drop it"
                )
            setattr(c, name, value)
        if chosen != "none" and c.use_rollout_logprobs:
            raise ConfigError(
                f"--off-policy-correction {chosen} weighs π_old against the engine's log-probs, which "
                "--use-rollout-logprobs makes π_old: drop one"
            )
    c.off_policy_correction = chosen


def correction_summary(c: Settings) -> str:
    """One line for the start of a run: which correction, and what it does to a token."""
    veto = (
        f"; sequences with a token ratio below {c.rs_veto_threshold:g} dropped"
        if c.rs_veto_threshold is not None
        else ""
    )
    if not (c.use_tis or c.use_rs or c.m2_threshold is not None):
        return "off-policy correction: none" + veto
    parts = []
    if c.m2_threshold is not None:
        parts.append(f"tokens of largest (log π_old/π_rollout)² masked until the rest's mean is ≤ {c.m2_threshold:g}")
    if c.use_tis:
        band = f"[{c.tis_clip_low:g}, {c.tis_clip:g}]"
        parts.append(
            (
                f"π_old/π_rollout clamped to {band}"
                if c.tis_mode == "truncate"
                else f"tokens with π_old/π_rollout outside {band} masked"
            )
            + ("" if c.tis_level == "token" else f", one weight per sequence ({c.tis_level})")
        )
    if c.use_rs:
        parts.append(f"{c.rs_level}s with a ratio outside [{c.rs_lower_bound:g}, {c.rs_upper_bound:g}] dropped")
    return f"off-policy correction: {c.off_policy_correction} ({'; '.join(parts)}{veto}); --off-policy-correction none turns it off"
