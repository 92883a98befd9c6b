"""Addresses to function names: kernel via kallsyms, user via ELF, per process.

User symbols are cached per (pid, process start time), so a pid reused by a
new process never inherits the old one's names. A process's memory map is
read at first sight, while it is alive, and its binaries are opened through
/proc/PID/map_files, which works even once a binary is deleted or replaced
on disk; parsed files are shared by every process that maps them
(offtop.elf). Dead processes are forgotten after a grace period.
"""

from __future__ import annotations

import bisect
import os
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from offtop.elf import ElfCache
from offtop.model import Frame

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


def process_start_time(pid: int) -> int | None:
    """The start time of a process in clock ticks since boot, or None if gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    # comm may contain spaces and ')': split after the last ')'.
    rest = data[data.rfind(b")") + 2:].split()
    try:
        return int(rest[19])
    except (IndexError, ValueError):
        return None


class KernelSymbols:
    """/proc/kallsyms, sorted, looked up by bisection, cached per address."""

    def __init__(self, path: str = "/proc/kallsyms") -> None:
        addrs: list[int] = []
        names: list[str] = []
        with open(path) as f:
            for line in f:
                parts = line.split()
                if len(parts) < 3 or parts[1] not in "tTwW":
                    continue
                addr = int(parts[0], 16)
                if addr == 0:
                    continue
                addrs.append(addr)
                names.append(parts[2])
        order = sorted(range(len(addrs)), key=addrs.__getitem__)
        self._addrs = [addrs[i] for i in order]
        self._names = [names[i] for i in order]
        self._cache: dict[int, Frame] = {}
        if not self._addrs:
            # kptr_restrict hides addresses (all zero) from unprivileged readers.
            self.available = False
        else:
            self.available = True

    def resolve(self, addr: int) -> Frame:
        """The function containing `addr`, or the address itself."""
        f = self._cache.get(addr)
        if f is None:
            i = bisect.bisect_right(self._addrs, addr) - 1
            name = self._names[i] if i >= 0 else f"0x{addr:x}"
            f = self._cache[addr] = Frame(name=name, module="kernel", kernel=True)
        return f

    def resolve_stack(self, addrs: Iterable[int]) -> tuple[Frame, ...]:
        """A kernel stack, innermost first, tracer frames stripped."""
        return strip_tracer_frames([self.resolve(a) for a in addrs])


@dataclass(frozen=True, slots=True)
class Mapping:
    """One executable file mapping of a process (from /proc/PID/maps)."""

    start: int
    end: int
    offset: int
    path: str  # as maps shows it, " (deleted)" included
    handle: str  # what to open: /proc/PID/map_files/START-END

    @property
    def module(self) -> str:
        """The file's base name, without " (deleted)"."""
        return os.path.basename(self.path.removesuffix(" (deleted)"))


def read_maps(pid: int, proc: str = "/proc") -> list[Mapping]:
    """Executable file mappings of a process, sorted by address ([] if it is gone)."""
    out: list[Mapping] = []
    try:
        with open(f"{proc}/{pid}/maps") as f:
            lines = f.read().splitlines()
    except OSError:
        return out
    for line in lines:
        parts = line.split(None, 5)
        if len(parts) < 6 or "x" not in parts[1] or not parts[5].startswith("/"):
            continue
        lo, hi = parts[0].split("-")
        out.append(Mapping(int(lo, 16), int(hi, 16), int(parts[2], 16), parts[5],
                           f"{proc}/{pid}/map_files/{parts[0]}"))
    out.sort(key=lambda m: m.start)
    return out


def read_perf_map(pid: int, proc: str = "/proc") -> list[tuple[int, int, str]]:
    """JIT symbols a runtime wrote to /tmp/perf-PID.map (start, size, name)."""
    for path in (f"{proc}/{pid}/root/tmp/perf-{pid}.map", f"/tmp/perf-{pid}.map"):
        try:
            with open(path, errors="replace") as f:
                out = []
                for line in f:
                    parts = line.rstrip("\n").split(" ", 2)
                    if len(parts) == 3:
                        try:
                            out.append((int(parts[0], 16), int(parts[1], 16), parts[2]))
                        except ValueError:
                            continue
                return sorted(out)
        except OSError:
            continue
    return []


@dataclass(slots=True)
class _Proc:
    start: int
    maps: list[Mapping]
    starts: list[int]
    frames: dict[int, Frame] = field(default_factory=dict)
    dead_since: float | None = None
    perf_map: list[tuple[int, int, str]] | None = None


