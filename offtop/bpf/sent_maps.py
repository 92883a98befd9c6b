"""Executable mappings as the kernel sends them (perf's PERF_RECORD_MMAP2).

A process that execs and ends between two of offtop's looks at /proc (a
script's `grep`, a loop's `sleep 0.01`: milliseconds) leaves stacks whose
addresses mean nothing without its memory map, gone with it. The kernel
tells of each executable mapping as it is made to a perf event opened for
it (a software "dummy" event on each CPU with `mmap2` and `comm_exec`: no
samples, only these records), which is how `perf record` names processes
that live a millisecond. Here the records are kept per process from its last
exec on, and given to the symbolizer for a process gone before its first
sight (`SentMaps.mappings`, offtop.symbols).

Only what the kernel said, and only of the process offtop's probe noted last
under that pid (offtop.bpf.lineage): an exec noted at the same moment (within
EXEC_SLACK_NS), no fork of the pid since. Anything else gives None, never a
guess:

- a ring that overflowed (records lost) drops everything kept: a lost exec
  or mapping could make a list another process's, or short;
- a process that had not exec'd since offtop started (its mappings were made
  before) has no list; a forked one is named in its forker's map instead
  (offtop.bpf.lineage);
- files are opened by the path the kernel gave and used only while they are
  the file that was mapped (device and inode, offtop.symbols): a file replaced
  since gives no names. The path is the process's own view: one whose forker
  lives in another mount namespace (a container's) is looked for through that
  one's root (/proc/FORKER/root), which is the process's too unless it moved;
  the device and inode say whether it is the same file.

Bounded: MAX_PROCESSES processes (the oldest exec dropped first), each kept
KEEP_NS after its exec, MAX_MAPPINGS mappings each, MAX_TOTAL_MAPPINGS in all
(a user who execs processes that map a thousand pieces of code each costs
offtop megabytes, not gigabytes). The ring is read when the engine reads new
stacks (it does not wake the engine): a flood of records (execs, or threads
renamed: the kernel sends every new name) overflows it, which costs a reset
and the parsing of one ring's worth a read, no more.
"""

from __future__ import annotations

import bisect
import ctypes as ct
import os
import struct
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from offtop.bpf.perf_ring import ATTR_DISABLED, PERF_TYPE_SOFTWARE, PerfEventAttr, PerfRing
from offtop.safe_text import decode
from offtop.symbols import Mapping

PERF_COUNT_SW_DUMMY = 9
PERF_RECORD_COMM = 3
PERF_RECORD_MMAP2 = 10
PERF_RECORD_MISC_COMM_EXEC = 1 << 13
PERF_SAMPLE_TID = 1 << 1
PERF_SAMPLE_TIME = 1 << 2
CLOCK_BOOTTIME = 7  # the probe's clock (bpf_ktime_get_boot_ns), /proc's start times'

# perf_event_attr flag bits (beside perf_ring's).
_EXCLUDE_KERNEL = 1 << 5
_EXCLUDE_HV = 1 << 6
_MMAP = 1 << 8
_COMM = 1 << 9
_SAMPLE_ID_ALL = 1 << 18
_MMAP2 = 1 << 23
_COMM_EXEC = 1 << 24
_USE_CLOCKID = 1 << 25

#: PERF_RECORD_MMAP2 after its header: pid, tid, addr, len, pgoff, maj, min,
#: ino, ino_generation, prot, flags; then the file name, NUL-ended and padded.
_MMAP2_BODY = struct.Struct("<IIQQQIIQQII")
#: PERF_RECORD_COMM after its header: pid, tid; then the name.
_PIDS = struct.Struct("<II")
#: The sample_id every record ends with (sample_id_all, TID | TIME): pid, tid, time.
_SAMPLE_ID = struct.Struct("<IIQ")
_HEADER_SIZE = 8

#: A process's exec as the probe noted it (sched_process_exec) is this much
#: later, at most, than the kernel's record of it (the new name is set early
#: in the exec, the tracepoint fires at its end).
EXEC_SLACK_NS = 1_000_000_000
MAX_PROCESSES = 2048
MAX_MAPPINGS = 1024
MAX_TOTAL_MAPPINGS = 65_536
MAX_PATHS = 4096  #: distinct paths shared between processes' lists
#: How long a process's list is kept after its exec: a process gone at once has
#: its stacks resolved within a second or two of its end; one that lives longer
#: is seen alive, and named from /proc.
KEEP_NS = 30_000_000_000


@dataclass(slots=True)
class _Sent:
    exec_ns: int
    maps: list[Mapping] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)


