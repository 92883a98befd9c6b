"""Walking a blocked thread's user stack with its binaries' call-frame information.

Each step looks up the rule for the frame's pc in the unwind table of the
file mapped there, computes the CFA (the caller's stack pointer), reads the
return address and, where the frame saved it, the caller's rbp from the
stack, and moves on. Nothing is guessed: a rule that needs a register the
walk does not know (rbp in a function that keeps a frame pointer, when no
inner frame saved rbp and the caller gave none), an expression that is not
one of the known patterns, a stack word that cannot be read, a stack pointer
that does not grow, or a return address outside every executable mapping
ends the walk there, with the reason. The addresses returned up to that
point are trusted; nothing past it is returned.

Addresses are innermost first: the thread's pc, then return addresses (a
caller's frame is looked up at its return address - 1, since a call to a
noreturn function may be the last instruction of a function; symbolizers
should do the same).
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol

from offtop.unwind.cache import TableCache
from offtop.unwind.maps import read_exec_maps
from offtop.unwind.memory import StackReader
from offtop.unwind.regs import read_syscall_regs
from offtop.unwind.rules import RBP, RIP, RSP, CfaKind, RegKind, Rule
from offtop.unwind.table import FileTable


class StopReason(StrEnum):
    """Why a walk ended. Only OUTERMOST means the stack is complete."""

    OUTERMOST = "outermost"  #: the return address is undefined: _start, clone, thread start
    MAX_FRAMES = "max_frames"
    TIME_BUDGET = "time_budget"
    PC_UNMAPPED = "pc_unmapped"  #: the first pc is in no executable file mapping (JIT, vdso)
    RA_UNMAPPED = "ra_unmapped"  #: a return address outside every executable file mapping
    NO_TABLE = "no_table"  #: the mapped file is not readable ELF
    NO_CFI = "no_cfi"  #: no FDE covers the pc
    RBP_UNKNOWN = "rbp_unknown"  #: the CFA is computed from rbp, whose value is not known
    REGISTER_UNKNOWN = "register_unknown"  #: a rule needs a register the walk does not know
    UNSUPPORTED_RULE = "unsupported_rule"  #: a DWARF expression or rule not handled
    STACK_READ = "stack_read"  #: a stack word could not be read
    SP_NOT_GROWING = "sp_not_growing"  #: the caller's sp is not above this frame's
    NOT_BLOCKED = "not_blocked"  #: unwind_blocked: the thread is running or gone
    THREAD_RAN = "thread_ran"  #: unwind_blocked: the thread ran while it was read


@dataclass(frozen=True, slots=True)
class UnwindResult:
    """A walked stack: trusted addresses, innermost first, and why the walk ended."""

    addresses: tuple[int, ...]
    stop_reason: StopReason

    @property
    def complete(self) -> bool:
        """True when the walk reached the outermost frame."""
        return self.stop_reason == StopReason.OUTERMOST


@dataclass(frozen=True, slots=True)
class UnwindLimits:
    """Bounds of one walk."""

    max_frames: int = 128
    time_budget_s: float = 0.05  #: checked between frames; a first-time table build is extra
    max_stack_pages: int = 64  #: 256 KiB of stack read at most


#: Processes whose rule-lookup walk is kept (each holds its mappings' tables).
MAX_RULE_WALKS = 1024


class WordReader(Protocol):
    """Reads a process's memory for one walk (StackReader, or a fake in tests)."""

    failures: dict[str, int]

    def u64(self, addr: int) -> int | None:
        """The 8-byte word at `addr`, None when it cannot be read."""


def stack_reader(pid: int, limits: UnwindLimits) -> WordReader:
    """The real memory of process `pid`, through process_vm_readv."""
    return StackReader(pid, max_pages=limits.max_stack_pages)


class SavedRegs(Protocol):
    """A thread's user registers as the kernel saved them (offtop.bpf.task_regs.UserRegs)."""

    @property
    def pc(self) -> int: ...

    @property
    def sp(self) -> int: ...

    @property
    def bp(self) -> int: ...


class FileMapping(Protocol):
    """An executable file mapping: [start, end) maps the file from `offset`, opened
    by `handle` (unwind.maps.ExecMapping, or the symbolizer's Mapping); `path` as
    the process's maps name it."""

    @property
    def start(self) -> int: ...
    @property
    def end(self) -> int: ...
    @property
    def offset(self) -> int: ...
    @property
    def path(self) -> str: ...
    @property
    def ident(self) -> tuple[int, int] | None:
        """(device, inode) `handle` must be, when it is a path (offtop.bpf.sent_maps)."""
    @property
    def handle(self) -> str: ...


