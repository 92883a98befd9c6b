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

import resource
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from offtop.bpf import environment
from offtop.bpf.blocked import BlockedNowReader
from offtop.bpf.compiler_memory import release_compiler_memory
from offtop.bpf.config import EngineConfig, EngineError
from offtop.bpf.decode import EVENT_STRUCT, decode_comm, state_name
from offtop.bpf.flood import FloodControl
from offtop.bpf.perf_ring import PerfRing
from offtop.bpf.probe import Probe
from offtop.bpf.probe_stats import ProbeStats
from offtop.bpf.stack_store import StackStore
from offtop.model import Aggregator, BlockedNow, CaptureStats, LongBlock, Sample, Snapshot
from offtop.procinfo import ProcessInfoCache
from offtop.safe_text import decode
from offtop.source import SourceInfo, local_info
from offtop.symbols import KernelSymbols, UserSymbols
from offtop.targets import TargetWatch, task_start_time

__all__ = ["BpfSource", "EngineConfig", "EngineError"]

#: The largest threshold the kernel map accepts (offtop.units bounds what users type).
MAX_THRESHOLD_NS = 1 << 62

# A raw row, stacks still ids: (tgid, tid, state, ustack, kstack).
_RawKey = tuple[int, int, int, int, int]


@dataclass(slots=True)
class _Interval:
    """What accumulates between two snapshots (resolved at each sub-tick)."""

    samples: list[Sample] = field(default_factory=list)
    long_blocks: deque[LongBlock] = field(default_factory=deque)
    events: int = 0
    notices: list[str] = field(default_factory=list)


