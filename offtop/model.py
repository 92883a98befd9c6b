"""Pure aggregation of off-CPU records into immutable snapshots.

The model knows nothing of bcc, BPF maps or the screen: the engine hands it
records whose stacks are already symbolized, and it hands back a frozen
`Snapshot` per interval. Everything here is deterministic and unit-tested.
"""

from __future__ import annotations

import bisect
import dataclasses
import hashlib
import heapq
import threading
from array import array
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, NotRequired, Protocol, TypedDict, Unpack, cast

from offtop.recent import Recent

#: Task states offtop reports, as the sched_switch tracepoint normalizes them.
STATE_NAMES: Mapping[str, str] = {
    "S": "sleeping (interruptible)",
    "D": "uninterruptible (incl. killable)",
    "I": "idle wait (TASK_IDLE)",
    "R": "runnable, preempted (runqueue wait)",
    "T": "stopped",
    "t": "traced",
}


#: Marker frames: not addresses, but what is known about where a stack ends.
#: Their names start with "[", so `Frame.unknown` is true for them.
MARK_TRUNCATED = "[stack truncated]"
"""Unwinding stopped at a frame that could not be trusted (it is dropped)."""
MARK_DEPTH_LIMIT = "[depth limit]"
"""The stack was cut at the capture's depth limit."""
MARK_USER_STACK_LOST = "[user stack lost]"
"""The user stack of this block could not be captured or stored."""
MARK_PROCESS_GONE = "[not resolved: process gone]"
"""The process was gone (its memory map with it) before offtop first saw it."""
#: The stacks of a block that ended while offtop was stopping (not resolved: a
#: signal must end offtop at once, whatever is left to symbolize).
MARK_NOT_RESOLVED = "[not resolved: offtop was stopping]"
#: The stacks of blocks summed while offtop was behind: new stacks came faster
#: than it resolved them (CaptureStats.behind_rows).
MARK_BEHIND = "[not resolved: offtop behind]"

_HEX_DIGITS = frozenset("0123456789abcdef")


@dataclass(frozen=True, slots=True)
class Frame:
    """One resolved stack frame."""

    name: str
    module: str = ""
    kernel: bool = False
    # Stacks (tuples of frames) are dictionary keys many times per interval:
    # the hash is computed once, not at every use (2.7x faster for a
    # 20-frame stack).
    _hash: int = field(default=0, init=False, repr=False, compare=False)
    # Asked of every frame of a stack, often: worked out once.
    _unknown: bool = field(default=False, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_hash", hash((self.name, self.module, self.kernel)))
        object.__setattr__(self, "_unknown", _unresolved(self.name))

    def __hash__(self) -> int:
        return self._hash

    @property
    def unknown(self) -> bool:
        """True when the address could not be resolved to a function.

        Such frames are marks ("[stack truncated]"), bare addresses ("0x…"),
        or addresses inside a module that could not be named, which read
        `module+0xOFFSET` (told by their form, so frames read back from JSON
        without their module are still known as unresolved).
        """
        return self._unknown


def _unresolved(name: str) -> bool:
    """`Frame.unknown` of a frame named `name`."""
    if name.startswith(("[", "0x")):
        return True
    module, plus, offset = name.rpartition("+0x")
    return bool(plus and module and offset) and all(c in _HEX_DIGITS for c in offset)


@dataclass(frozen=True, slots=True)
class Waker:
    """Who ended a block: a task, or an interrupt (then pid and tid are 0).

    `kind` is "task", or for an interrupt what its kernel stack shows:
    "timer" (an expired sleep or timeout), "softirq" (`comm` its work, e.g.
    NET_RX), "irq" (a device's handler) or "interrupt" (not known: its stack
    was not taken). Stacks are taken only for blocks long enough to matter:
    () when not taken.
    """

    pid: int
    tid: int
    comm: str
    kind: str = "task"
    kernel: tuple[Frame, ...] = ()
    user: tuple[Frame, ...] = ()
    # A key of every stack's wakers: hashed once (see Frame).
    _hash: int = field(default=0, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_hash", hash((self.pid, self.tid, self.comm, self.kind,
                                                self.kernel, self.user)))

    def __hash__(self) -> int:
        return self._hash

    @property
    def label(self) -> str:
        """How a waker is named: its comm, or what interrupted ("[timer interrupt]")."""
        if self.kind == "task":
            return self.comm
        if self.kind == "softirq":
            return f"[softirq {self.comm}]" if self.comm else "[softirq]"
        if self.kind == "timer":
            return "[timer interrupt]"
        if self.kind == "irq":
            return "[device interrupt]"
        return "[interrupt]"


@dataclass(frozen=True, slots=True)
class WakerRow:
    """The off-CPU time of one stack that one waker ended."""

    waker: Waker
    offcpu_ns: int
    count: int


@dataclass(frozen=True, slots=True)
class Sample:
    """Off-CPU time of one task in one state with one pair of stacks.

    This is what the engine feeds the model: an aggregate row drained from the
    kernel hash, or a single long block that came through the perf buffer
    (`count == 1`, `from_event`).
    """

    pid: int
    tid: int
    comm: str
    state: str
    offcpu_ns: int
    count: int
    max_ns: int
    kernel: tuple[Frame, ...] = ()
    user: tuple[Frame, ...] = ()
    from_event: bool = False
    #: The process's start time (clock ticks since boot; 0: unknown). With the
    #: pid it names the process: a reused pid starts its totals afresh.
    start: int = 0
    #: The block began before offtop started (found in /proc; counted whole, once).
    before_start: bool = False
    #: Who ended these blocks (None: not recorded, e.g. --no-wakers).
    waker: Waker | None = None


@dataclass(frozen=True, slots=True)
class LongBlock:
    """A block at or above the threshold, delivered one by one as it ended."""

    time: float
    pid: int
    tid: int
    comm: str
    state: str
    duration_ns: int
    kernel: tuple[Frame, ...] = ()
    user: tuple[Frame, ...] = ()
    cgroup_id: int = 0
    #: The block began before offtop started; its duration is estimated.
    before_start: bool = False
    #: Who ended it (None: not recorded).
    waker: Waker | None = None


@dataclass(frozen=True, slots=True)
class BlockedNow:
    """A task off the CPU at the moment of the snapshot, and for how long so far."""

    pid: int
    tid: int
    comm: str
    state: str
    blocked_ns: int
    kernel: tuple[Frame, ...] = ()
    user: tuple[Frame, ...] = ()
    #: Blocked since before offtop started: `blocked_ns` is estimated from the
    #: scheduler's clock (or counts from offtop's start when /proc does not say).
    before_start: bool = False


@dataclass(frozen=True, slots=True, order=True)
class RowKey:
    """Names a row of the task table across snapshots: a thread or a process."""

    kind: Literal["thread", "process"]
    id: int
    """The thread's tid, or the process's pid."""

    @classmethod
    def thread(cls, tid: int) -> RowKey:
        """The key of thread `tid`."""
        return cls("thread", tid)

    @classmethod
    def process(cls, pid: int) -> RowKey:
        """The key of process `pid`."""
        return cls("process", pid)

    @property
    def is_process(self) -> bool:
        """True for a process row."""
        return self.kind == "process"

    def __str__(self) -> str:
        return f"{self.kind} {self.id}"


@dataclass(slots=True)
class TaskRow:
    """One thread's off-CPU time in the interval, and since offtop started.

    Never changed once made, though not frozen: a build makes one a thread (1,000
    and more a second on a busy server), and a frozen dataclass sets each field
    through `object.__setattr__` (4x slower to make, as `StackRow`)."""

    pid: int
    tid: int
    comm: str
    offcpu_ns: int
    count: int
    max_ns: int
    state_ns: Mapping[str, int]
    total_ns: int
    events: int = 0

    @property
    def key(self) -> RowKey:
        """A stable identity for keyed table rows."""
        return RowKey.thread(self.tid)


@dataclass(frozen=True, slots=True)
class ProcessRow:
    """One process: its threads summed."""

    pid: int
    comm: str
    threads: int
    offcpu_ns: int
    count: int
    max_ns: int
    state_ns: Mapping[str, int]
    total_ns: int
    events: int = 0
    user: str = ""
    cmdline: str = ""

    @property
    def key(self) -> RowKey:
        """A stable identity for keyed table rows."""
        return RowKey.process(self.pid)