class TableSource(Protocol):
    """Where a walk gets a file's table from (TableCache, or a fake in tests)."""

    def get(self, path: str, expect: tuple[int, int] | None = None) -> FileTable | None:
        """The table of the file at `path` (which must be `expect`'s device and inode,
        if given), None when it has none."""


class _Walk:
    """The state of one walk: memory, mappings, per-mapping tables."""

    def __init__(self, mem: WordReader, maps: Sequence[FileMapping], tables: TableSource) -> None:
        self.mem = mem
        self.maps = maps
        self.starts = [m.start for m in maps]
        self.tables = tables
        self._by_map: dict[int, FileTable | None] = {}

    def mapping(self, addr: int) -> FileMapping | None:
        i = bisect.bisect_right(self.starts, addr) - 1
        if i >= 0 and addr < self.maps[i].end:
            return self.maps[i]
        return None

    def rule(self, m: FileMapping, pc: int) -> Rule | bool | None:
        """The rule at `pc` in mapping `m`; False when the file has no table."""
        if m.start not in self._by_map:
            self._by_map[m.start] = self.tables.get(m.handle, m.ident)
        table = self._by_map[m.start]
        if table is None:
            return False
        vaddr = table.vaddr_of(pc - m.start + m.offset)
        return None if vaddr is None else table.rule_at(vaddr)


