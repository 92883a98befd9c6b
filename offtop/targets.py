"""What offtop was asked to watch (-p, -t, -c), and noticing when it goes away.

A process or thread is its id *and* its start time: once it exits, its id
may name another task, which offtop must not follow silently. A cgroup is
its directory and that directory's inode (the cgroup id): a cgroup removed
and made again under the same name is another cgroup. Each loss is said
once, as a notice; when nothing is left, the run is over.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

from offtop.safe_files import read_proc_small

#: task flags (/proc/PID/stat's 9th field): the task is exiting.
PF_EXITING = 0x4


def _stat_fields(tid: int, proc: str) -> list[bytes] | None:
    """The task's own stat fields from the state on (the 3rd), None if gone.

    Read from /proc/TID/task/TID/stat, not /proc/TID/stat: the two agree on
    the fields read here (state, flags, start time: the task's own), but the
    latter sums every thread's counters for a process, in the kernel, under
    its lock: 1.25 ms for a process of 20,000 threads against 7 µs."""
    try:
        data = read_proc_small(f"{proc}/{tid}/task/{tid}/stat")
    except OSError:
        return None
    # comm may hold spaces and ')': the fields start after the last ')'.
    return data[data.rfind(b")") + 2:].split()


def task_start_time(tid: int, proc: str = "/proc") -> int | None:
    """The start time of a process or thread (clock ticks since boot), None if gone."""
    rest = _stat_fields(tid, proc)
    try:
        return int(rest[19]) if rest is not None else None
    except (IndexError, ValueError):
        return None


def task_ending(tid: int, proc: str = "/proc") -> bool:
    """Whether a task is exiting or has ended but is not reaped yet: its start time
    still reads as it was, but its memory, map_files included, is gone (or going:
    it goes before the task is a zombie)."""
    rest = _stat_fields(tid, proc)
    try:
        return rest is not None and (rest[0] in (b"Z", b"X") or bool(int(rest[6]) & PF_EXITING))
    except (IndexError, ValueError):
        return False


def cgroup_inode(path: str) -> int | None:
    """The inode of a cgroup v2 directory (its cgroup id), None if gone."""
    try:
        return os.stat(path).st_ino
    except OSError:
        return None


@dataclass(slots=True)
class _Watched:
    kind: str  # "pid", "tid" or "cgroup"
    ident: int | str
    identity: int | None  # start time, or inode
    gone: bool = False


class TargetWatch:
    """The -p/-t/-c targets of a run, checked for exits and reuse."""

    def __init__(
        self,
        pids: tuple[int, ...] = (),
        tids: tuple[int, ...] = (),
        cgroup: str | None = None,
        *,
        start_time: Callable[[int], int | None] = task_start_time,
        inode: Callable[[str], int | None] = cgroup_inode,
    ) -> None:
        self._start_time = start_time
        self._inode = inode
        self._watched = [_Watched("pid", p, start_time(p)) for p in pids]
        self._watched += [_Watched("tid", t, start_time(t)) for t in tids]
        if cgroup is not None:
            self._watched.append(_Watched("cgroup", cgroup, inode(cgroup)))
        for w in self._watched:
            w.gone = w.identity is None
        self.gone_pids: set[int] = set()
        self.gone_tids: set[int] = set()
        # Of those, the ids found naming another task: what is recorded under them
        # may be that task's.
        self._reused_pids: set[int] = set()
        self._reused_tids: set[int] = set()

    @property
    def configured(self) -> bool:
        """True when the run watches chosen targets rather than every task."""
        return bool(self._watched)

    @property
    def anything_left(self) -> bool:
        """False once every chosen target is gone (always True without targets)."""
        return not self._watched or any(not w.gone for w in self._watched)

    def check(self) -> list[str]:
        """Look again; return a notice for each target found gone since the last check."""
        lost: list[str] = []
        for w in self._watched:
            if w.gone:
                continue
            now = self._inode(str(w.ident)) if w.kind == "cgroup" else \
                self._start_time(int(w.ident))
            if now != w.identity:
                w.gone = True
                lost.append(gone_notice(w.kind, w.ident, reused=now is not None))
                if w.kind == "pid":
                    self.gone_pids.add(int(w.ident))
                    if now is not None:
                        self._reused_pids.add(int(w.ident))
                elif w.kind == "tid":
                    self.gone_tids.add(int(w.ident))
                    if now is not None:
                        self._reused_tids.add(int(w.ident))
        return lost

    @property
    def any_reused(self) -> bool:
        """Whether some target's id was found naming another task."""
        return bool(self._reused_pids or self._reused_tids)

    def accepts(self, pid: int, tid: int) -> bool:
        """False for a record under the id of a target found naming another task now.

        A target that exited is still accepted: what was recorded of it (its
        last blocks, drained in the sub-tick that found it gone) is its own,
        and nothing more is recorded under its id once the probe forgets it
        (`BpfSource._check_targets`)."""
        return pid not in self._reused_pids and tid not in self._reused_tids

    def watching(self, pid: int, tid: int) -> bool:
        """False for a target that is gone, exited or not (for what is blocked now)."""
        return pid not in self.gone_pids and tid not in self.gone_tids

    def initially_gone(self) -> list[str]:
        """Notices for targets already gone when watching began."""
        return [gone_notice(w.kind, w.ident) for w in self._watched if w.identity is None]


def gone_notice(kind: str, ident: int | str, *, reused: bool = False) -> str:
    """How a lost target is said: `pid 123 exited`, `cgroup /sys/fs/cgroup/x was removed`."""
    if kind == "cgroup":
        return f"cgroup {ident} was removed"
    what = "process" if kind == "pid" else "thread"
    return f"{kind} {ident} exited" + (f" (its id now names another {what}: not followed)"
                                        if reused else "")
