"""Long blocks whose user frames a time budget cut short, named again before their snapshot.

A stack is resolved the first time it is used, within that sub-tick's symbol
budget (wall time: it keeps the intervals on time), and cached; one left with
unnamed frames is looked at again only a few intervals later. On a machine
that starves offtop of the CPU, the budget can pass before a new binary's
symbols are loaded: a long block's frames read `module+0x…`, whether resolved
for it or for a row before it. A long block is shown only at its interval's
snapshot, so until then its stack is resolved again at each sub-tick, in what
budget is left: a starved offtop names it late, not never. A stack whose
frames went unnamed in time (a stripped binary's) is not tried again.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Callable

from offtop.model import Frame, LongBlock

#: (pid, start time, stack id, deadline) -> (the user frames resolved again now,
#: whether their resolving ran out of time again).
Again = Callable[[int, int, int, float], tuple[tuple[Frame, ...], bool]]


def _unnamed(frames: tuple[Frame, ...]) -> int:
    return sum(f.unknown for f in frames)


class CutShort:
    """This interval's long blocks whose user frames the budget cut short."""

    def __init__(self, again: Again, clock: Callable[[], float]) -> None:
        self._again = again
        self._clock = clock
        self._pending: list[tuple[LongBlock, int, int]] = []

    def __len__(self) -> int:
        return len(self._pending)

    def note(self, block: LongBlock, start: int, sid: int) -> None:
        """`block`, of process (`block.pid`, `start`), has user stack `sid` cut short."""
        self._pending.append((block, start, sid))

    def retry(self, blocks: deque[LongBlock], deadline: float) -> None:
        """Resolve the stacks cut short again until `deadline` (each once), and put the
        blocks so named in their place in `blocks`."""
        if not self._pending:
            return
        named: dict[tuple[int, int, int], tuple[tuple[Frame, ...], bool]] = {}
        renamed: dict[int, LongBlock] = {}
        left: list[tuple[LongBlock, int, int]] = []
        for block, start, sid in self._pending:
            key = (block.pid, start, sid)
            got = named.get(key)
            if got is None:
                if self._clock() >= deadline:
                    left.append((block, start, sid))
                    continue
                got = named[key] = self._again(block.pid, start, sid, deadline)
            user, short = got
            if _unnamed(user) < _unnamed(block.user):  # (a process gone since: not worse)
                renamed[id(block)] = block = dataclasses.replace(block, user=user)
            if short:
                left.append((block, start, sid))
        self._pending = left
        if renamed:
            # In place, in order (the deque is the interval's, bounded).
            kept = [renamed.get(id(b), b) for b in blocks]
            blocks.clear()
            blocks.extend(kept)

    def clear(self) -> None:
        """The interval's snapshot is out: its blocks are as they are."""
        self._pending.clear()
