"""Timers, metrics.jsonl, TensorBoard, and the progress bar.

One file of one JSON object per step is the source of truth: `vime report` reads it, and a
crash loses at most the step in progress (each line is flushed as it is written).
"""

from __future__ import annotations

import json
import logging
import math
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from vime.errors import VimeError

log = logging.getLogger("vime")
# One plain line per step: always in log.txt; on stderr too when it is no terminal (under make,
# nohup, CI or a scheduler, where a bar would print nothing useful), unless --quiet.
progress = logging.getLogger("vime.progress")


@contextmanager
def timed(metrics: dict[str, float], key: str) -> Iterator[None]:
    """Add the wall time of the block to metrics[key] (seconds, accumulated)."""
    t0 = time.perf_counter()
    try:
        yield
    finally:
        metrics[key] = metrics.get(key, 0.0) + time.perf_counter() - t0


def mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


# Counters shown in the progress line whenever they are not zero: each is a failure absorbed
# (reward errors, timeouts, prompts left out, optimizer steps skipped) that a user should see.
COUNTERS = {
    "rollout/reward_errors": "reward_err",
    "rollout/reward_timeouts": "reward_timeout",
    "rollout/skipped_prompts": "skipped_prompts",
    "train/skipped_steps": "skipped_steps",
}


class MetricsLogger:
    """Append-only metrics.jsonl (+ TensorBoard when installed) and a live progress bar.

    A run resumed from step N into its own directory trains steps N+1... again: their rows from
    before the resume move to metrics.superseded.jsonl, so metrics.jsonl holds each step once
    and nothing logged is lost."""

    def __init__(
        self, run_dir: Path, total_steps: int, start_step: int = 0, use_tensorboard: bool = True, quiet: bool = False
    ) -> None:
        self.total, self.step = total_steps, start_step
        self._step_times: list[float] = []
        self.path = run_dir / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if start_step > 0 and self.path.exists():
            _supersede_rows_after(self.path, start_step)
        self._file = self.path.open("a")
        self._tb = None
        if use_tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(run_dir / "tensorboard"))
            except Exception:  # tensorboard not installed: jsonl is enough
                self._tb = None
        from tqdm import tqdm

        # disable=None: a bar only on a terminal (the plain lines above serve everywhere else)
        self._bar = tqdm(
            total=total_steps,
            initial=start_step,
            desc="train",
            unit="step",
            dynamic_ncols=True,
            file=sys.stderr,
            disable=True if quiet else None,
        )

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        row = {"step": step, **{k: _jsonable(v) for k, v in metrics.items()}}
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
        if self._tb is not None:
            for k, v in row.items():
                if isinstance(v, (int, float)) and k != "step":
                    self._tb.add_scalar(k, v, step)

    def advance(self, metrics: dict[str, Any]) -> None:
        self._bar.set_postfix(progress_postfix(metrics), refresh=False)
        self._bar.update(1)
        self.step += 1
        if "perf/step_time" in metrics:
            self._step_times.append(float(metrics["perf/step_time"]))
        progress.info(self.progress_line(metrics))

    def progress_line(self, m: dict[str, Any]) -> str:
        """`step 3/20 | reward 0.125 | len 34.2 | step 2.31s | wait 0.10s | stale 0.8 (max 2) | ETA 0:00:39`;
        fields a step does not have (staleness in sync mode) are left out. The ETA is the mean
        step time of this run so far times the steps left (eval and checkpoints excluded)."""
        parts = [f"step {self.step}/{self.total}"]
        if "rollout/reward_mean" in m:
            parts.append(f"reward {m['rollout/reward_mean']:.3f}")
        if "rollout/response_len_mean" in m:
            parts.append(f"len {m['rollout/response_len_mean']:.1f}")
        if "perf/step_time" in m:
            parts.append(f"step {m['perf/step_time']:.2f}s")
        if "perf/train_wait_time" in m:
            parts.append(f"wait {m['perf/train_wait_time']:.2f}s")
        if "rollout/staleness_mean" in m:
            parts.append(f"stale {m['rollout/staleness_mean']:.1f} (max {m['rollout/staleness_max']:.0f})")
        if "eval/accuracy" in m:
            parts.append(f"eval {m['eval/accuracy']:.3f}")
        if self._step_times:
            left = max(0, self.total - self.step) * mean(self._step_times)
            parts.append(f"ETA {time.strftime('%H:%M:%S', time.gmtime(left))}")
        return " | ".join(parts)

    def write_line(self, text: str) -> None:
        """A line for people (eval results): above the bar on a terminal, and in log.txt."""
        if not self._bar.disable:
            self._bar.write(text)
        progress.info(text)

    def close(self) -> None:
        self._bar.close()
        self._file.close()
        if self._tb is not None:
            self._tb.close()


def progress_postfix(metrics: dict[str, Any]) -> dict[str, str]:
    """What the progress line shows after a step: its time, reward and eval accuracy, and every
    counter of COUNTERS that is not zero."""
    post = {}
    if "perf/step_time" in metrics:
        post["step_s"] = f"{metrics['perf/step_time']:.2f}"
    if "rollout/reward_mean" in metrics:
        post["reward"] = f"{metrics['rollout/reward_mean']:.3f}"
    if "eval/accuracy" in metrics:
        post["eval"] = f"{metrics['eval/accuracy']:.3f}"
    post.update({short: f"{metrics[key]:g}" for key, short in COUNTERS.items() if metrics.get(key)})
    return post


def _jsonable(v: Any) -> Any:
    if hasattr(v, "item"):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


def _supersede_rows_after(path: Path, step: int) -> None:
    """Move rows of steps after `step` from `path` to metrics.superseded.jsonl (appended);
    `path` is replaced whole, so a crash here leaves one of the two versions."""
    keep, later = [], []
    for line in path.read_text().splitlines():
        if line.strip():
            (later if json.loads(line).get("step", 0) > step else keep).append(line + "\n")
    if not later:
        return
    with (path.parent / "metrics.superseded.jsonl").open("a") as f:
        f.write("".join(later))
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(keep))
    tmp.replace(path)
    log.info(
        "resumed at step %d: %d rows of later steps moved from %s to metrics.superseded.jsonl",
        step,
        len(later),
        path.name,
    )


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        raise VimeError(f"{path} not found: is {run_dir} a vime run directory?")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class _NoProgress(logging.Filter):
    """Keeps the per-step lines off a stream that shows the bar (a terminal) or asked for quiet."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.name != progress.name


def setup_logging(log_file: Path | None = None, quiet: bool = False) -> None:
    stream = logging.StreamHandler(sys.stderr)
    if quiet or sys.stderr.isatty():
        stream.addFilter(_NoProgress())
    handlers: list[logging.Handler] = [stream]
    if log_file is not None:
        log_file.parent.mkdir(parents=True, exist_ok=True)
        handlers.append(logging.FileHandler(log_file))
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", handlers=handlers, force=True
    )