class UserSymbols:
    """Per-process user symbol resolution (see the module docstring)."""

    def __init__(
        self,
        *,
        grace_s: float = 30.0,
        max_processes: int = 4096,
        clock: Callable[[], float] = time.monotonic,
        start_time: Callable[[int], int | None] = process_start_time,
        maps: Callable[[int], list[Mapping]] = read_maps,
        elf_cache: ElfCache | None = None,
    ) -> None:
        self._procs: dict[int, _Proc] = {}
        self._grace = grace_s
        self._max = max_processes
        self._clock = clock
        self._start_time = start_time
        self._read_maps = maps
        self.elf = elf_cache or ElfCache()
        self.misses = 0

    @property
    def cached_processes(self) -> int:
        """How many processes have a symbol cache."""
        return len(self._procs)

    def _new_proc(self, pid: int, start: int) -> _Proc:
        maps = self._read_maps(pid)
        return _Proc(start=start, maps=maps, starts=[m.start for m in maps])

    def _proc(self, pid: int) -> _Proc | None:
        start = self._start_time(pid)
        p = self._procs.get(pid)
        if p is not None:
            if start is None:  # gone: keep what we know, until the grace ends
                if p.dead_since is None:
                    p.dead_since = self._clock()
                return p
            if start == p.start:
                return p
            del self._procs[pid]  # pid reused by another process
        if start is None:
            return None
        if len(self._procs) >= self._max:
            self.evict(force=True)
        p = self._procs[pid] = self._new_proc(pid, start)
        return p

    def see(self, pid: int) -> None:
        """Read a process's memory map at first sight, while it is alive."""
        self._proc(pid)

    def resolve_stack(self, pid: int, addrs: Iterable[int]) -> tuple[Frame, ...]:
        """A user stack, innermost first."""
        p = self._proc(pid)
        out = []
        for a in addrs:
            if p is None:
                self.misses += 1
                out.append(Frame(name=f"0x{a:x}", module="", kernel=False))
                continue
            f = p.frames.get(a)
            if f is None:
                f = self._resolve(pid, p, a)
                if not f.unknown:
                    p.frames[a] = f
            out.append(f)
        return tuple(out)

    def _mapping(self, pid: int, p: _Proc, addr: int) -> Mapping | None:
        i = bisect.bisect_right(p.starts, addr) - 1
        if i >= 0 and addr < p.maps[i].end:
            return p.maps[i]
        if p.dead_since is None:  # mapped since we looked (dlopen): look again
            fresh = self._new_proc(pid, p.start)
            p.maps, p.starts = fresh.maps, fresh.starts
            i = bisect.bisect_right(p.starts, addr) - 1
            if i >= 0 and addr < p.maps[i].end:
                return p.maps[i]
        return None

    def _resolve(self, pid: int, p: _Proc, addr: int) -> Frame:
        m = self._mapping(pid, p, addr)
        if m is None:
            name = self._jit_name(pid, p, addr)
            if name is not None:
                return Frame(name=name, module="[jit]", kernel=False)
            self.misses += 1
            return Frame(name=f"0x{addr:x}", module="", kernel=False)
        file_off = addr - m.start + m.offset
        syms = self.elf.get(m.handle)
        if syms is None and p.dead_since is not None and not m.path.endswith(" (deleted)"):
            syms = self.elf.get(m.path)  # map_files are gone with the process
        if syms is not None:
            vaddr = syms.vaddr_of(file_off)
            name = syms.lookup(vaddr) if vaddr is not None else None
            if name is not None:
                return Frame(name=name, module=m.module, kernel=False)
        self.misses += 1
        return Frame(name=f"[{m.module}+0x{file_off:x}]", module=m.module, kernel=False)

    def _jit_name(self, pid: int, p: _Proc, addr: int) -> str | None:
        if p.perf_map is None:
            p.perf_map = read_perf_map(pid)
        if not p.perf_map:
            return None
        i = bisect.bisect_right(p.perf_map, (addr, 1 << 64, "")) - 1
        if i >= 0:
            start, size, name = p.perf_map[i]
            if start <= addr < start + size:
                return name
        return None

    def evict(self, *, force: bool = False) -> int:
        """Forget processes dead for longer than the grace period; return how many."""
        now = self._clock()
        gone = []
        for pid, p in self._procs.items():
            if p.dead_since is None and self._start_time(pid) != p.start:
                p.dead_since = now - (self._grace if force else 0)
            if p.dead_since is not None and now - p.dead_since >= self._grace:
                gone.append(pid)
        for pid in gone:
            del self._procs[pid]
        return len(gone)

    def close(self) -> None:
        """Forget everything."""
        self._procs.clear()
