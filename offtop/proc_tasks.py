"""Tasks blocked before offtop started, from what /proc says about them.

The probe sees a block when it begins (switch-out): a task that was already
asleep when offtop attached would stay invisible until it wakes, and the
hung process is the first thing people look for. /proc knows: each task's
state (`stat`), where it last ran and when (`sched`: se.exec_start, on the
scheduler's clock, which `update_curr()` stamps at dequeue, i.e. when the
task went to sleep), and its kernel stack (`stack`).

The scheduler's clock (rq_clock_task) is not CLOCK_MONOTONIC: it leaves out
time spent in interrupts and, on a VM, the time the host stole, and each CPU
has its own. `SchedClock` measures the offset on each CPU (a thread pinned
there reads its own exec_start right after it is switched in); a block's
start is then its exec_start plus the offset of the CPU it last ran on: late
by that CPU's interrupt and steal time between the block's start and the
measurement (what came before is not kept anywhere). Shown as an estimate:
on a quiet VM here the offset moved 0.03% of the time; a busy host steals
more (a block found ~1.5% short once).

Every file here belongs to a task any user may control; each read is small
and bounded, and a task that vanishes midway is skipped.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

#: /proc/PID/stat flags: a kernel thread (include/linux/sched.h PF_KTHREAD).
PF_KTHREAD = 0x00200000


@dataclass(frozen=True, slots=True)
class TaskStat:
    """The fields of /proc/PID/task/TID/stat that offtop uses."""

    pid: int
    tid: int
    state: str
    flags: int
    cpu: int
    start: int


def _read(path: str, limit: int = 8192) -> bytes | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        return os.read(fd, limit)
    except OSError:
        return None
    finally:
        os.close(fd)


def parse_stat(pid: int, tid: int, data: bytes) -> TaskStat | None:
    """A TaskStat from the bytes of a stat file (None if malformed)."""
    # The comm may hold anything, ')' and spaces included: fields follow the last ')'.
    rest = data[data.rfind(b")") + 2:].split()
    try:
        return TaskStat(pid, tid, rest[0].decode("ascii", "replace"), int(rest[6]),
                        int(rest[36]), int(rest[19]))
    except (IndexError, ValueError):
        return None


def task_stat(pid: int, tid: int, proc: str = "/proc") -> TaskStat | None:
    """The stat of one thread, None when gone."""
    data = _read(f"{proc}/{pid}/task/{tid}/stat")
    return parse_stat(pid, tid, data) if data else None


def exec_start_ns(pid: int, tid: int, proc: str = "/proc") -> int | None:
    """se.exec_start of a thread, in ns of its CPU's rq_clock_task (None if unknown)."""
    data = _read(f"{proc}/{pid}/task/{tid}/sched", 4096)
    if not data:
        return None
    for line in data.splitlines():
        if line.startswith(b"se.exec_start"):
            try:
                ms = line.split(b":", 1)[1].strip()
                whole, _, frac = ms.partition(b".")
                return int(whole) * 1_000_000 + int((frac + b"000000")[:6])
            except (IndexError, ValueError):
                return None
    return None


def kernel_stack(pid: int, tid: int, proc: str = "/proc") -> tuple[str, ...]:
    """Function names of a thread's kernel stack, innermost first (root only)."""
    data = _read(f"{proc}/{pid}/task/{tid}/stack", 16384)
    if not data:
        return ()
    out = []
    for line in data.splitlines():
        # "[<0>] do_nanosleep+0x6b/0x170"
        name = line.partition(b"] ")[2].partition(b"+")[0]
        if name:
            out.append(name.decode("ascii", "replace"))
    return tuple(out)


def iter_threads(proc: str = "/proc", *, limit: int = 200_000) -> Iterator[tuple[int, int]]:
    """(pid, tid) of every thread, at most `limit`."""
    n = 0
    try:
        pids = os.listdir(proc)
    except OSError:
        return
    for p in pids:
        if not p.isdigit():
            continue
        try:
            tids = os.listdir(f"{proc}/{p}/task")
        except OSError:
            continue
        for t in tids:
            if t.isdigit():
                yield int(p), int(t)
                n += 1
                if n >= limit:
                    return


def in_cgroup(pid: int, tid: int, cgroup_rel: str, proc: str = "/proc") -> bool:
    """Is the thread in cgroup v2 `cgroup_rel` (a path relative to the mount) or below it?"""
    data = _read(f"{proc}/{pid}/task/{tid}/cgroup", 4096)
    if not data:
        return False
    for line in data.splitlines():
        if line.startswith(b"0::"):
            path = line[3:].decode("utf-8", "replace").rstrip("/") or "/"
            want = cgroup_rel.rstrip("/") or "/"
            return want == "/" or path == want or path.startswith(want + "/")
    return False


class SchedClock:
    """Converts a CPU's scheduler clock (rq_clock_task) to CLOCK_MONOTONIC (see module doc)."""

    def __init__(self, *, samples: int = 3, proc: str = "/proc") -> None:
        self._samples = samples
        self._proc = proc
        self._offset: dict[int, int | None] = {}

    def to_monotonic(self, cpu: int, sched_ns: int) -> int | None:
        """The CLOCK_MONOTONIC time of `sched_ns` on `cpu` (None: could not measure)."""
        if cpu not in self._offset:
            self._offset[cpu] = self._measure(cpu)
        off = self._offset[cpu]
        return None if off is None else sched_ns + off

    def _measure(self, cpu: int) -> int | None:
        result: list[int] = []

        def probe() -> None:
            try:
                os.sched_setaffinity(0, {cpu})  # this thread only
            except OSError:
                return
            tid = threading.get_native_id()
            for _ in range(self._samples):
                time.sleep(0.001)  # switched out, then in: exec_start is fresh
                start = exec_start_ns(os.getpid(), tid, self._proc)
                now = time.monotonic_ns()
                if start is not None:
                    result.append(now - start)

        t = threading.Thread(target=probe, name="offtop-sched-clock", daemon=True)
        t.start()
        t.join(timeout=1.0)
        return min(result) if result else None


@dataclass(frozen=True, slots=True)
class BlockedTask:
    """A thread found blocked in /proc, and since when (CLOCK_MONOTONIC ns, estimated)."""

    pid: int
    tid: int
    state: str
    since_ns: int | None
    kernel: tuple[str, ...]
    exec_start: int | None  #: the raw se.exec_start, to check later that it did not run


def blocked_tasks(
    states: Iterable[str],
    *,
    accept: Callable[[int, int], bool],
    kthreads: bool,
    clock: SchedClock,
    proc: str = "/proc",
    limit: int = 20_000,
    deadline: float | None = None,
) -> list[BlockedTask]:
    """Threads in one of `states` now, that `accept(pid, tid)` keeps; at most `limit`.

    Stops at `deadline` (time.monotonic) with what it has. A thread `accept` turns
    down is not read: `offtop -p PID` on a machine of 10,000 threads read them all,
    and its target, late in /proc's order, could be past the deadline.
    """
    want = set(states)
    out: list[BlockedTask] = []
    for pid, tid in iter_threads(proc):
        if deadline is not None and time.monotonic() > deadline:
            break
        if not accept(pid, tid):
            continue
        st = task_stat(pid, tid, proc)
        if st is None or st.state not in want:
            continue
        if (st.flags & PF_KTHREAD) and not kthreads:
            continue
        start = exec_start_ns(pid, tid, proc)
        since = clock.to_monotonic(st.cpu, start) if start is not None else None
        out.append(BlockedTask(pid, tid, st.state, since, kernel_stack(pid, tid, proc), start))
        if len(out) >= limit:
            break
    return out
