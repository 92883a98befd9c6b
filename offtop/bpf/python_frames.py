"""Python frames of blocked threads, spliced into their native user stacks.

Read once per snapshot for the threads blocked at that moment (a blocked
thread's interpreter state holds still, so the read is consistent) and kept
two ways:

- by block, (tid, switch-out time): exact for blocked-now and for the long
  block that the same wait becomes when it ends;
- by site, (tid, user stack id): the Python stack last seen while the
  thread was blocked at that native stack. Short blocks summed in the
  kernel get their Python frames from here: a sample, not a record of each
  block (the README says which is which).

Python frames become user frames named "py:function (file.py:line)" with the
source path as their module; see `offtop.pystacks` for the reader.
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

from offtop.model import Frame
from offtop.pystacks import (
    NOT_PYTHON,
    PyFrame,
    PythonStacks,
    PyThread,
    StackMarker,
    merge_stacks,
)

#: The prefix of Python frames' names in every output.
PY_PREFIX = "py:"


class ThreadBlock(Protocol):
    """What the reader needs of one blocked thread (the probe's record of it,
    `offtop.bpf.blocked.Blocked`)."""

    @property
    def pid(self) -> int: ...
    @property
    def tid(self) -> int: ...
    @property
    def ts(self) -> int: ...
    @property
    def ustack(self) -> int: ...


def python_frame(f: PyFrame) -> Frame:
    """A model frame for a Python frame."""
    return Frame(name=PY_PREFIX + f.label, module=f.filename)


class PythonFrames:
    """Reads and keeps the Python stacks of blocked threads (see module docstring)."""

    def __init__(self, stacks: PythonStacks, *, budget_s: float = 0.02, max_kept: int = 16_384,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._stacks = stacks
        self._budget = budget_s
        self._max = max_kept
        self._clock = clock
        self._by_block: OrderedDict[tuple[int, int], PyThread] = OrderedDict()
        self._by_site: OrderedDict[tuple[int, int], PyThread] = OrderedDict()
        self.skipped = 0  #: processes not read for lack of time, cumulative
        self._python_pids: set[int] = set()  # processes whose Python stacks could be read

    @property
    def failures(self) -> Counter[str]:
        """Reads that failed, by cause. A process that runs no Python is not a
        failure: it is left out (the reader counts it, once per process)."""
        return Counter({why: n for why, n in self._stacks.failures.items() if why != NOT_PYTHON})

    def read(self, blocked: Iterable[ThreadBlock]) -> None:
        """Read the Python stacks of these blocked threads, within the budget."""
        by_pid: dict[int, list[ThreadBlock]] = {}
        for b in blocked:
            by_pid.setdefault(b.pid, []).append(b)
        end = self._clock() + self._budget
        for pid, threads in by_pid.items():
            left = end - self._clock()
            if left <= 0:
                self.skipped += 1
                continue
            res = self._stacks.read_process(pid, {b.tid for b in threads}, budget_s=left)
            if res.threads:
                self._python_pids.add(pid)
            for b in threads:
                t = res.threads.get(b.tid)
                if t is None or not t.frames:
                    continue
                self._keep(self._by_block, (b.tid, b.ts), t)
                if b.ustack >= 0:
                    self._keep(self._by_site, (b.tid, b.ustack), t)

    def sample(self, blocked_record: Callable[[int], tuple[int, int] | None]) -> None:
        """Between snapshots: the Python threads of the Python processes seen so far
        that are blocked right now, by site (what summed short blocks are given).

        `blocked_record(tid)` is (switch-out time, user stack id) of a thread
        blocked now, None for one running. Within the same budget as `read`.
        """
        end = self._clock() + self._budget
        for pid in list(self._python_pids):
            left = end - self._clock()
            if left <= 0:
                self.skipped += 1
                return
            res = self._stacks.read_process(pid, budget_s=left)
            if not res.threads:
                self._python_pids.discard(pid)  # gone, or no longer readable
                continue
            for tid, t in res.threads.items():
                rec = blocked_record(tid)
                if rec is not None and t.frames and rec[1] >= 0:
                    self._keep(self._by_site, (tid, rec[1]), t)

    def _keep(self, store: OrderedDict[tuple[int, int], PyThread], key: tuple[int, int],
              t: PyThread) -> None:
        store[key] = t
        store.move_to_end(key)
        while len(store) > self._max:
            store.popitem(last=False)

    def forget_gone(self, start_time: Callable[[int], int | None]) -> int:
        """Drop what the reader keeps about processes gone; return how many."""
        return self._stacks.forget_gone(start_time)

    def is_python(self, pid: int) -> bool:
        """Whether process `pid`'s Python stacks are read (its frames change per sample)."""
        return pid in self._python_pids

    @staticmethod
    def merged(native: Sequence[Frame], thread: PyThread) -> tuple[Frame, ...]:
        """`native` with the thread's Python frames spliced in (see offtop.pystacks.merge).
        A method, so that callers reach it through a reader they hold: this module is
        imported once the probe is armed (`BpfSource._start_armed`)."""
        merged = merge_stacks(native, thread.frames, gil_wait=thread.waits_for_gil)
        out: list[Frame] = []
        for f in merged.frames:
            if isinstance(f, PyFrame):
                out.append(python_frame(f))
            elif isinstance(f, StackMarker):
                out.append(Frame(name=f.name))
            else:
                out.append(f)
        return tuple(out)

    def of_block(self, tid: int, ts: int, *, pop: bool = False) -> PyThread | None:
        """The Python stack of one block, read while it lasted."""
        key = (tid, ts)
        return self._by_block.pop(key, None) if pop else self._by_block.get(key)

    def of_site(self, tid: int, ustack: int) -> PyThread | None:
        """The Python stack last seen while `tid` was blocked at user stack `ustack`."""
        return self._by_site.get((tid, ustack)) if ustack >= 0 else None