class Unwinder:
    """Walks user stacks of blocked threads; counts outcomes by stop reason.

    Not thread-safe: use one per thread (tables may be shared through one
    TableCache only by one thread at a time).
    """

    def __init__(self, tables: TableSource | None = None, *, limits: UnwindLimits | None = None,
                 maps: Callable[[int], Sequence[FileMapping]] = read_exec_maps,
                 memory: Callable[[int, UnwindLimits], WordReader] = stack_reader,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.tables: TableSource = tables if tables is not None else TableCache()
        self.limits = limits or UnwindLimits()
        self._read_maps = maps
        self._memory = memory
        self._clock = clock
        self.stops: dict[str, int] = {}  #: walks by stop reason
        self.read_failures: dict[str, int] = {}  #: failed stack page reads by errno name
        self.unwinds = 0
        self.frames = 0
        self.saved_rbp = 0  #: blocked walks that took rbp from the kernel's saved registers
        self._rule_walks: dict[int, _Walk] = {}  # pid -> the walk rule_for looks up in

    def unwind(self, pid: int, tid: int, pc: int, sp: int, bp: int | None = None, *,
               regs: Mapping[int, int] | None = None,
               maps: Sequence[FileMapping] | None = None,
               mem: WordReader | None = None) -> UnwindResult:
        """Walk the stack of thread `tid` of process `pid` from pc, sp (and rbp if known).

        `regs` are further registers of the first frame by DWARF number (the
        syscall arguments); `maps` the process's executable file mappings
        (read from /proc/PID/maps when not given); `mem` the stack's memory
        (the process's own when not given; a copy the probe took: CopiedStack).
        """
        del tid  # the address space is the process's; kept for the callers' symmetry
        deadline = self._clock() + self.limits.time_budget_s
        walk = _Walk(self._memory(pid, self.limits) if mem is None else mem,
                     self._read_maps(pid) if maps is None else maps, self.tables)
        addrs: list[int] = []
        known: dict[int, int] = dict(regs or {})
        reason = self._walk(walk, addrs, pc, sp, bp, known, deadline)
        self.unwinds += 1
        self.frames += len(addrs)
        self.stops[reason] = self.stops.get(reason, 0) + 1
        for cause, n in walk.mem.failures.items():
            self.read_failures[cause] = self.read_failures.get(cause, 0) + n
        return UnwindResult(tuple(addrs), reason)

    def unwind_blocked(self, pid: int, tid: int, bp: int | None = None, *,
                       saved: Callable[[int], SavedRegs | None] | None = None,
                       maps_of: Callable[[int], Sequence[FileMapping]] | None = None
                       ) -> UnwindResult:
        """Walk a thread blocked in the kernel, from its /proc registers.

        /proc has no rbp: `bp` is the one the caller knows, else `saved(tid)`
        may give the registers the kernel saved (offtop.bpf.task_regs), used
        only if its pc and sp are the ones /proc shows. `maps_of(pid)` gives the
        process's mappings (default: read them), asked only for a blocked thread.
        The thread's scheduler statistics and registers are read before and
        after the walk: if they differ, it ran meanwhile, its stack may have
        changed under the walk, and nothing is returned.
        """
        before = _sched_marker(pid, tid)
        r = read_syscall_regs(pid, tid)
        if r is None:
            return self._count(UnwindResult((), StopReason.NOT_BLOCKED))
        if bp is None and saved is not None:
            got = saved(tid)
            if got is not None and got.pc == r.pc and got.sp == r.sp:
                bp = got.bp
                self.saved_rbp += 1
        result = self.unwind(pid, tid, r.pc, r.sp, bp, regs=r.leaf_registers(),
                             maps=maps_of(pid) if maps_of is not None else None)
        if _sched_marker(pid, tid) != before or read_syscall_regs(pid, tid) != r:
            self.stops[result.stop_reason] -= 1
            return self._count(UnwindResult((), StopReason.THREAD_RAN))
        return result

    def read_maps(self, pid: int) -> Sequence[FileMapping]:
        """The executable file mappings of process `pid`, as `unwind` reads them."""
        return self._read_maps(pid)

    def rule_for(self, pid: int, addr: int, *, exact: bool,
                 maps: Sequence[FileMapping] | None = None) -> Rule | None:
        """The call-frame rule of the function at `addr` in process `pid`.

        `exact`: `addr` is where a thread stopped (the leaf's pc); otherwise a
        return address, looked up at `addr - 1`. None when no table covers it.
        """
        walk = self._rule_walk(pid, maps)
        m = walk.mapping(addr)
        if m is None:
            return None
        rule = walk.rule(m, addr if exact else addr - 1)
        if rule is None or isinstance(rule, bool) or rule.cfa == CfaKind.NONE:
            return None
        return rule

    def _rule_walk(self, pid: int, maps: Sequence[FileMapping] | None) -> _Walk:
        """A walk without memory for rule lookups: one per process while its caller
        passes the same mappings, so a file's table is looked up (a stat() each)
        once per mapping, not once per pc."""
        if maps is None:
            return _Walk(_NoMemory(), self._read_maps(pid), self.tables)
        walk = self._rule_walks.get(pid)
        if walk is None or walk.maps is not maps:  # another process, or mappings read again
            if len(self._rule_walks) >= MAX_RULE_WALKS:
                self._rule_walks.clear()
            walk = self._rule_walks[pid] = _Walk(_NoMemory(), maps, self.tables)
        return walk

    def forget_gone(self, start_time: Callable[[int], int | None]) -> int:
        """Drop the rule walks of processes gone (`start_time(pid)` None); return how
        many. Under process churn they piled up to `MAX_RULE_WALKS`, each holding its
        process's mappings. Tables idle with their file open let it go too
        (`TableCache.forget_idle`)."""
        gone = [pid for pid in self._rule_walks if start_time(pid) is None]
        for pid in gone:
            del self._rule_walks[pid]
        if isinstance(self.tables, TableCache):
            self.tables.forget_idle()  # files held open by tables no walk uses
        return len(gone)

    def counters(self) -> dict[str, int]:
        """Every count, flat, for the engine's statistics: walks, frames, stops by
        reason ("stop:…"), failed stack reads by errno ("read:…"), files without a
        table by cause ("table:…"), tables loaded and the milliseconds spent."""
        out = {"unwinds": self.unwinds, "frames": self.frames, "saved_rbp": self.saved_rbp}
        out.update({f"stop:{k}": v for k, v in self.stops.items() if v})
        out.update({f"read:{k}": v for k, v in self.read_failures.items()})
        if isinstance(self.tables, TableCache):
            out.update({f"table:{k}": v for k, v in self.tables.failures.items()})
            out["tables_loaded"] = self.tables.builds
            out["table_load_ms"] = round(self.tables.build_seconds * 1000)
        return out

    def _count(self, result: UnwindResult) -> UnwindResult:
        self.stops[result.stop_reason] = self.stops.get(result.stop_reason, 0) + 1
        return result

    def _walk(self, walk: _Walk, addrs: list[int], pc: int, sp: int, bp: int | None,
              known: dict[int, int], deadline: float) -> StopReason:
        mem = walk.mem
        m = walk.mapping(pc)
        if m is None:
            return StopReason.PC_UNMAPPED
        f = _Frame(pc, sp, bp, known)
        # The first frame's pc, and a pc a signal interrupted, are where the
        # thread stopped; any other is a return address, the instruction
        # after a call that may end its function: look that up at pc - 1.
        exact_pc = True
        while True:
            addrs.append(f.pc)
            if len(addrs) >= self.limits.max_frames:
                return StopReason.MAX_FRAMES
            if self._clock() > deadline:
                return StopReason.TIME_BUDGET
            rule = walk.rule(m, f.pc if exact_pc else f.pc - 1)
            if rule is False:
                return StopReason.NO_TABLE
            if rule is None or rule is True or rule.cfa == CfaKind.NONE:
                return StopReason.NO_CFI
            if rule.ra == RegKind.UNDEFINED:
                return StopReason.OUTERMOST
            cfa, why = _cfa(rule, f, mem)
            if cfa is None:
                assert why is not None
                return why
            if cfa <= f.sp and not rule.signal:  # (a signal may have switched stacks)
                return StopReason.SP_NOT_GROWING
            ra, why = _saved(rule.ra, rule.ra_reg, rule.ra_off, cfa, f, mem, current=None)
            if ra is None:
                return why or StopReason.UNSUPPORTED_RULE
            # A caller's rbp that cannot be recovered is unknown, not an error:
            # only a later rule that needs it stops the walk.
            bp, _ = _saved(rule.bp, rule.bp_reg, rule.bp_off, cfa, f, mem, current=f.bp)
            if ra == 0:
                return StopReason.OUTERMOST  # a zeroed return address ends some hand-made stacks
            nm = walk.mapping(ra)
            if nm is None:
                return StopReason.RA_UNMAPPED
            # Argument registers are caller-saved: unknown past the first frame.
            f = _Frame(ra, cfa, bp, {})
            m = nm
            exact_pc = rule.signal


class _NoMemory:
    """A walk that reads no memory (rule lookups only)."""

    failures: dict[str, int] = {}

    def u64(self, addr: int) -> int | None:
        return None


@dataclass(slots=True)
class _Frame:
    """The registers one frame knows: pc, sp, rbp if known, and (first frame) more."""

    pc: int
    sp: int
    bp: int | None
    known: dict[int, int]

    def reg(self, r: int) -> int | None:
        """The value of DWARF register `r` in this frame, None when unknown."""
        if r == RSP:
            return self.sp
        if r == RBP:
            return self.bp
        if r == RIP:
            return self.pc
        return self.known.get(r)


def _cfa(rule: Rule, f: _Frame, mem: WordReader) -> tuple[int | None, StopReason | None]:
    reg = f.reg
    kind = rule.cfa
    if kind == CfaKind.RSP or kind == CfaKind.RBP or kind == CfaKind.REG:
        base = reg(rule.cfa_reg)
        if base is None:
            return None, StopReason.RBP_UNKNOWN if kind == CfaKind.RBP else StopReason.REGISTER_UNKNOWN
        return base + rule.cfa_off, None
    if kind == CfaKind.PLT:
        return f.sp + rule.cfa_off + (8 if (f.pc & 15) >= rule.cfa_arg else 0), None
    if kind == CfaKind.DEREF:
        base = reg(rule.cfa_reg)
        if base is None:
            return None, StopReason.RBP_UNKNOWN if rule.cfa_reg == RBP else StopReason.REGISTER_UNKNOWN
        word = mem.u64(base + rule.cfa_off)
        if word is None:
            return None, StopReason.STACK_READ
        return word + rule.cfa_arg, None
    return None, StopReason.UNSUPPORTED_RULE


def _saved(kind: RegKind, r: int, off: int, cfa: int, f: _Frame,
           mem: WordReader, *, current: int | None) -> tuple[int | None, StopReason | None]:
    """The caller's value of a register under a rule; `current` is this frame's value."""
    reg = f.reg
    if kind == RegKind.OFFSET:
        v = mem.u64(cfa + off)
        return v, None if v is not None else StopReason.STACK_READ
    if kind == RegKind.SAME:
        return current, None
    if kind == RegKind.VAL_OFFSET:
        return cfa + off, None
    if kind == RegKind.REGISTER:
        v = reg(r)
        return v, None if v is not None else StopReason.REGISTER_UNKNOWN
    if kind == RegKind.AT_REG:
        base = reg(r)
        if base is None:
            return None, StopReason.REGISTER_UNKNOWN
        v = mem.u64(base + off)
        return v, None if v is not None else StopReason.STACK_READ
    return None, StopReason.UNSUPPORTED_RULE


def _sched_marker(pid: int, tid: int) -> str | None:
    # schedstat's first field is the time the thread has run: it changes iff it ran.
    try:
        with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
            return f.read(128)
    except OSError:
        return None