def _mapping(body: bytes) -> tuple[int, int, Mapping] | None:
    """(pid, time, mapping) of one MMAP2 record (header included), or None if malformed."""
    if len(body) < _HEADER_SIZE + _MMAP2_BODY.size + _SAMPLE_ID.size:
        return None
    pid, _tid, addr, length, pgoff, maj, mnr, ino, _gen, _prot, _flags = \
        _MMAP2_BODY.unpack_from(body, _HEADER_SIZE)
    _p, _t, ts = _SAMPLE_ID.unpack_from(body, len(body) - _SAMPLE_ID.size)
    raw = body[_HEADER_SIZE + _MMAP2_BODY.size: len(body) - _SAMPLE_ID.size].split(b"\0", 1)[0]
    if not 0 < length < 1 << 47 or addr + length >= 1 << 64:
        return None
    path = decode(raw)
    if path == "//anon":
        path = ""
    usable = path.startswith("/") and not path.endswith(" (deleted)")
    return pid, ts, Mapping(addr, addr + length, pgoff, path, path if usable else "",
                            ident=(os.makedev(maj & 0xFFF, mnr & 0xFFFFF), ino))


class SentMaps:
    """Each exec'd process's executable mappings, from the kernel's records
    (`take`, as PerfRing.drain_records gives them).

    `noted_exec(pid)` is the probe's note of when the process now under `pid`
    last exec'd, if it did and was not forked since (boot-clock ns,
    offtop.bpf.lineage). `now_ns` reads the boot clock.
    """

    def __init__(self, noted_exec: Callable[[int], tuple[int, int] | None], *,
                 now_ns: Callable[[], int] = lambda: time.clock_gettime_ns(CLOCK_BOOTTIME),
                 max_processes: int = MAX_PROCESSES, proc: str = "/proc") -> None:
        self._noted_exec = noted_exec
        self._proc = proc
        self._mount_ns = _mount_ns("self", proc)
        self._now_ns = now_ns
        self._max = max_processes
        self._procs: dict[int, _Sent] = {}  # in the order of their execs
        self._total = 0  # mappings kept, all processes together
        self._paths: dict[str, str] = {}  # one string per path, shared by processes
        #: Times everything kept was dropped for lost records.
        self.resets = 0

    def __len__(self) -> int:
        return len(self._procs)

    def __contains__(self, pid: object) -> bool:
        """Whether an exec of `pid` was read (its list may still not be given)."""
        return pid in self._procs

    def take(self, records: Iterable[tuple[int, int, bytes]]) -> None:
        """Take in a batch of records, in any order across CPUs (each has its time)."""
        mmaps: list[tuple[int, int, Mapping]] = []
        for typ, misc, body in records:
            if typ == PERF_RECORD_COMM and misc & PERF_RECORD_MISC_COMM_EXEC:
                if len(body) >= _HEADER_SIZE + _PIDS.size + _SAMPLE_ID.size:
                    pid = _PIDS.unpack_from(body, _HEADER_SIZE)[0]
                    ts = _SAMPLE_ID.unpack_from(body, len(body) - _SAMPLE_ID.size)[2]
                    self._exec(pid, ts)
            elif typ == PERF_RECORD_MMAP2:
                got = _mapping(body)
                if got is not None:
                    mmaps.append(got)
        # After every exec in the batch: a CPU's records may be read before
        # those of the CPU the exec began on.
        for pid, ts, m in mmaps:
            self._add(pid, ts, m)
        self._expire()

    def lost(self) -> None:
        """Records were lost: nothing kept can be trusted to be whole."""
        if self._procs:
            self.resets += 1
        self._procs.clear()
        self._paths.clear()
        self._total = 0

    def exec_at(self, pid: int) -> int | None:
        """When the process under `pid` last exec'd, as the kernel recorded it
        (boot-clock ns), if read and still kept; a dict lookup, no check."""
        s = self._procs.get(pid)
        return s.exec_ns if s is not None else None

    def covers(self, pid: int, addr: int) -> bool:
        """Whether a mapping at `addr` was sent since the last exec of `pid`; no check."""
        s = self._procs.get(pid)
        if s is None:
            return False
        i = bisect.bisect_right(s.starts, addr) - 1
        return i >= 0 and addr < s.maps[i].end

    def mappings(self, pid: int) -> tuple[int, list[Mapping]] | None:
        """(exec time, mappings sorted by start) of the process under `pid`, if the
        kernel's records of it since its exec are all here (module docstring)."""
        s = self._procs.get(pid)
        if s is None:
            return None
        noted = self._noted_exec(pid)
        if noted is None or not 0 <= noted[0] - s.exec_ns <= EXEC_SLACK_NS:
            return None
        root = self._root_of(noted[1])
        if not root:
            return s.exec_ns, list(s.maps)
        return s.exec_ns, [Mapping(m.start, m.end, m.offset, m.path, root + m.handle, ident=m.ident)
                           if m.handle else m for m in s.maps]

    def _root_of(self, forker: int) -> str:
        """Where the paths a process forked by `forker` saw are, from here: "" if in
        this mount namespace (or unknown), else /proc/FORKER/root."""
        if not forker:
            return ""
        ns = _mount_ns(str(forker), self._proc)
        return f"{self._proc}/{forker}/root" if ns and ns != self._mount_ns else ""

    def _exec(self, pid: int, ts: int) -> None:
        old = self._procs.pop(pid, None)
        if old is not None:
            if old.exec_ns >= ts:
                self._procs[pid] = old  # an older exec, read late
                return
            self._total -= len(old.maps)
        if len(self._procs) >= self._max:
            self._drop_oldest()
        self._procs[pid] = _Sent(ts)

    def _drop_oldest(self) -> None:
        pid = next(iter(self._procs))
        self._total -= len(self._procs.pop(pid).maps)

    def _add(self, pid: int, ts: int, m: Mapping) -> None:
        s = self._procs.get(pid)
        if s is None or ts < s.exec_ns or len(s.maps) >= MAX_MAPPINGS:
            return  # not exec'd while watched (or before this exec): not whole
        while self._total >= MAX_TOTAL_MAPPINGS and next(iter(self._procs)) != pid:
            self._drop_oldest()
        if len(self._paths) >= MAX_PATHS:
            self._paths.clear()  # sharing starts over; nothing is wrong
        path = self._paths.setdefault(m.path, m.path)
        m = Mapping(m.start, m.end, m.offset, path, path if m.handle else "", ident=m.ident)
        # A new mapping replaces whatever it overlaps (the kernel unmapped it).
        lo = bisect.bisect_right(s.starts, m.start) - 1
        if lo < 0 or s.maps[lo].end <= m.start:
            lo += 1
        hi = bisect.bisect_left(s.starts, m.end)
        self._total += 1 - (hi - lo)
        s.maps[lo:hi] = [m]
        s.starts[lo:hi] = [m.start]

    def _expire(self) -> None:
        """Drop the lists of execs older than KEEP_NS: from the front (exec order),
        so a batch costs what it drops, not what is kept."""
        old = self._now_ns() - KEEP_NS
        procs = self._procs
        while procs and procs[next(iter(procs))].exec_ns < old:
            self._drop_oldest()


