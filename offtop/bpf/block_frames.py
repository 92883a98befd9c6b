"""The frames of a block: which stacks to show for a summed row, a long block or a
thread blocked now, from the probe's stack ids, /proc (blocks from before the
start), the unwinder (threads unwound while blocked) and Python frames.

Part of the engine (`offtop.bpf.engine.BpfSource`), apart so that the engine
reads as the capture loop and this as the rules of what a stack is:

- a block from before offtop started has the kernel stack /proc showed and the
  user stack unwound meanwhile;
- a thread unwound while it was blocked gets that user stack, the whole chain,
  instead of the probe's;
- Python frames are spliced in where they were read (per block, else per site);
- once a stop is coming (`hurry`), what is left is resolved for a short while
  more, then the stacks are marked instead: a signal never waits for long.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from offtop.bpf.before_start import BeforeStart
from offtop.bpf.blocked import BlockedNowReader
from offtop.bpf.budget import Budget
from offtop.bpf.decode import ST_BEFORE_START, state_name
from offtop.model import MARK_BEHIND, MARK_NOT_RESOLVED, BlockedNow, Frame
from offtop.safe_files import read_proc_small
from offtop.safe_text import decode
from offtop.targets import task_start_time

if TYPE_CHECKING:
    # Made once the probe is armed (`BpfSource._start_armed`), their modules too.
    from offtop.bpf.python_frames import PythonFrames
    from offtop.bpf.stack_store import StackStore
    from offtop.bpf.unwound import UnwoundStacks

NOT_RESOLVED = Frame(MARK_NOT_RESOLVED)
BEHIND = Frame(MARK_BEHIND)


class BlockFrames:
    """Resolves blocks to frames; `stacks`, `unwound` and `python` are set once the
    probe is loaded (`BpfSource.start`)."""

    def __init__(self, before: BeforeStart, *, clock: Callable[[], float] = time.monotonic
                 ) -> None:
        self.before = before
        self.stacks: StackStore | None = None
        self.unwound: UnwoundStacks | None = None
        self.python: PythonFrames | None = None
        #: Past this (clock time, set when a stop is coming), nothing more is resolved.
        self._hurry_deadline = math.inf
        self._clock = clock
        self._starts: dict[int, int] = {}  # pid -> start time, valid for one sub-tick
        # pid -> the start time it had when last seen alive: a process that
        # exited since is still itself (its stacks stay cached) until its last
        # sums are read (`sums_read`).
        self._last_starts: dict[int, int] = {}
        # Processes found gone since the kernel's sums were last read, and before
        # that: pid -> the start time they keep.
        self._gone: dict[int, int] = {}
        self._gone_before: dict[int, int] = {}
        self._warmed: set[int] = set()  # blocks from before the start symbolized whole

    def hurry(self, within_s: float) -> None:
        """A stop is coming: resolve for `within_s` more at most (callable from a signal
        handler or another thread)."""
        self._hurry_deadline = self._clock() + within_s

    def gave_up(self) -> bool:
        """A stop is coming and its time to resolve stacks is over."""
        return self._clock() >= self._hurry_deadline

    def new_subtick(self) -> None:
        """Start times are read again (a pid may be another process's by now)."""
        self._starts.clear()

    def start_of(self, pid: int) -> int:
        """The start time of process `pid` (0: unknown): with the pid, who it is."""
        start = self._starts.get(pid)
        if start is None:
            start = task_start_time(pid) or 0
            last = self._last_starts
            if start:
                if len(last) >= 65_536:
                    last.clear()
                last[pid] = start
            else:
                # Gone: the rows read until its last sums are read were summed
                # by the process last seen alive with this pid (else 0: unknown).
                start = last.get(pid, 0)
                if start and pid not in self._gone_before:
                    self._gone[pid] = start
            self._starts[pid] = start
        return start

    def start_if_alive(self, pid: int) -> int:
        """`start_of`, or 0 for a process found gone (whose start time is kept only
        for finding what was kept for it: `user`)."""
        start = self.start_of(pid)
        return 0 if self._found_gone(pid) else start

    def _found_gone(self, pid: int) -> bool:
        """Whether `pid` was found gone and keeps its start time (after `start_of`)."""
        return pid in self._gone or pid in self._gone_before

    def sums_read(self) -> None:
        """The kernel's sums were just read and summed. A process found gone before the
        previous read has had its last sums read now (those of its blocks between
        that read's cut and its exit): it is forgotten, its pid unknown from here
        (a pid gone longer may be another process's, born and gone between two
        looks). On a busy server, ~1,000 rows a second are of processes that
        exited within the interval: forgotten at the first look after their exit,
        they were resolved again at the read, without the frames kept for them."""
        last = self._last_starts
        for pid, start in self._gone_before.items():
            if last.get(pid) == start:  # not found alive again since (a pid reused)
                del last[pid]
        self._gone_before, self._gone = self._gone, {}

    def frames_of(self, tgid: int, tid: int, st: int, us: int, ks: int, deadline: float,
                  ts: int | None = None) -> tuple[tuple[Frame, ...], tuple[Frame, ...], bool]:
        """(kernel frames, user frames, began before offtop) of one block.

        A block from before the start has the stacks /proc showed (and the
        user stack unwound meanwhile); a block whose thread was unwound while
        blocked gets that user stack instead of the probe's; Python frames
        are spliced in where they were read.
        """
        if self.gave_up():
            return (), (NOT_RESOLVED,), bool(st & ST_BEFORE_START)
        py = self.python
        if st & ST_BEFORE_START:
            before = self.before.pop(tid)
            if before is None:
                return (), (), True
            user = self.unwound_frames(tid, before.ts, deadline, pop=True) or ()
            if py is not None and (t := py.of_block(tid, before.ts, pop=True)) is not None:
                user = py.merged(user, t)
            return before.kernel, user, True
        unwound = self.unwound_frames(tid, ts, deadline, pop=True) if ts is not None else None
        user = unwound if unwound is not None else self.user(tgid, us, deadline)
        if py is not None:
            t = py.of_block(tid, ts, pop=True) if ts is not None else None
            t = t or py.of_site(tid, us)
            if t is not None:
                user = py.merged(user, t)
        return self.kernel(ks), user, False

    def unwind_before_start(self, budget_s: float) -> None:
        """Unwind the user stacks of the blocks from before the start now, while they
        hold still: one that ends within the first interval (a short sleep caught
        under way) would otherwise have only the kernel stack /proc showed."""
        if self.unwound is None:
            return
        until = self._clock() + budget_s
        self.unwound.new_pass()
        for tid, b in self.before.blocks():
            if self._clock() > until:
                break
            if b.pid:
                self.unwound.unwind(b.pid, tid, b.ts, 0, until)

    def warm_before_start(self, deadline: float) -> bool:
        """Symbolize the blocks from before the start until `deadline`, ahead of the
        first snapshot; True once all are done.

        A big library's symbol table (libc's: ~45 ms on a quiet machine) is
        loaded a time budget at a time: on a busy machine one snapshot's budget
        did not load it, and the first blocked-now list showed `libc.so.6+0x…`.
        The first interval is idle time, spent here instead.
        """
        for tid, b in self.before.blocks():
            if tid in self._warmed:
                continue
            if self._clock() >= deadline:
                return False
            self.unwound_frames(tid, b.ts, deadline)
            if self._clock() >= deadline:  # may have been cut short
                return False
            self._warmed.add(tid)
        return True

    def unwound_frames(self, tid: int, ts: int, deadline: float | None,
                       *, pop: bool = False) -> tuple[Frame, ...] | None:
        if self.unwound is None:
            return None
        return self.unwound.frames(tid, ts, deadline, pop=pop)

    def kernel(self, sid: int) -> tuple[Any, ...]:
        assert self.stacks is not None
        return self.stacks.kernel(sid)

    def user(self, pid: int, sid: int, deadline: float | None) -> tuple[Any, ...]:
        assert self.stacks is not None
        if self.gave_up():  # a waker's stack too
            return (NOT_RESOLVED,)
        start = self.start_of(pid)
        if start and self._found_gone(pid):
            # Gone: the frames kept for it while it lived, else resolved as any
            # process gone is (in the one it was forked from, nothing kept).
            kept = self.stacks.kept_user(pid, start, sid)
            if kept is not None:
                return kept
            start = 0
        return self.stacks.user(pid, start, sid, deadline=deadline)

    def blocked_now(self, reader: BlockedNowReader, accepts: Callable[[int, int], bool], *,
                    symbol_budget_s: float, unwind_budget_s: float
                    ) -> tuple[list[BlockedNow], set[tuple[str, int]]]:
        """The threads blocked now, with their frames (each part within its budget), and
        the stack ids still in use (for the stack store's reclaim)."""
        rows, live = reader.read()
        symbols = Budget(symbol_budget_s, self._clock)
        # Once a stop's time to resolve is over, only what is known already is shown.
        hurried = self.gave_up()
        unwinding = Budget(unwind_budget_s, self._clock)
        if self.unwound is not None:
            self.unwound.new_pass()
        if self.python is not None and not hurried:
            self.python.read(b for b in rows if accepts(b.pid, b.tid))
        out = []
        for b in rows:
            if not accepts(b.pid, b.tid):
                continue
            before = bool(b.state & ST_BEFORE_START)
            unwound_known = False
            stacks = None if before else self.stacks
            start = self.start_of(b.pid) if stacks is not None else 0
            if stacks is not None and not hurried and b.ustack >= 0 \
                    and not stacks.final(b.pid, start, b.ustack):
                # Resolved first (it is below, in the same budget): a stack new
                # since the last look is most often whole, and then needs no
                # unwinding (~0.4 ms each, ten a snapshot on a busy server).
                with symbols:
                    self.user(b.pid, b.ustack, symbols.deadline())
            # A stack the probe already has whole needs no unwinding (on a busy
            # server that was most of the unwinder's work, every snapshot).
            whole = stacks is not None and stacks.whole(b.pid, start, b.ustack)
            if self.unwound is not None and not whole and not hurried:
                with unwinding:
                    unwound_known = self.unwound.unwind(b.pid, b.tid, b.ts, b.ubp,
                                                        unwinding.deadline())
            with symbols:
                deadline = symbols.deadline()
                unwound = self.unwound_frames(b.tid, b.ts, deadline) if unwound_known else None
                if before:
                    pre = self.before.get(b.tid)
                    kernel = pre.kernel if pre is not None else ()
                    user = unwound or ()
                else:
                    kernel = self.kernel(b.kstack)
                    user = self.user(b.pid, b.ustack, deadline)
                    # The unwound stack is the whole truth, once its names are
                    # there (a big file may take a few sub-ticks' budgets).
                    if unwound is not None and _resolved(unwound) >= _resolved(user):
                        user = unwound
                py = self.python
                if py is not None and (t := py.of_block(b.tid, b.ts)) is not None:
                    user = py.merged(user, t)
            out.append(BlockedNow(
                pid=b.pid, tid=b.tid, comm=_comm_of(b.pid, b.tid), state=state_name(b.state),
                blocked_ns=b.waited_ns, kernel=kernel, user=user, before_start=before,
            ))
        if self.unwound is not None:
            self.unwound.trim()
        return out, live


def _resolved(frames: tuple[Frame, ...]) -> int:
    return sum(1 for f in frames if not f.unknown)


def _comm_of(pid: int, tid: int) -> str:
    # A comm is whatever bytes the task set (prctl PR_SET_NAME): not UTF-8.
    try:
        return decode(read_proc_small(f"/proc/{pid}/task/{tid}/comm", 64).removesuffix(b"\n"))
    except OSError:
        return "?"
