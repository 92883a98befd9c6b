"""The live source: loads offcpu.c, drains its maps and ring, builds snapshots.

Data flows one way: kernel maps and perf ring -> decode -> symbols -> model.
Everything here runs in one thread (the app's worker, or batch mode's main
thread); only `set_threshold` may be called from another thread, and it is a
single map write.
"""

from __future__ import annotations

import contextlib
import ctypes as ct
import mmap
import os
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from offtop.bpf import environment
from offtop.bpf.compiler_memory import release_compiler_memory
from offtop.bpf.decode import (
    COUNTERS,
    DEFAULT_STATES,
    EVENT_STRUCT,
    AccRecord,
    StartRecord,
    decode_comm,
    free_slot,
    generation_sums,
    owned_slots,
    state_mask,
    state_name,
)
from offtop.bpf.perf_ring import PerfRing
from offtop.model import Aggregator, BlockedNow, CaptureStats, Frame, LongBlock, Sample, Snapshot
from offtop.procinfo import ProcessInfoCache
from offtop.safe_text import decode
from offtop.source import SourceInfo, local_info
from offtop.symbols import KernelSymbols, UserSymbols, process_start_time

PROBE_FUNCTION = b"tracepoint__sched__sched_switch"
_BPF_ENABLE_STATS = 32
_BPF_STATS_RUN_TIME = 0
_SYS_BPF = 321  # x86_64; other arches fall back to no probe stats

# A raw aggregate row, stacks still ids: (tgid, tid, state, ustack, kstack).
_RawKey = tuple[int, int, int, int, int]


