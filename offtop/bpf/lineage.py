"""Whose memory map a process gone before its first sight had (offcpu.c `lineage`).

User addresses mean something only with a process's memory map, read from
/proc while it lives. A process forked, blocked and reaped between two of
the engine's reads (a pre-fork server's short job, a shell's subshell: a
millisecond) is never seen alive. But a forked process begins with a copy
of the memory of the task that forked it, and keeps it until it execs: its
stacks mean the same in that process, as long as that one has not exec'd
since either. The probe notes, for each new task, which process it was
forked from and when, and for each process when it last exec'd; here that
becomes the living process to resolve a gone one's stacks in (`stand_in`),
up a chain of forked processes gone too.

What is not known is not guessed: no note (forked before offtop started,
or its note evicted from the probe's LRU), an exec on the way, or a process
alive under the pid but started after the fork (the pid reused) give None.
A mapping made after the fork, in the child (dlopen) or in the one resolved
in (an unmap, then another file at the same place), is the limit; the
child's own mappings are gone with it, so addresses outside the stand-in's
are cut as untrusted, like any (offtop.symbols).
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable
from dataclasses import dataclass

from offtop.targets import task_start_time

#: offcpu.c struct lineage_t: parent tgid, padding, fork time, last exec time.
LINEAGE_ENTRY = struct.Struct("<IIQQ")

#: Forked processes gone followed up a chain at most (a shell's subshell's subshell…).
MAX_HOPS = 8


@dataclass(frozen=True, slots=True)
class Forked:
    """One note of the probe's about a task (boot-clock ns; 0: not seen)."""

    parent: int  #: the process whose task forked it
    fork_ns: int
    exec_ns: int  #: when it last exec'd


def decode_forked(raw: bytes) -> Forked:
    parent, _pad, fork_ns, exec_ns = LINEAGE_ENTRY.unpack_from(raw)
    return Forked(parent, fork_ns, exec_ns)


class Lineage:
    """`stand_in(pid)`: the living process a gone one's user stacks are resolved in.

    `noted(pid)` reads the probe's note about `pid` (None: no note);
    `start_time(pid)` is a process's start time in clock ticks since boot
    (None: gone), as /proc gives it.
    """

    def __init__(self, noted: Callable[[int], Forked | None], *,
                 start_time: Callable[[int], int | None] = task_start_time,
                 ns_per_tick: int = 1_000_000_000 // os.sysconf("SC_CLK_TCK")) -> None:
        self._noted = noted
        self._start_time = start_time
        self._ns_per_tick = ns_per_tick

    def exec_of(self, pid: int) -> tuple[int, int] | None:
        """When the process now under `pid` exec'd (boot-clock ns), as the probe noted
        it, and the process it was forked from (0: not seen forking); None if it has
        no note, or was forked and has not exec'd since."""
        note = self._noted(pid)
        if note is None or not note.exec_ns or note.fork_ns > note.exec_ns:
            return None
        return note.exec_ns, note.parent if note.fork_ns else 0

    def stand_in(self, pid: int) -> tuple[int, int] | None:
        """A living process whose memory map `pid`'s user addresses mean the same in
        (see the module docstring), and its start time; or None."""
        note = self._noted(pid)
        if note is None or note.exec_ns or not note.fork_ns:
            return None  # not seen forking, or its memory is a program of its own
        forked_at, parent = note.fork_ns, note.parent
        for _ in range(MAX_HOPS):
            if parent in (0, pid):
                return None
            up = self._noted(parent)
            if up is not None and up.exec_ns > forked_at:
                return None  # another program's memory since the fork
            start = self._start_time(parent)
            if start is not None:
                # The one that forked, or a process that took its pid since?
                return (parent, start) if start * self._ns_per_tick <= forked_at else None
            # Gone too: the memory it had came from its own parent, if it never exec'd.
            if up is None or up.exec_ns or not up.fork_ns:
                return None
            forked_at, parent = up.fork_ns, up.parent
        return None
