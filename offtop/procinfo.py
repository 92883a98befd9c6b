"""Process metadata (user, command line), cached and vanish-proof.

A command line (and a process name) is whatever bytes the process chose.
It is read here as bytes and decoded with replacement, like comms, so JSON
carrying it is exact and valid UTF-8: psutil decodes with surrogateescape
(lone surrogates in JSON) and in text mode (a CR in an argument becomes LF).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import psutil

from offtop.safe_text import decode, redecode
from offtop.targets import task_start_time

#: Bytes of a command line kept. Its arguments are the process's to choose,
#: and the kernel allows megabytes of them.
CMDLINE_MAX = 64 * 1024


def read_cmdline(pid: int, proc: str = "/proc") -> str:
    """A process's arguments joined by spaces ("" for a kernel thread or a zombie).

    Raises OSError when the process is gone. Longer than `CMDLINE_MAX`
    bytes, the line is cut there and ends in "…".
    """
    with open(f"{proc}/{pid}/cmdline", "rb") as f:
        raw = f.read(CMDLINE_MAX + 1)
    if len(raw) > CMDLINE_MAX:
        return decode(raw[:CMDLINE_MAX].replace(b"\0", b" ")) + "…"
    # NUL after each argument; a process that rewrote its arguments
    # (setproctitle) may have left spaces instead.
    return decode(raw.removesuffix(b"\0").replace(b"\0", b" "))


@dataclass(frozen=True, slots=True)
class ProcessInfo:
    """What the UI says about a process besides its comm."""

    pid: int
    user: str
    cmdline: str


class ProcessInfoCache:
    """Looks each process up once per (pid, create time); bounded."""

    def __init__(self, max_entries: int = 8192) -> None:
        self._cache: dict[tuple[int, int], ProcessInfo] = {}
        self._max = max_entries

    def forget_gone(self, start_time: Callable[[int], int | None]) -> int:
        """Drop the processes gone (`start_time(pid)` None); return how many."""
        gone = [key for key in self._cache if start_time(key[0]) is None]
        for key in gone:
            del self._cache[key]
        return len(gone)

    def user_and_cmdline(self, pid: int) -> tuple[str, str] | None:
        """(user, command line) of a live process, for `Aggregator.build`."""
        info = self.get(pid)
        return None if info is None else (info.user, info.cmdline)

    def get(self, pid: int) -> ProcessInfo | None:
        """Metadata of a live process, or None when it is gone or hidden.

        A hit costs one read of the task's own stat (`task_start_time`): psutil
        reads /proc/PID/stat, which sums every thread's counters (1.25 ms for a
        process of 20,000 threads), and is asked only on a miss."""
        start = task_start_time(pid)
        if start is None:
            return None
        key = (pid, start)
        info = self._cache.get(key)
        if info is not None:
            return info
        try:
            proc = psutil.Process(pid)
            with proc.oneshot():
                user = redecode(proc.username())
                cmdline = read_cmdline(pid) or f"[{redecode(proc.name())}]"
        except (psutil.Error, OSError, KeyError):
            return None
        if task_start_time(pid) != start:
            return None  # the pid is another process's by now
        if len(self._cache) >= self._max:
            self._cache.clear()
        info = self._cache[key] = ProcessInfo(pid=pid, user=user, cmdline=cmdline)
        return info
