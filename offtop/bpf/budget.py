"""Time budgets and offtop's own cost: what keeps each interval on time, and says what it cost."""

from __future__ import annotations

import resource
from collections.abc import Callable


class Budget:
    """Seconds of one kind of work left in a pass, spent as it is measured (`with`).

    Several kinds of work take turns in one pass (unwinding, symbolizing);
    each is charged only for its own time, so one cannot eat another's.
    """

    def __init__(self, seconds: float, clock: Callable[[], float]) -> None:
        self.left = seconds
        self._clock = clock
        self._t0 = 0.0

    def deadline(self) -> float:
        """When this work must stop if it ran alone from now."""
        return self._clock() + max(0.0, self.left)

    def __enter__(self) -> Budget:
        self._t0 = self._clock()
        return self

    def __exit__(self, *exc: object) -> None:
        self.left -= self._clock() - self._t0


class SelfCost:
    """offtop's own CPU time and resident memory, per interval."""

    def __init__(self) -> None:
        self._cpu = self.cpu_s()

    @staticmethod
    def cpu_s() -> float:
        """The CPU time offtop has used (user and system, all threads), in seconds."""
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime

    def interval(self, elapsed: float, cpu: float) -> tuple[float, int]:
        """(% of one core since the last call, RSS bytes now). `cpu`: `cpu_s()` as read
        at the end of the `elapsed` seconds."""
        pct = 100.0 * (cpu - self._cpu) / elapsed if elapsed > 0 else 0.0
        self._cpu = cpu
        try:
            with open("/proc/self/statm", "rb") as f:
                rss = int(f.read().split()[1]) * resource.getpagesize()
        except (OSError, ValueError, IndexError):
            rss = 0
        return pct, rss
