"""The probe's own cost: BPF run-time statistics, sampled in a window per interval.

The kernel counts a program's run time and runs only while someone holds a
BPF_ENABLE_STATS fd, and while it does every BPF program on the machine
pays two clock reads per run (measured: +68 ns per context switch). So the
stats are on for a short window in the middle of each interval and scaled
to the interval (window 0: on for the whole run, as bpftop does). An
interval whose window was missed or cut short (no poll from its middle
until just before its end: a machine so loaded that one step of the loop
took the rest of the interval) is given the rate of the last whole window,
never a false 0 from a window of a few microseconds. Until a window was
whole, the window opens at the interval's start, so that there is one.
"""

from __future__ import annotations

from collections.abc import Callable

from offtop.bpf import syscalls


def read_prog_fdinfo(prog_fd: int, *names: str) -> list[int]:
    """Fields of a BPF program's fd's fdinfo, by name, in order (0 for one not there)."""
    found = dict.fromkeys(names, 0)
    if prog_fd < 0:
        return list(found.values())
    try:
        with open(f"/proc/self/fdinfo/{prog_fd}") as f:
            for line in f:
                name, _, value = line.partition(":")
                if name in found:
                    found[name] = int(value.split()[0])
    except (OSError, ValueError, IndexError):
        pass
    return list(found.values())


def read_prog_run_stats(prog_fd: int) -> tuple[int, int]:
    """(run_time_ns, run_cnt) of a BPF program, from its fd's fdinfo."""
    run_ns, runs = read_prog_fdinfo(prog_fd, "run_time_ns", "run_cnt")
    return (run_ns, runs)


def read_prog_misses(prog_fd: int) -> int:
    """How often the kernel ran the program's tracepoint without it (its recursion
    guard: another BPF program or a BPF map call was under way on that CPU), from
    its fd's fdinfo; 0 if unknown."""
    return read_prog_fdinfo(prog_fd, "recursion_misses")[0]


class ProbeStats:
    """Samples the probe's run time and run count once per interval (see module doc)."""

    def __init__(
        self,
        prog_fd: int,
        *,
        window_s: float,
        clock: Callable[[], float],
        read: Callable[[int], tuple[int, int]] = read_prog_run_stats,
        enable: Callable[[], int] | None = None,
    ) -> None:
        self._prog_fd = prog_fd
        self._window = window_s
        self._clock = clock
        self._read = read
        self._enable = enable or (lambda: syscalls.enable_bpf_run_stats())
        self._fd = -1
        self.missed = 0  #: intervals whose window was missed or cut short (given the last rate)
        self._on_at = 0.0
        self._open_at = 0.0
        self._opened = False
        self._prev = (0, 0)
        self._result: tuple[int, int, float] | None = None  # (run ns, runs, seconds)
        self._last: tuple[int, int, float] | None = None  # the last window measured
        if not window_s:
            self._turn_on()

    def start_interval(self, start: float, interval_s: float) -> None:
        """A new interval begins at `start`: plan its window in the middle."""
        self._result = None
        self._opened = False
        self._open_at = start + max(0.0, (interval_s - self._window) / 2)
        if self._window and self._last is None:
            # No whole window yet to stand in for a missed one (the first
            # intervals, which on a loaded machine can pass without a poll in
            # their middle): on from the start, for the window or the interval.
            self._opened = True
            self._turn_on()

    def poll(self, now: float) -> None:
        """Open or close the window as the interval goes on."""
        if not self._window:
            return
        if not self._opened and now >= self._open_at:
            self._opened = True
            self._turn_on()
        elif self._opened and self._result is None and now - self._on_at >= self._window:
            self._close_window(now)

    def interval_result(self, elapsed: float) -> tuple[int, int]:
        """(run ns, runs) of the probe over an interval of `elapsed` seconds."""
        if not self._window:
            run_ns, runs = self._read(self._prog_fd)
            prev_ns, prev_runs = self._prev
            self._prev = (run_ns, runs)
            return max(0, run_ns - prev_ns), max(0, runs - prev_runs)
        self._close_window(self._clock())
        result = self._result
        if result is None or not self._whole(result):
            self.missed += 1
            if self._last is not None:
                run_ns, runs, seconds = self._last
                return round(run_ns * elapsed / seconds), round(runs * elapsed / seconds)
            if result is None:
                return 0, 0
        run_ns, runs, seconds = result
        scale = elapsed / seconds if seconds < elapsed else 1.0
        return round(run_ns * scale), round(runs * scale)

    def close(self) -> None:
        """Turn the stats off (if on)."""
        syscalls.close_quietly(self._fd)
        self._fd = -1

    def _turn_on(self) -> None:
        try:
            fd = self._enable()
        except OSError:  # unknown syscall number here: no stats, nothing else lost
            fd = -1
        self._fd = fd if fd >= 0 else -1
        self._on_at = self._clock()
        self._prev = self._read(self._prog_fd)

    def _close_window(self, now: float) -> None:
        if not self._opened or self._result is not None:
            return
        run_ns, runs = self._read(self._prog_fd)
        prev_ns, prev_runs = self._prev
        self._result = (max(0, run_ns - prev_ns), max(0, runs - prev_runs),
                        max(1e-9, now - self._on_at))
        if self._whole(self._result):
            self._last = self._result
        self.close()

    def _whole(self, result: tuple[int, int, float]) -> bool:
        """Whether a window's (run ns, runs, seconds) measured enough to be scaled
        (at least half its length: not cut short)."""
        return result[2] >= self._window / 2
