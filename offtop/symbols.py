"""Addresses to function names: kernel via kallsyms, user via ELF, per process.

User symbols are cached per (pid, process start time), so a pid reused by a
new process never inherits the old one's names. A process's memory map is
read at first sight, while it is alive, and its binaries are opened through
/proc/PID/map_files, which works even once a binary is deleted or replaced
on disk; parsed files are shared by every process that maps it
(offtop.elf). Dead processes are forgotten after a grace period.

Everything a process controls is untrusted here: its maps (paths are bytes,
decoded with replacement), its binaries (offtop.elf checks them), its perf
map (read only when it is a regular file owned by the process's user or
root, capped in size and line length, read incrementally). What cannot be
resolved is said, never guessed:

- an address inside a mapping that cannot be named is `module+0xOFFSET`
  (the offset in the file), and the cause is counted in `errors`;
- an address outside every executable mapping and every perf-map entry is
  not trusted (a frame-pointer walk through code without frame pointers
  reads garbage): the stack is cut there and ends with MARK_TRUNCATED;
- a process gone before its first sight (its map gone with it) gives the
  stack MARK_PROCESS_GONE alone, unless `stand_in` names a living process
  whose memory it was forked with (offtop.bpf.lineage): then its addresses
  are resolved in that one's map and files, perf maps aside (a JIT's code
  there may be another since the fork: anonymous memory stays unnamed);
- a process's map is another program's once it execs, its pid and start time
  unchanged: a map read before an exec the kernel recorded (`exec_at`) is read
  again, or, the process gone, taken from the mappings the kernel sent for that
  exec; one read while the exec's loader still mapped libraries is completed
  from those; a read again that finds the process gone keeps the map it had, and
  the files read through its map_files while it lived (not what their paths hold
  since: an upgrade's new library);
- caller frames (every address after the first is a return address) are
  looked up at address - 1, so a function ending in a call to a noreturn
  function is not reported as the function placed after it;
- with a `deadline`, files are loaded only until then; later frames come back
  as `module+0xOFFSET`, uncached, and resolve at a later call.
"""

from __future__ import annotations

import bisect
import os
import sys
import time
from array import array
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Sequence
from collections.abc import Mapping as MappingABC
from dataclasses import dataclass, field
from itertools import accumulate

from offtop.elf import TIME_BUDGET, ElfCache, ElfSymbols
from offtop.model import MARK_PROCESS_GONE, MARK_TRUNCATED, Frame
from offtop.packed_strings import PackedStrings
from offtop.safe_files import UNREADABLE, FileRefused, open_regular, read_proc_file
from offtop.safe_text import decode
from offtop.targets import task_ending, task_start_time

#: Kernel frames added by the tracer itself, stripped from the innermost end.
TRACER_FRAME_PREFIXES = (
    "bpf_prog_",
    "bpf_trace_run",
    "__bpf_trace_",
    "perf_trace_",
    "trace_call_bpf",
    "bpf_get_stack",
    "__traceiter_",
    "bpf_perf_event_output",
)


def is_tracer_frame(name: str) -> bool:
    """True for frames of the BPF/tracing machinery rather than the workload."""
    return name.startswith(TRACER_FRAME_PREFIXES)


def strip_tracer_frames(frames: Sequence[Frame]) -> tuple[Frame, ...]:
    """Drop tracer frames from the innermost end of a kernel stack."""
    i = 0
    while i < len(frames) and is_tracer_frame(frames[i].name):
        i += 1
    return tuple(frames[i:])


#: kallsyms' types of text symbols (functions), as bytes' ints.
_KALLSYMS_TEXT = frozenset(b"tTwW")


def _hex_numbers(lines: list[bytes], width: int) -> tuple[list[bytes], Sequence[int]]:
    """(`lines`, their addresses as numbers): kallsyms' lines, their first `width`
    bytes lowercase hexadecimal. At 16 digits decoded all at once (1.4-2.5x
    faster than a call per address, which would also need each checked). A
    line whose address is not hexadecimal (none in a kernel's kallsyms) is
    left out."""
    digits = [line[:width] for line in lines]
    if width == 16:
        try:
            numbers = array("Q", bytes.fromhex(b"".join(digits).decode("ascii")))
        except (ValueError, UnicodeDecodeError):
            numbers = array("Q")
        if len(numbers) == len(lines):
            if sys.byteorder == "little":
                numbers.byteswap()
            return lines, numbers
    kept = [i for i, d in enumerate(digits) if d and not d.strip(b"0123456789abcdef")]
    return [lines[i] for i in kept], [int(digits[i], 16) for i in kept]


