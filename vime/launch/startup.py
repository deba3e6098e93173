"""Where a run's time goes before its first step, phase by phase, in the run's log.

On a GPU the 135M demo spent ~65 s before step 1, more than its training (issue 48); nobody could
say which part without a profiler. `assemble` and `Run` time their phases on one clock that starts
when the process did (Linux: /proc, so interpreter start-up and imports count too), and the run
logs one line before step 1 (and its step-0 eval):

    start-up 36.1 s before step 1 (and its step-0 eval): imports 5.2, checks 1.3, trainer 24.9, engines 4.1, weight group 0.4, ...
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from vime.lifetime import process_start

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

    def line(self) -> str:
        """The log line: the total from the process's start, then each phase; what no phase
        covers (work between them) is named `other`."""
        total = time.time() - self.started
        other = total - sum(s for _, s in self.phases)
        parts = [f"{name} {s:.1f}{self._split(name)}" for name, s in self.phases] + [f"other {max(0.0, other):.1f}"]
        return f"start-up {total:.1f} s before step 1 (and its step-0 eval): " + ", ".join(parts)

    def _split(self, name: str) -> str:
        split = self.parts.get(name)
        return f" ({', '.join(f'{part} {s:.1f}' for part, s in split)})" if split else ""