def _mount_ns(pid: str, proc: str) -> str:
    """The mount namespace of a process ("" if gone)."""
    try:
        return os.readlink(f"{proc}/{pid}/ns/mnt")
    except OSError:
        return ""


def watch_attr() -> PerfEventAttr:
    """The dummy event's attributes: exec and executable-mapping records only,
    stamped with the probe's clock (nobody polls for them: read as stacks are)."""
    attr = PerfEventAttr()
    attr.type = PERF_TYPE_SOFTWARE
    attr.size = ct.sizeof(PerfEventAttr)
    attr.config = PERF_COUNT_SW_DUMMY
    attr.sample_period = 1
    attr.sample_type = PERF_SAMPLE_TID | PERF_SAMPLE_TIME
    attr.flags = (ATTR_DISABLED | _EXCLUDE_KERNEL | _EXCLUDE_HV | _MMAP | _COMM
                  | _SAMPLE_ID_ALL | _MMAP2 | _COMM_EXEC | _USE_CLOCKID)
    attr.clockid = CLOCK_BOOTTIME
    return attr


class MappingWatch:
    """The kernel's exec and mapping records on every CPU, read into a SentMaps."""

    def __init__(self, sent: SentMaps, *, pages: int = 32) -> None:
        self.sent = sent
        self.ring = PerfRing(None, pages=pages, attr=watch_attr())
        self._lost = 0
        self._out: list[tuple[int, int, bytes]] = []

    def read(self) -> int:
        """Take in what the rings hold; how many records."""
        out = self._out
        n = self.ring.drain_records(out)
        if self.ring.lost != self._lost:
            self._lost = self.ring.lost
            self.sent.lost()
        if out:
            self.sent.take(out)
            out.clear()
        return n

    @property
    def lost(self) -> int:
        return self.ring.lost

    def close(self) -> None:
        self.ring.close()
