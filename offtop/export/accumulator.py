"""Off-CPU time summed over a whole run, bounded in memory, ready to export.

`ProfileAccumulator.add(snapshot)` folds each interval's stacks into totals
keyed by (thread, state, callchain), and keeps the run's long blocks for
timelines. `profile()` hands the exporters (`pprof`, `speedscope`) one frozen
`ProfileData`; `ProfileData.from_stacks` builds one from any stack rows (the
flame graph's current view, a single snapshot for a push).

Memory stays bounded on a busy machine running for days: when more than
`max_stacks` distinct keys are held, the smallest quarter is folded into one
`[other stacks]` entry per state, so the totals stay exact and only the
attribution of the smallest stacks is lost (and counted). Long blocks beyond
`max_long_blocks` are dropped and counted, never silently.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from offtop.model import Frame, LongBlock, Snapshot, StackRow

#: The frame a stack with no frames at all is shown with: a sample without a
#: location is invisible in most viewers, and its time must stay visible.
NO_STACK = Frame(name="[no stack]")
#: The frame standing for the stacks folded away to keep memory bounded.
OTHER_STACKS = Frame(name="[other stacks]")

#: (pid, tid, state, kernel chain, user chain): one exported sample. The
#: chains are strings (see `ProfileAccumulator._chain`): hashing a tuple of
#: `Frame`s calls a Python `__hash__` per frame, ten times slower.
StackKey = tuple[int, int, str, str, str]


@dataclass(slots=True)
class _Total:
    """The running total of one key (private to the accumulator)."""

    ns: int
    count: int
    max_ns: int
    kernel: tuple[Frame, ...]
    user: tuple[Frame, ...]


@dataclass(frozen=True, slots=True)
class StackTotal:
    """Off-CPU time of one thread in one state at one callchain, over the run.

    `pid == tid == 0` and `comm == "[other]"` mark the entry that holds the
    folded-away smallest stacks of one state (see module docstring).
    """

    pid: int
    tid: int
    comm: str
    state: str
    offcpu_ns: int
    count: int
    max_ns: int
    kernel: tuple[Frame, ...]
    user: tuple[Frame, ...]
    cgroup: str = ""

    @property
    def frames(self) -> tuple[Frame, ...]:
        """Innermost first: kernel frames, then user frames (never empty)."""
        return (self.kernel + self.user) or (NO_STACK,)


@dataclass(frozen=True, slots=True)
class ProfileData:
    """What the exporters read: the run's totals, frozen.

    `start` and `end` are unix seconds; `stacks` are sorted by off-CPU time,
    descending. `folded_stacks`/`folded_ns` say how much was folded into
    `[other stacks]` entries, `dropped_long_blocks` how many long blocks were
    not kept.
    """

    start: float
    end: float
    stacks: tuple[StackTotal, ...]
    long_blocks: tuple[LongBlock, ...] = ()
    snapshots: int = 0
    threshold_ns: int = 0
    folded_stacks: int = 0
    folded_ns: int = 0
    dropped_long_blocks: int = 0
    comments: tuple[str, ...] = field(default=())

    @property
    def total_ns(self) -> int:
        """All off-CPU time in the profile."""
        return sum(s.offcpu_ns for s in self.stacks)

    @property
    def duration_s(self) -> float:
        """How long the profile covers (never negative)."""
        return max(0.0, self.end - self.start)

    @classmethod
    def from_stacks(
        cls,
        stacks: Iterable[StackRow],
        *,
        start: float,
        end: float,
        long_blocks: Iterable[LongBlock] = (),
        threshold_ns: int = 0,
        cgroup_of: Callable[[int], str] | None = None,
        comments: Sequence[str] = (),
    ) -> ProfileData:
        """A profile of some stack rows (one snapshot, the flame graph's view).

        `cgroup_of(tid)` names a thread's cgroup ("" when unknown).
        """
        acc = ProfileAccumulator(max_stacks=1 << 62, max_long_blocks=1 << 62)
        acc.add_stacks(stacks, start=start, end=end, long_blocks=long_blocks)
        data = acc.profile(comments=comments)
        rows = data.stacks
        if cgroup_of is not None:
            rows = tuple(_with_cgroup(s, cgroup_of(s.tid) or s.cgroup) for s in rows)
        return cls(start=data.start, end=data.end, stacks=rows, long_blocks=data.long_blocks,
                   snapshots=0, threshold_ns=threshold_ns, comments=tuple(comments))


def _with_cgroup(s: StackTotal, cgroup: str) -> StackTotal:
    if cgroup == s.cgroup:
        return s
    return StackTotal(pid=s.pid, tid=s.tid, comm=s.comm, state=s.state, offcpu_ns=s.offcpu_ns,
                      count=s.count, max_ns=s.max_ns, kernel=s.kernel, user=s.user, cgroup=cgroup)


class ProfileAccumulator:
    """Sums snapshots over a run into per-(thread, state, stack) totals.

    Bounded: at most `max_stacks` keys (smallest folded, see module
    docstring), `max_long_blocks` long blocks, and the cgroup ids of at most
    `max_threads` threads. `cgroup_name(cgroup_id)` turns the cgroup id that
    long blocks carry into a label (a path); without it the id is used.
    """

    def __init__(
        self,
        *,
        max_stacks: int = 100_000,
        max_long_blocks: int = 10_000,
        max_threads: int = 50_000,
        cgroup_name: Callable[[int], str | None] | None = None,
    ) -> None:
        if max_stacks < 4:
            raise ValueError("max_stacks must be at least 4")
        self._max_stacks = max_stacks
        self._max_long_blocks = max_long_blocks
        self._max_threads = max_threads
        self._cgroup_name = cgroup_name
        # The comm is kept apart, per thread: a thread may exec.
        self._totals: dict[StackKey, _Total] = {}
        # id(frames tuple) -> (the tuple, its chain string): snapshots of a
        # live capture share their frame tuples from interval to interval.
        self._chains: dict[int, tuple[tuple[Frame, ...], str]] = {}
        self._comms: dict[int, str] = {}
        self._cgroups: dict[int, int] = {}
        self._other: dict[str, list[int]] = {}
        self._long_blocks: list[LongBlock] = []
        self._start: float | None = None
        self._end: float | None = None
        self._snapshots = 0
        self._threshold_ns = 0
        self.folded_stacks = 0
        """How many distinct stacks were folded into `[other stacks]`."""
        self.folded_ns = 0
        """How much off-CPU time those stacks held."""
        self.dropped_long_blocks = 0
        """Long blocks not kept (beyond `max_long_blocks`)."""

    @property
    def stack_count(self) -> int:
        """Distinct (thread, state, stack) keys held now."""
        return len(self._totals) + len(self._other)

    @property
    def snapshots(self) -> int:
        """Snapshots added so far."""
        return self._snapshots

    def add(self, snap: Snapshot) -> None:
        """Fold one interval in."""
        self._snapshots += 1
        self._threshold_ns = snap.threshold_ns
        self.add_stacks(snap.stacks, start=snap.time - snap.interval_s, end=snap.time,
                        long_blocks=snap.long_blocks)

    def add_stacks(
        self,
        stacks: Iterable[StackRow],
        *,
        start: float,
        end: float,
        long_blocks: Iterable[LongBlock] = (),
    ) -> None:
        """Fold stack rows covering [start, end] (unix seconds) in."""
        self._start = start if self._start is None else min(self._start, start)
        self._end = end if self._end is None else max(self._end, end)
        totals = self._totals
        comms = self._comms
        chain = self._chain
        for s in stacks:
            key = (s.pid, s.tid, s.state, chain(s.kernel), chain(s.user))
            cur = totals.get(key)
            if cur is None:
                totals[key] = _Total(s.offcpu_ns, s.count, s.max_ns, s.kernel, s.user)
            else:
                cur.ns += s.offcpu_ns
                cur.count += s.count
                if s.max_ns > cur.max_ns:
                    cur.max_ns = s.max_ns
            if s.comm:
                comms[s.tid] = s.comm
        for b in long_blocks:
            if b.cgroup_id:
                # Re-insert so the dict's order is "least recently seen first".
                self._cgroups.pop(b.tid, None)
                self._cgroups[b.tid] = b.cgroup_id
            if len(self._long_blocks) < self._max_long_blocks:
                self._long_blocks.append(b)
            else:
                self.dropped_long_blocks += 1
        if len(totals) > self._max_stacks:
            self._fold_smallest()
        self._bound_threads()

    def _chain(self, frames: tuple[Frame, ...]) -> str:
        """A string naming a chain of frames: their names, then their modules.

        Names and modules are NUL-free (C strings from ELF, kallsyms and
        perf maps), so NUL separates them; a name made to contain one could
        only merge two stacks of the same thread.
        """
        hit = self._chains.get(id(frames))
        if hit is not None and hit[0] is frames:
            return hit[1]
        text = "\0".join([f.name for f in frames]) + "\0\0" + "\0".join(
            [f.module if not f.kernel else "\1" + f.module for f in frames])
        if len(self._chains) > 4 * self._max_stacks + 1024:
            self._chains.clear()
        self._chains[id(frames)] = (frames, text)
        return text

    def _fold_smallest(self) -> None:
        """Fold the smallest quarter of the keys into `[other stacks]` per state.

        A quarter, not just the excess, so that folding (a sort) happens once
        per many new keys rather than on every interval.
        """
        keep = self._max_stacks * 3 // 4
        drop = heapq.nsmallest(len(self._totals) - keep, self._totals.items(),
                               key=lambda kv: kv[1].ns)
        for key, t in drop:
            del self._totals[key]
            other = self._other.setdefault(key[2], [0, 0, 0])
            other[0] += t.ns
            other[1] += t.count
            other[2] = max(other[2], t.max_ns)
            self.folded_stacks += 1
            self.folded_ns += t.ns
        live = {k[1] for k in self._totals}
        for tid in [t for t in self._comms if t not in live]:
            del self._comms[tid]

    def _bound_threads(self) -> None:
        excess = len(self._cgroups) - self._max_threads
        if excess > 0:
            for tid in list(self._cgroups)[:excess]:
                del self._cgroups[tid]

    def _cgroup_label(self, tid: int, names: dict[int, str]) -> str:
        cid = self._cgroups.get(tid)
        if not cid:
            return ""
        name = names.get(cid)
        if name is None:
            resolved = self._cgroup_name(cid) if self._cgroup_name is not None else None
            name = names[cid] = resolved if resolved else str(cid)
        return name

    def profile(self, *, comments: Sequence[str] = ()) -> ProfileData:
        """The run so far, frozen (the accumulator can go on taking snapshots)."""
        names: dict[int, str] = {}
        rows = [
            StackTotal(pid=k[0], tid=k[1], comm=self._comms.get(k[1], ""), state=k[2],
                       offcpu_ns=v.ns, count=v.count, max_ns=v.max_ns, kernel=v.kernel,
                       user=v.user, cgroup=self._cgroup_label(k[1], names))
            for k, v in self._totals.items()
        ]
        rows += [
            StackTotal(pid=0, tid=0, comm="[other]", state=state, offcpu_ns=v[0], count=v[1],
                       max_ns=v[2], kernel=(), user=(OTHER_STACKS,))
            for state, v in self._other.items()
        ]
        rows.sort(key=lambda r: (-r.offcpu_ns, r.pid, r.tid, r.state))
        start = self._start if self._start is not None else 0.0
        end = self._end if self._end is not None else start
        return ProfileData(
            start=start,
            end=end,
            stacks=tuple(rows),
            long_blocks=tuple(self._long_blocks),
            snapshots=self._snapshots,
            threshold_ns=self._threshold_ns,
            folded_stacks=self.folded_stacks,
            folded_ns=self.folded_ns,
            dropped_long_blocks=self.dropped_long_blocks,
            comments=tuple(comments),
        )
