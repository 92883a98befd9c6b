"""User stacks of blocked threads, unwound with call-frame information, kept per block.

A blocked thread's registers and stack stay put until it runs again, so a
whole user stack can be read then (offtop.unwind), also for code built
without frame pointers. Each block is unwound once, within a time budget,
and kept by (tid, switch-out time), which is also what its long-block event
carries (its end minus its duration): the event then shows the whole stack.
Addresses are kept, and symbolized at each use until every frame has a name
(a big file's symbols may take a few sub-ticks' budgets to load); from then
on the frames are kept too. A thread blocked for hours is shown at every
snapshot: symbolizing its stack each time was a tenth of an idle offtop's
work.

A process's maps are read once per pass over the blocked threads
(`new_pass`), not once per thread: a process of 5,000 threads has a maps
file of ~0.5 MB (each thread's stack is a mapping), ~6 ms to read and
parse, and the kernel holds the process's mmap lock while it writes it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

from offtop.model import MARK_DEPTH_LIMIT, MARK_TRUNCATED, Frame
from offtop.unwind import StopReason, Unwinder, UnwindResult
from offtop.unwind.unwinder import FileMapping, SavedRegs


class Symbolizer(Protocol):
    """Resolves user addresses (offtop.symbols.UserSymbols)."""

    def resolve_stack(self, pid: int, addrs: list[int] | tuple[int, ...], *,
                      deadline: float | None = None,
                      start: int | None = None) -> tuple[Frame, ...]:
        """Frames of a user stack."""
        ...


class UnwoundStacks:
    """Blocks unwound while they last (see the module docstring)."""

    #: A block that could not be unwound is tried again after this long.
    RETRY_S = 10.0

    def __init__(self, unwinder: Unwinder, symbols: Symbolizer, *,
                 clock: Callable[[], float], max_kept: int = 4096,
                 saved: Callable[[int], SavedRegs | None] | None = None) -> None:
        self._unwinder = unwinder
        self._saved = saved
        self._symbols = symbols
        self._clock = clock
        self._max = max_kept
        self._blocks: dict[tuple[int, int], tuple[int, UnwindResult]] = {}
        #: The frames of blocks whose every frame has a name (see the module docstring).
        self._named: dict[tuple[int, int], tuple[Frame, ...]] = {}
        #: Blocks that could not be unwound, and when to try again (`RETRY_S`).
        self._failed: dict[tuple[int, int], float] = {}
        #: The maps read in this pass, by pid (`new_pass`).
        self._maps: dict[int, Sequence[FileMapping]] = {}

    def new_pass(self) -> None:
        """A new pass over the blocked threads: processes' maps are read again."""
        self._maps.clear()

    def _maps_of(self, pid: int) -> Sequence[FileMapping]:
        maps = self._maps.get(pid)
        if maps is None:
            maps = self._maps[pid] = self._unwinder.read_maps(pid)
        return maps

    def unwind(self, pid: int, tid: int, ts: int, ubp: int, until: float) -> bool:
        """Unwind block (tid, ts) unless done already or past `until`; True if it is known."""
        key = (tid, ts)
        if key in self._blocks:
            return True
        now = self._clock()
        if now > until or now < self._failed.get(key, now):
            return False
        # The probe took rbp when it saw the block begin; a block from before
        # the start has none: then the kernel's saved registers give it.
        r = self._unwinder.unwind_blocked(pid, tid, bp=ubp or None, saved=self._saved,
                                          maps_of=self._maps_of)
        if not r.addresses or r.stop_reason in (StopReason.NOT_BLOCKED, StopReason.THREAD_RAN):
            # The block ended (a new one has another ts), or this one cannot be
            # read (another user's /proc files): tried again only now and then,
            # not at every snapshot of a block that lasts.
            self._failed[key] = now + self.RETRY_S
            return False
        self._failed.pop(key, None)
        self._blocks[key] = (pid, r)
        return True

    def frames(self, tid: int, ts: int, deadline: float | None, *,
               pop: bool = False) -> tuple[Frame, ...] | None:
        """The frames of an unwound block (None: it was not unwound)."""
        key = (tid, ts)
        hit = self._blocks.pop(key, None) if pop else self._blocks.get(key)
        if hit is None:
            return None
        named = self._named.pop(key, None) if pop else self._named.get(key)
        if named is not None:
            return named
        pid, r = hit
        named = self._symbols.resolve_stack(pid, r.addresses, deadline=deadline)
        frames = self._marked(r, named)
        if not pop and not any(f.unknown for f in named):
            self._named[key] = frames
        return frames

    @staticmethod
    def _marked(r: UnwindResult, frames: tuple[Frame, ...]) -> tuple[Frame, ...]:
        """`frames` with the mark of why the walk ended short, if it did."""
        if r.stop_reason == StopReason.MAX_FRAMES:
            return (*frames, Frame(name=MARK_DEPTH_LIMIT))
        if not r.complete and not (frames and frames[-1].name == MARK_TRUNCATED):
            return (*frames, Frame(name=MARK_TRUNCATED))
        return frames

    def forget_gone(self, start_time: Callable[[int], int | None]) -> int:
        """Drop the blocks of processes gone (`start_time(pid)` None); return how many."""
        gone = [key for key, (pid, _r) in self._blocks.items() if start_time(pid) is None]
        for key in gone:
            del self._blocks[key]
            self._named.pop(key, None)
        return len(gone)

    def trim(self) -> None:
        """Forget the oldest blocks beyond the bound (they ended unseen: short, or summed)."""
        for key in _oldest_past(self._blocks, self._max):
            del self._blocks[key]
            self._named.pop(key, None)
        for key in _oldest_past(self._failed, self._max):
            del self._failed[key]


def _oldest_past(d: dict[tuple[int, int], Any], bound: int) -> list[tuple[int, int]]:
    """The oldest keys of `d` to drop, down to half of `bound`, once it is past it."""
    return list(d)[: len(d) - bound // 2] if len(d) > bound else []
