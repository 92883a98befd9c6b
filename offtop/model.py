"""Pure aggregation of off-CPU records into immutable snapshots.

The model knows nothing of bcc, BPF maps or the screen: the engine hands it
records whose stacks are already symbolized, and it hands back a frozen
`Snapshot` per interval. Everything here is deterministic and unit-tested.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

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

_HEX_DIGITS = frozenset("0123456789abcdef")


@dataclass(frozen=True, slots=True)
class Frame:
    """One resolved stack frame."""

    name: str
    module: str = ""
    kernel: bool = False

    @property
    def unknown(self) -> bool:
        """True when the address could not be resolved to a function.

        Such frames are marks ("[stack truncated]"), bare addresses ("0x…"),
        or addresses inside a module that could not be named, which read
        `module+0xOFFSET` (told by their form, so frames read back from JSON
        without their module are still known as unresolved).
        """
        name = self.name
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


@dataclass(frozen=True, slots=True)
class TaskRow:
    """One thread's off-CPU time in the interval, and since offtop started."""

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
    def key(self) -> str:
        """A stable identity for keyed table rows."""
        return f"t{self.tid}"


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
    def key(self) -> str:
        """A stable identity for keyed table rows."""
        return f"p{self.pid}"


@dataclass(frozen=True, slots=True)
class StackRow:
    """Off-CPU time of one task in one state at one (kernel, user) callchain."""

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
    #: Who ended these blocks, most off-CPU time first.
    wakers: tuple[WakerRow, ...] = ()

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


@dataclass(slots=True)
class _Acc:
    """Mutable per-interval accumulator (private to the model)."""

    pid: int
    comm: str
    offcpu_ns: int = 0
    count: int = 0
    max_ns: int = 0
    events: int = 0
    start: int = 0
    state_ns: dict[str, int] = field(default_factory=dict)

    def add(self, s: Sample) -> None:
        if s.start:
            self.start = s.start
        self.offcpu_ns += s.offcpu_ns
        self.count += s.count
        self.max_ns = max(self.max_ns, s.max_ns)
        self.state_ns[s.state] = self.state_ns.get(s.state, 0) + s.offcpu_ns
        if s.from_event:
            self.events += s.count
        if s.comm:
            self.comm = s.comm


@dataclass(slots=True)
class _Total:
    pid: int
    start: int = 0
    total_ns: int = 0
    last_seq: int = 0


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
        self._max_stacks = max_stacks
        self._max_threads = max_threads

    @property
    def max_threads(self) -> int:
        """How many threads' totals are kept at most."""
        return self._max_threads

    @property
    def tracked_threads(self) -> int:
        """How many threads have since-start totals (bounded by forgetting)."""
        return len(self._totals)

    def build(
        self,
        samples: Iterable[Sample],
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
        """Aggregate one interval and return its snapshot.

        `process_meta(pid)` gives (user, command line) for the top `meta_limit`
        processes, or None for a process that is gone.
        """
        self._seq += 1
        seq = self._seq
        threads: dict[int, _Acc] = {}
        stacks: dict[tuple[int, str, tuple[Frame, ...], tuple[Frame, ...]], list[int]] = {}
        stack_meta: dict[tuple[int, str, tuple[Frame, ...], tuple[Frame, ...]], tuple[int, str]] = {}
        wakers: dict[tuple[int, str, tuple[Frame, ...], tuple[Frame, ...]],
                     dict[Waker, list[int]]] = {}

        for s in samples:
            acc = threads.get(s.tid)
            if acc is None:
                acc = threads[s.tid] = _Acc(pid=s.pid, comm=s.comm)
            acc.add(s)
            skey = (s.tid, s.state + ("<" if s.before_start else ""), s.kernel, s.user)
            cur = stacks.get(skey)
            if cur is None:
                stacks[skey] = [s.offcpu_ns, s.count, s.max_ns]
                stack_meta[skey] = (s.pid, s.comm)
            else:
                cur[0] += s.offcpu_ns
                cur[1] += s.count
                cur[2] = max(cur[2], s.max_ns)
            if s.waker is not None:
                by_waker = wakers.setdefault(skey, {})
                w = by_waker.get(s.waker)
                if w is None:
                    by_waker[s.waker] = [s.offcpu_ns, s.count]
                else:
                    w[0] += s.offcpu_ns
                    w[1] += s.count

        for tid, acc in threads.items():
            tot = self._totals.get(tid)
            if tot is None or tot.pid != acc.pid or (tot.start and acc.start
                                                     and tot.start != acc.start):
                # A new thread, or this tid reused by another process: afresh.
                tot = self._totals[tid] = _Total(pid=acc.pid, start=acc.start)
            elif not tot.start:
                tot.start = acc.start
            tot.total_ns += acc.offcpu_ns
            tot.last_seq = seq
        self._forget(seq)

        tasks = tuple(
            sorted(
                (
                    TaskRow(
                        pid=a.pid,
                        tid=tid,
                        comm=a.comm,
                        offcpu_ns=a.offcpu_ns,
                        count=a.count,
                        max_ns=a.max_ns,
                        state_ns=dict(a.state_ns),
                        total_ns=self._totals[tid].total_ns,
                        events=a.events,
                    )
                    for tid, a in threads.items()
                ),
                key=lambda t: (-t.offcpu_ns, t.tid),
            )
        )
        stack_rows = sorted(
            (
                StackRow(
                    pid=stack_meta[k][0],
                    tid=k[0],
                    comm=stack_meta[k][1],
                    state=k[1].rstrip("<"),
                    before_start=k[1].endswith("<"),
                    offcpu_ns=v[0],
                    count=v[1],
                    max_ns=v[2],
                    kernel=k[2],
                    user=k[3],
                    wakers=_waker_rows(wakers.get(k)),
                )
                for k, v in stacks.items()
            ),
            key=lambda r: (-r.offcpu_ns, r.tid, r.state),
        )
        return Snapshot(
            seq=seq,
            time=time,
            interval_s=interval_s,
            threshold_ns=threshold_ns,
            tasks=tasks,
            processes=group_processes(tasks, process_meta, meta_limit),
            stacks=tuple(stack_rows[: self._max_stacks]),
            long_blocks=tuple(long_blocks),
            blocked_now=tuple(sorted(blocked_now, key=lambda b: (-b.blocked_ns, b.tid))),
            stats=stats or CaptureStats(interval_s=interval_s),
            notices=tuple(notices),
            finished=finished,
        )

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


def _waker_rows(by_waker: Mapping[Waker, list[int]] | None) -> tuple[WakerRow, ...]:
    if not by_waker:
        return ()
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
