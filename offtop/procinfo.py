"""Process metadata (user, command line) from psutil, cached and vanish-proof."""

from __future__ import annotations

from dataclasses import dataclass

import psutil


@dataclass(frozen=True, slots=True)
class ProcessInfo:
    """What the UI says about a process besides its comm."""

    pid: int
    user: str
    cmdline: str


class ProcessInfoCache:
    """Looks each process up once per (pid, create time); bounded."""

    def __init__(self, max_entries: int = 8192) -> None:
        self._cache: dict[tuple[int, float], ProcessInfo] = {}
        self._max = max_entries

    def user_and_cmdline(self, pid: int) -> tuple[str, str] | None:
        """(user, command line) of a live process, for `Aggregator.build`."""
        info = self.get(pid)
        return None if info is None else (info.user, info.cmdline)

    def get(self, pid: int) -> ProcessInfo | None:
        """Metadata of a live process, or None when it is gone or hidden."""
        try:
            proc = psutil.Process(pid)
            key = (pid, proc.create_time())
            info = self._cache.get(key)
            if info is None:
                with proc.oneshot():
                    user = proc.username()
                    cmdline = " ".join(proc.cmdline()) or f"[{proc.name()}]"
                if len(self._cache) >= self._max:
                    self._cache.clear()
                info = self._cache[key] = ProcessInfo(pid=pid, user=user, cmdline=cmdline)
            return info
        except (psutil.Error, OSError, KeyError):
            return None
