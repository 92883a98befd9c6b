"""The frames of a summed row, remembered across intervals while they cannot change.

On a busy server the same (thread, stack, waker) keys come back interval
after interval (8,000 of them a second, 1,000 threads blocking in the same
few places): resolving each one afresh each interval, through the stack
store, the waker cache and the start-time check, was a sixth of offtop's
CPU. A key's resolution is kept here once nothing about it can change:

- its stacks are final in the store (not waiting for a library or a time
  budget: those are looked at again, `StackStore.final`);
- no Python frames are spliced into it (those are sampled per sub-tick);
- it did not begin before offtop started (that record is taken once);
- the process is known by its start time, which is part of the key: a
  reused pid is another process and misses.

Wakers are kept apart, by their raw form (ids, name, the waking process's
start time), on the same terms: a thread's stack is woken by many wakers,
and the waker's stacks are those of the latest block, so one key for both
would miss at nearly every row. An interrupt's waker is named by its kind
and kernel stack alone (`Wakers.waker`), and kept by those: on a busy
server most carried rows have an interrupt's new stack at each interval
(what it interrupted differs), and the engine finds it without decoding
the row (`kept_interrupt_waker`).

The stack store renumbers nothing behind a kept entry: a cleared cache bumps
its `generation`, which empties this one, and what is kept by the kernel ids
it deleted is dropped (`StackStore.stale_ids`). A hit stamps
its ids as used, as a resolution would, so that they are not reclaimed.
What no row has asked for in a whole interval is dropped (`next_interval`):
with process churn, the rows of processes gone would pile up.
"""

from __future__ import annotations

from collections.abc import Callable

from offtop.bpf.block_frames import BlockFrames
from offtop.bpf.decode import ST_BEFORE_START, WAKER_KINDS, decode_comm
from offtop.bpf.wakers import RawWaker, Wakers
from offtop.model import Frame, Waker
from offtop.recent import Recent

#: An interrupt's waker kind (a raw waker's `what >> 24`).
_INTERRUPT = next(k for k, v in WAKER_KINDS.items() if v == "interrupt")

#: (kernel frames, user frames, began before offtop, waker, process start time, final:
#: whether all of it is kept, so that it holds while the process does)
Resolved = tuple[tuple[Frame, ...], tuple[Frame, ...], bool, Waker | None, int, bool]


