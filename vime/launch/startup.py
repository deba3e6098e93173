"""Where a run's time goes before its first step, phase by phase, in the run's log.

On a GPU the 135M demo spent ~65 s before step 1, more than its training (issue 48); nobody could
say which part without a profiler. `assemble` and `Run` time their phases on one clock that starts
when the process did (Linux: /proc, so interpreter start-up and imports count too), and the run
logs one line before step 1:

    start-up 36.1 s before step 1: imports 5.2, checks 1.3, trainer 24.9, engines 4.1, weight group 0.4, ...
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field


def process_start() -> float:
    """When this process started, as a `time.time()` value; where /proc cannot tell, now (the
    imports before this call then go uncounted, and the line says so by naming no imports)."""
    try:
        with open("/proc/self/stat") as f:
            # field 22 (starttime, in clock ticks since boot) counts after the ')' that ends field 2
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime "))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return time.time()


@dataclass
class StartupClock:
    """The phases of one run's start-up, in the order they ran, in seconds."""

    started: float = field(default_factory=process_start)
    phases: list[tuple[str, float]] = field(default_factory=list)

    def __post_init__(self) -> None:
        # the process's own start-up and imports, up to the clock's creation (at most the 10 ms
        # granularity of /proc's start time below zero: clamped)
        self.phases.append(("imports", max(0.0, time.time() - self.started)))

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        t0 = time.time()
        try:
            yield
        finally:
            self.phases.append((name, time.time() - t0))

    def line(self) -> str:
        """The log line: the total from the process's start, then each phase; what no phase
        covers (work between them) is named `other`."""
        total = time.time() - self.started
        other = total - sum(s for _, s in self.phases)
        parts = [f"{name} {s:.1f}" for name, s in self.phases] + [f"other {max(0.0, other):.1f}"]
        return f"start-up {total:.1f} s before step 1: " + ", ".join(parts)