class EngineError(RuntimeError):
    """The engine could not start; the message is one line for users."""


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Everything fixed for a run; only the threshold changes while running."""

    threshold_ns: int = 500_000_000
    states: str = DEFAULT_STATES
    kthreads: bool = False
    user_stacks: bool = True
    kernel_stacks: bool = True
    pids: tuple[int, ...] = ()
    tids: tuple[int, ...] = ()
    cgroup: str | None = None
    stack_entries: int = 16_384
    start_entries: int = 65_536
    agg_entries: int = 65_536
    kstack_depth: int = 48
    ustack_depth: int = 127
    perf_pages: int = 256
    wakeup_events: int = 64
    subtick_s: float = 0.25
    first_interval_s: float = 0.5
    # BPF run-time stats cost every program on the machine two clock reads per
    # run (measured: +68 ns per context switch), so they are on only for
    # stats_window_s in the middle of each interval and scaled (0: always on).
    stats_window_s: float = 0.1
    blocked_min_ns: int = 5_000_000
    blocked_max: int = 200
    long_blocks_max: int = 1_000
    exclude_self: bool = True
    scope: str = field(default="", compare=False)

    def cflags(self) -> list[str]:
        """The -D flags for offcpu.c: validated integers only, never user text."""
        ints = {
            "OFFTOP_STATE_MASK": state_mask(self.states),
            "OFFTOP_KTHREADS": int(self.kthreads),
            "OFFTOP_USER_STACKS": int(self.user_stacks),
            "OFFTOP_KERNEL_STACKS": int(self.kernel_stacks),
            "OFFTOP_FILTER_PID": int(bool(self.pids or self.tids)),
            "OFFTOP_FILTER_TID": int(bool(self.pids or self.tids)),
            "OFFTOP_FILTER_CGROUP": int(self.cgroup is not None),
            "OFFTOP_SELF_TGID": os.getpid() if self.exclude_self else 0,
            "OFFTOP_STACK_ENTRIES": self.stack_entries,
            "OFFTOP_SLOTS": self.start_entries,
            "OFFTOP_AGG_ENTRIES": self.agg_entries,
            "OFFTOP_KSTACK_DEPTH": self.kstack_depth,
            "OFFTOP_USTACK_DEPTH": self.ustack_depth,
        }
        for name, v in ints.items():
            if not isinstance(v, int) or isinstance(v, bool) or v < 0 or v > 1 << 24:
                raise ValueError(f"{name}={v!r} is not a valid setting")
        return [f"-D{k}={v}" for k, v in ints.items()]

    @property
    def stack_mode(self) -> str:
        """A short label: kernel+user, kernel, user or none."""
        parts = [n for n, on in (("kernel", self.kernel_stacks), ("user", self.user_stacks)) if on]
        return "+".join(parts) or "no stacks"


@dataclass(slots=True)
class _Interval:
    """What accumulates between two snapshots (resolved at each sub-tick)."""

    samples: list[Sample] = field(default_factory=list)
    long_blocks: deque[LongBlock] = field(default_factory=deque)
    events: int = 0


class BpfSource:
    """The real source: a BPF program on sched:sched_switch (see offcpu.c)."""

    def __init__(self, config: EngineConfig, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self._clock = clock
        self._threshold_ns = config.threshold_ns
        self._bpf: Any = None
        self._tables: dict[str, Any] = {}
        self._slots_mm: mmap.mmap | None = None
        self._acc_mm: mmap.mmap | None = None
        self._ring: PerfRing | None = None
        self._ksyms: KernelSymbols | None = None
        self._usyms: UserSymbols | None = None
        self._agg = Aggregator()
        self._procinfo = ProcessInfoCache()
        self._gen = 0
        self._raw_events: list[tuple[Any, ...]] = []
        self._event_acc: dict[_RawKey, list[Any]] = {}
        self._event_tail: deque[tuple[Any, ...]] = deque(maxlen=config.long_blocks_max)
        self._interval = _Interval(long_blocks=deque(maxlen=config.long_blocks_max))
        self._last_tick = 0.0
        self._next_subtick = 0.0
        self._stats_fd = -1
        self._prog_fd = -1
        self._prev_run = (0, 0)
        self._stats_on_at = 0.0
        self._stats_open_at = 0.0  # when this interval's sampling window opens
        self._stats_opened = False  # this interval's window was opened
        self._stats_window: tuple[int, int, float] | None = None  # (run_ns, runs, seconds)
        self._lost_seen = 0
        self._events_total = 0
        self._stack_last_use: dict[tuple[str, int], int] = {}
        self._stack_frames: dict[tuple[str, int, int, int], tuple[Frame, ...]] = {}
        self._starts: dict[int, int] = {}  # pid -> start time, valid for one sub-tick
        self._stacks_reclaimed = 0
        self._truncated = 0
        self._seq = 0
        self._mono_to_wall = time.time() - time.monotonic()
        self._closed = False

    # --- SnapshotSource -----------------------------------------------------

    @property
    def info(self) -> SourceInfo:
        return local_info("bpf", scope=self.config.scope or "all tasks", stacks=self.config.stack_mode)

    @property
    def threshold_ns(self) -> int:
        return self._threshold_ns

    def start(self) -> None:
        """Check the machine, compile and attach offcpu.c, open the ring."""
        environment.prepare()
        from bcc import BPF  # after prepare(): bcc picks tracefs and headers at import

        src = resources.files("offtop.bpf").joinpath("offcpu.c").read_text()
        try:
            with environment.captured_stderr() as log:
                self._bpf = BPF(text=src, cflags=self.config.cflags())
        except Exception as e:  # bcc raises bare Exception on compile/load/attach errors
            raise EngineError(environment.load_failure(str(e), log.text)) from None
        try:
            self._setup_maps()
            self._ring = PerfRing(
                self._set_perf_fd, pages=self.config.perf_pages,
                wakeup_events=self.config.wakeup_events,
            )
            # offcpu.c CFG_ARMED: the program records nothing until its maps are
            # set and every CPU's ring is in place (else its first events fail).
            self._table("offtop_config")[ct.c_int(1)] = ct.c_uint64(1)
        except Exception:
            self.close()
            raise
        self._ksyms = KernelSymbols() if self.config.kernel_stacks else None
        self._usyms = UserSymbols()
        if not self.config.stats_window_s:
            self._enable_prog_stats()
        release_compiler_memory()
        now = self._clock()
        self._last_tick = now
        self._next_subtick = now + self.config.subtick_s

    def next_snapshot(self, interval_s: float, stop: Any) -> Snapshot | None:
        """Poll the ring until the interval ends, then drain and build a snapshot."""
        if self._bpf is None or self._ring is None:
            raise EngineError("the engine is not started")
        if self._seq == 0 and interval_s > 0:
            # The first snapshot comes early so users see data at once; its
            # interval_s says how long it really covered.
            interval_s = min(interval_s, self.config.first_interval_s)
        end = self._last_tick + interval_s
        window = self.config.stats_window_s
        self._stats_window = None
        self._stats_opened = False
        self._stats_open_at = self._last_tick + max(0.0, (interval_s - window) / 2)
        now = self._clock()
        if end < now - interval_s:  # fell far behind (e.g. the process was stopped)
            end = now
        while not stop.is_set():
            now = self._clock()
            if now >= end:
                break
            if now >= self._next_subtick:
                self._subtick()
                self._next_subtick = now + self.config.subtick_s
            self._ring.wait(min(0.05, end - now, max(0.0, self._next_subtick - now)))
            self._read_ring()
            if window and not self._stats_opened and now >= self._stats_open_at:
                self._stats_opened = True
                self._enable_prog_stats()
            elif window and self._stats_fd >= 0 and now - self._stats_on_at >= window:
                self._close_stats_window(now)
        if stop.is_set():
            return None
        self._subtick()
        now = self._clock()
        self._next_subtick = now + self.config.subtick_s
        elapsed = max(1e-9, now - self._last_tick)
        self._last_tick = now
        return self._build(elapsed)

    def set_threshold(self, ns: int) -> None:
        """Write offcpu_thresh_ns in the running program (no reload)."""
        if not isinstance(ns, int) or ns < 0 or ns > 1 << 62:
            raise ValueError(f"invalid threshold {ns!r}")
        self._threshold_ns = ns
        if self._bpf is not None:
            self._table("offcpu_thresh_ns")[ct.c_int(0)] = ct.c_uint64(ns)

    def kernel_threshold_ns(self) -> int:
        """The threshold as the kernel map holds it now (for tests)."""
        return int(self._table("offcpu_thresh_ns")[ct.c_int(0)].value)

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
        if self._slots_mm is not None:
            self._slots_mm.close()
            self._slots_mm = None
        if self._acc_mm is not None:
            self._acc_mm.close()
            self._acc_mm = None
        if self._bpf is not None:
            self._bpf.cleanup()
            self._bpf = None
        if self._stats_fd >= 0:
            os.close(self._stats_fd)
            self._stats_fd = -1

    # --- set-up -------------------------------------------------------------

    def _table(self, name: str) -> Any:
        """A bcc table by name, looked up once."""
        t = self._tables.get(name)
        if t is None:
            t = self._tables[name] = self._bpf.get_table(name.encode())
        return t

    def _setup_maps(self) -> None:
        b = self._bpf
        self._table("offcpu_thresh_ns")[ct.c_int(0)] = ct.c_uint64(self._threshold_ns)
        if self.config.pids or self.config.tids:
            one = ct.c_uint8(1)
            for pid in self.config.pids:
                self._table("pid_filter")[ct.c_uint32(pid)] = one
            for tid in self.config.tids:
                self._table("tid_filter")[ct.c_uint32(tid)] = one
        if self.config.cgroup is not None:
            try:
                self._table("cgroup_filter")[0] = self.config.cgroup
            except Exception as e:
                raise EngineError(f"cannot use cgroup {self.config.cgroup}: {e}") from None
        self._prog_fd = b.funcs[PROBE_FUNCTION].fd if PROBE_FUNCTION in b.funcs else -1
        # offcpu.c's per-thread records, mapped: blocked-now is read from memory.
        slots = self._table("offcpu_slots")
        self._slots_mm = mmap.mmap(slots.map_fd, self.config.start_entries * ct.sizeof(StartRecord),
                                   mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        acc = self._table("offcpu_acc")
        self._acc_mm = mmap.mmap(acc.map_fd, 2 * self.config.start_entries * ct.sizeof(AccRecord),
                                 mmap.MAP_SHARED, mmap.PROT_READ)

    def _set_perf_fd(self, cpu: int, fd: int) -> None:
        table = self._table("offcpu_events")
        # Bypass bcc's PerfEventArray bookkeeping: the ring is ours (perf_ring.py).
        key, leaf = ct.c_int(cpu), ct.c_int(fd)
        from bcc.libbcc import lib

        if lib.bpf_update_elem(table.map_fd, ct.byref(key), ct.byref(leaf), 0) < 0:
            raise EngineError(f"could not attach the perf ring of CPU {cpu}")

    def _enable_prog_stats(self) -> None:
        """Turn on BPF run-time stats for as long as offtop runs (as bpftop does)."""
        libc = ct.CDLL(None, use_errno=True)
        attr = (ct.c_uint32 * 4)(_BPF_STATS_RUN_TIME, 0, 0, 0)
        fd = libc.syscall(_SYS_BPF, _BPF_ENABLE_STATS, ct.byref(attr), ct.sizeof(attr))
        self._stats_fd = fd if fd >= 0 else -1
        self._stats_on_at = self._clock()
        self._prev_run = self._read_prog_stats()

    def _close_stats_window(self, now: float) -> None:
        """End the sampling window: keep what it measured, turn the stats off."""
        if not self._stats_opened or self._stats_window is not None:
            return
        run_ns, runs = self._read_prog_stats()
        prev_ns, prev_runs = self._prev_run
        self._stats_window = (max(0, run_ns - prev_ns), max(0, runs - prev_runs),
                              max(1e-9, now - self._stats_on_at))
        if self._stats_fd >= 0:
            os.close(self._stats_fd)
            self._stats_fd = -1

    def _probe_stats(self, elapsed: float) -> tuple[int, int]:
        """(run ns, runs) of the probe over the interval, from its sampling window."""
        if not self.config.stats_window_s:
            run_ns, runs = self._read_prog_stats()
            prev_ns, prev_runs = self._prev_run
            self._prev_run = (run_ns, runs)
            return max(0, run_ns - prev_ns), max(0, runs - prev_runs)
        self._close_stats_window(self._clock())
        window = self._stats_window
        if window is None:
            return 0, 0
        run_ns, runs, seconds = window
        scale = elapsed / seconds if seconds < elapsed else 1.0
        return round(run_ns * scale), round(runs * scale)

    def _read_prog_stats(self) -> tuple[int, int]:
        if self._prog_fd < 0:
            return (0, 0)
        run_ns = runs = 0
        try:
            with open(f"/proc/self/fdinfo/{self._prog_fd}") as f:
                for line in f:
                    if line.startswith("run_time_ns:"):
                        run_ns = int(line.split()[1])
                    elif line.startswith("run_cnt:"):
                        runs = int(line.split()[1])
        except OSError:
            pass
        return (run_ns, runs)

    # --- the interval loop --------------------------------------------------

    def _read_ring(self) -> None:
        """Drain the perf ring (bounded) and sum its events by key, raw."""
        assert self._ring is not None
        raw = self._raw_events
        # Decoded in bulk (perf_ring.drain_unpacked): tuples in EVENT_STRUCT order.
        self._ring.drain_unpacked(raw, EVENT_STRUCT, max_records=262_144)
        if not raw:
            return
        acc = self._event_acc
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
        tail = self._event_tail
        tail.extend(raw[-tail.maxlen:] if tail.maxlen else raw)
        self._interval.events += len(raw)
        self._events_total += len(raw)
        raw.clear()

    def _subtick(self) -> None:
        """Resolve what arrived since the last sub-tick, while processes live."""
        self._starts.clear()
        self._read_ring()
        self._flip_and_drain()
        if self._event_acc:
            for (tgid, tid, st, us, ks), (tot, cnt, mx, comm) in self._event_acc.items():
                self._interval.samples.append(
                    self._sample(tgid, tid, st, us, ks, tot, cnt, mx, comm, True)
                )
            self._event_acc = {}
        if self._event_tail:
            wall = self._mono_to_wall
            # Each CPU's ring is in order; merge them by end time.
            for end_ns, delta, cg, tgid, tid, us, ks, st, _cpu, comm in sorted(self._event_tail):
                self._interval.long_blocks.append(
                    LongBlock(
                        time=end_ns / 1e9 + wall,
                        pid=tgid,
                        tid=tid,
                        comm=decode_comm(comm),
                        state=state_name(st),
                        duration_ns=delta,
                        kernel=self._kernel_frames(ks),
                        user=self._user_frames(tgid, us),
                        cgroup_id=cg,
                    )
                )
            self._event_tail.clear()

    def _flip_and_drain(self) -> None:
        """Switch the program to the other aggregate map, then drain the idle one."""
        old = self._gen
        self._gen += 1  # offcpu.c CFG_GEN: a counter; its parity picks map and slot sums
        self._table("offtop_config")[ct.c_int(0)] = ct.c_uint64(self._gen)
        # sched_switch runs its programs with interrupts off: one that read the
        # old generation finishes within microseconds of the flip.
        time.sleep(0.0005)
        table = self._table(f"offcpu_agg{old & 1}")
        for k, v in table.items_lookup_and_delete_batch():
            self._interval.samples.append(
                self._sample(k.tgid, k.tid, k.state, k.ustack, k.kstack,
                             v.total_ns, v.count, v.max_ns, v.comm, False)
            )
        # Short blocks the probe summed in the threads' own slots (offcpu_acc).
        assert self._acc_mm is not None
        for a in generation_sums(self._acc_mm, self.config.start_entries, old):
            self._interval.samples.append(
                self._sample(a.tgid, a.tid, a.state, a.ustack, a.kstack,
                             a.total_ns, a.count, a.max_ns, a.comm, False)
            )

    def _sample(self, tgid: int, tid: int, st: int, us: int, ks: int, total: int,
                count: int, mx: int, comm: bytes, from_event: bool) -> Sample:
        return Sample(
            pid=tgid,
            tid=tid,
            comm=decode_comm(comm),
            state=state_name(st),
            offcpu_ns=int(total),
            count=int(count),
            max_ns=int(mx),
            kernel=self._kernel_frames(ks),
            user=self._user_frames(tgid, us),
            from_event=from_event,
        )

    # --- stacks -------------------------------------------------------------

    def _stack_addrs(self, kind: str, sid: int) -> tuple[int, ...] | None:
        table = self._table("kernel_stacks" if kind == "k" else "user_stacks")
        try:
            leaf = table[table.Key(sid)]
        except KeyError:
            return None
        ips = []
        for ip in leaf.ip:
            if not ip:
                break
            ips.append(int(ip))
        return tuple(ips)

    def _kernel_frames(self, sid: int) -> tuple[Frame, ...]:
        if sid < 0 or self._ksyms is None:
            return ()
        self._stack_last_use[("k", sid)] = self._agg_seq()
        key = ("k", sid, 0, 0)
        frames = self._stack_frames.get(key)
        if frames is None:
            addrs = self._stack_addrs("k", sid)
            frames = self._ksyms.resolve_stack(addrs) if addrs else ()
            self._stack_frames[key] = frames
        return frames

    def _user_frames(self, pid: int, sid: int) -> tuple[Frame, ...]:
        if sid < 0 or self._usyms is None:
            return ()
        self._stack_last_use[("u", sid)] = self._agg_seq()
        # The process start time is part of the key: a pid reused by another
        # process must not find the old process's frames.
        start = self._starts.get(pid)
        if start is None:
            start = self._starts[pid] = process_start_time(pid) or 0
        key = ("u", sid, pid, start)
        frames = self._stack_frames.get(key)
        if frames is None:
            addrs = self._stack_addrs("u", sid)
            frames = self._usyms.resolve_stack(pid, addrs) if addrs else ()
            if frames and frames[-1].unknown:
                self._truncated += 1
            # Cache only fully resolved stacks: a miss may resolve later.
            if not any(f.unknown for f in frames):
                self._stack_frames[key] = frames
        return frames

    def _agg_seq(self) -> int:
        return self._seq

    def _reclaim_stacks(self, live: set[tuple[str, int]]) -> None:
        """Free stack ids no record references any more, before the map fills.

        The kernel never frees a stack id, and a full map silently turns new
        stacks into -ENOMEM. Ids unused for a few intervals and not held by a
        task that is asleep right now are deleted from the map, and their
        cached frames dropped, since the id may then name another stack.
        """
        cap = self.config.stack_entries
        if len(self._stack_last_use) < cap // 2 and self._seq % 30:
            return
        if self._seq % 30 == 0:
            for kind, name in (("k", "kernel_stacks"), ("u", "user_stacks")):
                for key in self._table(name):
                    self._stack_last_use.setdefault((kind, key.value), self._seq)
        if len(self._stack_last_use) < cap // 2:
            return
        horizon = self._seq - 2
        victims = [k for k, seen in self._stack_last_use.items() if seen < horizon and k not in live]
        for kind, sid in victims:
            table = self._table("kernel_stacks" if kind == "k" else "user_stacks")
            with contextlib.suppress(KeyError):
                del table[table.Key(sid)]
            del self._stack_last_use[(kind, sid)]
        if victims:
            gone = set(victims)
            self._stack_frames = {
                k: v for k, v in self._stack_frames.items() if (k[0], k[1]) not in gone
            }
            self._stacks_reclaimed += len(victims)

    # --- the snapshot -------------------------------------------------------

    def _blocked_now(self) -> tuple[list[BlockedNow], set[tuple[str, int]]]:
        """Tasks asleep right now, from the per-thread records; and the stack ids they hold."""
        now_ns = time.monotonic_ns()
        rows: list[tuple[int, int, StartRecord]] = []
        live: set[tuple[str, int]] = set()
        table = self._table("offcpu_start")
        stale: list[tuple[int, int]] = []  # (tid, slot index; -1: the overflow hash)
        # offcpu.c keeps one record per live thread; ts == 0: not blocked now.
        # Records of exited threads are dropped by the probe (sched_process_free);
        # now and then, reap any that a missed event left behind.
        reap_idle = self._seq % 30 == 0
        assert self._slots_mm is not None
        records: list[tuple[int, StartRecord, int]] = [
            (v.tid, v, i) for i, v in owned_slots(self._slots_mm, self.config.start_entries)]
        records += [(k if isinstance(k, int) else k.value, v, -1)
                    for k, v in table.items_lookup_batch()]
        for tid, v, slot in records:
            if v.ts == 0:
                if reap_idle and not os.path.exists(f"/proc/{v.tgid}/task/{tid}"):
                    stale.append((tid, slot))
                continue
            if v.ustack >= 0:
                live.add(("u", v.ustack))
            if v.kstack >= 0:
                live.add(("k", v.kstack))
            waited = now_ns - v.ts
            if waited >= self.config.blocked_min_ns:
                rows.append((waited, tid, v))
            if waited > 10_000_000_000 and not os.path.exists(f"/proc/{v.tgid}/task/{tid}"):
                stale.append((tid, slot))  # exited while asleep: never switched in again
        for tid, slot in stale:
            if slot >= 0:
                free_slot(self._slots_mm, slot, tid)
            else:
                with contextlib.suppress(KeyError):
                    del table[table.Key(tid)]
        gone = {tid for tid, _ in stale}
        rows.sort(key=lambda r: -r[0])
        out = []
        for waited, tid, v in rows[: self.config.blocked_max]:
            if tid in gone:
                continue
            out.append(
                BlockedNow(
                    pid=v.tgid,
                    tid=tid,
                    comm=_comm_of(v.tgid, tid),
                    state=state_name(v.state),
                    blocked_ns=waited,
                    kernel=self._kernel_frames(v.kstack),
                    user=self._user_frames(v.tgid, v.ustack),
                )
            )
        return out, live

    def _counters(self) -> dict[str, int]:
        table = self._table("offtop_counters")
        out = {}
        for i, name in enumerate(COUNTERS):
            try:
                out[name] = int(sum(table[ct.c_int(i)]))
            except (KeyError, IndexError):
                out[name] = 0
        return out

    def _build(self, elapsed: float) -> Snapshot:
        self._seq += 1
        blocked, live = self._blocked_now()
        c = self._counters()
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
            for label, name in (("start map full", "start_full"), ("aggregate map full", "agg_full"),
                                ("perf output failed", "output_fail"))
            if c[name]
        }
        probe_ns, probe_runs = self._probe_stats(elapsed)
        assert self._ring is not None
        lost_total = self._ring.lost
        lost = lost_total - self._lost_seen
        self._lost_seen = lost_total
        iv = self._interval
        self._interval = _Interval(long_blocks=deque(maxlen=self.config.long_blocks_max))
        stats = CaptureStats(
            events=iv.events,
            lost=lost,
            events_total=self._events_total,
            lost_total=lost_total,
            stack_errors=stack_errors,
            drops=drops,
            truncated_stacks=self._truncated,
            symbol_misses=self._usyms.misses if self._usyms else 0,
            agg_entries=len(iv.samples),
            stacks_used=len(self._stack_last_use),
            stacks_capacity=self.config.stack_entries * 2,
            stacks_reclaimed=self._stacks_reclaimed,
            probe_run_ns=probe_ns,
            probe_runs=probe_runs,
            interval_s=elapsed,
        )
        self._reclaim_stacks(live)
        if self._usyms is not None and self._seq % 10 == 0:
            self._usyms.evict()
        if len(self._stack_frames) > 200_000:
            self._stack_frames.clear()
        return self._agg.build(
            iv.samples,
            time=time.time(),
            interval_s=elapsed,
            threshold_ns=self._threshold_ns,
            long_blocks=iv.long_blocks,
            blocked_now=blocked,
            stats=stats,
            process_meta=self._procinfo.user_and_cmdline,
        )


def _comm_of(pid: int, tid: int) -> str:
    # A comm is whatever bytes the task set (prctl PR_SET_NAME): not UTF-8.
    try:
        return decode(Path(f"/proc/{pid}/task/{tid}/comm").read_bytes().rstrip(b"\n"))
    except OSError:
        return "?"

