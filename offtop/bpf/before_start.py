"""Blocks that began before offtop started: found in /proc, handed to the probe.

The probe sees a block begin at switch-out; a thread already asleep when
offtop attached would stay invisible until it woke, and the hung process is
the first thing people look for. `BeforeStart` gives each such thread (in
scope) a record in the probe, as if the probe had seen it go: its block is
then in blocked-now at once and counted once, whole, when it ends, marked
(offcpu.c ST_BEFORE_START). The kernel stack /proc showed is kept for it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

from offtop.bpf.decode import REC_NO_USER, REC_SEEDED, ST_BEFORE_START, STATE_MASKS, StartRecord
from offtop.model import Frame
from offtop.proc_tasks import SchedClock, blocked_tasks, exec_start_ns


class Seeding(Protocol):
    """What BeforeStart needs of the probe (`offtop.bpf.probe.Probe`)."""

    def recorded_tids(self) -> set[int]:
        """The threads the probe has a record of (read in bulk)."""
        ...

    def seed_record(self, tid: int, rec: StartRecord) -> bool:
        """Give a thread a record unless it has one; True if written."""
        ...

    def unseed(self, tid: int, ts: int) -> bool:
        """Take a seeded record back if it still holds `ts`; False if it no longer does."""
        ...


@dataclass(frozen=True, slots=True)
class Before:
    """One block from before the start: when it began (estimated), its kernel stack."""

    ts: int
    kernel: tuple[Frame, ...]
    pid: int = 0


class BeforeStart:
    """Seeds the probe with the blocks already under way (see the module docstring)."""

    def __init__(self, probe: Seeding, *, states: Iterable[str], kthreads: bool,
                 user_stacks: bool, accept: Callable[[int, int], bool],
                 budget_s: float = 1.0) -> None:
        self._probe = probe
        self._letters = [c for c in states if c in STATE_MASKS]
        self._kthreads = kthreads
        self._user_stacks = user_stacks
        self._accept = accept
        self._budget = budget_s
        self._blocks: dict[int, Before] = {}

    def seed(self) -> int:
        """Seed every blocked thread in scope (once, right after the probe is armed).

        Each is checked again afterwards: one that ran meanwhile (its
        exec_start moved) may have been counted already or be blocked
        elsewhere now, so its seed is taken back unless the probe took it.
        Returns how many stayed seeded.
        """
        armed_at = time.monotonic_ns()
        found = blocked_tasks(self._letters, accept=self._accept, kthreads=self._kthreads,
                              clock=SchedClock(), deadline=time.monotonic() + self._budget)
        # Read once, after the walk: a thread that switched out since it was
        # found has a record, or has run (its exec_start moved: checked below).
        recorded = self._probe.recorded_tids()
        # Threads of one pool wait in the same place: one tuple of frames per stack.
        kernels: dict[tuple[str, ...], tuple[Frame, ...]] = {}
        seeded = []
        for t in found:
            if t.tid in recorded:
                continue  # the probe saw it switch out: its record is the truth
            ts = t.since_ns if t.since_ns is not None and t.since_ns < armed_at else armed_at
            rec = StartRecord(ts=ts, tid=t.tid, tgid=t.pid,
                              state=STATE_MASKS[t.state] | ST_BEFORE_START,
                              ustack=-1, kstack=-1, cg_gen=0xFFFFFFFF,
                              skip=REC_SEEDED | (0 if self._user_stacks else REC_NO_USER))
            if self._probe.seed_record(t.tid, rec):
                kernel = kernels.get(t.kernel)
                if kernel is None:
                    kernel = kernels[t.kernel] = tuple(
                        Frame(name=n, module="kernel", kernel=True) for n in t.kernel)
                self._blocks[t.tid] = Before(ts, kernel, t.pid)
                seeded.append((t, ts))
        for t, ts in seeded:
            # Its frames stay if the program took the seed: the block it began, from
            # before the start, ended meanwhile and is summed under it, as one whose
            # frames are these (taken away, its row had none at all).
            if exec_start_ns(t.pid, t.tid) != t.exec_start and self._probe.unseed(t.tid, ts):
                self._blocks.pop(t.tid, None)
        return len(self._blocks)

    def blocks(self) -> list[tuple[int, Before]]:
        """(tid, block) of every block from before the start still under way."""
        return list(self._blocks.items())

    def get(self, tid: int) -> Before | None:
        """The block of `tid` from before the start, while it lasts."""
        return self._blocks.get(tid)

    def pop(self, tid: int) -> Before | None:
        """The block of `tid`, as it ends (it is counted once)."""
        return self._blocks.pop(tid, None)


def cgroup_relative(path: str) -> str:
    """A cgroup v2 directory as /proc/PID/cgroup names it (relative to its mount)."""
    from offtop.cgroups import cgroup2_mounts

    p = os.path.realpath(path)
    for mount in cgroup2_mounts():
        m = str(mount)
        if p == m or p.startswith(m.rstrip("/") + "/"):
            return "/" + p[len(m):].strip("/")
    return "/"