def _symbol_range(kallsyms: bytes, width: int, first: bytes, last: bytes) -> tuple[int, int] | None:
    """The addresses of two symbols of /proc/kallsyms, (first's, last's), if both are
    there, nonzero and in order."""
    found = []
    for name in (first, last):
        at = kallsyms.find(b" " + name + b"\n")
        line = kallsyms[kallsyms.rfind(b"\n", 0, at) + 1:at] if at >= 0 else b""
        try:
            found.append(int(line[:width], 16) if len(line) == width + 2 else 0)
        except ValueError:
            found.append(0)
    lo, hi = found
    return (lo, hi) if 0 < lo < hi else None


class KernelSymbols:
    """/proc/kallsyms, sorted, looked up by bisection, cached per address.

    Its lines ("ADDRESS TYPE NAME", then a module in brackets after a tab) are
    sorted whole: the addresses are hexadecimal of one width, so the lines sort
    by address as bytes. ~120,000 lines are read and sorted in ~65 ms
    (splitting each into fields and numbers took ~140 ms of offtop's
    start-up). They are then kept as numbers side by side (an array, bisected
    in C) and the rest of the lines end to end (with where each ends),
    compressed (`PackedStrings`): as 120,000 bytes objects they held ~10 MB,
    all of offtop's life; end to end 2.8 MB, compressed 0.56 (the table: 2.0 MiB).
    """

    #: Addresses whose frames are cached at most. Interrupts wake tasks from
    #: wherever they stop the kernel, so the addresses seen grow for long: at
    #: the busy server ~6,000 in the first minute, then 40-80 a second (65,536,
    #: the bound before, within half an hour). An address costs ~100 bytes in
    #: the cache; its frame is shared with every address in the same function.
    MAX_CACHED = 1 << 14

    def __init__(self, path: str = "/proc/kallsyms") -> None:
        with open(path, "rb") as f:
            data = f.read()
        lines = data.rstrip(b"\n").split(b"\n") if data else []
        w = self._width = max(lines[0].find(b" "), 1) if lines else 1
        #: The kernel's entry code, [start, end) (where interrupts' paths begin), if listed.
        self.entry_text = _symbol_range(data, w, b"__entry_text_start", b"__entry_text_end")
        text = _KALLSYMS_TEXT
        # A line of another address width (none on a sane kernel) is left out.
        mine = [line for line in lines if len(line) > w + 3 and line[w] == 32 and line[w + 1] in text]
        del lines, data
        mine.sort()
        zero = b"0" * w
        if mine and mine[0].startswith(zero):
            # kptr_restrict hides addresses (all zero) from unprivileged readers.
            mine = [line for line in mine if not line.startswith(zero)]
        # Built a slice of lines at a time: a list of every piece at once
        # would double start-up's peak.
        self._addrs, rests, lengths = array("Q"), [], array("Q")
        for lo in range(0, len(mine), 8192):
            part, numbers = _hex_numbers(mine[lo:lo + 8192], w)
            self._addrs.extend(numbers)
            rests.append(b"".join([line[w + 3:] for line in part]))
            lengths.extend([len(line) - w - 3 for line in part])
        del mine
        # Kept compressed (2.8 MB of names in 0.56): a frame names a function once.
        self._rests = PackedStrings.packed(b"".join(rests))
        # 4-byte offsets: the names of a kernel run to a few MB.
        self._ends = array("I" if sum(lengths) < 1 << 32 else "Q", accumulate(lengths))
        self._cache: dict[int, Frame] = {}
        self._by_symbol: dict[int, Frame] = {}
        self.available = bool(self._ends)

    def resolve(self, addr: int) -> Frame:
        """The function containing `addr`, or the address itself."""
        f = self._cache.get(addr)
        if f is None:
            if len(self._cache) >= self.MAX_CACHED:
                # Frames already handed out stay as they are.
                self._cache.clear()
                self._by_symbol.clear()
            i = bisect.bisect_right(self._addrs, addr) - 1 if addr < 1 << (4 * self._width) else -1
            if i >= 0:
                f = self._by_symbol.get(i)
                if f is None:
                    start = self._ends[i - 1] if i else 0
                    rest = self._rests.read(start, self._ends[i] - start)
                    f = self._by_symbol[i] = Frame(name=decode(rest.split(b"\t", 1)[0]),
                                                   module="kernel", kernel=True)
            else:
                f = Frame(name=f"0x{addr:x}", module="kernel", kernel=True)
            self._cache[addr] = f
        return f

    def resolve_stack(self, addrs: Iterable[int]) -> tuple[Frame, ...]:
        """A kernel stack, innermost first, tracer frames stripped."""
        return strip_tracer_frames([self.resolve(a) for a in addrs])



# --- user space ----------------------------------------------------------------------

#: Causes counted in `UserSymbols.errors` beside offtop.safe_files' and offtop.elf's.
NO_SYMBOL = "no symbol at address"
UNTRUSTED = "frame outside mappings"
PROCESS_GONE = "process gone"
MAPS_TOO_LARGE = "maps too large"
PERF_MAP_PREFIX = "perf map "
PERF_MAP_TRUNCATED = "perf map too large"
PERF_MAP_LONG_LINE = "perf map line too long"

