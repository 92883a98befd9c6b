"""Who is off the CPU right now, read from the probe's per-thread records.

A record with a timestamp is a thread that switched out in a recorded state
and has not run since: blocked now, for `now - ts`. The records are a
memory-mapped array (plus a small overflow hash), so this is a pass over
memory, not a system call per thread.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from offtop.bpf.decode import RecordFields


class ThreadRecords(Protocol):
    """Where records come from (`offtop.bpf.probe.Probe`, or a fake in tests)."""

    def thread_fields(self) -> list[RecordFields]:
        """(ts, tid, tgid, state, ustack, kstack, ubp, slot) of every thread with a record."""
        ...

    def free_record(self, tid: int, slot: int) -> None:
        """Drop the record of a thread that is gone."""
        ...


@dataclass(frozen=True, slots=True)
class Blocked:
    """One thread blocked now, stacks still ids."""

    tid: int
    pid: int
    state: int  #: normalized state bits, with ST_BEFORE_START for a seeded record
    waited_ns: int
    ustack: int
    kstack: int
    ts: int  #: when it switched out (CLOCK_MONOTONIC ns): with tid, names this block
    ubp: int  #: its user rbp then (0: not taken)


def _thread_exists(pid: int, tid: int) -> bool:
    return os.path.exists(f"/proc/{pid}/task/{tid}")


class BlockedNowReader:
    """Reads blocked-now from the records; reaps records of threads gone unseen.

    The probe drops a thread's record when the thread is freed
    (sched_process_free); one that a missed event left behind is reaped
    here: every `reap_every` reads for idle records, and at once for a record
    that claims a wait of more than `stale_after_ns` by a thread that no
    longer exists.
    """

    def __init__(
        self,
        records: ThreadRecords,
        *,
        min_ns: int,
        limit: int,
        reap_every: int = 30,
        stale_after_ns: int = 10_000_000_000,
        clock_ns: Callable[[], int] = time.monotonic_ns,
        exists: Callable[[int, int], bool] = _thread_exists,
    ) -> None:
        self._records = records
        self._min_ns = min_ns
        self._limit = limit
        self._reap_every = reap_every
        self._stale_after = stale_after_ns
        self._clock_ns = clock_ns
        self._exists = exists
        self._reads = 0
        self.reaped = 0

    def read(self) -> tuple[list[Blocked], set[tuple[str, int]]]:
        """Threads blocked at least `min_ns`, longest first (at most `limit`);
        and the stack ids every blocked thread holds (not to be reclaimed).

        A record that claims a long wait is checked against /proc only if it
        is to be shown, or at a reaping read: a process of 5,000 threads
        idle for hours was 5,000 stat() calls a read, for 200 rows."""
        self._reads += 1
        reap = self._reads % self._reap_every == 0
        now = self._clock_ns()
        # A Blocked is made only for the rows shown.
        found: list[RecordFields] = []
        live: set[tuple[str, int]] = set()
        latest = now - min(self._min_ns, self._stale_after)
        for f in self._records.thread_fields():
            ts, tid, tgid, _state, us, ks, _bp, slot = f
            if ts == 0:
                if reap and not self._exists(tgid, tid):
                    self._reap(tid, slot)
                continue
            if us >= 0:
                live.add(("u", us))
            if ks >= 0:
                live.add(("k", ks))
            if ts <= latest:
                found.append(f)
        found.sort()  # by (ts, tid): longest wait first, then tid
        rows: list[Blocked] = []
        for ts, tid, tgid, state, us, ks, bp, slot in found:
            waited = now - ts
            shown = waited >= self._min_ns and len(rows) < self._limit
            if not (shown or reap):
                if len(rows) >= self._limit:
                    break
                continue
            if waited > self._stale_after and not self._exists(tgid, tid):
                self._reap(tid, slot)  # exited while asleep: never switched in again
                continue
            if shown:
                rows.append(Blocked(tid, tgid, state, waited, us, ks, ts, bp))
        return rows, live

    def _reap(self, tid: int, slot: int) -> None:
        self._records.free_record(tid, slot)
        self.reaped += 1
