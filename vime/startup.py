"""Where a process's time goes before it starts its work, phase by phase, in its log.

On a GPU the 135M demo spent ~65 s before step 1, more than its training (issue 48); nobody could
say which part without a profiler. `assemble` and `Run` time a run's phases on one clock that
starts when the process did (Linux: /proc, so interpreter start-up and imports count too), and
the run logs one line before step 1 (and its step-0 eval); an engine server logs its own before
it serves (`vime/engine/server.py`):

    start-up 36.1 s before step 1 (and its step-0 eval): imports 5.2, checks 1.3 (outputs 0.0, tokenizer 1.1, ...), trainer 24.9, ...
    start-up 2.5 s before serving: imports 1.3, CUDA and weights 0.7, KV cache and CUDA graphs 0.4, other 0.1
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field


def process_start() -> float | None:
    """When this process started, as a `time.time()` value, or None where /proc cannot tell.
    /proc gives the start in clock ticks since boot; the boot is placed by CLOCK_BOOTTIME (the
    whole-second `btime` of /proc/stat would put the start up to 1 s early)."""
    try:
        with open("/proc/self/stat") as f:
            # field 22 (starttime) counts after the ')' that ends field 2, the command's name
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        since_start = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return None
    return time.time() - since_start


_process_clock_taken = False  # only a process's first run counts its imports; a later one starts its clock when made


@dataclass
class StartupClock:
    """The phases of one run's start-up, in the order they ran, in seconds. The first clock of a
    process starts with the process (its imports, argument parsing and config validation are
    the `imports` phase); a later run in the same process (a notebook, a test running several)
    starts its clock when it is made, and has no `imports`."""

    started: float = 0.0
    phases: list[tuple[str, float]] = field(default_factory=list)
    parts: dict[str, list[tuple[str, float]]] = field(default_factory=dict)  # a phase's own split, if it has one

    def __post_init__(self) -> None:
        global _process_clock_taken
        now = time.time()
        first = None if _process_clock_taken else process_start()
        _process_clock_taken = True
        self.started = now if first is None else first
        if first is not None:
            self.phases.append(("imports", max(0.0, now - first)))

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        t0 = time.monotonic()
        try:
            yield
        finally:
            self.phases.append((name, time.monotonic() - t0))

    def line(self, before: str) -> str:
        """The log line: the total from the process's start up to `before` (the work it leads
        to), then each phase; what no phase covers (work between them) is named `other`."""
        total = time.time() - self.started
        other = total - sum(s for _, s in self.phases)
        parts = [f"{name} {s:.1f}{self._split(name)}" for name, s in self.phases] + [f"other {max(0.0, other):.1f}"]
        return f"start-up {total:.1f} s {before}: " + ", ".join(parts)

    def _split(self, name: str) -> str:
        split = self.parts.get(name)
        return f" ({', '.join(f'{part} {s:.1f}' for part, s in split)})" if split else ""