#: The module of frames named from a perf map.
JIT_MODULE = "[jit]"

#: Caps on what one process may make offtop read and keep.
MAX_MAPS_BYTES = 2 << 20  # ~20,000 lines: 10x a browser's; ~30 ms to read and parse
MAX_MAPPINGS = 16384  # executable mappings kept per process
MAX_PERF_MAP_BYTES = 64 << 20
MAX_PERF_MAP_ENTRIES = 1 << 18
MAX_PERF_MAP_LINE = 4096
MAX_JIT_NAME_CHARS = 1024
#: A process's maps and perf map are read again after a miss, at most this often.
REREAD_S = 1.0


@dataclass(frozen=True, slots=True)
class Mapping:
    """One executable mapping of a process (from /proc/PID/maps)."""

    start: int
    end: int
    offset: int
    path: str  # as maps shows it (decoded with replacement), " (deleted)" included
    handle: str  # what to open: /proc/PID/map_files/START-END; "" for anonymous memory
    #: (device, inode) the kernel said was mapped, for a mapping it sent
    #: (offtop.bpf.sent_maps): `handle` is then a path, used only while the
    #: file there is that one.
    ident: tuple[int, int] | None = None

    @property
    def module(self) -> str:
        """The file's base name without " (deleted)"; `vdso`, `anon`, … for memory."""
        if not self.path.startswith("/"):
            return self.path.strip("[]").split(":", 1)[0] or "anon"
        return os.path.basename(self.path.removesuffix(" (deleted)"))


def read_maps(pid: int, proc: str = "/proc", *, errors: Counter[str] | None = None) -> list[Mapping]:
    """Executable mappings of a process, sorted by address ([] if it is gone).

    At most MAX_MAPS_BYTES of the file and MAX_MAPPINGS mappings are read
    (a process can map one file 65,000 times); a cut is counted in `errors`.
    """
    out: list[Mapping] = []
    try:
        data, cut = read_proc_file(f"{proc}/{pid}/maps", MAX_MAPS_BYTES)
    except FileRefused:
        return out
    lines = data.split(b"\n")
    if cut:
        lines.pop()  # a partial line
    for line in lines:
        parts = line.split(None, 5)
        if len(parts) < 5 or b"x" not in parts[1]:
            continue
        if len(out) >= MAX_MAPPINGS:
            cut = True
            break
        lo, _, hi = parts[0].partition(b"-")
        try:
            start, end, offset = int(lo, 16), int(hi, 16), int(parts[2], 16)
        except ValueError:
            continue
        path = decode(parts[5]) if len(parts) == 6 else ""
        # map_files names are unpadded (maps pads addresses to 8 digits).
        handle = f"{proc}/{pid}/map_files/{start:x}-{end:x}" if path.startswith("/") else ""
        out.append(Mapping(start, end, offset, path, handle))
    if cut and errors is not None:
        errors[MAPS_TOO_LARGE] += 1
    out.sort(key=lambda m: m.start)
    return out


def process_euid(pid: int, proc: str = "/proc") -> int | None:
    """The effective uid of a process (from /proc/PID/status), or None if gone."""
    try:
        data, _ = read_proc_file(f"{proc}/{pid}/status", 64 << 10)
    except FileRefused:
        return None
    for line in data.split(b"\n"):
        if line.startswith(b"Uid:"):
            fields = line.split()
            if len(fields) >= 3 and fields[2].isdigit():
                return int(fields[2])
    return None


