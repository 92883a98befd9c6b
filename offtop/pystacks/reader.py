"""Walking one CPython process's runtime state: interpreters, thread states, frames.

The chain, for every supported version (offsets in `offsets.Layout`):

    _PyRuntime.interpreters.head -> PyInterpreterState -> .next ...
      interp threads head -> PyThreadState -> .next ...
        innermost frame -> frame -> previous frame ... (code object, instruction)

Everything is read with process_vm_readv while the process runs. For a
blocked thread that is a consistent picture: its frames cannot change
until it runs again. A running thread can be caught mid-call; its chain is
checked as it is followed (pointer plausibility, no loops, `tstate->interp`
pointing back, type objects of code objects), and a check that fails ends
that thread's stack with `truncated` rather than producing wrong frames.

Thread states are mapped to kernel thread ids by `native_thread_id` (3.11+)
or, before it, through glibc's `struct pthread` (`thread_id` is its
address), at the offset of its `tid` field, found once per process where
the main thread's struct holds the process id (as pystack does).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, replace

from offtop.pystacks.memory import ProcessMemory, ReadError, plausible_pointer
from offtop.pystacks.model import INCONSISTENT, TIME_LIMIT, PyFrame, PyThread
from offtop.pystacks.objects import Inconsistent, ObjectReader, TypeAddresses, i32, u64
from offtop.pystacks.offsets import OWNED_BY_CSTACK, Layout

#: More sub-interpreters than this in one process is taken for a loop in garbage.
MAX_INTERPRETERS = 64
#: glibc's offsetof(struct pthread, tid) on x86-64 (2.26 to at least 2.40), tried first.
_GLIBC_TID_OFFSET = 0x2D0
#: How much of a `struct pthread` is searched for the tid when glibc's offset does not hold.
_PTHREAD_SCAN = 2048
#: futex(2) syscall numbers by machine: a thread in futex on the GIL waits for it.
_FUTEX_NR = {"x86_64": 202, "aarch64": 98}


@dataclass(frozen=True, slots=True)
class _RawFrame:
    code: int
    position: int
    entry: bool
    shim: bool


@dataclass(frozen=True, slots=True)
class _ThreadState:
    addr: int
    tid: int
    first_frame: int
    gil: tuple[int, int, bool]
    """(address, size, held by this thread) of the GIL of its interpreter."""


class ThreadReadError(Exception):
    """Why a read of the thread list stopped: a failure cause of `model`."""

    def __init__(self, cause: str, detail: str) -> None:
        super().__init__(f"{cause}: {detail}")
        self.cause = cause


class ProcessReader:
    """Reads the Python threads of one process (one per process and start time)."""

    def __init__(self, pid: int, runtime: int, layout: Layout, types: TypeAddresses, *,
                 mem: ProcessMemory | None = None, max_depth: int = 128, max_threads: int = 1024,
                 proc: str = "/proc", clock: Callable[[], float] = time.monotonic) -> None:
        self.pid = pid
        self.runtime = runtime
        self.layout = layout
        self.mem = mem or ProcessMemory(pid)
        self.objects = ObjectReader(self.mem, layout, types)
        self.types = types
        self.max_depth = max_depth
        self.max_threads = max_threads
        self._proc = proc
        self._clock = clock
        self._tid_offset: int | None = None
        self._futex_nr = _FUTEX_NR.get(os.uname().machine)

    # -- thread list ---------------------------------------------------------

    def _interpreters(self) -> list[tuple[int, int, tuple[int, int, int]]]:
        """(interpreter, first thread state, (GIL address, last holder, locked)) of each interpreter."""
        lay = self.layout
        out = []
        interp = self.mem.read_u64(self.runtime + lay.runtime_interpreters_head)
        seen: set[int] = set()
        while interp:
            if not plausible_pointer(interp) or interp in seen or len(seen) >= MAX_INTERPRETERS:
                raise Inconsistent(f"interpreter pointer {interp:#x}")
            seen.add(interp)
            ranges = [(interp + lay.interp_next, 8), (interp + lay.interp_threads_head, 8)]
            if lay.interp_gil_ptr is not None:
                ranges.append((interp + lay.interp_gil_ptr, 8))
            got = self.mem.read_many(ranges)
            if any(g is None for g in got):
                raise Inconsistent(f"interpreter at {interp:#x} unreadable")
            words = [u64(g, 0) for g in got if g is not None]
            gil = words[2] if lay.interp_gil_ptr is not None else self.runtime + (lay.runtime_gil or 0)
            holder, locked = 0, 0
            if plausible_pointer(gil):
                try:
                    raw = self.mem.read(gil, lay.gil_locked + 4)
                    holder, locked = u64(raw, lay.gil_last_holder), i32(raw, lay.gil_locked)
                except ReadError:
                    pass
            out.append((interp, words[1], (gil, holder, locked)))
            interp = words[0]
        return out

    def _task_ids(self) -> set[int]:
        try:
            return {int(t) for t in os.listdir(f"{self._proc}/{self.pid}/task") if t.isdigit()}
        except OSError as e:
            raise ReadError(e.errno or 0, f"task list of {self.pid}: {e}") from e

    def _find_tid_offset(self, pthreads: list[int]) -> int | None:
        """Where `struct pthread` keeps the kernel tid: where the main thread's holds the pid."""
        raws = [r for r in self.mem.read_many([(p, _PTHREAD_SCAN) if plausible_pointer(p) else (0, 0)
                                               for p in pthreads]) if r is not None]
        # glibc's own offset first, in every struct, before any guess.
        for raw in raws:
            if int.from_bytes(raw[_GLIBC_TID_OFFSET:_GLIBC_TID_OFFSET + 4], "little") == self.pid:
                return _GLIBC_TID_OFFSET
        for raw in raws:
            for off in range(0, len(raw) - 3, 4):
                if int.from_bytes(raw[off:off + 4], "little") == self.pid:
                    return off
        return None

    def _pthread_tids(self, pthreads: list[int]) -> list[int]:
        if self._tid_offset is None:
            self._tid_offset = self._find_tid_offset(pthreads)
        off = self._tid_offset if self._tid_offset is not None else _GLIBC_TID_OFFSET
        got = self.mem.read_many([(p + off, 4) if plausible_pointer(p) else (0, 0) for p in pthreads])
        return [int.from_bytes(g, "little") if g is not None else 0 for g in got]

    def thread_states(self) -> tuple[list[_ThreadState], str | None]:
        """Thread states of every interpreter whose tid is a live thread of the process.

        A chain that breaks after some good thread states (a thread being
        created or torn down while it is read) gives those and INCONSISTENT;
        one that breaks at once raises Inconsistent.
        """
        lay = self.layout
        size = max(lay.tstate_next, lay.tstate_interp, lay.tstate_thread_id, lay.tstate_frame,
                   lay.tstate_native_thread_id or 0) + 8
        tasks = self._task_ids()
        rows: list[tuple[int, int, int, tuple[int, int, bool]]] = []
        seen: set[int] = set()
        problem: str | None = None
        try:
            for interp, head, (gil, holder, locked) in self._interpreters():
                ts = head
                while ts:
                    if not plausible_pointer(ts) or ts in seen or len(seen) >= self.max_threads:
                        raise Inconsistent(f"thread state pointer {ts:#x}")
                    seen.add(ts)
                    try:
                        raw = self.mem.read(ts, size)
                    except ReadError as e:
                        raise Inconsistent(f"thread state at {ts:#x}: {e}") from e
                    if u64(raw, lay.tstate_interp) != interp:
                        raise Inconsistent(f"thread state {ts:#x} is not of interpreter {interp:#x}")
                    ident = u64(raw, lay.tstate_native_thread_id if lay.tstate_native_thread_id is not None
                                else lay.tstate_thread_id)
                    rows.append((ts, ident, u64(raw, lay.tstate_frame),
                                 (gil, lay.gil_size, bool(locked) and holder == ts)))
                    ts = u64(raw, lay.tstate_next)
        except Inconsistent:
            if not rows:
                raise
            problem = INCONSISTENT
        if lay.tstate_native_thread_id is None:
            tids = self._pthread_tids([r[1] for r in rows])
        else:
            tids = [r[1] for r in rows]
        states = [_ThreadState(addr=r[0], tid=tid, first_frame=r[2], gil=r[3])
                  for r, tid in zip(rows, tids, strict=True) if tid in tasks]
        if rows and not states:
            raise Inconsistent("no thread state names a thread of the process")
        return states, problem

    # -- frames --------------------------------------------------------------

    def _innermost(self, ts: _ThreadState) -> int:
        if self.layout.cframe_current_frame is None:
            return ts.first_frame
        cframe = ts.first_frame
        if not cframe:
            return 0
        if not plausible_pointer(cframe):
            raise Inconsistent(f"cframe pointer {cframe:#x}")
        return self.mem.read_u64(cframe + self.layout.cframe_current_frame)

    def _walk(self, first: int, deadline: float) -> tuple[list[_RawFrame], str | None]:
        lay = self.layout
        out: list[_RawFrame] = []
        seen: set[int] = set()
        addr = first
        while addr:
            if len(out) >= self.max_depth:
                return out, None
            if self._clock() > deadline:
                return out, TIME_LIMIT
            if not plausible_pointer(addr) or addr in seen:
                return out, INCONSISTENT
            seen.add(addr)
            try:
                raw = self.mem.read(addr, lay.frame_read)
            except ReadError:
                return out, INCONSISTENT
            if lay.frame_kind == "object":
                if u64(raw, 8) != self.types.frame:
                    return out, INCONSISTENT
                # 3.8-3.10: one C-level evaluation call per frame object.
                out.append(_RawFrame(u64(raw, lay.frame_code), i32(raw, lay.frame_lasti or 0), True, False))
            else:
                owner = raw[lay.frame_owner or 0]
                entry = bool(raw[lay.frame_is_entry]) if lay.frame_is_entry is not None else False
                shim = lay.version >= (3, 12) and owner == OWNED_BY_CSTACK
                out.append(_RawFrame(u64(raw, lay.frame_code), u64(raw, lay.frame_instr or 0), entry, shim))
            addr = u64(raw, lay.frame_back)
        return out, None

    def _frames(self, raw_frames: list[_RawFrame]) -> tuple[list[PyFrame], bool]:
        """Frames of code objects, innermost first; True when a frame could not be decoded."""
        headers = self.objects.code_headers(list({f.code for f in raw_frames if not f.shim}))
        frames: list[PyFrame] = []
        for rf in raw_frames:
            if rf.shim:
                # 3.12+: the C call of the evaluation loop that ran the frames
                # inside this shim begins here; mark the outermost of them.
                if frames and not frames[-1].entry:
                    frames[-1] = replace(frames[-1], entry=True)
                continue
            raw = headers.get(rf.code)
            if raw is None:
                return frames, True
            try:
                info = self.objects.code(rf.code, raw)
            except (Inconsistent, ReadError):
                return frames, True
            frames.append(PyFrame(function=info.function, filename=info.filename,
                                  line=self.objects.line(info, rf.position), entry=rf.entry))
        return frames, False

    def waits_for_gil(self, tid: int, gil: int, gil_size: int) -> bool | None:
        """True when the thread is in a futex wait on the GIL's condition variable or mutex.

        /proc/PID/task/TID/syscall gives the syscall a sleeping thread is in
        and its arguments (the kernel waits for the task to be off-CPU; it
        neither stops nor signals it). A futex whose address lies inside
        the GIL's struct is a wait for the GIL: take_gil's condition
        variable, its mutex, or drop_gil's switch condition.
        """
        if self._futex_nr is None or not gil:
            return None
        try:
            with open(f"{self._proc}/{self.pid}/task/{tid}/syscall", "rb") as f:
                fields = f.read(256).split()
        except OSError:
            return None
        if len(fields) < 2 or not fields[0].isdigit():
            return False  # "running", or not in a syscall
        try:
            uaddr = int(fields[1], 16)
        except ValueError:
            return False
        return int(fields[0]) == self._futex_nr and gil <= uaddr < gil + gil_size

    def read(self, tids: Collection[int] | None, deadline: float,
             gil_waits: bool = True) -> tuple[dict[int, PyThread], str | None]:
        """The Python threads (all, or those in `tids`) and the cause of a partial read, if any."""
        states, problem = self.thread_states()
        out: dict[int, PyThread] = {}
        for ts in states:
            if tids is not None and ts.tid not in tids:
                continue
            if self._clock() > deadline:
                return out, TIME_LIMIT
            try:
                first = self._innermost(ts)
            except (Inconsistent, ReadError):
                first, problem = 0, INCONSISTENT
            raw_frames, why = self._walk(first, deadline)
            frames, bad = self._frames(raw_frames)
            if bad:
                why = why or INCONSISTENT
            problem = problem or why
            gil, gil_size, holds = ts.gil
            waits = None if holds or not gil_waits else self.waits_for_gil(ts.tid, gil, gil_size)
            out[ts.tid] = PyThread(tid=ts.tid, frames=tuple(frames), holds_gil=holds,
                                   waits_for_gil=False if holds else waits,
                                   truncated=why is not None or len(raw_frames) >= self.max_depth)
        return out, problem