@dataclass(slots=True, eq=False)
class StackRow:
    """Off-CPU time of one task in one state at one (kernel, user) callchain.

    Its wakers (`wakers`) are given whole (`waker_rows`), or as where a build
    summed them (`waker_sums`, at the row's `waker_slot` there) and made into rows
    when asked: a busy server's snapshot has ~10,000 stacks, the screen shows
    the wakers of one, and each stack's rows made at every build were ~20,000
    objects a second for the GC to walk. Rows are equal when what they say is
    (their wakers as rows), however their wakers are held.

    Never changed once made (it is hashed), though not frozen: the TUI's builds
    make every stack's, and a frozen dataclass sets each field through
    `object.__setattr__`: 9.0 against 2.2 ms for a busy server's 8,700 rows.
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
    #: Time of a block that began before offtop started (see Sample.before_start).
    before_start: bool = False
    #: Who ended these blocks, most off-CPU time first (see `wakers`).
    waker_rows: tuple[WakerRow, ...] = ()
    waker_sums: WakerSums | None = None
    waker_slot: int = -1  #: the row's place in `waker_sums`

    @property
    def wakers(self) -> tuple[WakerRow, ...]:
        """Who ended these blocks, most off-CPU time first."""
        sums = self.waker_sums
        return self.waker_rows if sums is None else sums.rows(self.waker_slot)

    def _said(self) -> tuple[Any, ...]:
        return (self.pid, self.tid, self.comm, self.state, self.offcpu_ns, self.count,
                self.max_ns, self.kernel, self.user, self.before_start, self.wakers)

    def __eq__(self, other: object) -> bool:
        if other.__class__ is not StackRow:
            return NotImplemented
        return self is other or self._said() == other._said()

    def __hash__(self) -> int:
        return hash((self.pid, self.tid, self.state, self.offcpu_ns, self.count, self.kernel,
                     self.user, self.before_start))

    @property
    def key(self) -> str:
        """A stable identity: the same task, state and frames give the same key."""
        state = self.state + ("<" if self.before_start else "")
        return stack_key(self.tid, state, self.kernel, self.user)


@dataclass(frozen=True, slots=True)
class CaptureStats:
    """How healthy the capture is: nothing lost or failed is hidden."""

    events: int = 0
    lost: int = 0
    events_total: int = 0
    lost_total: int = 0
    stack_errors: Mapping[str, int] = field(default_factory=dict)
    drops: Mapping[str, int] = field(default_factory=dict)
    truncated_stacks: int = 0
    symbol_misses: int = 0
    agg_entries: int = 0
    stacks_used: int = 0
    stacks_capacity: int = 0
    stacks_reclaimed: int = 0
    probe_run_ns: int = 0
    probe_runs: int = 0
    interval_s: float = 1.0
    #: The threshold flood control holds in the kernel (0: none; see offtop.bpf.flood).
    flood_threshold_ns: int = 0
    #: User frames left unresolved because the interval's symbol budget ran out.
    symbol_deadline_misses: int = 0
    #: Stacks cut at the capture's depth limit; user stacks lost (not stored).
    depth_limited_stacks: int = 0
    user_stacks_lost: int = 0
    #: New summed rows whose stacks were not resolved because offtop was behind
    #: (new stacks came faster than it resolved them): each summed per thread
    #: and state, marked `[not resolved: offtop behind]` (MARK_BEHIND).
    behind_rows: int = 0
    #: Symbolization errors by cause (a hostile or odd file), cumulative.
    symbol_errors: Mapping[str, int] = field(default_factory=dict)
    #: Python stacks that could not be read, by cause (cumulative).
    python_failures: Mapping[str, int] = field(default_factory=dict)
    #: offtop's own cost: CPU (% of one core over the interval) and resident memory.
    offtop_cpu_pct: float = 0.0
    offtop_rss_bytes: int = 0

    @property
    def stack_errors_total(self) -> int:
        """All stack-id failures, whatever their cause."""
        return sum(self.stack_errors.values())

    @property
    def events_per_s(self) -> float:
        """Perf-buffer events per second in the interval."""
        return self.events / self.interval_s if self.interval_s > 0 else 0.0

    @property
    def switches_per_s(self) -> float:
        """sched_switch hits per second (the probe's run count)."""
        return self.probe_runs / self.interval_s if self.interval_s > 0 else 0.0

    @property
    def probe_ns_per_switch(self) -> float:
        """Average probe run time per context switch."""
        return self.probe_run_ns / self.probe_runs if self.probe_runs else 0.0

    @property
    def probe_cpu_pct(self) -> float:
        """The probe's CPU time as a percentage of one CPU over the interval."""
        if self.interval_s <= 0:
            return 0.0
        return 100.0 * self.probe_run_ns / (self.interval_s * 1e9)


@dataclass(frozen=True, slots=True)
class Snapshot:
    """Everything offtop knows about one interval, ready to render or print."""

    seq: int
    time: float
    interval_s: float
    threshold_ns: int
    tasks: tuple[TaskRow, ...] = ()
    processes: tuple[ProcessRow, ...] = ()
    stacks: tuple[StackRow, ...] = ()
    long_blocks: tuple[LongBlock, ...] = ()
    blocked_now: tuple[BlockedNow, ...] = ()
    stats: CaptureStats = field(default_factory=CaptureStats)
    #: What happened to the capture's scope in this interval ("pid 123 exited").
    notices: tuple[str, ...] = ()
    #: Set once nothing the run was asked to watch is left: why.
    finished: str = ""
    #: Stacks of the interval ranked below those in `stacks` and left out (the
    #: aggregator's `max_stacks`): counted, never dropped silently.
    omitted_stacks: int = 0

    @property
    def total_offcpu_ns(self) -> int:
        """Off-CPU time of all tasks in the interval."""
        return sum(t.offcpu_ns for t in self.tasks)

    def stacks_of(self, tid: int) -> tuple[StackRow, ...]:
        """The stacks of one thread, most off-CPU time first."""
        return tuple(s for s in self.stacks if s.tid == tid)

    def stacks_of_process(self, pid: int) -> tuple[StackRow, ...]:
        """The stacks of all threads of one process, most off-CPU time first."""
        return tuple(s for s in self.stacks if s.pid == pid)


def stack_key(tid: int, state: str, kernel: Iterable[Frame], user: Iterable[Frame]) -> str:
    """A short stable digest naming a (task, state, callchain)."""
    h = hashlib.blake2b(digest_size=8)
    h.update(f"{tid}|{state}|".encode())
    for f in kernel:
        h.update(b"k" + f.name.encode(errors="replace") + b";")
    for f in user:
        h.update(b"u" + f.name.encode(errors="replace") + b";")
    return h.hexdigest()


class _FrameTupleNumbers:
    """Numbers for frame tuples, equal for equal frames (private to the model).

    Found by the tuple's identity first (the engine hands out the same tuple
    for the same stack interval after interval), by its frames only for a
    tuple not seen before. The tuples are held (`_held`), so an identity is
    not reused while it is a key: ids map to plain ints, not to (tuple,
    number) pairs, which would be ~15,000 more objects for every full GC
    pass to walk on a busy server. Unbounded: its owner (`StackGroups`)
    forgets it whole, with the numbers made from it.
    """

    def __init__(self) -> None:
        self._by_id: dict[int, int] = {}
        self._held: list[tuple[Frame, ...]] = []
        self._by_frames: dict[tuple[Frame, ...], int] = {}
        self._next = 0

    def lookups(self) -> tuple[Callable[[int], int | None], Callable[[tuple[Frame, ...]], int]]:
        """(the number of a tuple seen before, by its `id` alone, else None; the
        function that numbers any tuple). The first is a dict's own `get`: most
        tuples were seen before, and a Python call each was a tenth of a build."""
        by_id, hold, by_frames = self._by_id, self._held.append, self._by_frames

        def number(frames: tuple[Frame, ...]) -> int:
            n = by_id.get(id(frames))
            if n is not None:
                return n
            # One lookup, so the frames are hashed once (a Python call a frame).
            n = by_frames.setdefault(frames, self._next)
            if n == self._next:
                self._next += 1
            by_id[id(frames)] = n
            hold(frames)
            return n

        return by_id.get, number

    @property
    def size(self) -> int:
        """Frame tuples held (by identity)."""
        return len(self._by_id)


class GroupedSample(Protocol):
    """A `Sample` (its fields by name) with the number of its stack group in the
    aggregator's `StackGroups`: what `Aggregator.build_grouped` sums."""

    @property
    def group(self) -> int: ...
    @property
    def pid(self) -> int: ...
    @property
    def tid(self) -> int: ...
    @property
    def comm(self) -> str: ...
    @property
    def state(self) -> str: ...
    @property
    def offcpu_ns(self) -> int: ...
    @property
    def count(self) -> int: ...
    @property
    def max_ns(self) -> int: ...
    @property
    def kernel(self) -> tuple[Frame, ...]: ...
    @property
    def user(self) -> tuple[Frame, ...]: ...
    @property
    def from_event(self) -> bool: ...
    @property
    def start(self) -> int: ...
    @property
    def before_start(self) -> bool: ...
    @property
    def waker(self) -> Waker | None: ...


@dataclass(frozen=True, slots=True)
class _Grouped(Sample):
    """A sample with its group's number (`Aggregator.build`)."""

    group: int = 0


class StackGroups:
    """Numbers for what a snapshot sums a stack's samples by: the thread, the state,
    whether the block began before offtop, and the frames (equal frames in other
    tuples are the same: `_FrameTupleNumbers`). Each number also names its thread
    (`thread_of`).

    A source that keeps its rows from one interval to the next (the engine: on a
    busy server ~10,000 a second, nearly all of them the interval before's too)
    numbers each row once and hands the number in with the row's sums
    (`Aggregator.build_grouped`): a build then adds by list index. Hashing every
    row's key at every build was most of a build (measured on six intervals
    captured at the busy server: 23-34 ms against 6-8 ms for the top 100 stacks,
    37-60 against 22-35 for all of them).

    Bounded: past `max_groups` numbers (or as many frame tuples) everything is
    forgotten when the next build starts (`start_build`), and `generation` goes up.
    Numbers are never reused within a generation, so that a row keeps its number
    until then, and only then must ask again.
    """

    def __init__(self, max_groups: int = 32_768) -> None:
        self.max_groups = max_groups
        #: Goes up each time every number is forgotten (`start_build`).
        self.generation = 0
        self._reset()

    def _reset(self) -> None:
        self._chains = _FrameTupleNumbers()
        self._seen, self._chain = self._chains.lookups()
        self._by_key: dict[tuple[int, str, bool, int, int], int] = {}
        self._threads: dict[int, int] = {}
        #: Group number -> its thread's number (numbered in order of first sight).
        self.thread_of: list[int] = []

    def __len__(self) -> int:
        return len(self.thread_of)

    @property
    def threads(self) -> int:
        """How many threads are numbered."""
        return len(self._threads)

    def start_build(self) -> bool:
        """Called before a build's rows are numbered or summed: past the bound,
        everything is forgotten (True: every number given before is void)."""
        if len(self.thread_of) <= self.max_groups and self._chains.size <= self.max_groups:
            return False
        self.generation += 1
        self._reset()
        return True

    def number(self, tid: int, state: str, before: bool, kernel: tuple[Frame, ...],
               user: tuple[Frame, ...]) -> int:
        """The number of the group of a sample of thread `tid` in `state` with these frames."""
        nk = self._seen(id(kernel))
        if nk is None:
            nk = self._chain(kernel)
        nu = self._seen(id(user))
        if nu is None:
            nu = self._chain(user)
        key = (tid, state, before, nk, nu)
        g = self._by_key.get(key)
        if g is None:
            g = self._by_key[key] = len(self.thread_of)
            t = self._threads.get(tid)
            if t is None:
                t = self._threads[tid] = len(self._threads)
            self.thread_of.append(t)
        return g


@dataclass(slots=True)
class _Total:
    pid: int
    start: int = 0
    total_ns: int = 0
    last_seq: int = 0


class SnapshotParts(TypedDict):
    """What a build takes besides the interval's samples (`Aggregator.build_grouped`)."""

    time: float
    interval_s: float
    threshold_ns: int
    long_blocks: NotRequired[Iterable[LongBlock]]
    blocked_now: NotRequired[Iterable[BlockedNow]]
    stats: NotRequired[CaptureStats | None]
    process_meta: NotRequired[Callable[[int], tuple[str, str] | None] | None]
    meta_limit: NotRequired[int]
    notices: NotRequired[Iterable[str]]
    finished: NotRequired[str]


class Aggregator:
    """Turns each interval's samples into a `Snapshot`, keeping since-start totals.

    Totals are kept per thread; a thread not seen for `forget_after` intervals
    is forgotten so that long runs with thread churn stay bounded.
    """

    def __init__(self, *, forget_after: int = 300, max_stacks: int = 20_000,
                 max_threads: int = 50_000) -> None:
        self._totals: dict[int, _Total] = {}
        self._seq = 0
        self._forget_after = forget_after
        #: At most this many stacks are made into rows per snapshot (the top ones;
        #: the rest counted in `Snapshot.omitted_stacks`). Batch output that shows
        #: only the top N sets it to N: rows nobody reads are not made.
        self.max_stacks = max_stacks
        self._max_threads = max_threads
        #: The numbers builds sum stacks by (see `build_grouped`).
        self.groups = StackGroups()

    @property
    def max_threads(self) -> int:
        """How many threads' totals are kept at most."""
        return self._max_threads

    @property
    def tracked_threads(self) -> int:
        """How many threads have since-start totals (bounded by forgetting)."""
        return len(self._totals)

    def build(self, samples: Iterable[Sample], **parts: Unpack[SnapshotParts]) -> Snapshot:
        """Aggregate one interval and return its snapshot (see `build_grouped`).

        `process_meta(pid)` gives (user, command line) for the top `meta_limit`
        processes, or None for a process that is gone.
        """
        groups = self.groups
        groups.start_build()
        number = groups.number
        return self.build_grouped(
            [_Grouped(s.pid, s.tid, s.comm, s.state, s.offcpu_ns, s.count, s.max_ns, s.kernel,
                      s.user, s.from_event, s.start, s.before_start, s.waker,
                      number(s.tid, s.state, s.before_start, s.kernel, s.user)) for s in samples],
            **parts)

    def build_grouped(
        self,
        rows: Collection[GroupedSample],
        *,
        time: float,
        interval_s: float,
        threshold_ns: int,
        long_blocks: Iterable[LongBlock] = (),
        blocked_now: Iterable[BlockedNow] = (),
        stats: CaptureStats | None = None,
        process_meta: Callable[[int], tuple[str, str] | None] | None = None,
        meta_limit: int = 200,
        notices: Iterable[str] = (),
        finished: str = "",
    ) -> Snapshot:
        """`build`, from rows numbered by `self.groups` (`StackGroups.number`) since its
        last `start_build`, which the caller makes first: what the engine hands over,
        its rows kept and numbered once (a busy server has 10,000 rows a second).

        A stack is the sum of its group's rows: the pid, comm and frames of its first
        row, and its wakers summed by equality in the order they came. A thread's
        comm is its last row's that has one. Stacks are ranked by time, then thread
        and state, then the order their first rows came in; only the top
        `max_stacks` are made into rows (and only their wakers summed)."""
        self._seq += 1
        seq = self._seq
        thread_of = self.groups.thread_of
        n_groups, n_threads = len(thread_of), self.groups.threads
        # Sums by group and by thread, in lists indexed by their numbers; a group's
        # and a thread's first row stands for it (its pid, comm, frames).
        g_ns = [0] * n_groups
        g_count = [0] * n_groups
        g_max = [0] * n_groups
        g_first: list[GroupedSample | None] = [None] * n_groups
        order: list[int] = []  # groups, in the order their first rows came
        t_ns = [0] * n_threads
        t_count = [0] * n_threads
        t_max = [0] * n_threads
        t_first: list[GroupedSample | None] = [None] * n_threads
        t_comm = [""] * n_threads
        t_start = [0] * n_threads
        t_events = [0] * n_threads
        t_states: list[dict[str, int]] = [{}] * n_threads  # each replaced at a first row
        t_order: list[int] = []
        for r in rows:
            g = r.group
            ns = r.offcpu_ns
            count = r.count
            max_ns = r.max_ns
            if g_first[g] is None:
                g_first[g] = r
                g_ns[g] = ns
                g_count[g] = count
                g_max[g] = max_ns
                order.append(g)
            else:
                g_ns[g] += ns
                g_count[g] += count
                if max_ns > g_max[g]:
                    g_max[g] = max_ns
            t = thread_of[g]
            if t_first[t] is None:
                t_first[t] = r
                t_ns[t] = ns
                t_count[t] = count
                t_max[t] = max_ns
                t_comm[t] = r.comm
                t_start[t] = r.start
                t_events[t] = count if r.from_event else 0
                t_states[t] = {r.state: ns}
                t_order.append(t)
                continue
            t_ns[t] += ns
            t_count[t] += count
            if max_ns > t_max[t]:
                t_max[t] = max_ns
            states = t_states[t]
            states[r.state] = states.get(r.state, 0) + ns
            if r.from_event:
                t_events[t] += count
            if r.start:
                t_start[t] = r.start
            if r.comm:
                t_comm[t] = r.comm

        totals = self._totals
        task_list = []
        for t in t_order:
            first = t_first[t]
            assert first is not None
            pid, tid, start = first.pid, first.tid, t_start[t]
            tot = totals.get(tid)
            if tot is None or tot.pid != pid or (tot.start and start and tot.start != start):
                # A new thread, or this tid reused by another process: afresh.
                tot = totals[tid] = _Total(pid=pid, start=start)
            elif not tot.start:
                tot.start = start
            tot.total_ns += t_ns[t]
            tot.last_seq = seq
            task_list.append(TaskRow(pid, tid, t_comm[t], t_ns[t], t_count[t], t_max[t],
                                     t_states[t], tot.total_ns, t_events[t]))
        self._forget(seq)
        task_list.sort(key=lambda task: (-task.offcpu_ns, task.tid))
        tasks = tuple(task_list)

        # Ranked before the rows are made, and only the kept ones made. With
        # few kept (batch output's top N), the rest is cut by time first, in C.
        kept: list[int] = order
        keep = self.max_stacks
        if keep * 4 < len(order):
            cut = heapq.nlargest(keep, [g_ns[g] for g in order])[-1] if keep > 0 else -1
            kept = [g for g in order if g_ns[g] >= cut]
        ranked = sorted(kept, key=lambda g: (-g_ns[g], g_first[g].tid, g_first[g].state))[:keep]  # type: ignore[union-attr]
        wakers = sum_wakers(n_groups, ranked, rows)
        chunk = WakerSums.CHUNK
        stack_rows = []
        for i, g in enumerate(ranked):
            f = g_first[g]
            assert f is not None
            stack_rows.append(StackRow(f.pid, f.tid, f.comm, f.state, g_ns[g], g_count[g], g_max[g],
                                       f.kernel, f.user, f.before_start, (), wakers[i // chunk],
                                       i % chunk))
        return Snapshot(
            seq=seq,
            time=time,
            interval_s=interval_s,
            threshold_ns=threshold_ns,
            tasks=tasks,
            processes=group_processes(tasks, process_meta, meta_limit),
            stacks=tuple(stack_rows),
            long_blocks=tuple(long_blocks),
            blocked_now=tuple(sorted(blocked_now, key=lambda b: (-b.blocked_ns, b.tid))),
            stats=stats or CaptureStats(interval_s=interval_s),
            notices=tuple(notices),
            finished=finished,
            omitted_stacks=len(order) - len(stack_rows),
        )

    def forget_gone(self, start_time: Callable[[int], int | None]) -> int:
        """Drop the totals of threads whose process is gone; return how many.

        `start_time(pid)` is the start time of process `pid` now (None: gone).
        A gone thread's total is never read again (a reused tid starts afresh),
        yet would be kept `forget_after` intervals: with process churn, tens of
        thousands. Threads seen in this interval or the one before are kept (a
        process's last rows may come a sub-tick after it ended). Each process is
        asked about once.
        """
        recent = self._seq - 1
        now: dict[int, int | None] = {}
        gone = []
        for tid, t in self._totals.items():
            if t.last_seq >= recent:
                continue
            if t.pid not in now:
                now[t.pid] = start_time(t.pid)
            started = now[t.pid]
            if started is None or (t.start and started != t.start):
                gone.append(tid)
        for tid in gone:
            del self._totals[tid]
        return len(gone)

    def _forget(self, seq: int) -> None:
        if len(self._totals) > self._max_threads:
            # Process churn: thousands of new threads a second would each be
            # kept for `forget_after` intervals. Keep the most recently seen,
            # and every thread of this interval (its row reads its total).
            old = sorted((t.last_seq, tid) for tid, t in self._totals.items() if t.last_seq < seq)
            for _, tid in old[: len(self._totals) - self._max_threads * 3 // 4]:
                del self._totals[tid]
        horizon = seq - self._forget_after
        if horizon <= 0 or (len(self._totals) < 1024 and seq % 64):
            return
        stale = [tid for tid, t in self._totals.items() if t.last_seq < horizon]
        for tid in stale:
            del self._totals[tid]


#: `WakerSums`' first-waker slot once a group's wakers are summed in a dict.
_MANY_WAKERS = object()


class WakerSums:
    """The wakers of up to `CHUNK` stacks of a build (`sum_wakers`), each by its slot
    here, made into rows when a stack's are asked for (`StackRow.wakers`): the
    first waker inline (most stacks have one), all of them in a dict once another
    came. A build's ~10,000 stacks hold no object of their own here but a dict per
    stack with two wakers or more, so that they cost the GC next to nothing, and a
    row kept past its snapshot keeps its own chunk only (a reference and two 64-bit
    cells a stack): rows of old snapshots wait in cyclic garbage for the full pass,
    ~15 builds' in the TUI on a busy server, and each kept a whole build's sums."""

    CHUNK = 256

    def __init__(self, first: list[Any], ns: array[int], count: array[int],
                 many: dict[int, dict[Waker, list[int]]]) -> None:
        self._first, self._ns, self._count, self._many = first, ns, count, many

    def __len__(self) -> int:
        """Stacks whose wakers are here."""
        return len(self._first)

    def rows(self, slot: int) -> tuple[WakerRow, ...]:
        """The wakers of the stack in `slot`, most off-CPU time first."""
        by_waker = self._many.get(slot)
        if by_waker is not None:
            return _waker_rows(by_waker)
        w = self._first[slot]
        return (WakerRow(w, self._ns[slot], self._count[slot]),) if w is not None else ()


def sum_wakers(n_groups: int, kept: Sequence[int],
               rows: Iterable[GroupedSample]) -> list[WakerSums]:
    """The wakers of the groups a build makes rows of (`Aggregator.build_grouped`: the
    groups in `kept`, each numbered below `n_groups`), summed from `rows` by equality
    in the order they came; group `kept[i]`'s are in chunk `i // CHUNK`, at slot
    `i % CHUNK`. Summed at the build: the engine's rows change after it."""
    slot_of = [-1] * n_groups
    for i, g in enumerate(kept):
        slot_of[g] = i
    n = len(kept)
    first: list[Any] = [None] * n  # a Waker, None or _MANY_WAKERS
    ns_of = [0] * n
    count_of = [0] * n
    many: dict[int, dict[Waker, list[int]]] = {}
    for r in rows:
        w = r.waker
        if w is None:
            continue
        g = slot_of[r.group]
        if g < 0:
            continue
        cur = first[g]
        if cur is w:  # the same object: the engine reuses its wakers
            ns_of[g] += r.offcpu_ns
            count_of[g] += r.count
        elif cur is None:
            first[g], ns_of[g], count_of[g] = w, r.offcpu_ns, r.count
        else:
            by_waker = many.get(g)
            if by_waker is None:
                if cur == w:
                    ns_of[g] += r.offcpu_ns
                    count_of[g] += r.count
                    continue
                by_waker = many[g] = {cur: [ns_of[g], count_of[g]]}
                first[g] = _MANY_WAKERS  # summed in the dict from here
            sums = by_waker.get(w)
            if sums is None:
                by_waker[w] = [r.offcpu_ns, r.count]
            else:
                sums[0] += r.offcpu_ns
                sums[1] += r.count
    size = WakerSums.CHUNK
    chunk_many: list[dict[int, dict[Waker, list[int]]]] = [{} for _ in range(0, n, size)]
    for g, by_waker in many.items():
        chunk_many[g // size][g % size] = by_waker
    return [WakerSums(first[lo:lo + size], array("q", ns_of[lo:lo + size]),
                      array("q", count_of[lo:lo + size]), chunk_many[lo // size])
            for lo in range(0, n, size)]


def _waker_rows(by_waker: Mapping[Waker, list[int]] | None) -> tuple[WakerRow, ...]:
    if not by_waker:
        return ()
    if len(by_waker) == 1:
        for w, (ns, n) in by_waker.items():
            return (WakerRow(w, ns, n),)
    rows = [WakerRow(w, ns, n) for w, (ns, n) in by_waker.items()]
    rows.sort(key=lambda r: (-r.offcpu_ns, r.waker.tid, r.waker.label))
    return tuple(rows)


@dataclass(slots=True)
class _ProcAcc:
    comm: str
    has_main: bool = False
    threads: int = 0
    offcpu_ns: int = 0
    count: int = 0
    max_ns: int = 0
    total_ns: int = 0
    events: int = 0
    state_ns: dict[str, int] = field(default_factory=dict)


def group_processes(
    tasks: Iterable[TaskRow],
    process_meta: Callable[[int], tuple[str, str] | None] | None = None,
    meta_limit: int = 200,
) -> tuple[ProcessRow, ...]:
    """Sum threads into processes, most off-CPU time first.

    A process is named after its main thread when that thread is present
    (its comm is the process name), else after its first-ranked thread.
    """
    procs: dict[int, _ProcAcc] = {}
    for t in tasks:
        p = procs.get(t.pid)
        if p is None:
            p = procs[t.pid] = _ProcAcc(comm=t.comm)
        if t.tid == t.pid and not p.has_main:
            p.comm, p.has_main = t.comm, True
        p.threads += 1
        p.offcpu_ns += t.offcpu_ns
        p.count += t.count
        p.total_ns += t.total_ns
        p.events += t.events
        p.max_ns = max(p.max_ns, t.max_ns)
        for st, ns in t.state_ns.items():
            p.state_ns[st] = p.state_ns.get(st, 0) + ns
    rows = [
        ProcessRow(
            pid=pid,
            comm=p.comm,
            threads=p.threads,
            offcpu_ns=p.offcpu_ns,
            count=p.count,
            max_ns=p.max_ns,
            state_ns=p.state_ns,
            total_ns=p.total_ns,
            events=p.events,
        )
        for pid, p in procs.items()
    ]
    rows.sort(key=lambda r: (-r.offcpu_ns, r.pid))
    if process_meta is not None:
        for i, r in enumerate(rows[:meta_limit]):
            meta = process_meta(r.pid)
            if meta is not None:
                rows[i] = dataclasses.replace(r, user=meta[0], cmdline=meta[1])
    return tuple(rows)


# --- views of a snapshot (what the TUI derives from it) ------------------------

#: The scheduler's own frames, at the top of every off-CPU kernel stack: they
#: say nothing about why a task blocked, so summaries look past them.
SCHEDULER_FRAMES = frozenset(
    {"__schedule", "schedule", "finish_task_switch", "finish_task_switch.isra.0",
     "__traceiter_sched_switch", "preempt_schedule_common", "schedule_preempt_disabled"}
)

#: Kernel functions that wait for *any* of many things, not for one resource:
#: an event loop's poll (poll, select, epoll_wait, io_uring's completion wait),
#: a parent's wait4/waitid, pause/sigsuspend, and the idle loops of kernel
#: worker threads. A thread blocked there is idle, not held up.
IDLE_KERNEL_FRAMES = frozenset(
    {"do_epoll_wait", "ep_poll", "do_epoll_pwait", "do_sys_poll", "do_select",
     "core_sys_select", "do_pselect", "kern_select", "do_wait", "kernel_wait4",
     "kernel_waitid", "__do_sys_pause", "__x64_sys_pause", "sigsuspend",
     "__x64_sys_rt_sigsuspend", "io_cqring_wait", "worker_thread", "smpboot_thread_fn",
     "kthread_worker_fn", "rescuer_thread"}
)

#: Kernel functions of a futex wait (the names differ across kernel versions).
FUTEX_WAIT_FRAMES = frozenset(
    {"futex_wait", "futex_wait_queue", "futex_wait_queue_me", "futex_do_wait", "__futex_wait"}
)

#: User frames (substrings of their names) of a thread pool's worker waiting
#: for work: a futex wait under one of them is idle. Deliberately short: a
#: condition variable or a park in general is a lock wait, never idle.
IDLE_POOL_FRAMES: tuple[str, ...] = (
    "g_thread_pool_wait_for_new_task",   # glib
    "runtime.notesleep", "runtime.stopm",  # Go: an M with nothing to run
    "worker::Context::park",            # tokio's multi-thread workers
    "rayon_core::sleep",                # rayon
    "py:_worker (thread.py",            # concurrent.futures' ThreadPoolExecutor
)

#: User modules whose frames are plumbing, not the program (the innermost
#: caller outside them is where a program blocked).
_RUNTIME_MODULES = ("libc.so", "libc-", "libpthread", "ld-linux", "libdl")


def is_idle_wait(kernel: Sequence[Frame], user: Sequence[Frame]) -> bool:
    """True for a block that is a thread waiting for work, not for a resource.

    The rule: some kernel frame is in `IDLE_KERNEL_FRAMES` (poll, select,
    epoll_wait, wait4/waitid, pause, io_uring's wait, kernel worker idle
    loops); or the kernel frames show a futex wait and some user frame's
    name contains one of `IDLE_POOL_FRAMES` (an idle thread-pool worker).
    A sleep (nanosleep) is not idle: a program asked for that time.
    """
    futex = False
    for f in kernel:
        if f.name in IDLE_KERNEL_FRAMES:
            return True
        futex = futex or f.name in FUTEX_WAIT_FRAMES
    if not futex:
        return False
    return any(p in f.name for f in user for p in IDLE_POOL_FRAMES)


def _runtime_frame(f: Frame) -> bool:
    module = f.module.rpartition("/")[2]
    return module.startswith(_RUNTIME_MODULES)


def blocked_in(kernel: Sequence[Frame], user: Sequence[Frame]) -> Frame | None:
    """The innermost frame that says where a program blocked, or None.

    The innermost Python frame (`py:`) if there is one; else the innermost
    resolved user frame outside libc, libpthread and the loader (the caller
    of the syscall wrapper); else the innermost kernel frame that is not the
    scheduler's. Marks (`[…]`) and unresolved frames are never the answer.
    """
    for f in user:
        if f.name.startswith("py:"):
            return f
    for f in user:
        if not f.unknown and not _runtime_frame(f):
            return f
    for f in kernel:
        if not f.unknown and f.name not in SCHEDULER_FRAMES:
            return f
    return None


_UNKNOWN: Any = object()  # a `ChainInfo` fact not worked out yet


class ChainInfo:
    """What is known of one (kernel, user) callchain, whoever blocked in it.

    The number is given at once; `idle` and `blocked_in` are worked out at
    their first use (a merge asks only for numbers, of every stack). Safe
    between threads: a fact worked out twice at once comes out the same.
    """

    __slots__ = ("_blocked_in", "_idle", "_kernel", "_user", "chain")

    def __init__(self, chain: int, kernel: Sequence[Frame], user: Sequence[Frame]) -> None:
        self.chain = chain
        """Equal for equal frames (by name, kernel and user apart)."""
        self._kernel = kernel
        self._user = user
        self._idle: Any = _UNKNOWN
        self._blocked_in: Any = _UNKNOWN

    @property
    def idle(self) -> bool:
        """`is_idle_wait`."""
        if self._idle is _UNKNOWN:
            self._idle = is_idle_wait(self._kernel, self._user)
        return bool(self._idle)

    @property
    def blocked_in(self) -> Frame | None:
        """`blocked_in`."""
        if self._blocked_in is _UNKNOWN:
            self._blocked_in = blocked_in(self._kernel, self._user)
        return cast("Frame | None", self._blocked_in)


#: A chain's facts with the frame tuples they were worked out for (held: see ChainCatalog).
_ChainEntry = tuple[tuple[Frame, ...], tuple[Frame, ...], ChainInfo]


class ChainCatalog:
    """Facts about callchains, each worked out once per distinct chain.

    The engine hands out the same frame tuples for the same stack id interval
    after interval, so facts are kept by the tuples' identity (the tuples are
    held too, so an identity is never reused while kept); a chain seen in new
    tuples (a replay, a re-symbolized stack) is found again by its names.
    Kept by generation: what was not asked for since the last
    `next_generation()` is forgotten at the next one (with process churn, the
    chains of the processes gone would pile up: ~130 a second on a busy
    server, ~400 bytes each). Bounded too: past `max_entries` chains
    everything is forgotten at once. A chain asked for in either of the last
    two generations keeps its number, and a number is never given to two
    chains. Safe to share between the worker thread and the event loop (one
    dict operation at a time; an entry written into a generation just
    retired is found there, and moved, at its next use).
    """

    def __init__(self, max_entries: int = 100_000) -> None:
        self._max = max_entries
        self._by_id: Recent[tuple[int, int], _ChainEntry] = Recent(max_entries)
        self._by_names: Recent[tuple[tuple[str, ...], tuple[str, ...]], ChainInfo] = \
            Recent(max_entries)
        self._texts: dict[int, str] = {}
        self._next = 0

    def __len__(self) -> int:
        """Chains kept, by identity (both generations)."""
        return len(self._by_id)

    def next_generation(self) -> None:
        """Chains not asked for since the last call are forgotten (see the class)."""
        self._by_id.rotate()
        self._by_names.rotate()
        self._texts = {}

    def new_chains(self, stacks: Sequence[StackRow], sample: int = 1_000) -> int:
        """About how many of `stacks` have a chain not kept for their frame
        tuples: counted on an even sample of at most `sample` of them, and
        scaled (a merge meeting thousands of new chains has them worked out
        in a thread first; the count decides only where that work runs)."""
        step = max(1, len(stacks) // sample)
        return step * self._by_id.missing((id(s.kernel), id(s.user)) for s in stacks[::step])

    def info(self, kernel: tuple[Frame, ...], user: tuple[Frame, ...]) -> ChainInfo:
        """The facts of one chain."""
        key = (id(kernel), id(user))
        hit = self._by_id.get(key)
        if hit is not None and hit[0] is kernel and hit[1] is user:
            return hit[2]
        if len(self._by_id) >= self._max:
            self._by_id.clear()
            self._by_names.clear()
            self._texts = {}
        names = (tuple([f.name for f in kernel]), tuple([f.name for f in user]))
        info = self._by_names.get(names)
        if info is None:
            self._next += 1
            info = ChainInfo(self._next, kernel, user)
            self._by_names.put(names, info)
        self._by_id.put(key, (kernel, user, info))
        return info

    def infos(self, stacks: Sequence[StackRow]) -> list[ChainInfo]:
        """`info` of each stack's chain: those kept looked up in one pass (a merge
        or the idle pass asks for every stack of a snapshot, 20,000 at times)."""
        kernels = [s.kernel for s in stacks]
        users = [s.user for s in stacks]
        found = self._by_id.get_many(list(zip(map(id, kernels), map(id, users), strict=True)))
        return [hit[2] if hit is not None and hit[0] is k and hit[1] is u else self.info(k, u)
                for hit, k, u in zip(found, kernels, users, strict=True)]

    def text(self, stack: StackRow) -> str:
        """The chain's frame names, casefolded, for searching."""
        chain = self.info(stack.kernel, stack.user).chain
        text = self._texts.get(chain)
        if text is None:
            text = self._texts[chain] = "\n".join(
                [f.name for f in stack.kernel] + [f.name for f in stack.user]).casefold()
        return text


#: How identical stacks are merged: not at all, across the threads of a
#: process, or across processes with the same command (comm).
MergeBy = Literal["none", "process", "command"]


@dataclass(frozen=True, slots=True)
class MergedStack:
    """Identical callchains (same state and frames) summed across tasks.

    `row` holds the sums, with the pid, tid and comm of the hottest member.
    """

    row: StackRow
    threads: int = 1
    processes: int = 1


class SnapshotIndex:
    """Lookups over one snapshot, made once per snapshot (in a worker thread).

    Rows by `RowKey` at once; everything else when first asked and then kept
    (a tick asks for a few tasks' stacks, not for 2,000): a task's stacks,
    every task's hottest stack, idle time per task, frame-text matches. The
    facts of a stack's chain come from the shared `ChainCatalog`. Not to be
    changed once made; used from the event loop only once posted.
    """

    #: `facts_of` this many stacks or more keeps the facts of all (see there).
    MANY_STACKS: ClassVar[int] = 1_000

    def __init__(self, snapshot: Snapshot, catalog: ChainCatalog | None = None) -> None:
        self.snapshot = snapshot
        # Not `catalog or ...`: an empty catalog is falsy (it has a length), and the
        # first index would then keep a catalog of its own, and every later one.
        self.catalog = catalog if catalog is not None else ChainCatalog()
        rows: dict[RowKey, TaskRow | ProcessRow] = {t.key: t for t in snapshot.tasks}
        rows.update((p.key, p) for p in snapshot.processes)
        self.rows: Mapping[RowKey, TaskRow | ProcessRow] = rows
        self._stacks: dict[RowKey, tuple[StackRow, ...]] = {}
        # (by tid, by pid), made at the first ask
        self._hottest: tuple[dict[int, StackRow], dict[int, StackRow]] | None = None
        self._idle_ns: dict[RowKey, int] | None = None
        # The snapshot's rows are alive as long as the index: their ids are theirs.
        self._facts: dict[int, ChainInfo] | None = None
        self._matches: tuple[str, frozenset[int], frozenset[int]] | None = None

    @classmethod
    def empty(cls) -> SnapshotIndex:
        """The index of a snapshot with nothing in it."""
        return cls(Snapshot(seq=0, time=0.0, interval_s=1.0, threshold_ns=0))

    def stacks_of(self, key: RowKey) -> tuple[StackRow, ...]:
        """The stacks of a thread or a process, most off-CPU time first."""
        stacks = self._stacks.get(key)
        if stacks is None:
            n = key.id
            all_stacks = self.snapshot.stacks
            stacks = (tuple([s for s in all_stacks if s.pid == n]) if key.is_process
                      else tuple([s for s in all_stacks if s.tid == n]))
            if len(self._stacks) > 256:
                self._stacks.clear()
            self._stacks[key] = stacks
        return stacks

    def hottest(self, key: RowKey) -> StackRow | None:
        """The stack of a thread or process with the most off-CPU time."""
        if self._hottest is None:
            # By ids, not `RowKey`s: a key made and hashed per stack cost ~20 ms a
            # snapshot on a busy server (8,000 stacks; the wide task table asks).
            by_tid: dict[int, StackRow] = {}
            by_pid: dict[int, StackRow] = {}
            for s in self.snapshot.stacks:  # ranked: the first seen is the hottest
                by_tid.setdefault(s.tid, s)
                by_pid.setdefault(s.pid, s)
            self._hottest = by_tid, by_pid
        by_tid, by_pid = self._hottest
        return (by_pid if key.kind == "process" else by_tid).get(key.id)

    def facts(self, stack: StackRow) -> ChainInfo:
        """The chain facts of a stack (of this snapshot or any other)."""
        return self.catalog.info(stack.kernel, stack.user)

    def facts_of(self, stacks: Sequence[StackRow]) -> list[ChainInfo]:
        """`facts` of each of `stacks`, in one pass. Asked for many (a merge of all
        stacks, the idle pass), the facts of every stack of the snapshot are kept
        by the stack's identity (alive as long as the index): a second merge, or
        a merge after the idle pass, then finds each with one dict lookup."""
        if self._facts is None and len(stacks) < self.MANY_STACKS:
            return self.catalog.infos(stacks)
        known = self._all_facts()
        out = list(map(known.get, map(id, stacks)))
        if None in out:  # not of this snapshot (since-start rows)
            more = iter(self.catalog.infos([s for s, f in zip(stacks, out, strict=True)
                                            if f is None]))
            return [f if f is not None else next(more) for f in out]
        return cast("list[ChainInfo]", out)

    def _all_facts(self) -> dict[int, ChainInfo]:
        """The facts of every stack of the snapshot by the stack's identity, worked
        out in one pass the first time."""
        if self._facts is None:
            every = self.snapshot.stacks
            self._facts = dict(zip(map(id, every), self.catalog.infos(every), strict=True))
        return self._facts

    def counterpart(self, key: RowKey) -> RowKey | None:
        """The row of the other mode for the same task: a thread's process,
        or a process's main thread (else its hottest thread)."""
        if not key.is_process:
            row = self.rows.get(key)
            return RowKey.process(row.pid) if row is not None else None
        main = RowKey.thread(key.id)
        if main in self.rows:
            return main
        top = self.hottest(key)
        return RowKey.thread(top.tid) if top is not None else None

    def cmdline(self, pid: int) -> str:
        """A process's command line, when the snapshot has it."""
        row = self.rows.get(RowKey.process(pid))
        return row.cmdline if isinstance(row, ProcessRow) else ""

    def idle_ns(self, key: RowKey) -> int:
        """Off-CPU time of a thread or process in idle waits (`is_idle_wait`)."""
        if self._idle_ns is None:
            self._find_idle()
        assert self._idle_ns is not None
        return self._idle_ns.get(key, 0)

    def is_idle(self, stack: StackRow) -> bool:
        """`is_idle_wait` of a stack (of this snapshot: looked up, not worked out)."""
        if self._idle_ns is None:
            self._find_idle()
        assert self._facts is not None
        known = self._facts.get(id(stack))
        return (known or self.catalog.info(stack.kernel, stack.user)).idle

    def prepare_idle(self) -> None:
        """Work out what hiding idle waits needs now (the pump does, off the event
        loop, while idle waits are hidden), not at its first use."""
        if self._idle_ns is None:
            self._find_idle()

    def _find_idle(self) -> None:
        """One pass over the snapshot for what hiding idle waits needs."""
        idle_ns: dict[RowKey, int] = {}
        facts = self._all_facts()
        for s in self.snapshot.stacks:
            if facts[id(s)].idle:
                for k in (RowKey.thread(s.tid), RowKey.process(s.pid)):
                    idle_ns[k] = idle_ns.get(k, 0) + s.offcpu_ns
        self._idle_ns = idle_ns

    def frames_contain(self, key: RowKey, text: str) -> bool:
        """True if a stack of the thread or process has a frame containing `text`
        (case-insensitive); worked out for the whole snapshot once per text."""
        needle = text.casefold()
        if self._matches is None or self._matches[0] != needle:
            hits = [s for s in self.snapshot.stacks if needle in self.catalog.text(s)]
            self._matches = (needle, frozenset(s.tid for s in hits),
                             frozenset(s.pid for s in hits))
        return key.id in self._matches[2 if key.is_process else 1]

    def view(self, stacks: Iterable[StackRow], *, hide_idle: bool = False,
             text: str = "") -> list[StackRow]:
        """`stacks` without idle waits and/or only those with a frame containing `text`."""
        if not hide_idle and not text:
            return list(stacks)
        needle = text.casefold()
        out = []
        for s in stacks:
            if hide_idle and self.is_idle(s):
                continue
            if needle and needle not in self.catalog.text(s):
                continue
            out.append(s)
        return out


def merge_identical(stacks: Sequence[StackRow], by: MergeBy,
                    facts_of: Callable[[Sequence[StackRow]], list[ChainInfo]],
                    limit: int | None = None) -> tuple[list[MergedStack], int]:
    """Sum stacks with the same state and frames: within a process, or across
    processes with the same comm (`by`). Returns the heaviest `limit` (all
    by default), most off-CPU time first, and how many there are in all.

    `facts_of(stacks)` gives each stack's chain (a `SnapshotIndex.facts_of`),
    so equal chains are told by one number, not by comparing frames. `stacks`
    are ranked already (as a snapshot's are): unmerged, the first `limit`.
    """
    if by == "none":
        return [MergedStack(s) for s in stacks[:limit]], len(stacks)
    groups: dict[tuple[int | str, str, bool, int], list[StackRow]] = {}
    totals: dict[tuple[int | str, str, bool, int], int] = {}
    by_process = by == "process"
    for s, info in zip(stacks, facts_of(stacks), strict=True):
        key = (s.pid if by_process else s.comm, s.state, s.before_start, info.chain)
        group = groups.get(key)
        if group is None:
            groups[key] = [s]
            totals[key] = s.offcpu_ns
        else:
            group.append(s)
            totals[key] += s.offcpu_ns
    heaviest: Iterable[tuple[int | str, str, bool, int]] = groups
    if limit is not None and len(groups) > limit:
        heaviest = heapq.nlargest(limit, totals, key=totals.__getitem__)
    out = []
    for group_key in heaviest:
        members = groups[group_key]
        top = members[0]  # ranked: the hottest member (the first of equals)
        if len(members) == 1:
            out.append(MergedStack(top))
            continue
        top = StackRow(top.pid, top.tid, top.comm, top.state, totals[group_key],
                       sum([s.count for s in members]), max([s.max_ns for s in members]),
                       top.kernel, top.user, top.before_start, top.wakers)
        out.append(MergedStack(top, threads=len({s.tid for s in members}),
                               processes=len({s.pid for s in members})))
    out.sort(key=lambda m: (-m.row.offcpu_ns, m.row.tid, m.row.state))
    return out, len(groups)


#: A since-start key: (id of the kernel tuple, id of the user tuple, tid, state,
#: before-start).
_SinceKey = tuple[int, int, int, str, bool]

#: The largest sum `SinceStart` holds (its arrays' cells are unsigned 64-bit): a sum
#: past it (only a replayed file could make one) stays there.
_SUM_MAX = (1 << 64) - 1


#: `SinceStart._shed`'s weight of a key its latest snapshot had: above any other's.
_FRESH = 1 << 62


class SinceStart:
    """Every stack's off-CPU time summed since offtop started (a cumulative view).

    `add` takes each snapshot as it comes (in the source's thread) and only
    queues its stacks; `fold` sums what is queued, later and in another
    thread (the TUI folds once the snapshot is on screen, so that the sum,
    ~1 µs a stack, never delays a tick), and `ranked` folds first, so that
    it always covers every snapshot added before it was called. Past
    `MAX_PENDING` queued snapshots `add` folds them itself (memory stays
    bounded when nothing folds). Summing keys each stack by its thread,
    state and the identity of its frame tuples (the engine hands out the
    same tuples for the same stack id interval after interval; the rows
    kept hold them, so an identity is not reused). `ranked` (from any
    thread: a lock keeps them apart) merges what is the same chain in other
    tuples (a replay, a re-symbolized stack) and gives the totals as stack
    rows, most time first. Bounded: past `max_entries` keys the lightest
    are dropped down to three quarters, their time counted in `dropped_ns`;
    the keys of the snapshot just summed go last (see `_shed`).

    The totals live a session long, 20,000 of them on a busy server, and every
    full pass of the cyclic GC walks what lives (offtop.gc_pacing): they are
    kept where it has nothing to walk. A key's sums are cells of unsigned
    64-bit arrays (not objects: nothing to visit), at the slot an index dict
    gives (ints for tuples of ints: the GC stops tracking such a dict at its
    next full pass); its name and frames are items of three lists. Held as
    one object a key, they were ~220,000 references for the full pass to
    visit, each a cache miss, at the 20,000 totals a busy server fills
    (bench/bench_ui.py); now ~60,000. The price is in the fold, off the event
    loop: a cell is read into a new int and written back from one, where an
    object's slot held the int itself (1.4-2.4x slower, bench/README.md).
    """

    #: Snapshots queued at most before `add` folds them itself.
    MAX_PENDING = 4

    def __init__(self, max_entries: int = 20_000) -> None:
        self._max = max_entries
        self._lock = threading.Lock()
        self._slots: dict[_SinceKey, int] = {}  # key -> its slot in the lists below
        self._ns, self._count, self._max_ns = array("Q"), array("Q"), array("Q")
        self._seen = array("Q")  # the last fold (`_folded`) whose snapshot had the key
        self._pid = array("Q")
        self._comm: list[str] = []
        self._kernel: list[tuple[Frame, ...]] = []
        self._user: list[tuple[Frame, ...]] = []
        self._pending: list[Sequence[StackRow]] = []
        self._folded = 0  # snapshots summed
        self._catalog = ChainCatalog()
        #: Off-CPU time of the keys dropped to stay bounded.
        self.dropped_ns = 0
        #: Snapshots added, and the time the first one began (unix seconds).
        self.snapshots = 0
        self.since = 0.0

    @property
    def pending(self) -> int:
        """Snapshots added and not summed yet."""
        return len(self._pending)

    def add(self, index: SnapshotIndex) -> None:
        """Add one snapshot's stacks (queued: see `fold`)."""
        snap = index.snapshot
        with self._lock:
            self._catalog = index.catalog
            if not self.snapshots:
                self.since = snap.time - snap.interval_s
            self.snapshots += 1
            self._pending.append(snap.stacks)
            if len(self._pending) > self.MAX_PENDING:
                self._fold()

    def fold(self) -> None:
        """Sum the snapshots added since the last fold into the totals."""
        with self._lock:
            self._fold()

    def _fold(self) -> None:
        slots, comms, kernels, users = self._slots, self._comm, self._kernel, self._user
        ns, count, max_ns, seen_at, pids = self._ns, self._count, self._max_ns, self._seen, self._pid
        get = slots.get
        for stacks in self._pending:
            self._folded += 1
            seen = self._folded
            for s in stacks:
                # The cheapest key that tells stacks apart (this loop is the cost).
                key = (id(s.kernel), id(s.user), s.tid, s.state, s.before_start)
                i = get(key)
                done = 0  # the sums written so far (see `_saturate`)
                try:
                    if i is None:
                        # Its wakers are not summed here: not held either.
                        ns.append(s.offcpu_ns)
                        count.append(s.count)
                        max_ns.append(s.max_ns)
                        seen_at.append(seen)
                        pids.append(s.pid)
                        slots[key] = len(comms)
                        comms.append(s.comm)
                        kernels.append(s.kernel)
                        users.append(s.user)
                        continue
                    ns[i] += s.offcpu_ns
                    done = 1
                    count[i] += s.count
                    done = 2
                    if s.max_ns > max_ns[i]:
                        max_ns[i] = s.max_ns
                    seen_at[i] = seen
                except OverflowError:
                    self._saturate(key, i, s, seen, done)
                    continue
                if comms[i] != s.comm:  # a thread renamed: its latest name (all else is the key's)
                    comms[i] = s.comm
            if len(comms) > self._max:
                self._shed()
                slots, comms, kernels, users = self._slots, self._comm, self._kernel, self._user
                ns, count, max_ns, seen_at, pids = (self._ns, self._count, self._max_ns,
                                                    self._seen, self._pid)
                get = slots.get
        self._pending.clear()

    def _saturate(self, key: _SinceKey, i: int | None, s: StackRow, seen: int,
                  done: int) -> None:
        """`_fold`'s sums of `s` where one overflowed its cell (only a replayed file
        can make one): each held at `_SUM_MAX`. `done`: how many of the key's
        sums (ns, count) `_fold` wrote before the overflow."""
        if i is None:  # a new key: its cells appended so far are undone
            i = n = len(self._comm)
            for a in (self._ns, self._count, self._max_ns, self._seen, self._pid):
                del a[n:]
                a.append(0)
            self._pid[i] = min(max(s.pid, 0), _SUM_MAX)
            self._slots[key] = n
            self._comm.append(s.comm)
            self._kernel.append(s.kernel)
            self._user.append(s.user)
        if done < 1:
            self._ns[i] = min(self._ns[i] + max(s.offcpu_ns, 0), _SUM_MAX)
        if done < 2:
            self._count[i] = min(self._count[i] + max(s.count, 0), _SUM_MAX)
        self._max_ns[i] = min(max(self._max_ns[i], s.max_ns), _SUM_MAX)
        self._seen[i] = seen
        self._comm[i] = s.comm

    def clear(self) -> None:
        """Forget every total: the next `add` starts them again (a replay
        jumped, and its totals begin at the interval it jumped to)."""
        with self._lock:
            self._slots = {}
            self._ns, self._count, self._max_ns = array("Q"), array("Q"), array("Q")
            self._seen, self._pid = array("Q"), array("Q")
            self._comm, self._kernel, self._user = [], [], []
            self._pending.clear()
            self.dropped_ns = 0
            self.snapshots = 0
            self.since = 0.0

    def _shed(self) -> None:
        """Drop the lightest keys down to three quarters of `max_entries`: a sort
        of weights alone (ints, in C), then one pass.

        The keys of the snapshot just summed are dropped last (only if they
        alone are more than that). Else, under process churn, the totals fill
        with the stacks of threads gone, each heavy with its life's time, and
        every live thread's keys, new at each snapshot with one interval's
        time, would be the lightest: dropped at each shed, their totals never
        more than an interval or two, and all of them summed afresh at every
        fold (measured at the busy server: 8,300 new keys of 8,330 a snapshot).
        """
        ns, seen_at = self._ns, self._seen
        cut = len(self._comm) - self._max * 3 // 4
        if cut <= 0:
            return
        fresh, top = self._folded, _FRESH
        weights = [min(n, top - 1) | (top if at == fresh else 0)
                   for n, at in zip(ns, seen_at, strict=True)]
        ordered = sorted(weights)
        # Dropped: every key lighter than `limit`, and as many at `limit` as make `cut`.
        limit = ordered[cut - 1]
        ties = cut - bisect.bisect_left(ordered, limit)
        keep: list[int] = []
        dropped = 0
        for i, w in enumerate(weights):
            if w > limit or (w == limit and ties <= 0):
                keep.append(i)
            else:
                if w == limit:
                    ties -= 1
                dropped += ns[i]
        self.dropped_ns += dropped
        slot_of = [-1] * len(weights)  # old slot -> new, -1 where dropped
        for new, i in enumerate(keep):
            slot_of[i] = new
        self._slots = {key: slot_of[i] for key, i in self._slots.items() if slot_of[i] >= 0}
        self._ns, self._count, self._max_ns, self._seen, self._pid = (
            array("Q", [a[i] for i in keep])
            for a in (self._ns, self._count, self._max_ns, self._seen, self._pid))
        self._comm = [self._comm[i] for i in keep]
        self._kernel = [self._kernel[i] for i in keep]
        self._user = [self._user[i] for i in keep]

    def ranked(self, keep: Callable[[int, int, str], bool] | None = None,
               limit: int | None = None) -> tuple[StackRow, ...]:
        """The totals as stack rows, most off-CPU time first: of the stacks whose
        task `keep(pid, tid, comm)` keeps (all by default), the `limit` heaviest (all
        by default). Rows are made for those only."""
        with self._lock:  # held briefly: `add` waits for it in the source's thread
            self._fold()
            a_ns, a_count, a_max, a_pid = self._ns, self._count, self._max_ns, self._pid
            comms, kernels, users = self._comm, self._kernel, self._user
            items = [(key, a_ns[i], a_count[i], a_max[i], a_pid[i], comms[i], kernels[i], users[i])
                     for key, i in self._slots.items()
                     if keep is None or keep(a_pid[i], key[2], comms[i])]
            info = self._catalog.info
        merged: dict[tuple[int, str, bool, int], list[Any]] = {}
        for (_k, _u, tid, state, before), ns, count, max_ns, pid, comm, kernel, user in items:
            key = (tid, state, before, info(kernel, user).chain)
            cur = merged.get(key)
            if cur is None:
                merged[key] = [ns, count, max_ns, pid, tid, comm, state, kernel, user, before]
            else:
                cur[0] += ns
                cur[1] += count
                if max_ns > cur[2]:
                    cur[2] = max_ns
        runs: Iterable[list[Any]] = merged.values()
        if limit is not None and len(merged) > limit:
            runs = heapq.nlargest(limit, runs, key=lambda r: r[0])
        rows = [StackRow(pid, tid, comm, state, ns, count, mx, kernel, user, before)
                for ns, count, mx, pid, tid, comm, state, kernel, user, before in runs]
        rows.sort(key=lambda r: (-r.offcpu_ns, r.tid, r.state))
        return tuple(rows)
