"""The live source: the probe's records, decoded and symbolized into snapshots.

Data flows one way: kernel maps and perf ring (`Probe`, `PerfRing`) ->
raw rows -> frames (`StackStore`) -> the model (`Aggregator`). Everything
here runs in one thread (the app's worker, or batch mode's main thread);
only `set_threshold` and `blocked_waits` may be called from another thread
(a single map write; reads of mapped memory).

Each interval is cut in sub-ticks (0.25 s): at each, the ring is drained,
the aggregates of the last sub-tick are read and symbolized while their
processes still exist, flood control looks at the event rate, and the
targets are checked. The interval's deadline always comes first: the ring
is read in bounded batches and symbolizing has a time budget per sub-tick.
"""

from __future__ import annotations

import functools
import math
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from offtop.bpf import environment
from offtop.bpf.before_start import BeforeStart, cgroup_relative
from offtop.bpf.block_frames import BEHIND, NOT_RESOLVED, BlockFrames
from offtop.bpf.blocked import BlockedNowReader
from offtop.bpf.budget import SelfCost
from offtop.bpf.compiler_memory import release_compiler_memory, trim_heap
from offtop.bpf.config import EngineConfig, EngineError
from offtop.bpf.cut_short import CutShort
from offtop.bpf.decode import (
    EVENT_STRUCT,
    ST_BEFORE_START,
    StackCopy,
    decode_comm,
    new_user_stacks,
    record_addresses,
    state_name,
)
from offtop.bpf.flood import FloodControl
from offtop.bpf.lineage import Lineage
from offtop.bpf.loader.load import AheadCompile
from offtop.bpf.perf_ring import PerfRing, make_room_for_files, online_cpus, ring_pages
from offtop.bpf.probe import LINEAGE, RULES_OWNER, Drained, Probe, RawRow, RawSums, agg_key
from offtop.bpf.probe_stats import ProbeStats
from offtop.bpf.row_frames import Resolved, RowFrames
from offtop.bpf.wakers import RawWaker, Wakers
from offtop.model import (
    Aggregator,
    CaptureStats,
    Frame,
    LongBlock,
    Snapshot,
    Waker,
)
from offtop.proc_tasks import in_cgroup
from offtop.source import SourceInfo, local_info
from offtop.targets import TargetWatch, task_start_time

if TYPE_CHECKING:
    # Imported once the probe is armed (see `_start_armed`).
    from offtop.bpf.sent_maps import MappingWatch
    from offtop.procinfo import ProcessInfoCache
    from offtop.symbols import KernelSymbols, UserSymbols
    from offtop.unwind import Unwinder

__all__ = ["BpfSource", "EngineConfig", "EngineError"]

#: The probe's perf event array of new user stacks (offcpu.c).
NEW_USER_STACKS = "new_user_stacks"

#: The stack ids of a row summed per thread and state once a stop came, or while
#: offtop was behind: no id the probe hands out (those are s32; -1 with -1 is a
#: block from before the start).
UNRESOLVED_ID = -(1 << 40)
BEHIND_ID = UNRESOLVED_ID - 1

#: Rows summed between two looks at whether a stop's time to resolve is over
#: (a flood of new stacks makes a row cost tens of microseconds).
_STOP_CHECK_ROWS = 512

#: New rows resolved at each read of the sums even when offtop is behind
#: (`BpfSource._sum_rows`), and new stacks at each sub-tick
#: (`_resolve_new_stacks`): on a starved CPU the read and the carry alone can
#: outlast a sub-tick, and with nothing resolved past it offtop never caught up.
_MIN_NEW_ROWS = 512
_MIN_NEW_STACKS = 64

#: New user stacks waiting to be resolved between two reads of the sums, at most
#: (`BpfSource._resolve_new_stacks`; past it, they are resolved with their rows).
_NEW_STACKS_MAX = 65_536

#: New user stacks since the sums were last read, or new keys in the last read,
#: past which the sums are read at the next sub-tick (`BpfSource._subtick`): a
#: flood of new keys is resolved a sub-tick's share at a time, as they come, not
#: a second's at once (which left 2-4 times as many rows behind).
_FLOOD_NEW = 4_096

#: Long-block events read from the ring at once (`_read_ring`): ~7 ms of CPU.
_READ_CHUNK = 4096

#: The user frames of rows summed unresolved (one tuple each: `StackGroups` numbers by it).
_NOT_RESOLVED = (NOT_RESOLVED,)
_BEHIND = (BEHIND,)

#: The largest threshold the kernel map accepts (offtop.units bounds what users type).
MAX_THRESHOLD_NS = 1 << 62

# A raw key of summed events, stacks still ids: (tgid, tid, state, ustack, kstack,
# waker tgid, waker tid, waker what).
_RawKey = tuple[int, int, int, int, int, int, int, int]


@dataclass(slots=True)
class _Row:
    """One raw key's sums over an interval; its stacks and its process's start time
    taken at first sight (while the process lives).

    A row whose resolution is final (`RowFrames`) is kept for the next interval
    and given its new sums there without being resolved again, as long as its
    process is the same one (its start time), its stack ids name the same
    stacks (the store's generation) and its waker's stacks are the same ones.

    What the model sums (`GroupedSample`) is named as there; `group` is the
    row's number in the aggregator's `StackGroups`, given once.
    """

    offcpu_ns: int
    count: int
    max_ns: int
    comm: str
    kernel: tuple[Frame, ...]
    user: tuple[Frame, ...]
    before_start: bool
    waker: Waker | None
    start: int
    pid: int
    tid: int
    st: int  #: the key's state bits
    state: str  #: and their name
    ustack: int
    kstack: int
    from_event: bool  #: summed from long blocks' events (else from the kernel's sums)
    seq: int  #: the interval its sums are of
    group: int
    final: bool = False  #: its frames and waker may be carried into the next interval
    wus: int = -1  #: the waker's user stack id its waker was resolved from
    wks: int = -1  #: and kernel stack id
    what: int = 0  #: the waker's kind (the key's: the same at every interval)


