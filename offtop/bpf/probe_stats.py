"""The probe's own cost per interval: its runs and the time they took.

The probe counts its runs and times one in 16 per CPU itself (offcpu.c,
TIME_EVERY); the interval's time is the timed runs' scaled to all runs.
The kernel's BPF run-time statistics are not used: they are one switch for
the whole machine, and while on, every BPF program of every tool pays two
clock reads per run (+68 ns per context switch, measured); turning them on
and off patches the kernel's code. Sampled in a window per interval, they
also missed nine runs in ten.
"""

from __future__ import annotations

from collections.abc import Mapping


class ProbeStats:
    """The probe's (run ns, runs) over each interval, from its counters (see module doc)."""

    def __init__(self) -> None:
        self._prev = (0, 0, 0)
        self._ns_per_run = 0.0  # from the last interval with timed runs

    def interval_result(self, counters: Mapping[str, int]) -> tuple[int, int]:
        """(run ns, runs) since the last call, from `Probe.counters()` read now."""
        now = (counters.get("runs", 0), counters.get("timed_runs", 0),
               counters.get("timed_ns", 0))
        runs, timed, ns = (max(0, a - b) for a, b in zip(now, self._prev, strict=True))
        self._prev = now
        if timed:
            self._ns_per_run = ns / timed
        return round(self._ns_per_run * runs), runs
