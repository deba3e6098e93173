"""Timers, metrics.jsonl, the progress bar and the run's log.txt.

One file of one JSON object per step is the source of truth: `vime report` reads it, and a
crash loses at most the step in progress (each line is flushed as it is written). Every row
written there also goes, at the same step, to each sink the flags ask for (`vime/sinks.py`:
TensorBoard, Weights & Biases).
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from vime.config import Config
from vime.errors import VimeError
from vime.eval_sets import summary as eval_summary
from vime.sinks import Sink, close_all, first_line, open_sinks

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


class MetricsError(VimeError, OSError):
    """metrics.jsonl cannot take a row (a full disk, a quota): the run stops in one line."""


class MetricsLogger:
    """Append-only metrics.jsonl, the same rows to every sink, and a live progress bar.

    A run resumed from step N into its own directory trains steps N+1... again: their rows from
    before the resume move to metrics.superseded.jsonl, so metrics.jsonl holds each step once
    and nothing logged is lost."""

    def __init__(
        self, run_dir: Path, total_steps: int, start_step: int = 0, sinks: Sequence[Sink] = (), quiet: bool = False
    ) -> None:
        self.total, self.step = total_steps, start_step
        self.sinks = list(sinks)
        self._step_times: list[float] = []
        self.path = run_dir / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if start_step > 0 and self.path.exists():
            _supersede_rows_after(self.path, start_step)
        # rows go out with os.write, unbuffered: a row the disk has no room for is cut off at
        # once (and taken back), not left in a buffer that a later flush half-writes
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
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

    @classmethod
    def for_run(cls, args: Config, total_steps: int, start_step: int = 0) -> MetricsLogger:
        """The logger of a training run: its directory and console (the output component's settings,
        `args.output`), and the sinks its flags ask for."""
        out = args.output
        sinks = open_sinks(args, start_step)
        try:
            return cls(out.run_dir, total_steps, start_step, sinks, quiet=out.quiet)
        except BaseException:
            close_all(sinks, failed=True)
            raise

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        row = {"step": step, **{k: _jsonable(v) for k, v in metrics.items()}}
        self._append(step, (json.dumps(row) + "\n").encode())
        for sink in list(self.sinks):
            try:
                sink.log(step, row)
            except Exception as e:  # a sink's failure (W&B's service gone) must not end a run the jsonl still records
                log.warning(
                    "%s failed at step %d (%s): it gets no more rows, metrics.jsonl has them all",
                    type(sink).__name__,
                    step,
                    first_line(e),
                )
                self.sinks.remove(sink)
                close_all([sink], failed=True)

    def _append(self, step: int, data: bytes) -> None:
        """One whole row or none: a write the disk cannot take (full, quota, file size limit) is
        truncated away, so metrics.jsonl never ends in a torn row, and the run stops in one line."""
        end = os.lseek(self._fd, 0, os.SEEK_END)
        try:
            done = 0
            while done < len(data):
                done += os.write(self._fd, data[done:])
        except OSError as e:
            try:
                os.ftruncate(self._fd, end)  # freeing needs no room
            except OSError:
                pass  # a torn row left behind is repaired on resume and skipped by `vime report`
            raise MetricsError(
                f"cannot write step {step}'s metrics to {self.path} ({e.strerror}): make room there, then resume "
                "with --load (the rows before it are intact)"
            ) from None

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
        if "train/sft_loss" in m:
            parts.append(f"sft loss {m['train/sft_loss']:.3f}")
        if "rollout/response_len_mean" in m:
            parts.append(f"len {m['rollout/response_len_mean']:.1f}")
        if "perf/step_time" in m:
            parts.append(f"step {m['perf/step_time']:.2f}s")
        if "perf/train_wait_time" in m:
            parts.append(f"wait {m['perf/train_wait_time']:.2f}s")
        if "rollout/staleness_mean" in m:
            parts.append(f"stale {m['rollout/staleness_mean']:.1f} (max {m['rollout/staleness_max']:.0f})")
        if "eval/accuracy" in m:
            parts.append(f"eval {eval_summary(m)}")
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
        """Closed while an exception unwinds the run (run.py closes it in `finally:`), the run
        is recorded as failed where a sink keeps that (W&B)."""
        self._bar.close()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        close_all(self.sinks, failed=sys.exc_info()[0] is not None)


def progress_postfix(metrics: dict[str, Any]) -> dict[str, str]:
    """What the progress line shows after a step: its time, reward and eval accuracy, and every
    counter of COUNTERS that is not zero."""
    post = {}
    if "perf/step_time" in metrics:
        post["step_s"] = f"{metrics['perf/step_time']:.2f}"
    if "rollout/reward_mean" in metrics:
        post["reward"] = f"{metrics['rollout/reward_mean']:.3f}"
    if "eval/accuracy" in metrics:
        post["eval"] = eval_summary(metrics)
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
    rows = parse_rows(path)  # a torn last row (the process that wrote it was killed) is dropped
    for row in rows:
        (later if row.get("step", 0) > step else keep).append(json.dumps(row) + "\n")
    torn = len(rows) < sum(1 for line in path.read_text(encoding="utf-8").splitlines() if line.strip())
    if not later and not torn:
        return
    if later:
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
    return parse_rows(path)


def parse_rows(path: Path, warn: bool = True) -> list[dict[str, Any]]:
    """The JSON rows of a metrics file. A last row cut short (a run killed mid-write, a full
    disk) is skipped with a warning (`warn`); a bad row anywhere else is an error naming its line."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as e:
        raise VimeError(
            f"{path} is not UTF-8 text ({e.reason} at byte {e.start}): not a metrics file vime wrote"
        ) from None
    except OSError as e:  # a directory of that name, no permission: IsADirectoryError's traceback
        raise VimeError(
            f"{path} cannot be read ({e.strerror or e}): move it aside, or pick another --run-name"
        ) from None
    rows: list[dict[str, Any]] = []
    numbered = [(i + 1, line) for i, line in enumerate(lines) if line.strip()]
    for k, (lineno, line) in enumerate(numbered):
        try:
            row = json.loads(line)
            if not isinstance(row, dict):
                raise ValueError(f"a {type(row).__name__}, not an object")
        except ValueError as e:
            if k == len(numbered) - 1:
                if warn:
                    log.warning(
                        "%s: the last row (line %d) is cut short and is skipped (%s)", path, lineno, first_line(e)
                    )
                break
            raise VimeError(
                f"{path} line {lineno} is not a metrics row ({first_line(e)}): repair or remove that line"
            ) from None
        rows.append(row)
    return rows


class _RunLog(logging.FileHandler):
    """The run's log.txt. A disk that fills makes each record's write fail, and logging would
    print a traceback for every one; this says so once on stderr and stops writing the file
    (the terminal still gets every line, and the run stops at its next metrics row or save)."""

    def handleError(self, record: logging.LogRecord) -> None:
        err = sys.exc_info()[1]
        if not isinstance(err, OSError):  # a record that does not format is that record's bug, not the disk's
            super().handleError(record)
            return
        sys.stderr.write(f"warning: cannot write {self.baseFilename} ({err.strerror or err}): it gets no more lines\n")
        logging.getLogger().removeHandler(self)


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
        handlers.append(_RunLog(log_file))
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", handlers=handlers, force=True
    )
