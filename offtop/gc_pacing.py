"""Python's full garbage-collection passes, taken over by offtop's main loops.

offtop's data is acyclic (tuples, dicts, frames): reference counting frees
it. The cyclic GC still walks it: each interval's rows (10,000 on a busy
server) outlive a couple of young collections, reach the oldest
generation, and make Python's own full passes come every few seconds, each
walking every cached frame and stack: 50-60 ms each at a busy server's
~100,000 objects, at any moment (measured: 2-3.5% of a core in batch, and
a keypress's worth of stall in the TUI).

So, once the first snapshot is out: everything alive then (imports,
tables, caches) is frozen out of the GC's sight, Python's own full passes
are turned off (young and middle passes go on, paced as below), and the loop runs a
full pass itself every `every` snapshots, and at least every `max_s`
seconds (`due`), at a moment of its choosing (after output, after a
redraw). Cyclic garbage, if any, is then freed within that time.

The young generations are also taken longer than Python's defaults. Textual's
drawn lines are reference cycles (a strip divided into one piece caches
itself; each strip is ~15 objects the GC tracks, seven of them its caches): a
redraw makes thousands, dead as soon as the frame is written. Whatever is
alive at a young pass moves to the middle generation, and whatever is alive
at a middle pass to the oldest, where it waits, dead, for the next full pass.
With Python's default (a young pass every 700 net allocations, a middle one
every 10 young ones) most of a redraw's lines were caught alive in the very
redraw that made them and promoted: at 2,000 tasks and 20,000 stacks
(bench/bench_ui.py), ~225,000 objects, most of the full pass's time. So a young
pass comes every `YOUNG_OBJECTS` (20,000) net allocations, more than a redraw's
lines and work: a redraw's lines are mostly dead by the next young pass, which
frees them where they are. A middle pass comes every `YOUNG_PASSES` (4)
young ones. In bench/bench_ui.py, against a young pass every 700 allocations
and a middle one every 100: 57 young passes instead of 3,569 (median 6 ms, the
longest 23-32 ms), 11 middle ones instead of 35 (the longest ~30 ms either
way), and a last full pass that frees ~17,000 objects instead of ~38,000 in
about half the time; all of them 0.6-0.65 s of CPU instead of 0.86
(bench/README.md, "Young passes of 20,000 objects").

Batch mode draws nothing: it makes no such cycles, and turns the young and
middle passes off too (`young=False`). At the busy server (bench/README.md)
they took 25-35 ms of CPU a second (each snapshot's 10,000 rows outlive a
young pass or two before they are freed; batch mode 46.9% -> 44.5% of a
core without them, side by side), while the cyclic garbage the paced full
passes then find is ~40 objects a second.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


def freeze_alive() -> None:
    """Collect, then move everything alive out of the cyclic GC's sight for good."""
    gc.collect()
    gc.freeze()


class GcPacing:
    """Full GC passes at the loop's pace (see the module docstring)."""

    #: The third GC threshold that stops Python's own full passes.
    NO_FULL_GC = 1 << 30
    #: The first GC threshold while active (`young`): net allocations between two
    #: young passes.
    YOUNG_OBJECTS = 20_000
    #: The second GC threshold while active: young passes between two middle ones.
    YOUNG_PASSES = 4

    def __init__(self, clock: Callable[[], float] = time.monotonic, *, every: int = 30,
                 max_s: float = 60.0, young: bool = True) -> None:
        self._clock = clock
        #: Whether Python's young and middle passes go on while active (else only
        #: the full passes run, at the loop's pace: see the module docstring).
        self.young = young
        self.every = every  #: a full pass every this many snapshots...
        self.max_s = max_s  #: ... and at least every this many seconds (paused, no data)
        self._saved: tuple[int, int, int] | None = None
        self._snapshots = 0
        self._at = 0.0
        self.passes = 0  #: full passes run (the first, which freezes, included)

    @property
    def active(self) -> bool:
        """Whether the full passes are this object's (after the first `full_pass`)."""
        return self._saved is not None

    def snapshot_done(self) -> bool:
        """Count a snapshot out; True if a full pass is due (the first, then every `every`)."""
        self._snapshots += 1
        return self._snapshots % self.every == 1

    def overdue(self) -> bool:
        """True if active and no full pass ran for `max_s` seconds."""
        return self._saved is not None and self._clock() - self._at >= self.max_s

    def full_pass(self) -> None:
        """A full pass now; the first also freezes what is alive and stops Python's own."""
        if self._saved is None:
            self._saved = gc.get_threshold()
            freeze_alive()
            # A first threshold of 0 turns Python's own passes off, all of them.
            gc.set_threshold(self.YOUNG_OBJECTS if self.young else 0, self.YOUNG_PASSES,
                             self.NO_FULL_GC)
        else:
            gc.collect()
        self.passes += 1
        self._at = self._clock()

    def restore(self) -> None:
        """Give Python its own full passes back (what was frozen stays so)."""
        if self._saved is not None:
            gc.set_threshold(*self._saved)
            self._saved = None


class Parcel(Generic[T]):
    """A worker thread's inputs, handed over once (`take`).

    A finished Textual worker is a reference cycle (it and its task reach
    each other through the context they ran in), so only a full pass frees
    it, and until then it keeps its arguments alive. Given a snapshot's
    index or its stacks, every such worker kept a snapshot: at a busy server
    with all stacks merged, 8-9 dead snapshots (90,000 stack rows) waited
    for each full pass, which then took 0.7 s, and RSS grew by 70 MB. A
    worker given a parcel takes its inputs out as it starts and holds
    nothing once it ran. (One cancelled before it started never takes them:
    they wait for the next full pass, as before.)
    """

    __slots__ = ("_value",)

    def __init__(self, value: T) -> None:
        self._value: T | None = value

    def take(self) -> T | None:
        """The inputs, the first time; None after (its one taker is the worker)."""
        value, self._value = self._value, None
        return value
