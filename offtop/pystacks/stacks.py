"""The public reader: Python stacks of a process by thread id, cached per process, bounded in time.

`PythonStacks.read_process(pid)` finds the interpreter once per (pid,
process start time) — which file defines `_PyRuntime`, its version, the
layout of its structs — and keeps that, the code objects it decoded and the
pthread tid offset for later reads of the same process. A process that is
not Python, or of an unsupported version, is remembered as such for
`negative_ttl_s` (it may exec a Python later, or load libpython), so
asking about every blocked process each interval costs a stat and a
dictionary lookup for most of them.

Nothing here raises for what a process holds: every failure is a cause in
`model.FAILURE_CAUSES`, counted in `failures` and returned in the result.
Not thread-safe: one instance per thread that reads.
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Collection
from dataclasses import dataclass

from offtop.pystacks.binary import Interpreter, InterpreterFinder
from offtop.pystacks.memory import ProcessMemory, ReadError, plausible_pointer
from offtop.pystacks.model import (
    INCONSISTENT,
    NOT_PYTHON,
    READ_FAILED,
    UNSUPPORTED,
    PyFrame,
    PyProcess,
)
from offtop.pystacks.objects import Inconsistent, TypeAddresses
from offtop.pystacks.offsets import (
    DEBUG_OFFSETS_SIZE,
    LAYOUTS,
    Layout,
    LayoutError,
    debug_offsets_layout,
    debug_offsets_version,
)
from offtop.pystacks.reader import ProcessReader
from offtop.targets import task_start_time


@dataclass(slots=True)
class _Known:
    """A process whose interpreter was looked for: a reader, or why there is none."""

    reader: ProcessReader | None
    version: str
    failure: str | None
    since: float


def _version_text(hexversion: int) -> str:
    return f"{hexversion >> 24}.{(hexversion >> 16) & 0xFF}.{(hexversion >> 8) & 0xFF}"


class PythonStacks:
    """Reads the Python frames of CPython 3.8-3.13 processes from their memory."""

    def __init__(
        self,
        *,
        budget_s: float = 0.02,
        max_depth: int = 128,
        max_threads: int = 1024,
        negative_ttl_s: float = 30.0,
        max_processes: int = 1024,
        gil_waits: bool = True,
        proc: str = "/proc",
        clock: Callable[[], float] = time.monotonic,
        finder: InterpreterFinder | None = None,
        start_time: Callable[[int], int | None] = task_start_time,
    ) -> None:
        self.budget_s = budget_s
        self.max_depth = max_depth
        self.max_threads = max_threads
        self.negative_ttl_s = negative_ttl_s
        self.gil_waits = gil_waits
        self._max_processes = max_processes
        self._proc = proc
        self._clock = clock
        self._finder = finder or InterpreterFinder(proc=proc)
        self._start_time = start_time
        self._known: OrderedDict[tuple[int, int], _Known] = OrderedDict()
        self.failures: Counter[str] = Counter()
        """Failures by cause: process-level ones ("not python", "unsupported
        version") once per process, the others once per read."""

    def read(self, pid: int, tids: Collection[int] | None = None) -> dict[int, tuple[PyFrame, ...]]:
        """Python frames by native thread id, innermost first; {} when they cannot be read."""
        return {tid: t.frames for tid, t in self.read_process(pid, tids).threads.items()}

    def read_process(self, pid: int, tids: Collection[int] | None = None, *,
                     budget_s: float | None = None) -> PyProcess:
        """One read of `pid`'s Python threads (all of them, or those in `tids`)."""
        deadline = self._clock() + (self.budget_s if budget_s is None else budget_s)
        start = self._start_time(pid)
        if start is None:
            return PyProcess(pid=pid, failure=NOT_PYTHON)
        known = self._lookup(pid, start)
        if known.reader is None:
            return PyProcess(pid=pid, version=known.version, failure=known.failure)
        reader = known.reader
        before = reader.mem.syscalls
        failure: str | None
        try:
            threads, failure = reader.read(tids, deadline, gil_waits=self.gil_waits)
        except Inconsistent:
            threads, failure = {}, INCONSISTENT
        except ReadError:
            threads, failure = {}, READ_FAILED
        if failure is not None:
            self.failures[failure] += 1
        return PyProcess(pid=pid, version=known.version, threads=threads, failure=failure,
                         syscalls=reader.mem.syscalls - before)

    def forget(self, pid: int) -> None:
        """Drop what is cached about `pid` (all its incarnations)."""
        for key in [k for k in self._known if k[0] == pid]:
            del self._known[key]

    def forget_gone(self, start_time: Callable[[int], int | None]) -> int:
        """Drop what is cached about processes that are not there any more (a pid
        without a start time, or another process's by now); return how many."""
        gone = [key for key in self._known if start_time(key[0]) != key[1]]
        for key in gone:
            del self._known[key]
        return len(gone)

    @property
    def cached_processes(self) -> int:
        """How many (pid, start time) entries are cached, readers and negatives."""
        return len(self._known)

    def _lookup(self, pid: int, start: int) -> _Known:
        key = (pid, start)
        known = self._known.get(key)
        now = self._clock()
        if known is not None and (known.reader is not None or now - known.since < self.negative_ttl_s):
            self._known.move_to_end(key)
            return known
        known = self._resolve(pid, now)
        if known.failure is not None and (self._known.get(key) is None
                                          or self._known[key].failure != known.failure):
            self.failures[known.failure] += 1
        self._known[key] = known
        self._known.move_to_end(key)
        while len(self._known) > self._max_processes:
            self._known.popitem(last=False)
        return known

    def _resolve(self, pid: int, now: float) -> _Known:
        try:
            interp = self._finder.find(pid)
        except ReadError:
            return _Known(None, "", READ_FAILED, now)
        if interp is None:
            return _Known(None, "", NOT_PYTHON, now)
        try:
            mem = ProcessMemory(pid)
            layout, version = self._layout(mem, interp)
        except ReadError:
            return _Known(None, "", READ_FAILED, now)
        except Inconsistent:
            return _Known(None, "", INCONSISTENT, now)
        if layout is None:
            return _Known(None, version, UNSUPPORTED, now)
        syms = interp.symbols
        try:
            types = TypeAddresses(code=syms["PyCode_Type"], unicode=syms["PyUnicode_Type"],
                                  bytes=syms["PyBytes_Type"], frame=syms.get("PyFrame_Type", 0))
        except KeyError:
            return _Known(None, version, INCONSISTENT, now)
        reader = ProcessReader(pid, syms["_PyRuntime"], layout, types, mem=mem,
                               max_depth=self.max_depth, max_threads=self.max_threads,
                               proc=self._proc, clock=self._clock)
        return _Known(reader, version, None, now)

    @staticmethod
    def _layout(mem: ProcessMemory, interp: Interpreter) -> tuple[Layout | None, str]:
        """The layout and version of the interpreter: debug offsets, Py_Version, or the file name."""
        runtime = interp.symbols["_PyRuntime"]
        if not plausible_pointer(runtime):
            raise Inconsistent(f"_PyRuntime at {runtime:#x}")
        head = mem.read(runtime, 16)
        hexversion = debug_offsets_version(head)
        if hexversion is not None:
            if hexversion >> 16 != 0x030D:
                return None, _version_text(hexversion)
            try:
                return debug_offsets_layout(mem.read(runtime, DEBUG_OFFSETS_SIZE)), _version_text(hexversion)
            except LayoutError as e:
                # Free-threaded 3.13t, or debug offsets that make no sense.
                return None, f"{_version_text(hexversion)} ({e})"
        if "Py_Version" in interp.symbols:
            hexversion = mem.read_u64(interp.symbols["Py_Version"]) & 0xFFFFFFFF
            return LAYOUTS.get((hexversion >> 24, (hexversion >> 16) & 0xFF)), _version_text(hexversion)
        if interp.name_version is not None:
            major, minor = interp.name_version
            return LAYOUTS.get((major, minor)), f"{major}.{minor}"
        return None, ""


def describe_failure(result: PyProcess) -> str:
    """A short text for why a read gave no or partial Python stacks ("" when it was whole)."""
    if result.failure is None:
        return ""
    partial = " (partial)" if result.threads else ""
    version = f" {result.version}" if result.version and result.failure == UNSUPPORTED else ""
    return f"python stacks: {result.failure}{version}{partial}"