class RowFrames:
    """Resolves summed rows (see the module docstring); bounded by `max_kept`."""

    def __init__(self, frames: BlockFrames, wakers: Wakers, *, max_kept: int = 100_000) -> None:
        self._frames = frames
        self._wakers = wakers
        self._kept: Recent[tuple[int, ...],
                            tuple[tuple[Frame, ...], tuple[Frame, ...], bool]] = Recent(max_kept)
        self._wakers_kept: Recent[tuple[int | bytes, ...], Waker | None] = Recent(max_kept)
        # Wakers resolved in this interval whose stacks are not final, by the same
        # key: asked for again only at the next interval. The rows of a process's
        # threads, woken as it exits by its main thread (gone by the read), share
        # one raw waker; each resolved that gone process's stack afresh (~40 µs,
        # ~150 a second on a busy server with process churn).
        self._not_final: dict[tuple[int | bytes, ...], Waker] = {}
        self._at = (-1, 0)  # where the stack store was when what is kept was checked
        self.hits = 0  #: rows resolved from what was kept (cumulative)
        self.misses = 0  #: rows resolved afresh (cumulative)

    def __len__(self) -> int:
        return len(self._kept)

    def next_interval(self) -> None:
        """What was not asked for since the last call is dropped at the next."""
        self._kept.rotate()
        self._wakers_kept.rotate()
        self._not_final.clear()

    def resolve(self, tgid: int, tid: int, st: int, us: int, ks: int, waker: RawWaker,
                deadline: float) -> Resolved:
        """(kernel, user, before, waker, start, final) of one summed row."""
        key, start, python, kept = self._lookup(tgid, tid, st, us, ks)
        final = kept is not None
        if kept is not None:
            kernel, user, before = kept
        else:
            self.misses += 1
            frames = self._frames
            assert frames.stacks is not None
            kernel, user, before = frames.frames_of(tgid, tid, st, us, ks, deadline)
            if (start and not python and not st & ST_BEFORE_START and not frames.gave_up()
                    and frames.stacks.final(tgid, start, us)):
                self._kept.put(key, (kernel, user, before))
                final = True
        w, waker_final = self.waker(waker)
        return kernel, user, before, w, start, final and waker_final

    def kept(self, tgid: int, tid: int, st: int, us: int, ks: int,
             waker: RawWaker) -> Resolved | None:
        """`resolve`'s answer from what is kept alone, nothing read or symbolized; None
        if the row's frames are not kept. For the rows summed once a stop's time to
        resolve is over: a key seen before keeps its stacks (a waker not kept is
        named without its stacks, `kept_waker`)."""
        _key, start, _python, kept = self._lookup(tgid, tid, st, us, ks)
        if kept is None:
            return None
        w, waker_final = self.kept_waker(waker)
        return *kept, w, start, waker_final

    def _lookup(self, tgid: int, tid: int, st: int, us: int, ks: int
                ) -> tuple[tuple[int, ...], int, bool,
                           tuple[tuple[Frame, ...], tuple[Frame, ...], bool] | None]:
        """(key, process start time, whether Python, kept frames or None) of a row.
        Ids renumbered since (the store's generation) empty what is kept first; a
        hit stamps the row's stacks as used (as resolving would)."""
        frames = self._frames
        stacks = frames.stacks
        assert stacks is not None
        self._check_generation()
        start = frames.start_of(tgid)
        py = frames.python
        python = py is not None and py.is_python(tgid)
        key = (tgid, start, tid, st, us, ks)
        kept = None if python else self._kept.get(key)
        if kept is not None:
            stacks.touch(ks, us)
            self.hits += 1
        return key, start, python, kept

    def _check_generation(self) -> None:
        """What is kept by kernel ids deleted since (`StackStore.stale_ids`) is dropped;
        after a cleared cache, everything."""
        stacks = self._frames.stacks
        assert stacks is not None
        at = stacks.at
        if at == self._at:
            return
        freed = stacks.stale_ids(self._at)
        self._at = at
        self._not_final.clear()
        if freed is None:
            self._kept.clear()
            self._wakers_kept.clear()
        elif freed:
            # Keys: (tgid, start, tid, state, ustack, kstack); a waker's, (what, kstack)
            # for an interrupt, else (tgid, tid, ustack, kstack, what, comm, start).
            self._kept.drop(lambda key: key[5] in freed)
            self._wakers_kept.drop(lambda key: key[1 if len(key) == 2 else 3] in freed)

    def kept_interrupt_waker(self, what: int, ks: int) -> Waker | None:
        """The kept waker of an interrupt (`what`, as a key's `waker_what`) whose kernel
        stack is `ks`; None if `what` is not an interrupt's or nothing is kept. A
        hit stamps the stack as used (as resolving would)."""
        if what >> 24 != _INTERRUPT:
            return None
        self._check_generation()
        kept = self._wakers_kept.get((what, ks))
        if kept is not None:
            assert self._frames.stacks is not None
            self._frames.stacks.touch(ks, -1)
        return kept

    def interrupt_wakers(self) -> Callable[[int, int], Waker | None]:
        """`kept_interrupt_waker` for the rows of one read (`BpfSource._sum_rows`: on a
        busy server ~2,400 carried rows a second find their interrupt's waker
        here). The store's generation is checked once, not at each row: nothing
        in a read frees stack ids (`StackStore.at` moves at a snapshot's reclaim
        and trim). A hit does not stamp its stack as used: the rows of an interval
        are, all at once, at its snapshot (`StackStore.touch_all`, before the
        reclaim)."""
        self._check_generation()
        get = self._wakers_kept.get

        def kept(what: int, ks: int) -> Waker | None:
            return get((what, ks)) if what >> 24 == _INTERRUPT else None

        return kept

    def kept_waker(self, raw: RawWaker) -> tuple[Waker | None, bool]:
        """`waker`'s answer if kept; else the waker named without its stacks (not
        final), nothing read or symbolized."""
        kind = WAKER_KINDS.get(raw[4] >> 24)
        if not kind:
            return None, True
        _key, _start, kept = self._kept_waker(raw)
        if kept is not None:
            return kept, True
        if kind == "task":
            return Waker(raw[0], raw[1], decode_comm(raw[5]), kind), False
        return Waker(0, 0, "", kind), False

    def waker(self, raw: RawWaker) -> tuple[Waker | None, bool]:
        """The model's waker of a raw one, and whether it is kept (final, as for rows)."""
        if not WAKER_KINDS.get(raw[4] >> 24):
            return None, True  # the probe saw none (as Wakers.waker says, without its cost)
        self._check_generation()
        key, wstart, kept = self._kept_waker(raw)
        if kept is not None:
            return kept, True
        w = self._not_final.get(key)
        if w is not None:
            return w, False
        w = self._wakers.waker(raw)
        frames = self._frames
        assert frames.stacks is not None
        wtgid, wus = raw[0], raw[2]
        if ((wstart or wus < 0) and not frames.gave_up()
                and (wus < 0 or frames.stacks.final(wtgid, wstart, wus))):
            self._wakers_kept.put(key, w)
            return w, True
        if w is not None:
            self._not_final[key] = w
        return w, False

    def _kept_waker(self, raw: RawWaker) -> tuple[tuple[int | bytes, ...], int, Waker | None]:
        """(key, the waking process's start time (0: none or unknown), kept answer or
        None). An interrupt's key is (what, kernel stack id); a task's, the raw
        waker and its process's start time. A hit stamps the waker's stacks as
        used (as resolving would)."""
        wtgid, wus, ks, what = raw[0], raw[2], raw[3], raw[4]
        if what >> 24 == _INTERRUPT:
            return (what, ks), 0, self.kept_interrupt_waker(what, ks)
        start = self._frames.start_of(wtgid) if wtgid > 0 and wus >= 0 else 0
        key = (*raw, start)
        kept = self._wakers_kept.get(key)
        if kept is not None:
            assert self._frames.stacks is not None
            self._frames.stacks.touch(ks, wus)
        return key, start, kept