class PerfMap:
    """A process's JIT symbols from /tmp/perf-PID.map, read as the file grows.

    perf's own rule: the file is read only if it is a regular file owned by
    the process's user or by root, so a file another user planted for
    someone else's pid is ignored; it is never followed through a symlink.
    Reads are capped in total bytes, entries and line length: a 1 GB
    sparse file without a newline costs one capped read, no memory.
    """

    def __init__(self, paths: Sequence[str], owners: Collection[int]) -> None:
        self._paths = paths
        self._owners = owners
        self._identity: tuple[int, int] | None = None
        self._offset = 0  # bytes consumed so far
        self._carry = b""  # a line not yet ended
        self._skipping = False  # inside a line longer than MAX_PERF_MAP_LINE
        self._starts: list[int] = []
        self._ends: list[int] = []
        self._names: list[str] = []
        #: Problems met so far, by cause (each counted once by UserSymbols).
        self.errors: set[str] = set()

    def __len__(self) -> int:
        return len(self._starts)

    def _reset(self, identity: tuple[int, int]) -> None:
        self._identity = identity
        self._offset = 0
        self._carry = b""
        self._skipping = False
        self._starts, self._ends, self._names = [], [], []

    def lookup(self, addr: int) -> str | None:
        """The JIT symbol containing `addr`, if any."""
        i = bisect.bisect_right(self._starts, addr) - 1
        if i >= 0 and addr < self._ends[i]:
            return self._names[i]
        return None

    def refresh(self, deadline: float | None = None,
                clock: Callable[[], float] = time.monotonic) -> bool:
        """Read what was appended since the last refresh (until `deadline`).

        True when the file was read to its end (or its cap), or refused;
        False when there is none yet (a runtime may write it later) or
        `deadline` cut the read short.
        """
        f = None
        for path in self._paths:
            try:
                f = open_regular(path, follow_symlinks=False, owners=self._owners)
                break
            except FileRefused as e:
                if not e.gone:
                    self.errors.add(PERF_MAP_PREFIX + e.cause)
                    return True
        if f is None:
            return False
        complete = True
        with f:
            identity = (f.stat.st_dev, f.stat.st_ino)
            if identity != self._identity or f.size < self._offset:  # replaced or rewritten
                self._reset(identity)
            end = min(f.size, MAX_PERF_MAP_BYTES)
            if f.size > MAX_PERF_MAP_BYTES:
                self.errors.add(PERF_MAP_TRUNCATED)
            added: list[tuple[int, int, str]] = []
            try:
                for chunk in f.chunks(start=self._offset, limit=max(0, end - self._offset)):
                    self._offset += len(chunk)
                    self._take(chunk, added)
                    if self._offset < end and deadline is not None and clock() >= deadline:
                        complete = False
                        break
            except FileRefused as e:
                self.errors.add(PERF_MAP_PREFIX + e.cause)
        if added:
            self._add(added)
        return complete

    def _take(self, chunk: bytes, added: list[tuple[int, int, str]]) -> None:
        lines = chunk.split(b"\n")
        last = lines.pop()  # not ended yet (b"" when the chunk ends a line)
        if lines:
            first = lines[0]
            if self._skipping:
                lines[0] = b""  # the end of an overlong line
                self._skipping = False
            else:
                lines[0] = self._carry + first
            self._carry = b""
        for line in lines:
            if len(line) > MAX_PERF_MAP_LINE:
                self.errors.add(PERF_MAP_LONG_LINE)
                continue
            entry = _perf_map_entry(line)
            if entry is not None and len(self._starts) + len(added) < MAX_PERF_MAP_ENTRIES:
                added.append(entry)
        if self._skipping:
            return
        if len(self._carry) + len(last) > MAX_PERF_MAP_LINE:
            self.errors.add(PERF_MAP_LONG_LINE)
            self._carry = b""
            self._skipping = True
        else:
            self._carry += last

    def _add(self, added: list[tuple[int, int, str]]) -> None:
        added.sort()
        if self._starts and added[0][0] < self._starts[-1]:
            merged = sorted(zip(self._starts, self._ends, self._names, strict=True))
            merged += added
            merged.sort()
        else:
            merged = [*zip(self._starts, self._ends, self._names, strict=True), *added]
        self._starts = [e[0] for e in merged]
        self._ends = [e[1] for e in merged]
        self._names = [e[2] for e in merged]


def _perf_map_entry(line: bytes) -> tuple[int, int, str] | None:
    """`START SIZE NAME` (hex, as perf writes and reads it) or None."""
    parts = line.split(b" ", 2)
    if len(parts) != 3:
        return None
    try:
        start, size = int(parts[0], 16), int(parts[1], 16)
    except ValueError:
        return None
    if not 0 < size < 1 << 40 or not 0 <= start < 1 << 64:
        return None
    name = decode(parts[2])
    if len(name) > MAX_JIT_NAME_CHARS:
        name = name[: MAX_JIT_NAME_CHARS - 1] + "…"
    return start, start + size, name


@dataclass(slots=True)
class _Proc:
    start: int
    maps: list[Mapping]
    starts: list[int]
    maps_read_at: float
    #: Boot-clock ns the map holds from: taken before its read from /proc, or the
    #: exec the kernel sent it for. An exec of the pid after it makes it another
    #: program's (`exec_at`).
    since_ns: int = 0
    files: list[Mapping] | None = None  # the file mappings of `maps`, made at first ask
    # Mapping start -> (when found, its file's symbols): the cache's answer
    # without a stat of map_files for every new address (see _file_frame).
    tables: dict[int, tuple[float, ElfSymbols]] = field(default_factory=dict)
    frames: dict[int, Frame] = field(default_factory=dict)
    dead_since: float | None = None
    perf_map: PerfMap | None = None
    perf_map_read_at: float = float("-inf")
    sent_ns: int = 0  # the exec time of the mappings the kernel sent, if known
    made_from_sent: bool = False  # `maps` are those mappings (not /proc's)