@dataclass(slots=True)
class _Interval:
    """What accumulates between two snapshots besides the rows (`BpfSource._known`)."""

    long_blocks: deque[LongBlock] = field(default_factory=deque)
    events: int = 0
    #: New summed rows not resolved because offtop was behind (`BpfSource._sum_rows`).
    behind_rows: int = 0
    notices: list[str] = field(default_factory=list)


class BpfSource:
    """The real source: offcpu.c on sched:sched_switch (see the module docstring).

    Collaborators can be passed in (tests, benchmarks); by default they are
    made in `start()`, since reading kallsyms and the like takes time that
    the TUI should spend with its screen already up.
    """

    def __init__(
        self,
        config: EngineConfig,
        *,
        clock: Callable[[], float] = time.monotonic,
        aggregator: Aggregator | None = None,
        kernel_symbols: KernelSymbols | None = None,
        user_symbols: UserSymbols | None = None,
        process_info: ProcessInfoCache | None = None,
        ahead: AheadCompile | None = None,
        targets: TargetWatch | None = None,
    ) -> None:
        self.config = config
        self._clock = clock
        self._user_threshold_ns = config.threshold_ns
        self.aggregator = aggregator or Aggregator()
        self._ksyms = kernel_symbols
        self._usyms = user_symbols
        self._procinfo = process_info  # made in `start()` if None
        self._unwinder: Unwinder | None = None
        # `ahead`: the program's compile, begun before (offtop.bpf.probe.compile_ahead_of).
        self.probe = Probe(config, ahead=ahead, clock=clock)
        self.flood = FloodControl(config.event_budget_per_s)
        # The -p/-t/-c targets' watch: the config's (the probe records by the config).
        self.targets = (targets if targets is not None
                        else TargetWatch(config.pids, config.tids, config.cgroup))
        self._cgroup_rel = cgroup_relative(config.cgroup) if config.cgroup else "/"
        self.before = BeforeStart(self.probe, states=config.states, kthreads=config.kthreads,
                                  user_stacks=config.user_stacks, accept=self._in_scope)
        self.frames = BlockFrames(self.before, clock=clock)
        # Within the sub-tick's symbol budget, as every stack resolved then.
        self._deadline: float | None = None
        #: The blocks from before the start are symbolized (or the first snapshot is out).
        self._warm = False
        self._wakers = Wakers(self.frames.kernel,
                              lambda pid, sid: self.frames.user(pid, sid, self._deadline))
        self._rows = RowFrames(self.frames, self._wakers)
        self._comms: dict[bytes, str] = {}  # raw comm -> decoded (`_comm_text`)
        self._groups_generation = 0  # the aggregator's StackGroups' its rows are numbered in
        self._ring: PerfRing | None = None
        self._stack_ring: PerfRing | None = None  # new user stacks, whole (see StackStore.offer_user)
        self._watch: MappingWatch | None = None  # the kernel's mapping records (sent_maps)
        self._blocked: BlockedNowReader | None = None
        self._stats = ProbeStats()
        self._self_cost = SelfCost()
        # The probe's counters and offtop's CPU time as the interval's last
        # sub-tick cut the sums: the costs are per interval as the sums are, from cut to cut
        # (read at the snapshot instead, a sub-tick that resolved for long
        # charged its time to the interval before, up to 345% of a core).
        self._cut_counters: dict[str, int] = {}
        self._cut_cpu = 0.0
        self._lock = threading.Lock()  # the threshold, set from the UI thread
        self._raw_events: list[tuple[Any, ...]] = []
        self._event_acc: dict[_RawKey, list[Any]] = {}
        self._event_tail: deque[tuple[Any, ...]] = deque(maxlen=config.long_blocks_max)
        self._durations: list[int] = []  # a sample of this sub-tick's event durations
        self._subtick_events = 0
        self._interval = _Interval(long_blocks=deque(maxlen=config.long_blocks_max))
        # Its long blocks whose user frames the symbol budget cut short.
        self._cut_short = CutShort(self._user_again, clock)
        # The probe's rows by raw key (ids, not frames), summed over the interval
        # (those whose `seq` is the interval's; the others are last interval's,
        # kept to be carried: see _Row). A key is resolved the first time it is
        # seen (at a sub-tick, while its process lives) and samples are made
        # once, at the snapshot: the work grows with the keys that were active,
        # not with how often each was drained.
        # Keyed by offcpu.c's struct agg_key as bytes (`Drained.keys`; a long
        # block's with a byte more), or (tgid, tid, state, UNRESOLVED_ID or BEHIND_ID).
        self._known: dict[bytes | tuple[int, ...], _Row] = {}
        self._known_at = (0, 0)  # where the stack store was when `_known` was checked
        #: Rows carried into an interval without being resolved again (cumulative).
        self.carried = 0
        self._last_tick = 0.0
        self._cut_at = 0.0  #: when the kernel's sums were last cut (read)
        self._next_drain = 0.0  #: when they are read next at the latest
        #: (tgid, user stack id) of new stacks, resolved at sub-ticks while their
        #: processes live (the ring's records say whose they are).
        self._new_stacks: list[tuple[int, int]] = []
        self._new_since_drain = 0
        self._interval_base = 0.0  #: when the last interval's resolving was done
        self._last_subtick = 0.0
        self._next_subtick = 0.0
        self._lost_seen = 0
        self._events_total = 0
        self._seq = 0
        self._finished = ""
        self._mono_to_wall = time.time() - time.monotonic()
        self._closed = False

    # --- SnapshotSource -----------------------------------------------------

    @property
    def info(self) -> SourceInfo:
        return local_info("bpf", scope=self.config.scope or "all tasks",
                          stacks=self.config.stack_mode)

    @property
    def stack_ring_lost(self) -> int:
        """Records of new user stacks the ring had no room for (read from the map instead)."""
        return self._stack_ring.lost if self._stack_ring is not None else 0

    @property
    def threshold_ns(self) -> int:
        return self._user_threshold_ns

    @property
    def user_symbols(self) -> UserSymbols | None:
        """The user-space symbolizer (None until started, or without user stacks)."""
        return self._usyms

    def start(self) -> None:
        """Check the machine, compile and attach offcpu.c, open the ring, arm."""
        environment.prepare()
        cfg = self.config
        try:
            self.probe.load(self.flood.effective(self._user_threshold_ns))
            cpus = len(online_cpus())
            make_room_for_files(3 * cpus)  # the event ring, new stacks, mapping records
            self._ring = PerfRing(
                self.probe.set_perf_fd, wakeup_events=cfg.wakeup_events,
                pages=ring_pages(cfg.perf_pages, cfg.perf_pages_total, cpus, least=16))
            if cfg.user_stacks and self.probe.has_map(NEW_USER_STACKS):
                # Drained at each sub-tick, and between them when a batch of new
                # stacks wakes the interval loop (`_read_new_stacks`: a new
                # process is seen at once).
                self._stack_ring = PerfRing(
                    functools.partial(self.probe.set_perf_fd, ring=NEW_USER_STACKS),
                    pages=ring_pages(cfg.new_stack_pages, cfg.new_stack_pages_total, cpus,
                                     least=8),
                    wakeup_events=cfg.new_stack_wakeup)
                self._ring.wake_on(self._stack_ring)
            # The program records nothing until its maps are set and every
            # CPU's ring is in place (else its first events would fail).
            self.probe.arm()
            # The first interval is counted from here: what follows (symbols,
            # the blocks already under way) takes time the probe records.
            armed = self._clock()
        except Exception:
            self.close()
            raise
        self._start_armed(armed)

    def _start_armed(self, armed: float) -> None:
        """The rest of `start`, once the probe is armed (at `armed`): what turns its ids
        into frames and names, and the blocks already under way.

        Their modules are imported here, not with the engine's: the symbolizers,
        the unwinder, the Python stack reader and psutil take ~65 ms of a CPU to
        import, which the first interval absorbs (the probe records meanwhile).
        Before the probe was armed they delayed the first data by as much, on one
        CPU or beside a first start's compile.
        """
        from offtop.bpf.python_frames import PythonFrames
        from offtop.bpf.stack_store import StackStore
        from offtop.bpf.unwound import UnwoundStacks
        from offtop.bpf.user_stacks import UserStackRepair
        from offtop.procinfo import ProcessInfoCache
        from offtop.pystacks import PythonStacks
        from offtop.symbols import KernelSymbols, UserSymbols
        from offtop.unwind import Unwinder

        cfg = self.config
        if self._procinfo is None:
            self._procinfo = ProcessInfoCache()
        if self._ksyms is None and cfg.kernel_stacks:
            self._ksyms = KernelSymbols()
        if self._ksyms is not None and self._ksyms.entry_text is not None:
            self.probe.set_entry_text(*self._ksyms.entry_text)  # a no-op without wakers
        if self._usyms is None and cfg.user_stacks:
            self._usyms = UserSymbols()
        repair = None
        if cfg.user_stacks:
            unwinder = self._unwinder = Unwinder()
            assert self._usyms is not None
            lineage = Lineage(self.probe.forked)
            if self.probe.has_map(LINEAGE):
                self._usyms.stand_in = lineage.stand_in
                self._watch_mappings(lineage)
            owners = self.probe if self.probe.has_map(RULES_OWNER) else None
            self.frames.unwound = UnwoundStacks(unwinder, self._usyms, clock=self._clock,
                                               saved=self.probe.user_regs)
            if cfg.python_stacks:
                self.frames.python = PythonFrames(PythonStacks(),
                                                  budget_s=cfg.python_budget_s)
            repair = UserStackRepair(unwinder, self.probe.set_unwind_rule,
                                     forget=self.probe.forget_unwind_rules,
                                     maps=self._usyms.file_mappings, max_rules=cfg.unwind_rules,
                                     owners=owners, lender=lineage.stand_in if owners else None)
        self.frames.stacks = StackStore(
            self.probe, kernel_symbols=self._ksyms, user_symbols=self._usyms, repair=repair,
            capacity={"k": cfg.stack_entries, "u": cfg.ustack_entries},
            kernel_depth=cfg.kstack_depth, user_depth=cfg.ustack_depth)
        self._blocked = BlockedNowReader(self.probe, min_ns=cfg.blocked_min_ns,
                                         limit=cfg.blocked_max)
        self._interval.notices.extend(self.targets.initially_gone())
        self.before.seed()
        self.frames.unwind_before_start(cfg.unwind_budget_s)
        release_compiler_memory()
        self._last_tick = self._last_subtick = self._interval_base = armed
        self._next_subtick = armed + cfg.subtick_s
        self._next_drain = armed  # at the first sub-tick: it may be a flood

    def _watch_mappings(self, lineage: Lineage) -> None:
        """Read the kernel's records of execs and executable mappings (offtop.bpf.sent_maps),
        each time new stacks are (`_read_new_stacks`): a process gone before its first
        sight is named in its own. Without them (an older kernel, a locked-down perf),
        such a process is not named, as before."""
        cfg = self.config
        assert self._usyms is not None
        if not cfg.sent_map_pages:
            return
        from offtop.bpf.sent_maps import MappingWatch, SentMaps  # see `_start_armed`

        try:
            self._watch = MappingWatch(SentMaps(lineage.exec_of), pages=ring_pages(
                cfg.sent_map_pages, cfg.sent_map_pages_total, len(online_cpus()), least=4))
        except OSError as e:
            self._interval.notices.append(f"processes gone at once are not named: {e}")
            return
        self._usyms.sent = self._watch.sent.mappings
        self._usyms.exec_at = self._watch.sent.exec_at
        self._usyms.sent_covers = self._watch.sent.covers

    def _in_scope(self, pid: int, tid: int) -> bool:
        cfg = self.config
        if pid == _SELF_PID:
            return False
        if (cfg.pids or cfg.tids) and pid not in cfg.pids and tid not in cfg.tids:
            return False
        return cfg.cgroup is None or in_cgroup(pid, tid, self._cgroup_rel)

    def next_snapshot(self, interval_s: float, stop: Any) -> Snapshot | None:
        """Poll the ring until the interval ends, then build its snapshot."""
        if self._ring is None:
            raise EngineError("the engine is not started")
        if self._finished and self._seq > 0:
            return None  # the last snapshot said why: nothing is left to watch
        if self._seq == 0 and interval_s > 0:
            # The first snapshot comes early so users see data at once; its
            # interval_s says how long it really covered.
            interval_s = min(interval_s, self.config.first_interval_s)
        end = self._interval_base + interval_s
        now = self._clock()
        if end < now - interval_s:  # fell far behind (e.g. the process was stopped)
            end = now
        if self._next_drain > end - self.config.drain_s / 2:
            # The interval's last sub-tick reads the kernel's sums: a read due
            # less than half of `drain_s` before it waits for it. (Reading every
            # key twice an interval, 0.1-0.2 s apart, was an eighth of offtop's
            # CPU on a busy server.)
            self._next_drain = max(self._next_drain, end)
        while not stop.is_set():
            now = self._clock()
            if now >= end:
                break
            if now >= self._next_subtick:
                self._subtick(now)
                now = self._clock()
                if now >= end:
                    break
            if not self._warm:  # the first interval's idle time
                self._warm = self.frames.warm_before_start(
                    min(end, now + self.config.symbol_budget_s))
                now = self._clock()
            # Woken by a batch of records (`wakeup_events`), a stop (`hurry`) or the
            # next sub-tick, nothing else: an idle engine polled 20 times a second
            # spent a quarter of its CPU on waking up.
            self._ring.wait(max(0.0, min(end - now, self._next_subtick - now)))
            self._read_ring()
            self._read_new_stacks(see=True)
        if stop.is_set():
            return None
        self._subtick(self._clock(), last=True)
        # The next interval runs its full length from here, after the resolving
        # (on a loaded machine each keeps its sub-ticks' time to resolve).
        self._interval_base = self._clock()
        if self._next_drain > self._cut_at:  # (not a flood's read at once)
            # The next interval's reads are timed from its start, not from this
            # read, which came before this sub-tick's resolving.
            self._next_drain = self._interval_base + self.config.drain_s
        self._warm = True
        # Its length: from cut to cut, the time the sums cover.
        elapsed = max(1e-9, self._cut_at - self._last_tick)
        self._last_tick = self._cut_at
        return self._build(elapsed)

    def hurry(self, within_s: float = 0.1) -> None:
        """A stop is coming (see `offtop.source.Hurry`): what is left is resolved for
        `within_s` more, then its stacks are marked not resolved. The probe is
        detached meanwhile: the unfinished interval ends here (its blocked-now
        list is as the stop found it)."""
        self.frames.hurry(within_s)
        self.probe.detach_soon()
        if self._ring is not None:
            self._ring.wake()  # the loop sees the stop now, not at the next sub-tick

    def set_threshold(self, ns: int) -> None:
        """The user's long-block threshold, written into the running program (no reload)."""
        if not isinstance(ns, int) or isinstance(ns, bool) or ns < 0 or ns > MAX_THRESHOLD_NS:
            raise ValueError(f"invalid threshold {ns!r}")
        with self._lock:
            self._user_threshold_ns = ns
            self.flood.user_changed(ns)
            if self._ring is not None:
                self.probe.set_threshold(self.flood.effective(ns))

    def kernel_threshold_ns(self) -> int:
        """The threshold as the kernel map holds it now (for tests)."""
        return self.probe.kernel_threshold()

    def close(self) -> None:
        """Detach the probe, close the ring and free caches; safe twice."""
        if self._closed:
            return
        self._closed = True
        for ring in (self._ring, self._stack_ring):
            if ring is not None:
                ring.close()
        self._ring = self._stack_ring = None
        if self._watch is not None:
            self._watch.close()
            self._watch = None
        if self._usyms is not None:
            self._usyms.close()
        self.probe.close()

    # --- the interval loop --------------------------------------------------

    def _read_ring(self) -> int:
        """Read one chunk of the perf ring and sum its events by key, raw.

        A chunk (`_READ_CHUNK` events), not all there is: under a flood that
        keeps the CPUs busy, offtop's thread gets a small share of one, and
        reading 100,000 events at once took most of a second of wall time,
        past the interval's end. The interval loop reads chunk after chunk
        and looks at the clock between them; a ring left unread overflows,
        and what it drops is counted (`lost`)."""
        assert self._ring is not None
        raw = self._raw_events
        # Decoded in bulk (perf_ring.drain_unpacked): tuples in EVENT_STRUCT order.
        self._ring.drain_unpacked(raw, EVENT_STRUCT, max_records=_READ_CHUNK)
        if not raw:
            return 0
        acc = self._event_acc
        if len(self._durations) < 65_536:  # for flood control: the rate's make-up
            self._durations.extend(r[1] for r in raw)
        watch = self.targets
        # Summed by who they are and who woke them; the waker's stacks (which
        # for an interrupt run through whatever it interrupted) are those of
        # the latest such block.
        for _end, delta, _cg, tgid, tid, us, ks, st, _cpu, comm, wt, wtid, wus, wks, what, _pad, \
                wcomm in raw:
            key = (tgid, tid, st, us, ks, wt, wtid, what)
            a = acc.get(key)
            if a is None:
                acc[key] = [delta, 1, delta, comm, wcomm, wus, wks]
            else:
                a[0] += delta
                a[1] += 1
                if delta > a[2]:
                    a[2] = delta
                a[5] = wus
                a[6] = wks
        if watch.any_reused:
            for key in [k for k in acc if not watch.accepts(k[0], k[1])]:
                del acc[key]
        tail = self._event_tail
        tail.extend(raw[-tail.maxlen:] if tail.maxlen else raw)
        n = len(raw)
        self._interval.events += n
        self._subtick_events += n
        self._events_total += n
        raw.clear()
        return n

    def _read_ring_out(self) -> None:
        """Read every event the ring holds now (at most its size: a flood does
        not keep this going).

        Run once targets were found gone: what they sent before they went
        (the long block that ended as a process exited, sent as it was woken)
        is in the ring by then, but may have come after the sub-tick's read.
        At an interval's last sub-tick nothing would read it before the run
        ended with "nothing left to watch", and the block was never told.
        And at a stop's last sub-tick, once the probe stopped recording: a
        flood's ring holds several chunks (256 pages a CPU: ~16,000 events on
        two CPUs), and what one read left was never read."""
        assert self._ring is not None
        # Each event takes more than its struct's bytes there.
        chunks = -(-self._ring.data_bytes // (_READ_CHUNK * EVENT_STRUCT.size))
        for _ in range(max(1, chunks)):
            if self._read_ring() < _READ_CHUNK:
                return

    def _read_new_stacks(self, *, see: bool = False) -> None:
        """Hand the user stacks the probe stored since the last call to the stack store.

        `see`: between sub-ticks, woken by the stack ring (its `wakeup_events`),
        the processes whose first stacks these are are seen at once
        (`StackStore.see_processes`): their program's unwinding rules taught
        before their threads block again, not a sub-tick later."""
        ring = self._stack_ring
        stacks = self.frames.stacks
        if ring is None or stacks is None:
            return
        records: list[bytes] = []
        ring.drain(records)
        if self._watch is not None:
            # After the stacks: a process maps its files before it blocks, so each
            # stack just read has its process's mapping records in by now.
            self._watch.read()
        if records:
            copies: list[StackCopy] = []
            new = new_user_stacks(records, depth=self.config.ustack_depth, copies=copies)
            self._new_since_drain += len(new)
            stacks.offer_user([(sid, raw) for sid, _tgid, raw in new])
            if len(self._new_stacks) < _NEW_STACKS_MAX:
                self._new_stacks.extend([(tgid, sid) for sid, tgid, _raw in new])
            if copies:
                stacks.offer_copies(copies)
            if see and not self.frames.gave_up():
                firsts = {tgid: raw for _sid, tgid, raw in new if raw}
                stacks.see_processes({tgid: record_addresses(raw)[0]
                                      for tgid, raw in firsts.items()},
                                     self.frames.start_if_alive)

    def _resolve_new_stacks(self, deadline: float) -> None:
        """Resolve the new user stacks waiting (`_new_stacks`) until the next sub-tick.

        Between two reads of the kernel's sums (`drain_s` apart), a new key is
        not seen; its user stack is, as the probe sends it (with its process).
        Resolved here, while the process lives, its frames are kept, and its
        rows find them there when the sums are read, even once it is gone (a
        process born and reaped within the second). A stack whose id another
        process had first is not sent again: a process that shares another's
        addresses and lives less than `drain_s` may lose its names, unless it was
        forked (and did not exec) from one that lives (offtop.bpf.lineage)."""
        pending = self._new_stacks
        user, start_of, clock = self.frames.user, self.frames.start_if_alive, self._clock
        done = 0
        # Until the next sub-tick is due, as rows are resolved (`_sum_rows`): past
        # `deadline`, only symbols already read are used (`StackStore.user`).
        for tgid, sid in pending:
            if done % _MIN_NEW_STACKS == 0 and (
                    self.frames.gave_up() or (done and clock() >= self._next_subtick)):
                break
            # A process gone before its first sight keeps nothing here: its rows
            # are resolved as they are read (in the process it was forked from).
            if start_of(tgid):
                user(tgid, sid, deadline)
            done += 1
        del pending[:done]

    def _subtick(self, now: float, *, last: bool = False) -> None:
        """Resolve what arrived since the last sub-tick, while processes live. `last`:
        the interval's last, whose cut its snapshot's costs are read at.

        The kernel's sums are read (drained) at the interval's last sub-tick, once
        `drain_s` passed since they were, when a target is found gone (its last
        blocks are its own), and, in a flood, when many new stacks came since or
        when the last read left rows unresolved; the other sub-ticks resolve the
        new stacks."""
        self._next_subtick = now + self.config.subtick_s
        deadline = self._deadline = now + self.config.symbol_budget_s
        self.frames.new_subtick()
        self._read_ring()
        lost = self.targets.check() if self.targets.configured else []
        if lost or (last and self.probe.stopped_at < math.inf):
            # Targets gone, or a stop's last interval (the probe recorded its last):
            # all the ring holds is theirs (`_read_ring_out`).
            self._read_ring_out()
        self._read_new_stacks()
        drain = (last or now >= self._next_drain or bool(lost)
                 or self._new_since_drain >= _FLOOD_NEW)
        drained = None
        if drain:
            self._next_drain = now + self.config.drain_s
            self._new_since_drain = 0
            # The kernel's sums are cut here, next to the ring's read: both end
            # the sub-tick at one moment, the one an interval's length is taken
            # from (or, once a stop came, the moment the probe stopped recording).
            self._cut_at = min(self._clock(), self.probe.stopped_at)
            drained = self.probe.drain_aggregates()
        if last:
            self._cut_counters = self.probe.counters()
            self._cut_cpu = SelfCost.cpu_s()
        self._read_new_stacks()  # after the rows: their stacks were sent before them
        covered = len(self._new_stacks)
        self._control_flood(now)
        self._targets_lost(lost)
        if self.frames.python is not None:
            self.frames.python.sample(self._blocked_record)
        self._resolve_long_blocks(deadline)
        if not self.frames.gave_up():
            self._cut_short.retry(self._interval.long_blocks, deadline)
        if drained is None:
            self._resolve_new_stacks(deadline)
        else:
            behind = self._interval.behind_rows
            new_keys = self._sum_drained(drained, deadline)
            self.frames.sums_read()
            # Resolved with the rows just read; those that came while they were
            # summed are of rows read next time.
            del self._new_stacks[:covered]
            if self._interval.behind_rows > behind or new_keys >= _FLOOD_NEW:
                # A flood: the next sub-tick reads again (rows left unresolved are
                # tried again at their next read: soon).
                self._next_drain = now

    def _sum_drained(self, drained: Drained, deadline: float) -> int:
        """Sum the kernel's sums just read, and the long blocks' events read since the
        last time, into this interval's rows; how many keys were new (`_sum_rows`)."""
        stacks = self.frames.stacks
        assert stacks is not None
        if stacks.at != self._known_at:
            # Ids were deleted (and may be handed out again): the rows that name
            # them are not carried (a reclaim deletes none of the interval's rows'
            # ids; a cleared cache, every row).
            freed = stacks.stale_ids(self._known_at)
            self._known_at = stacks.at
            for kept in self._known.values():
                if freed is None or kept.kstack in freed or kept.wks in freed:
                    kept.final = False
        seq = self._seq + 1  # the interval being summed
        new_keys = self._sum_rows(drained.keys, drained.sums, drained.row, False, deadline, seq)
        if self._event_acc:
            keys, sums, raws = [], [], []
            for ekey, (tot, cnt, mx, comm, wcomm, wus, wks) in self._event_acc.items():
                tgid, tid, st, us, ks, wt, wtid, what = ekey
                keys.append(agg_key(tgid, tid, st, us, ks, wt, wtid, what) + b"\x01")  # apart
                sums.append((tot, mx, cnt, comm, wus, wks))
                raws.append((tgid, tid, st, us, ks, tot, cnt, mx, comm,
                             (wt, wtid, wus, wks, what, wcomm)))
            new_keys += self._sum_rows(keys, sums, raws.__getitem__, True, deadline, seq)
            self._event_acc = {}
        return new_keys

    def _resolve_long_blocks(self, deadline: float) -> None:
        """The long blocks read since the last sub-tick, each resolved whole."""
        if self._event_tail:
            iv = self._interval
            wall = self._mono_to_wall
            # Each CPU's ring is in order; merge them by end time.
            for ev in sorted(self._event_tail):
                end_ns, delta, cg, tgid, tid, us, ks, st, _cpu, comm = ev[:10]
                if not self.targets.accepts(tgid, tid):
                    continue
                kernel, user, before = self.frames.frames_of(tgid, tid, st, us, ks, deadline,
                                                       ts=end_ns - delta)
                wt, wtid, wus, wks, what, _pad, wcomm = ev[10:]
                block = LongBlock(
                    time=end_ns / 1e9 + wall, pid=tgid, tid=tid, comm=decode_comm(comm),
                    state=state_name(st), duration_ns=delta, kernel=kernel, user=user,
                    cgroup_id=cg, before_start=before,
                    waker=self._wakers.waker((wt, wtid, wus, wks, what, wcomm)),
                )
                iv.long_blocks.append(block)
                if any(f.unknown for f in user):
                    self._note_cut_short(block, us)
            self._event_tail.clear()

    def _note_cut_short(self, block: LongBlock, sid: int) -> None:
        """`block`'s user frames lack names: resolved again at the next sub-ticks if
        their resolving ran out of time, they are the stack store's (not an
        unwinder's, nor merged with Python frames) and the process lives
        (offtop.bpf.cut_short)."""
        stacks = self.frames.stacks
        start = self.frames.start_if_alive(block.pid)
        if (stacks is not None and start and stacks.short_of_time(block.pid, start, sid)
                and stacks.kept_user(block.pid, start, sid) is block.user):
            self._cut_short.note(block, start, sid)

    def _user_again(self, pid: int, start: int, sid: int, deadline: float
                    ) -> tuple[tuple[Frame, ...], bool]:
        assert self.frames.stacks is not None
        return self.frames.stacks.user_again(pid, start, sid, deadline=deadline)

    def _sum_rows(self, keys: list[bytes], sums: list[RawSums], row_of: Callable[[int], RawRow],
                  event: bool, deadline: float, seq: int) -> int:
        """Sum rows into interval `seq`'s (`_known`): row i has key `keys[i]`, sums
        `sums[i]` and, decoded whole, `row_of(i)` (asked only for a key not summed
        this interval). A key summed before this interval is carried (see _Row),
        else resolved. `event`: long blocks' rows, never collapsed at a stop and
        already checked against the targets (`_read_ring`). Returns how many keys
        were new (neither summed this interval nor carried)."""
        rows = self._known
        accepts = self.targets.accepts
        comms = self._comms
        new_keys = carried = resolved = 0
        carries = self._carry_verdicts()
        interrupt_waker = self._rows.interrupt_wakers()
        for lo in range(0, len(keys), _STOP_CHECK_ROWS):
            # Asked once a chunk, not per row: once a stop came and its time to
            # resolve is over, or once the next sub-tick is due (offtop is
            # behind: new stacks come faster than it resolves them), the rest
            # of the sub-tick's new rows take only what is kept
            # (`_unresolved_row`). So the work of a sub-tick is bounded, and a
            # flood of new stacks neither stretches the intervals nor grows the
            # rows without end; a key left unresolved is tried again at its
            # next drain. Behind, the first _MIN_NEW_ROWS new rows of a read
            # are still resolved, wherever they are in it: the keys come in the
            # map's order, and those left past a sub-tick's worth of carried
            # rows were never reached. Long blocks' rows are always resolved.
            stopping = not event and self.frames.gave_up()
            behind = not event and not stopping and self._clock() >= self._next_subtick
            if lo:
                # Resolving a flood of new rows takes long: the ring of new
                # stacks is read meanwhile too, or it overflows.
                self._read_new_stacks()
            hi = lo + _STOP_CHECK_ROWS
            for i, key, (total, mx, count, comm, wus, wks) in zip(
                    range(lo, hi), keys[lo:hi], sums[lo:hi], strict=False):
                row = rows.get(key)
                if row is not None:
                    if row.seq == seq:
                        row.offcpu_ns += total
                        row.count += count
                        if mx > row.max_ns:
                            row.max_ns = mx
                        continue
                    if row.final and carries(row):
                        if wus != row.wus or wks != row.wks:
                            # An interrupt's kept waker is found without decoding the row.
                            w = interrupt_waker(row.what, wks)
                            if w is not None:
                                row.waker, row.wus, row.wks = w, wus, wks
                            else:
                                self._new_waker(row, row_of(i)[9], stopping)
                        text = comms.get(comm)
                        if text is None:
                            text = self._comm_text(comm)
                        row.seq, row.offcpu_ns, row.count, row.max_ns, row.comm = \
                            seq, total, count, mx, text
                        carried += 1
                        continue
                r = row_of(i)
                if not (event or accepts(r[0], r[1])):
                    continue
                new_keys += 1
                if stopping or (behind and resolved >= _MIN_NEW_ROWS):
                    if self._unresolved_row(key, r, seq, stopping) and behind:
                        self._interval.behind_rows += 1
                else:
                    resolved += 1
                    rows[key] = self._row(r, event, seq, self._rows.resolve(*r[:5], r[9],
                                                                            deadline))
        self.carried += carried
        return new_keys

    def _unresolved_row(self, key: bytes | tuple[int, ...], raw: RawRow, seq: int,
                        stopping: bool) -> bool:
        """A new summed row with no time to resolve it (a stop is coming, or offtop is
        behind): with its frames if they are kept (`RowFrames.kept`), else summed per
        thread and state, its stacks not resolved. True in the second case."""
        tgid, tid, st, us, ks, total, count, mx, comm, waker = raw
        kept = self._rows.kept(tgid, tid, st, us, ks, waker)
        if kept is not None:
            self._known[key] = self._row(raw, False, seq, kept)
            return False
        sid, user = (UNRESOLVED_ID, _NOT_RESOLVED) if stopping else (BEHIND_ID, _BEHIND)
        key = (tgid, tid, st, sid)
        row = self._known.get(key)
        if row is not None and row.seq == seq:
            row.offcpu_ns += total
            row.count += count
            row.max_ns = max(row.max_ns, mx)
            return True
        state, before = state_name(st), bool(st & ST_BEFORE_START)
        self._known[key] = _Row(total, count, mx, self._comm_text(comm), (), user, before, None,
                                self.frames.start_of(tgid), tgid, tid, st, state, sid, sid, False,
                                seq, self.aggregator.groups.number(tid, state, before, (), user))
        return True

    def _control_flood(self, now: float) -> None:
        seconds = now - self._last_subtick
        self._last_subtick = now
        with self._lock:
            new = self.flood.observe(self._subtick_events, self._durations, seconds,
                                     self._user_threshold_ns)
            if new is not None:
                self.probe.set_threshold(new)
        self._subtick_events = 0
        self._durations.clear()

    def _targets_lost(self, lost: list[str]) -> None:
        """Targets found gone (`TargetWatch.check`'s notices): said, and forgotten by the
        probe (after their last sums were read)."""
        if not lost:
            return
        self._interval.notices.extend(lost)
        for pid in self.targets.gone_pids:
            self.probe.forget_target(pid=pid)
        for tid in self.targets.gone_tids:
            self.probe.forget_target(tid=tid)
        if not self.targets.anything_left:
            self._finished = "nothing left to watch: " + "; ".join(
                [*self._interval.notices])

    def _row(self, raw: RawRow, event: bool, seq: int, resolved: Resolved) -> _Row:
        """The row of `raw`'s sums, with its resolution (and its group's number)."""
        tgid, tid, st, us, ks, total, count, mx, comm, waker = raw
        kernel, user, before, w, start, final = resolved
        state = state_name(st)
        return _Row(total, count, mx, self._comm_text(comm), kernel, user, before, w, start, tgid,
                    tid, st, state, us, ks, event, seq,
                    self.aggregator.groups.number(tid, state, before, kernel, user),
                    final, waker[2], waker[3], waker[4])

    def _comm_text(self, comm: bytes) -> str:
        """A raw comm decoded (`decode_comm`), remembered: the same few come back at
        every interval."""
        comms = self._comms
        text = comms.get(comm)
        if text is None:
            if len(comms) > 100_000:
                comms.clear()
            text = comms[comm] = decode_comm(comm)
        return text

    def _carry_verdicts(self) -> Callable[[_Row], bool]:
        """Whether last interval's final row still holds for this one (see _Row), for
        the rows of one read: what decides it is asked once per process, not per row
        (a busy server's read carries ~8,000 rows of a few dozen processes). Start
        times hold for a sub-tick (`BlockFrames.new_subtick`), a read's rows are
        summed within one."""
        frames, targets = self.frames, self.targets
        python = frames.python
        by_tgid: dict[int, int] = {}  # tgid -> the start time its rows carry at, else -1

        def start_carried(tgid: int) -> int:
            start = frames.start_of(tgid)
            # Found to be Python since: its frames change per sample.
            if python is not None and python.is_python(tgid):
                start = -1
            by_tgid[tgid] = start
            return start

        # A target's id found naming another task: its rows are asked for one by one.
        accepts = targets.accepts if targets.any_reused else None

        def carries(row: _Row) -> bool:
            start = by_tgid.get(row.pid)
            if start is None:
                start = start_carried(row.pid)
            return start == row.start and (accepts is None or accepts(row.pid, row.tid))

        return carries

    def _new_waker(self, row: _Row, raw: RawWaker, stopping: bool) -> None:
        """A carried row's waker, resolved again: its stacks are not the ones it had
        (once a stop's time to resolve is over, only as kept: `RowFrames.kept_waker`)."""
        rows = self._rows
        row.waker, row.final = rows.kept_waker(raw) if stopping else rows.waker(raw)
        row.wus, row.wks = raw[2], raw[3]

    # --- the snapshot -------------------------------------------------------

    def _blocked_record(self, tid: int) -> tuple[int, int] | None:
        """(switch-out time, user stack id) of a thread blocked now; None if it runs."""
        rec = self.probe.record_of(tid)
        if rec is None or not rec.ts:
            return None
        return rec.ts, rec.ustack

    def blocked_waits(self, tids: Iterable[int]) -> Mapping[int, int]:
        """How long each of `tids` has been blocked now (absent: running again).

        Reads the mapped per-thread records only: cheap enough for the UI to
        call between snapshots, so that waits shown never outgrow the truth.
        """
        if self._ring is None:
            return {}
        now = time.monotonic_ns()
        out = {}
        for tid in tids:
            rec = self.probe.record_of(tid)
            if rec is not None and rec.ts:
                out[tid] = now - rec.ts
        return out

    def _build(self, elapsed: float) -> Snapshot:
        stacks, python, procinfo = self.frames.stacks, self.frames.python, self._procinfo
        assert stacks is not None and self._ring is not None and procinfo is not None
        self._seq += 1
        stacks.next_interval(self._seq)
        self._rows.next_interval()
        self._wakers.next_interval()
        assert self._blocked is not None
        self._read_new_stacks()
        blocked, live = self.frames.blocked_now(
            self._blocked, self.targets.watching, symbol_budget_s=self.config.symbol_budget_s,
            unwind_budget_s=self.config.unwind_budget_s)
        counters = self._cut_counters
        stack_errors, drops = _errors_by_cause(counters)
        probe_ns, probe_runs = self._stats.interval_result(counters)
        lost_total = self._ring.lost
        lost = lost_total - self._lost_seen
        self._lost_seen = lost_total
        iv = self._interval
        self._interval = _Interval(long_blocks=deque(maxlen=self.config.long_blocks_max))
        self._cut_short.clear()
        seq = self._seq
        # This interval's rows; the others were not seen in it and are dropped.
        rows = self._known = {k: r for k, r in self._known.items() if r.seq == seq}
        # Their ids stay in use (not reclaimed), carried rows' as resolved ones'.
        kept = rows.values()
        stacks.touch_all([r.kstack for r in kept] + [r.wks for r in kept],
                         [r.ustack for r in kept] + [r.wus for r in kept])
        cpu_pct, rss = self._self_cost.interval(elapsed, self._cut_cpu)
        st = stacks.stats
        usyms = self._usyms
        stats = CaptureStats(
            events=iv.events,
            lost=lost,
            events_total=self._events_total,
            lost_total=lost_total,
            stack_errors=stack_errors,
            drops=drops,
            truncated_stacks=st.truncated,
            symbol_misses=usyms.misses if usyms else 0,
            agg_entries=len(rows),
            stacks_used=stacks.used,
            stacks_capacity=self.config.stack_entries + self.config.ustack_entries,
            stacks_reclaimed=st.reclaimed,
            probe_run_ns=probe_ns,
            probe_runs=probe_runs,
            interval_s=elapsed,
            flood_threshold_ns=self.flood.floor_ns,
            symbol_deadline_misses=st.symbol_deadline_misses,
            depth_limited_stacks=st.depth_limited,
            user_stacks_lost=st.user_lost,
            behind_rows=iv.behind_rows,
            symbol_errors=dict(getattr(usyms, "errors", {}) or {}),
            offtop_cpu_pct=cpu_pct,
            offtop_rss_bytes=rss,
            python_failures=dict(python.failures) if python is not None else {},
        )
        stacks.reclaim(live)
        # What belongs to processes gone is let go at the sweeps: the stack
        # store's, the symbols' and the totals'. Each process's start time is
        # read once for all of them (they know the same processes).
        start_time = functools.cache(task_start_time)
        sweep = self._seq % stacks.SWEEP_INTERVALS == 0
        if sweep and usyms is not None:
            usyms.evict(start_time=start_time)
        stacks.trim(start_time)
        groups = self.aggregator.groups
        groups.start_build()
        if groups.generation != self._groups_generation:
            # Every number was forgotten (StackGroups' bound): each row asks again.
            self._groups_generation = groups.generation
            number = groups.number
            for r in kept:
                r.group = number(r.tid, r.state, r.before_start, r.kernel, r.user)
        snap = self.aggregator.build_grouped(
            kept,
            time=time.time(),
            interval_s=elapsed,
            threshold_ns=self._user_threshold_ns,
            long_blocks=iv.long_blocks,
            blocked_now=blocked,
            stats=stats,
            process_meta=procinfo.user_and_cmdline,
            notices=iv.notices,
            finished=self._finished,
        )
        if sweep:
            self.aggregator.forget_gone(start_time)
            self._forget_gone(start_time)
            trim_heap()
        return snap

    def _forget_gone(self, start_time: Callable[[int], int | None]) -> None:
        """What the unwinder, the Python stack reader, the blocks unwound and the
        process metadata keep about processes gone. Each was bounded by a count
        only (1,024 to 8,192 processes): under churn (3 processes a second) the
        TUI's memory grew with them, past 150 MB within a minute or two."""
        frames = self.frames
        if frames.unwound is not None:
            frames.unwound.forget_gone(start_time)
        if frames.python is not None:
            frames.python.forget_gone(start_time)
        if self._unwinder is not None:
            self._unwinder.forget_gone(start_time)
        if self._procinfo is not None:
            self._procinfo.forget_gone(start_time)


def _errors_by_cause(c: Mapping[str, int]) -> tuple[dict[str, int], dict[str, int]]:
    """The probe's counters as (stack id failures, drops), by cause, zeros left out."""
    stack_errors = {
        cause: c[name]
        for cause, name in (
            ("user EFAULT", "ustack_efault"), ("user ENOMEM", "ustack_enomem"),
            ("user EEXIST", "ustack_eexist"), ("user other", "ustack_other"),
            ("kernel EFAULT", "kstack_efault"), ("kernel ENOMEM", "kstack_enomem"),
            ("kernel EEXIST", "kstack_eexist"), ("kernel other", "kstack_other"),
        )
        if c[name]
    }
    drops = {
        label: c[name]
        for label, name in (("start map full", "start_full"),
                            ("aggregate map full", "agg_full"),
                            ("perf output failed", "output_fail"),
                            # Blocks whose end (switch-in) the kernel ran
                            # without the probe (offcpu.c on_switch_out).
                            ("block ends unseen", "end_unseen"))
        if c[name]
    }
    return stack_errors, drops


_SELF_PID = os.getpid()