class _SelfCost:
    """offtop's own CPU time and resident memory, per interval."""

    def __init__(self) -> None:
        self._cpu = self._cpu_s()

    @staticmethod
    def _cpu_s() -> float:
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime

    def interval(self, elapsed: float) -> tuple[float, int]:
        """(% of one core since the last call, RSS bytes now)."""
        cpu = self._cpu_s()
        pct = 100.0 * (cpu - self._cpu) / elapsed if elapsed > 0 else 0.0
        self._cpu = cpu
        try:
            with open("/proc/self/statm", "rb") as f:
                rss = int(f.read().split()[1]) * resource.getpagesize()
        except (OSError, ValueError, IndexError):
            rss = 0
        return pct, rss


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
    ) -> None:
        self.config = config
        self._clock = clock
        self._user_threshold_ns = config.threshold_ns
        self.aggregator = aggregator or Aggregator()
        self._ksyms = kernel_symbols
        self._usyms = user_symbols
        self._procinfo = process_info or ProcessInfoCache()
        self.probe = Probe(config)
        self.flood = FloodControl(config.event_budget_per_s)
        self.targets = TargetWatch(config.pids, config.tids, config.cgroup)
        self.stacks: StackStore | None = None
        self._ring: PerfRing | None = None
        self._blocked: BlockedNowReader | None = None
        self._stats: ProbeStats | None = None
        self._self_cost = _SelfCost()
        self._lock = threading.Lock()  # the threshold, set from the UI thread
        self._raw_events: list[tuple[Any, ...]] = []
        self._event_acc: dict[_RawKey, list[Any]] = {}
        self._event_tail: deque[tuple[Any, ...]] = deque(maxlen=config.long_blocks_max)
        self._durations: list[int] = []  # a sample of this sub-tick's event durations
        self._subtick_events = 0
        self._interval = _Interval(long_blocks=deque(maxlen=config.long_blocks_max))
        self._last_tick = 0.0
        self._last_subtick = 0.0
        self._next_subtick = 0.0
        self._lost_seen = 0
        self._events_total = 0
        self._starts: dict[int, int] = {}  # pid -> start time, valid for one sub-tick
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
            self._ring = PerfRing(self.probe.set_perf_fd, pages=cfg.perf_pages,
                                  wakeup_events=cfg.wakeup_events)
            # The program records nothing until its maps are set and every
            # CPU's ring is in place (else its first events would fail).
            self.probe.arm()
        except Exception:
            self.close()
            raise
        if self._ksyms is None and cfg.kernel_stacks:
            self._ksyms = KernelSymbols()
        if self._usyms is None and cfg.user_stacks:
            self._usyms = UserSymbols()
        self.stacks = StackStore(self.probe, kernel_symbols=self._ksyms,
                                 user_symbols=self._usyms,
                                 capacity={"k": cfg.stack_entries, "u": cfg.ustack_entries},
                                 kernel_depth=cfg.kstack_depth, user_depth=cfg.ustack_depth)
        self._blocked = BlockedNowReader(self.probe, min_ns=cfg.blocked_min_ns,
                                         limit=cfg.blocked_max)
        self._stats = ProbeStats(self.probe.prog_fd, window_s=cfg.stats_window_s,
                                 clock=self._clock)
        self._interval.notices.extend(self.targets.initially_gone())
        release_compiler_memory()
        now = self._clock()
        self._last_tick = self._last_subtick = now
        self._next_subtick = now + cfg.subtick_s

    def next_snapshot(self, interval_s: float, stop: Any) -> Snapshot | None:
        """Poll the ring until the interval ends, then build its snapshot."""
        if self._ring is None or self._stats is None:
            raise EngineError("the engine is not started")
        if self._finished and self._seq > 0:
            return None  # the last snapshot said why: nothing is left to watch
        if self._seq == 0 and interval_s > 0:
            # The first snapshot comes early so users see data at once; its
            # interval_s says how long it really covered.
            interval_s = min(interval_s, self.config.first_interval_s)
        end = self._last_tick + interval_s
        self._stats.start_interval(self._last_tick, interval_s)
        now = self._clock()
        if end < now - interval_s:  # fell far behind (e.g. the process was stopped)
            end = now
        while not stop.is_set():
            now = self._clock()
            if now >= end:
                break
            if now >= self._next_subtick:
                self._subtick(now)
                now = self._clock()
                if now >= end:
                    break
            self._ring.wait(min(0.05, end - now, max(0.0, self._next_subtick - now)))
            self._read_ring()
            self._stats.poll(self._clock())
        if stop.is_set():
            return None
        now = self._clock()
        self._subtick(now)
        now = self._clock()
        elapsed = max(1e-9, now - self._last_tick)
        self._last_tick = now
        return self._build(elapsed)

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
        if self._ring is not None:
            self._ring.close()
            self._ring = None
        if self._usyms is not None:
            self._usyms.close()
        self.probe.close()
        if self._stats is not None:
            self._stats.close()

    # --- the interval loop --------------------------------------------------

    def _read_ring(self) -> None:
        """Drain the perf ring (bounded) and sum its events by key, raw."""
        assert self._ring is not None
        raw = self._raw_events
        # Decoded in bulk (perf_ring.drain_unpacked): tuples in EVENT_STRUCT order.
        budget = max(1024, self.config.event_budget_per_s or 262_144)
        self._ring.drain_unpacked(raw, EVENT_STRUCT, max_records=budget)
        if not raw:
            return
        acc = self._event_acc
        if len(self._durations) < 65_536:  # for flood control: the rate's make-up
            self._durations.extend(r[1] for r in raw)
        watch = self.targets
        for _end_ns, delta, _cg, tgid, tid, us, ks, st, _cpu, comm in raw:
            key = (tgid, tid, st, us, ks)
            a = acc.get(key)
            if a is None:
                acc[key] = [delta, 1, delta, comm]
            else:
                a[0] += delta
                a[1] += 1
                if delta > a[2]:
                    a[2] = delta
        if watch.gone_pids or watch.gone_tids:
            for key in [k for k in acc if not watch.accepts(k[0], k[1])]:
                del acc[key]
        tail = self._event_tail
        tail.extend(raw[-tail.maxlen:] if tail.maxlen else raw)
        self._interval.events += len(raw)
        self._subtick_events += len(raw)
        self._events_total += len(raw)
        raw.clear()

    def _subtick(self, now: float) -> None:
        """Resolve what arrived since the last sub-tick, while processes live."""
        self._next_subtick = now + self.config.subtick_s
        deadline = now + self.config.symbol_budget_s
        self._starts.clear()
        self._read_ring()
        self._control_flood(now)
        self._check_targets()
        iv = self._interval
        for row in self.probe.drain_aggregates():
            tgid, tid, st, us, ks, total, count, mx, comm = row
            if self.targets.accepts(tgid, tid):
                iv.samples.append(self._sample(tgid, tid, st, us, ks, total, count, mx, comm,
                                               False, deadline))
        if self._event_acc:
            for (tgid, tid, st, us, ks), (tot, cnt, mx, comm) in self._event_acc.items():
                iv.samples.append(self._sample(tgid, tid, st, us, ks, tot, cnt, mx, comm, True,
                                               deadline))
            self._event_acc = {}
        if self._event_tail:
            wall = self._mono_to_wall
            # Each CPU's ring is in order; merge them by end time.
            for end_ns, delta, cg, tgid, tid, us, ks, st, _cpu, comm in sorted(self._event_tail):
                if not self.targets.accepts(tgid, tid):
                    continue
                iv.long_blocks.append(LongBlock(
                    time=end_ns / 1e9 + wall, pid=tgid, tid=tid, comm=decode_comm(comm),
                    state=state_name(st), duration_ns=delta, kernel=self._kernel(ks),
                    user=self._user(tgid, us, deadline), cgroup_id=cg,
                ))
            self._event_tail.clear()

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

    def _check_targets(self) -> None:
        if not self.targets.configured:
            return
        lost = self.targets.check()
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

    def _start_of(self, pid: int) -> int:
        start = self._starts.get(pid)
        if start is None:
            start = self._starts[pid] = task_start_time(pid) or 0
        return start

    def _sample(self, tgid: int, tid: int, st: int, us: int, ks: int, total: int,
                count: int, mx: int, comm: bytes, from_event: bool, deadline: float) -> Sample:
        return Sample(
            pid=tgid, tid=tid, comm=decode_comm(comm), state=state_name(st),
            offcpu_ns=int(total), count=int(count), max_ns=int(mx),
            kernel=self._kernel(ks), user=self._user(tgid, us, deadline),
            from_event=from_event, start=self._start_of(tgid),
        )

    def _kernel(self, sid: int) -> tuple[Any, ...]:
        assert self.stacks is not None
        return self.stacks.kernel(sid)

    def _user(self, pid: int, sid: int, deadline: float | None) -> tuple[Any, ...]:
        assert self.stacks is not None
        return self.stacks.user(pid, self._start_of(pid), sid, deadline=deadline)

    # --- the snapshot -------------------------------------------------------

    def blocked_waits(self, tids: Iterable[int]) -> Mapping[int, int]:
        """How long each of `tids` has been blocked now (absent: running again).

        Reads the mapped per-thread records only: cheap enough for the UI to
        call between snapshots, so that waits shown never outgrow the truth.
        """
        if self._ring is None:
            return {}
        want = set(tids)
        now = time.monotonic_ns()
        return {tid: now - v.ts for tid, v, _ in self.probe.thread_records()
                if tid in want and v.ts}

    def _blocked_now(self) -> tuple[list[BlockedNow], set[tuple[str, int]]]:
        assert self._blocked is not None
        rows, live = self._blocked.read()
        deadline = self._clock() + self.config.symbol_budget_s
        out = []
        for b in rows:
            if not self.targets.accepts(b.pid, b.tid):
                continue
            out.append(BlockedNow(
                pid=b.pid, tid=b.tid, comm=_comm_of(b.pid, b.tid), state=state_name(b.state),
                blocked_ns=b.waited_ns, kernel=self._kernel(b.kstack),
                user=self._user(b.pid, b.ustack, deadline),
            ))
        return out, live

    def _build(self, elapsed: float) -> Snapshot:
        assert self.stacks is not None and self._ring is not None and self._stats is not None
        self._seq += 1
        self.stacks.next_interval(self._seq)
        blocked, live = self._blocked_now()
        c = self.probe.counters()
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
                                ("perf output failed", "output_fail"))
            if c[name]
        }
        probe_ns, probe_runs = self._stats.interval_result(elapsed)
        lost_total = self._ring.lost
        lost = lost_total - self._lost_seen
        self._lost_seen = lost_total
        iv = self._interval
        self._interval = _Interval(long_blocks=deque(maxlen=self.config.long_blocks_max))
        cpu_pct, rss = self._self_cost.interval(elapsed)
        st = self.stacks.stats
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
            agg_entries=len(iv.samples),
            stacks_used=self.stacks.used,
            stacks_capacity=self.config.stack_entries + self.config.ustack_entries,
            stacks_reclaimed=st.reclaimed,
            probe_run_ns=probe_ns,
            probe_runs=probe_runs,
            interval_s=elapsed,
            flood_threshold_ns=self.flood.floor_ns,
            symbol_deadline_misses=st.symbol_deadline_misses,
            depth_limited_stacks=st.depth_limited,
            user_stacks_lost=st.user_lost,
            symbol_errors=dict(getattr(usyms, "errors", {}) or {}),
            offtop_cpu_pct=cpu_pct,
            offtop_rss_bytes=rss,
        )
        self.stacks.reclaim(live)
        if usyms is not None and self._seq % 10 == 0:
            usyms.evict()
        self.stacks.trim()
        return self.aggregator.build(
            iv.samples,
            time=time.time(),
            interval_s=elapsed,
            threshold_ns=self._user_threshold_ns,
            long_blocks=iv.long_blocks,
            blocked_now=blocked,
            stats=stats,
            process_meta=self._procinfo.user_and_cmdline,
            notices=iv.notices,
            finished=self._finished,
        )


def _comm_of(pid: int, tid: int) -> str:
    # A comm is whatever bytes the task set (prctl PR_SET_NAME): not UTF-8.
    try:
        with open(f"/proc/{pid}/task/{tid}/comm", "rb") as f:
            return decode(f.read(64).removesuffix(b"\n"))
    except OSError:
        return "?"
