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

from offtop.bpf.decode import StartRecord


class ThreadRecords(Protocol):
    """Where records come from (`offtop.bpf.probe.Probe`, or a fake in tests)."""

    def thread_records(self) -> list[tuple[int, StartRecord, int]]:
        """(tid, record, slot) of every thread with a record."""
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
        and the stack ids every blocked thread holds (not to be reclaimed)."""
        self._reads += 1
        reap_idle = self._reads % self._reap_every == 0
        now = self._clock_ns()
        rows: list[Blocked] = []
        live: set[tuple[str, int]] = set()
        for tid, v, slot in self._records.thread_records():
            if v.ts == 0:
                if reap_idle and not self._exists(v.tgid, tid):
                    self._reap(tid, slot)
                continue
            if v.ustack >= 0:
                live.add(("u", v.ustack))
            if v.kstack >= 0:
                live.add(("k", v.kstack))
            waited = now - v.ts
            if waited > self._stale_after and not self._exists(v.tgid, tid):
                self._reap(tid, slot)  # exited while asleep: never switched in again
                continue
            if waited >= self._min_ns:
                rows.append(Blocked(tid, v.tgid, v.state, waited, v.ustack, v.kstack, v.ts,
                                    v.ubp))
        rows.sort(key=lambda b: (-b.waited_ns, b.tid))
        return rows[: self._limit], live

    def _reap(self, tid: int, slot: int) -> None:
        self._records.free_record(tid, slot)
        self.reaped += 1
