"""The drift warning: once, after three steps in a row over the limit, never for a blip."""

from vime.trainer.drift import DRIFT_LIMIT, DriftWatch


def _feed(watch: DriftWatch, values: list[float | None]) -> list[int]:
    """The steps at which the watch warned."""
    warned = []
    for step, v in enumerate(values, 1):
        metrics = {} if v is None else {"train/log_ratio_sq": v}
        if (msg := watch.observe(step, metrics)) is not None:
            assert f"step {step}" in msg and "--max-staleness 1" in msg and "--lr" in msg
            warned.append(step)
    return warned


def test_warns_once_after_three_steps_in_a_row_over_the_limit():
    high, low = 4 * DRIFT_LIMIT, DRIFT_LIMIT / 2
    assert _feed(DriftWatch(), [high, high, high, high, high, high]) == [3]
    # a step back under the limit starts the count again; a step with no stale tokens counts as nothing
    assert _feed(DriftWatch(), [high, high, low, high, None, high, high]) == [7]


def test_stays_quiet_at_the_drift_of_runs_that_kept_syncs_accuracy():
    """0.016: fully-async at lr 1e-5 in the staleness study, as accurate as sync."""
    assert _feed(DriftWatch(), [0.016] * 50) == []
