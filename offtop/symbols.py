"""Addresses to function names: kernel via kallsyms, user via bcc, per process.

User symbols are cached per (pid, process start time), so a pid reused by a
new process never inherits the old one's names, and a process is resolved
while it is alive (bcc reads its maps and binaries through /proc/<pid>).
Dead processes are forgotten after a grace period.
"""

from __future__ import annotations

import bisect
import ctypes as ct
import os
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

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


@dataclass(slots=True)
class _Proc:
    start: int
    cache: Any  # bcc symcache handle (void *)
    frames: dict[int, Frame] = field(default_factory=dict)
    dead_since: float | None = None


class _BccSymbol(ct.Structure):
    """Mirrors bcc's `struct bcc_symbol` (bcc_syms.h)."""

    _fields_ = [
        ("name", ct.c_char_p),
        ("demangle_name", ct.c_char_p),
        ("module", ct.POINTER(ct.c_char)),
        ("offset", ct.c_ulonglong),
    ]


class UserSymbols:
    """Per-process user symbol resolution on top of bcc's symcache.

    `lib` is bcc's `libbcc` ctypes handle and `symbol_type` its `bcc_symbol`
    structure; tests may pass fakes with `bcc_symcache_new`,
    `bcc_symcache_resolve` and `bcc_free_symcache`.
    """

    def __init__(
        self,
        lib: Any,
        *,
        grace_s: float = 30.0,
        max_processes: int = 4096,
        clock: Callable[[], float] = time.monotonic,
        start_time: Callable[[int], int | None] = process_start_time,
        symbol_type: type[ct.Structure] = _BccSymbol,
    ) -> None:
        self._lib = lib
        self._symbol_type = symbol_type
        self._procs: dict[int, _Proc] = {}
        self._grace = grace_s
        self._max = max_processes
        self._clock = clock
        self._start_time = start_time
        self.misses = 0

    @property
    def cached_processes(self) -> int:
        """How many processes have a live symbol cache."""
        return len(self._procs)

    def _proc(self, pid: int) -> _Proc | None:
        start = self._start_time(pid)
        p = self._procs.get(pid)
        if p is not None:
            if start is None:  # gone: keep what we resolved, until the grace ends
                if p.dead_since is None:
                    p.dead_since = self._clock()
                return p
            if start == p.start:
                return p
            self._drop(pid)  # pid reused by another process
        if start is None:
            return None
        if len(self._procs) >= self._max:
            self.evict(force=True)
        cache = self._lib.bcc_symcache_new(pid, None)
        if not cache:
            return None
        p = self._procs[pid] = _Proc(start=start, cache=cache)
        return p

    def see(self, pid: int) -> None:
        """Open a process's symbol cache at first sight, while it is alive."""
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
                f = p.frames[a] = self._resolve(p, a)
            out.append(f)
        return tuple(out)

    def _resolve(self, p: _Proc, addr: int) -> Frame:
        if p.dead_since is not None:
            # The process is gone: bcc could not read its maps or binaries now.
            self.misses += 1
            return Frame(name=f"0x{addr:x}", module="", kernel=False)
        sym: Any = self._symbol_type()
        res = self._lib.bcc_symcache_resolve(p.cache, ct.c_ulonglong(addr), ct.byref(sym))
        module = ""
        if sym.module:
            module = os.path.basename(ct.cast(sym.module, ct.c_char_p).value or b"").decode(
                errors="replace"
            )
        if res < 0 or not (sym.demangle_name or sym.name):
            self.misses += 1
            if module:
                return Frame(name=f"[{module}+0x{sym.offset:x}]", module=module, kernel=False)
            return Frame(name=f"0x{addr:x}", module="", kernel=False)
        raw = sym.demangle_name or sym.name
        name = raw.decode(errors="replace")
        if sym.demangle_name and hasattr(self._lib, "bcc_symbol_free_demangle_name"):
            self._lib.bcc_symbol_free_demangle_name(ct.byref(sym))
        return Frame(name=name, module=module, kernel=False)

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
            self._drop(pid)
        return len(gone)

    def _drop(self, pid: int) -> None:
        p = self._procs.pop(pid, None)
        if p is not None and p.cache:
            self._lib.bcc_free_symcache(p.cache, pid)

    def close(self) -> None:
        """Free every symbol cache."""
        for pid in list(self._procs):
            self._drop(pid)
