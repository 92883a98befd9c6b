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

Thread states form a linked list (one read each); the frames of all the
threads asked for are then walked together, one batched process_vm_readv
per depth, and the code objects they run are read in one more batch.

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
    """A frame as read, before its code object is decoded."""

    code: int
    position: int
    entry: bool
    shim: bool


@dataclass(frozen=True, slots=True)
class _Gil:
    """The GIL of one interpreter: where its struct is, and who has it."""

    addr: int
    size: int
    locked: bool
    holder: int
    """The PyThreadState that took it last."""


@dataclass(frozen=True, slots=True)
class _ThreadState:
    """A PyThreadState that names a live thread of the process."""

    addr: int
    tid: int
    first_frame: int
    gil: _Gil


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

    def _interpreters(self) -> tuple[list[tuple[int, int, _Gil]], bool]:
        """(interpreter, its first thread state, its GIL) of each interpreter, and whether the list broke.

        A list that breaks after good entries (a loop, an unreadable next)
        gives those; one whose head is already bad raises Inconsistent.
        """
        lay = self.layout
        out: list[tuple[int, int, _Gil]] = []
        interp = self.mem.read_u64(self.runtime + lay.runtime_interpreters_head)
        seen: set[int] = set()
        while interp:
            try:
                if not plausible_pointer(interp) or interp in seen or len(seen) >= MAX_INTERPRETERS:
                    raise Inconsistent(f"interpreter pointer {interp:#x}")
                seen.add(interp)
                ranges = [(interp + lay.interp_next, 8), (interp + lay.interp_threads_head, 8)]
                if lay.interp_gil_ptr is not None:
                    ranges.append((interp + lay.interp_gil_ptr, 8))
                got = self.mem.read_many(ranges)
                if any(g is None for g in got):
                    raise Inconsistent(f"interpreter at {interp:#x} unreadable")
            except Inconsistent:
                if not out:
                    raise
                return out, True
            words = [u64(g, 0) for g in got if g is not None]
            out.append((interp, words[1], self._gil(words[2] if lay.interp_gil_ptr is not None
                                                    else self.runtime + (lay.runtime_gil or 0))))
            interp = words[0]
        return out, False

    def _gil(self, addr: int) -> _Gil:
        """The GIL at `addr`: taken or not, and by which thread state (free if unreadable)."""
        lay = self.layout
        if plausible_pointer(addr):
            try:
                raw = self.mem.read(addr, lay.gil_locked + 4)
                return _Gil(addr, lay.gil_size, i32(raw, lay.gil_locked) > 0, u64(raw, lay.gil_last_holder))
            except ReadError:
                pass
        return _Gil(0, 0, False, 0)

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
        rows: list[tuple[int, int, int, _Gil]] = []
        seen: set[int] = set()
        interpreters, broken = self._interpreters()
        problem = INCONSISTENT if broken else None
        try:
            for interp, head, gil in interpreters:
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
                    rows.append((ts, ident, u64(raw, lay.tstate_frame), gil))
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

    def _innermost(self, states: list[_ThreadState]) -> list[int | None]:
        """The innermost frame of each thread (0: none, None: unreadable), in one batched read."""
        current = self.layout.cframe_current_frame
        if current is None:
            return [ts.first_frame for ts in states]
        # 3.11-3.12: tstate->cframe (on the thread's C stack) ->current_frame.
        got = self.mem.read_many([(ts.first_frame + current, 8) if plausible_pointer(ts.first_frame)
                                  else (0, 0) for ts in states])
        return [0 if not ts.first_frame else (u64(g, 0) if g is not None else None)
                for ts, g in zip(states, got, strict=True)]

    def _parse_frame(self, raw: bytes) -> tuple[_RawFrame, int] | None:
        """A frame's code, position and entry marks, and the next frame out; None for garbage."""
        lay = self.layout
        if lay.frame_kind == "object":
            if u64(raw, 8) != self.types.frame:
                return None
            # 3.8-3.10: one C-level evaluation call per frame object.
            rf = _RawFrame(u64(raw, lay.frame_code), i32(raw, lay.frame_lasti or 0), True, False)
        else:
            owner = raw[lay.frame_owner or 0]
            entry = bool(raw[lay.frame_is_entry]) if lay.frame_is_entry is not None else False
            shim = lay.version >= (3, 12) and owner == OWNED_BY_CSTACK
            rf = _RawFrame(u64(raw, lay.frame_code), u64(raw, lay.frame_instr or 0), entry, shim)
        return rf, u64(raw, lay.frame_back)

    def _walk(self, firsts: list[int | None], deadline: float) -> list[tuple[list[_RawFrame], str | None]]:
        """Every thread's frame chain, walked breadth-first: one batched read per depth, not per frame."""
        walks: list[list[_RawFrame]] = [[] for _ in firsts]
        why: list[str | None] = [None if f is not None else INCONSISTENT for f in firsts]
        seen: list[set[int]] = [set() for _ in firsts]
        cursor = {i: f for i, f in enumerate(firsts) if f}
        while cursor:
            if self._clock() > deadline:
                for i in cursor:
                    why[i] = TIME_LIMIT
                break
            for i, addr in list(cursor.items()):
                if len(walks[i]) >= self.max_depth:
                    del cursor[i]
                elif not plausible_pointer(addr) or addr in seen[i]:
                    why[i] = INCONSISTENT  # a pointer out of user space, or a loop
                    del cursor[i]
            items = list(cursor.items())
            got = self.mem.read_many([(addr, self.layout.frame_read) for _, addr in items])
            for (i, addr), raw in zip(items, got, strict=True):
                seen[i].add(addr)
                parsed = None if raw is None else self._parse_frame(raw)
                if parsed is None:
                    why[i] = INCONSISTENT
                    del cursor[i]
                    continue
                walks[i].append(parsed[0])
                if parsed[1]:
                    cursor[i] = parsed[1]
                else:
                    del cursor[i]
        return list(zip(walks, why, strict=True))

    def _frames(self, raw_frames: list[_RawFrame], headers: dict[int, bytes]) -> tuple[list[PyFrame], bool]:
        """Frames of code objects, innermost first; True when a frame could not be decoded."""
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

    def waits_for_gil(self, tid: int, gil: _Gil) -> bool | None:
        """True when the thread is in a futex wait on the GIL's condition variable or mutex.

        /proc/PID/task/TID/syscall gives the syscall a sleeping thread is in
        and its arguments (the kernel waits for the task to be off-CPU; it
        neither stops nor signals it). A futex whose address lies inside
        the GIL's struct is a wait for the GIL: take_gil's condition
        variable, its mutex, or drop_gil's switch condition.
        """
        if self._futex_nr is None or not gil.addr:
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
        return int(fields[0]) == self._futex_nr and gil.addr <= uaddr < gil.addr + gil.size

    def read(self, tids: Collection[int] | None, deadline: float,
             gil_waits: bool = True) -> tuple[dict[int, PyThread], str | None]:
        """The Python threads (all, or those in `tids`) and the cause of a partial read, if any."""
        states, problem = self.thread_states()
        if tids is not None:
            states = [ts for ts in states if ts.tid in tids]
        walks = self._walk(self._innermost(states), deadline)
        codes = {rf.code for walk, _ in walks for rf in walk if not rf.shim}
        headers = self.objects.code_headers(list(codes))
        out: dict[int, PyThread] = {}
        for ts, (raw_frames, why) in zip(states, walks, strict=True):
            frames, bad = self._frames(raw_frames, headers)
            if bad:
                why = why or INCONSISTENT
            problem = problem or why
            gil = ts.gil
            holds = gil.locked and gil.holder == ts.addr
            # Nobody waits for a GIL that is free (a waiter is about to take it).
            waits = (self.waits_for_gil(ts.tid, gil) if gil_waits and gil.locked and not holds
                     else False if gil.locked or holds else None)
            out[ts.tid] = PyThread(tid=ts.tid, frames=tuple(frames), holds_gil=holds, waits_for_gil=waits,
                                   truncated=why is not None or len(raw_frames) >= self.max_depth)
        return out, problem