class UserSymbols:
    """Per-process user symbol resolution (see the module docstring)."""

    def __init__(
        self,
        *,
        grace_s: float = 10.0,
        max_processes: int = 4096,
        max_frames: int = 1 << 20,
        max_shared: int = 1 << 17,
        clock: Callable[[], float] = time.monotonic,
        now_ns: Callable[[], int] = lambda: time.clock_gettime_ns(time.CLOCK_BOOTTIME),
        start_time: Callable[[int], int | None] = task_start_time,
        maps: Callable[[int], list[Mapping]] | None = None,
        elf_cache: ElfCache | None = None,
        proc: str = "/proc",
    ) -> None:
        self._procs: dict[int, _Proc] = {}
        self._grace = grace_s
        self._max = max_processes
        self._max_frames = max_frames
        self._frames = 0  # cached frames, all processes together
        self._shared: dict[Frame, Frame] = {}
        self._max_shared = max_shared
        self._clock = clock
        self._now_ns = now_ns
        self._start_time = start_time
        self._errors: Counter[str] = Counter()
        self._read_maps = maps or (lambda pid: read_maps(pid, proc, errors=self._errors))
        self._proc_root = proc
        self.elf = elf_cache if elf_cache is not None else ElfCache(clock=clock)
        self.misses = 0
        #: The living process whose memory map a process gone before its first
        #: sight was forked with, and its start time (None: none known); set by
        #: the engine (offtop.bpf.lineage).
        self.stand_in: Callable[[int], tuple[int, int] | None] | None = None
        #: Stacks of processes gone before their first sight resolved in a stand-in's map.
        self.stood_in = 0
        #: A gone process's exec time and executable mappings as the kernel sent
        #: them (None: not known whole); set by the engine (offtop.bpf.sent_maps).
        self.sent: Callable[[int], tuple[int, list[Mapping]] | None] = lambda pid: None
        #: Processes gone before their first sight named in the mappings the kernel sent.
        self.from_sent = 0
        #: When the process under a pid last exec'd as the kernel recorded it
        #: (boot-clock ns; None: not seen): cheap, asked at every lookup. Set by
        #: the engine (offtop.bpf.sent_maps).
        self.exec_at: Callable[[int], int | None] = lambda pid: None
        #: Whether the kernel sent a mapping at an address of the process under a
        #: pid since its last exec (unchecked, cheap: asked at a miss, before
        #: `sent`). Set by the engine (offtop.bpf.sent_maps).
        self.sent_covers: Callable[[int, int], bool] = lambda pid, addr: False
        #: Maps dropped because their process exec'd after they were read.
        self.execs_since_read = 0
        # pid -> (when asked, the answer): a gone process's stacks and their
        # unwinding ask again and again, a read of the probe's notes and of
        # /proc each time; an answer holds for REREAD_S.
        self._stand_ins: dict[int, tuple[float, tuple[int, int] | None]] = {}

    @property
    def errors(self) -> MappingABC[str, int]:
        """Frames that could not be named since offtop started, by cause."""
        return self._errors

    @property
    def cached_processes(self) -> int:
        """How many processes have a symbol cache."""
        return len(self._procs)

    @property
    def cached_frames(self) -> int:
        """How many resolved frames are cached, all processes together (<= max_frames)."""
        return self._frames

    def _new_proc(self, pid: int, start: int) -> _Proc:
        since = self._now_ns()  # before the read: an exec during it makes it stale
        maps = self._read_maps(pid)
        return _Proc(start=start, maps=maps, starts=[m.start for m in maps],
                     maps_read_at=self._clock(), since_ns=since)

    def _proc(self, pid: int, start: int | None = None) -> _Proc | None:
        if start is None:
            start = self._start_time(pid)
        p = self._procs.get(pid)
        if p is not None and self._exec_since(pid, p):
            # The pid exec'd since its map was read (a shell's child, read as the
            # shell, then `sleep`): the same process, another program's memory.
            self.execs_since_read += 1
            self._forget(pid)
            if start is None:  # gone: only the kernel's records of the exec are left
                return self._sent_proc(pid, p.start)
            p = None
        if p is not None:
            if start is None and p.made_from_sent and not self._sent_holds(pid, p):
                self._forget(pid)  # another process under the pid since
            elif start is None:  # gone: keep what we know, until the grace ends
                if p.dead_since is None:
                    p.dead_since = self._clock()
                return p
            elif start == p.start:
                return p
            else:
                self._forget(pid)  # pid reused by another process
        if start is None:
            return self._sent_proc(pid, -1)
        if len(self._procs) >= self._max:
            self.evict(force=True)
        p = self._new_proc(pid, start)
        if not p.maps:
            # Seen alive (its start is known) but gone, or a zombie (its start
            # still readable, its map empty), before its map was read.
            sent = self._sent_proc(pid, start)
            if sent is not None:
                return sent
        self._procs[pid] = p
        return p

    def _exec_since(self, pid: int, p: _Proc) -> bool:
        """Whether the process under `pid` exec'd after `p`'s map was had."""
        exec_ns = self.exec_at(pid)
        return exec_ns is not None and exec_ns > p.since_ns

    def _sent_proc(self, pid: int, start: int) -> _Proc | None:
        """A gone process's cache made from the mappings the kernel sent, if known
        (`start`: its start time, -1 if unknown)."""
        got = self.sent(pid)
        if got is None:
            return None
        exec_ns, maps = got
        if len(self._procs) >= self._max:
            self.evict(force=True)
        now = self._clock()
        self.from_sent += 1
        p = self._procs[pid] = _Proc(start=start, maps=maps, starts=[m.start for m in maps],
                                     maps_read_at=now, since_ns=exec_ns, dead_since=now,
                                     sent_ns=exec_ns, made_from_sent=True)
        return p

    def _sent_holds(self, pid: int, p: _Proc) -> bool:
        """Whether the mappings the kernel sent are still those of the process under
        `pid`: asked again once a REREAD_S (a pid is reused by a new process)."""
        now = self._clock()
        if now - p.maps_read_at < REREAD_S:
            return True
        got = self.sent(pid)
        if got is None or got[0] != p.sent_ns:
            return False
        p.maps_read_at = now
        return True

    def _sent_holds_addr(self, pid: int, p: _Proc, addr: int) -> bool:
        """Whether the kernel sent a mapping at `addr` for the exec `p`'s map is of:
        if so, the sent mappings are its cache's now. `p` was had while that exec's
        loader was still mapping libraries: read from /proc then, or made from what
        the kernel had sent by then (the process gone since either way)."""
        if not self.sent_covers(pid, addr):
            return False  # a junk address, most often: said without a check of the list
        got = self.sent(pid)
        if got is None or got[0] > p.since_ns:
            return False  # not known whole, or another exec's (`_proc` reads again)
        self._take_sent(p, got)
        p.made_from_sent = True
        return True

    @staticmethod
    def _take_sent(p: _Proc, got: tuple[int, list[Mapping]]) -> None:
        p.maps, p.starts = got[1], [m.start for m in got[1]]
        p.sent_ns = p.since_ns = got[0]
        p.files = None
        p.tables.clear()

    def _forget(self, pid: int) -> None:
        p = self._procs.pop(pid)
        self._frames -= len(p.frames)

    def see(self, pid: int) -> None:
        """Read a process's memory map at first sight, while it is alive."""
        self._proc(pid)

    def _stood_in(self, pid: int) -> tuple[int, _Proc] | None:
        """(pid, cache) of the process to resolve a gone one's addresses in (`stand_in`)."""
        if self.stand_in is None:
            return None
        now = self._clock()
        known = self._stand_ins.get(pid)
        if known is None or now - known[0] >= REREAD_S:
            if len(self._stand_ins) >= 4096:
                self._stand_ins.clear()
            known = self._stand_ins[pid] = (now, self.stand_in(pid))
        if known[1] is None:
            return None
        other, start = known[1]
        p = self._proc(other, start)
        return (other, p) if p is not None else None

    def stand_in_for(self, pid: int) -> tuple[int, int] | None:
        """(pid, start time) of the process a gone one's addresses are resolved in
        (`stand_in`), if its own map is not known here; None if it is, or there is none."""
        if pid in self._procs:
            return None
        stood = self._stood_in(pid)
        return (stood[0], stood[1].start) if stood is not None else None

    def file_mappings(self, pid: int, addr: int, start: int | None = None) -> list[Mapping]:
        """The process's executable file mappings, for unwinding near `addr`: the
        ones its symbols come from (one read of /proc/PID/maps for both), read
        again as for a symbol, if `addr` lies outside them. The same list until
        then, so that callers may key their own caches by it. [] if it is gone
        (and no stand-in's, see the module docstring)."""
        p = self._proc(pid, start or None)
        if p is None:
            stood = self._stood_in(pid)
            if stood is None:
                return []
            pid, p = stood
        self._mapping(pid, p, addr, None)
        if p.dead_since is not None and not p.sent_ns:
            # Seen alive, gone since: its map_files went with it. The files the
            # kernel said it mapped can still be opened, by path (sent_maps).
            got = self.sent(pid)
            if got is not None:
                p.sent_ns = got[0]
                p.files = [m for m in got[1] if m.handle]
        if p.files is None:
            p.files = [m for m in p.maps if m.handle]
        return p.files

    def resolve_stack(self, pid: int, addrs: Iterable[int], *,
                      deadline: float | None = None, start: int | None = None
                      ) -> tuple[Frame, ...]:
        """A user stack, innermost first (see the module docstring).

        `deadline` is a time on this object's clock (time.monotonic by
        default) after which no file is loaded: frames that would need one
        come back as `module+0xOFFSET`, uncached, counted as TIME_BUDGET.
        `start`: the process's start time, when the caller has just read it
        (else it is read here: a process is its pid and start time).
        """
        addrs = list(addrs)
        if not addrs:
            return ()
        p = self._proc(pid, start or None)
        jit = True
        if p is None:
            stood = self._stood_in(pid)
            if stood is None:
                self._miss(PROCESS_GONE)
                return (Frame(name=MARK_PROCESS_GONE),)
            pid, p = stood
            jit = False
            self.stood_in += 1
        out: list[Frame] = []
        for n, addr in enumerate(addrs):
            # Every address after the first is a return address: the call
            # is the instruction before it (address - 1 lies inside it).
            look = addr if n == 0 else addr - 1
            key = addr << 1 | (n != 0)
            f = p.frames.get(key)
            if f is not None and not jit and f.module == JIT_MODULE:
                f = None
            if f is None:
                f, keep = self._resolve(pid, p, addr, look, deadline, jit=jit)
                if f is None:
                    out.append(Frame(name=MARK_TRUNCATED))
                    break
                f = self._shared_frame(f)
                if keep:
                    self._remember(p, key, f)
            out.append(f)
        return tuple(out)

    def _shared_frame(self, f: Frame) -> Frame:
        """The one Frame object for frames equal to `f`. Processes of one program
        have the same frames at other addresses (ASLR), each resolved afresh;
        stacks kept past a process (since-start totals, the chain catalog) would
        otherwise hold a copy of every frame per process. Bounded: past
        `max_shared` all is let go (sharing starts over; nothing is wrong)."""
        shared = self._shared
        got = shared.get(f)
        if got is not None:
            return got
        if len(shared) >= self._max_shared:
            shared.clear()
        shared[f] = f
        return f

    def _remember(self, p: _Proc, key: int, f: Frame) -> None:
        if self._frames >= self._max_frames:  # a bound on memory, whatever processes do
            for q in self._procs.values():
                q.frames.clear()
            self._frames = 0
        p.frames[key] = f
        self._frames += 1

    def _miss(self, cause: str) -> None:
        self.misses += 1
        self._errors[cause] += 1

    @staticmethod
    def _in_maps(p: _Proc, addr: int) -> Mapping | None:
        i = bisect.bisect_right(p.starts, addr) - 1
        if i >= 0 and addr < p.maps[i].end:
            return p.maps[i]
        return None

    def _mapping(self, pid: int, p: _Proc, addr: int, deadline: float | None) -> Mapping | None:
        m = self._in_maps(p, addr)
        if m is not None:
            return m
        if self._sent_holds_addr(pid, p, addr):
            m = self._in_maps(p, addr)
            if m is not None:
                return m
        now = self._clock()
        if (p.dead_since is None and now - p.maps_read_at >= REREAD_S
                and (deadline is None or now < deadline)):
            # Mapped since we looked (dlopen, a JIT): look again, not more than
            # once a REREAD_S, since a junk address would otherwise cost a
            # read of the whole map every time.
            since = self._now_ns()
            maps = self._read_maps(pid)
            if not maps or self._start_time(pid) != p.start:
                # Gone since (or a zombie, or the pid another process's): the map
                # read while it lived stands; its stacks are often read after it
                # ended (a row's, at the interval's end), a junk address first.
                p.dead_since = now
                return None
            p.maps, p.since_ns, p.maps_read_at = maps, since, now
            p.starts = [m.start for m in maps]
            p.files = None
            p.tables.clear()
            return self._in_maps(p, addr)
        return None

    def _resolve(self, pid: int, p: _Proc, addr: int, look: int,
                 deadline: float | None, *, jit: bool = True) -> tuple[Frame | None, bool]:
        """The frame at `addr` (looked up at `look`), and whether to cache it.

        None: the address is in no mapping, not to be trusted. `jit`: name
        anonymous memory from the perf map (not for a stand-in's, where it is
        not cached either).
        """
        m = self._mapping(pid, p, look, deadline)
        if m is not None and m.handle:
            return self._file_frame(pid, p, m, addr, look, deadline)
        name, settled = self._jit_name(pid, p, look, deadline) if jit else (None, False)
        if name is not None:
            return Frame(name=name, module=JIT_MODULE, kernel=False), True
        if m is None:
            self._miss(UNTRUSTED)
            return None, False
        # Anonymous executable memory (a JIT without a perf-map entry, vdso):
        # trusted, unnamed. Cached only once the perf map has been read up to
        # date: a read put off (time budget, or read less than REREAD_S ago)
        # may still name it.
        frame = Frame(name=f"{m.module}+0x{addr - m.start:x}", module=m.module, kernel=False)
        if settled:
            self._miss(NO_SYMBOL)
        elif deadline is not None and self._clock() >= deadline:
            self._miss(TIME_BUDGET)
        else:
            self.misses += 1
        return frame, settled

    def _file_frame(self, pid: int, p: _Proc, m: Mapping, addr: int, look: int,
                    deadline: float | None) -> tuple[Frame, bool]:
        # ElfCache answers a table or the cause there is none; None is taken
        # as "unreadable" too, from caches that keep no causes.
        # A mapping's file is looked up in the cache (a stat of its map_files
        # link, a system call) once a REREAD_S per mapping, not once per new
        # address (under process churn, hundreds a second, each also a point
        # where the TUI's thread takes the GIL); a file rewritten in place
        # meanwhile is read again after that.
        now = self._clock()
        known = p.tables.get(m.start)
        syms: ElfSymbols | str | None
        if known is not None and (now - known[0] < REREAD_S or p.dead_since is not None):
            # Gone, a process maps nothing more: the file read through its
            # map_files while it lived is the one it mapped, whatever its path
            # holds since (a package upgrade replaces a library as its services
            # restart: their last stacks, read then, were named in the new one).
            syms = known[1]
        else:
            syms = self.elf.get(m.handle, deadline=deadline, expect=m.ident)
            if isinstance(syms, ElfSymbols):
                p.tables[m.start] = (now, syms)
        if (syms is None or (isinstance(syms, str) and syms != TIME_BUDGET)) \
                and p.dead_since is None \
                and (task_ending(pid, self._proc_root) or self._start_time(pid) != p.start):
            # Gone since it was last asked about (its rows are read after it
            # ended, under the start time it had): a process seen alive for a
            # few milliseconds (an exec'd `sleep 0.01`) was `libc.so.6+0x…`.
            # Ending first: its map_files went with its memory, so it was ending
            # then, and is still, or reaped since (its start time gone). Asked
            # the other way round, a process reaped between the two reads (the
            # shell waits at once) was taken as alive: a block of a loop of `sleep
            # 0.01` named `libc.so.6+0x…` in 4 of ~340 runs of its end-to-end test
            # beside two CPU hogs. A file out of time (TIME_BUDGET) was found by
            # its map_files link, so its process lived: not asked (two reads of
            # /proc a frame, for every frame of a flood past its budget).
            p.dead_since = now
        if (syms is None or isinstance(syms, str)) and p.dead_since is not None:
            if known is not None:
                syms = known[1]  # as above: found gone just now
            elif m.handle != m.path and not m.path.endswith(" (deleted)"):
                # map_files are gone with the process (a mapping the kernel sent
                # may be opened by its very path already: not asked twice)
                syms = self.elf.get(m.path, deadline=deadline, expect=m.ident)
        if syms is None or isinstance(syms, str):
            cause = syms or UNREADABLE
        else:
            vaddr = syms.vaddr_of(look - m.start + m.offset)
            name = syms.lookup(vaddr) if vaddr is not None else None
            if name is not None:
                return Frame(name=name, module=m.module, kernel=False), True
            cause = NO_SYMBOL
        self._miss(cause)
        frame = Frame(name=f"{m.module}+0x{addr - m.start + m.offset:x}", module=m.module, kernel=False)
        return frame, cause != TIME_BUDGET

    def _jit_name(self, pid: int, p: _Proc, addr: int,
                  deadline: float | None) -> tuple[str | None, bool]:
        """The perf-map name at `addr`, and whether the perf map was just read up to date."""
        if p.perf_map is not None:
            name = p.perf_map.lookup(addr)
            if name is not None:
                return name, True
        now = self._clock()
        if p.dead_since is not None:
            return None, True  # nothing more will be written
        if now - p.perf_map_read_at < REREAD_S or (deadline is not None and now >= deadline):
            return None, False
        p.perf_map_read_at = now
        if p.perf_map is None:
            euid = process_euid(pid, self._proc_root)
            if euid is None:  # gone
                return None, True
            p.perf_map = PerfMap((f"{self._proc_root}/{pid}/root/tmp/perf-{pid}.map",
                                  f"/tmp/perf-{pid}.map"), owners={0, euid})
        before = set(p.perf_map.errors)
        complete = p.perf_map.refresh(deadline, self._clock)
        for cause in p.perf_map.errors - before:
            self._errors[cause] += 1
        return p.perf_map.lookup(addr), complete

    def evict(self, *, force: bool = False,
              start_time: Callable[[int], int | None] | None = None) -> int:
        """Forget processes dead for longer than the grace period; return how many.
        `force` (the cache is full): every dead process, however recently it was found
        gone (its last rows read after it ended, or named in the mappings the kernel
        sent), or the cache grows past its bound under a churn of exec'd processes.
        `start_time`: the sweep's reader of start times, if not this object's."""
        now = self._clock()
        start_time = start_time or self._start_time
        gone = []
        for pid, p in self._procs.items():
            if p.dead_since is None and start_time(pid) != p.start:
                p.dead_since = now
            if p.dead_since is not None and (force or now - p.dead_since >= self._grace):
                gone.append(pid)
        for pid in gone:
            self._forget(pid)
        return len(gone)

    def close(self) -> None:
        """Forget everything."""
        self._procs.clear()
        self._frames = 0
        self.elf.close()
