"""Faults offtop must survive: floods, full maps, churn, pid reuse, vanished binaries, signals.

Every test here runs the real BPF program against known workloads. The
long-running version of these (a 30-minute soak) is `bench/soak.py`.
"""

from __future__ import annotations

import collections
import contextlib
import gc
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from offtop.model import (
    MARK_BEHIND,
    MARK_NOT_RESOLVED,
    MARK_PROCESS_GONE,
    Aggregator,
    Frame,
    Sample,
    Snapshot,
)
from offtop.symbols import Mapping, UserSymbols
from tests.conftest import (
    ROOT,
    Workload,
    build,
    in_read,
    offtop_json,
    process_ended,
    start_workload,
    task_of,
    wait_until,
)

MS = 1_000_000

bpf = [pytest.mark.bpf, pytest.mark.usefixtures("bpf_available")]


# --- helpers ---------------------------------------------------------------------


@dataclass
class LiveOfftop:
    """`offtop --batch --format json` running in the background, lines timestamped.

    The lines are read and timed in this process, whose heap the tests before
    may have grown (~500,000 objects after the UI tests): a full GC pass of it,
    in the reader thread, took ~0.5 s of CPU, and under a flood that owns both
    CPUs 1.3-2.1 s of wall time, a stall of the reader, not of offtop (its
    output waits in the pipe meanwhile). What is alive at the start is frozen
    out of the GC's sight until `stop`, so that the times are offtop's.
    """

    proc: subprocess.Popen[str]
    lines: list[tuple[float, dict[str, Any]]] = field(default_factory=list)
    reader: threading.Thread | None = None

    @classmethod
    def start(cls, *args: str) -> LiveOfftop:
        proc = subprocess.Popen(
            [sys.executable, "-m", "offtop.cli", "--batch", "--format", "json", *args],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
        )
        gc.collect()
        gc.freeze()  # after the Popen: a failed one leaves nothing frozen
        live = cls(proc)
        live.reader = threading.Thread(target=live._read, daemon=True)
        live.reader.start()
        return live

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.strip():
                self.lines.append((time.monotonic(), json.loads(line)))

    def wait_lines(self, n: int, timeout: float = 30) -> None:
        ok = wait_until(lambda: len(self.lines) >= n or self.proc.poll() is not None, timeout)
        assert ok and len(self.lines) >= n, (
            f"offtop gave {len(self.lines)} lines; rc={self.proc.poll()} "
            f"stderr={self.stderr()[:500]!r}")

    def prog_ids(self) -> set[int]:
        """The BPF programs this process holds (from its fds)."""
        ids = set()
        fd_dir = Path(f"/proc/{self.proc.pid}/fdinfo")
        for f in fd_dir.iterdir():
            with contextlib.suppress(OSError):
                for line in f.read_text().splitlines():
                    if line.startswith("prog_id:"):
                        ids.add(int(line.split()[1]))
        return ids

    def stop(self, sig: int) -> float:
        """Send `sig`; return how long the process took to exit."""
        t0 = time.monotonic()
        self.proc.send_signal(sig)
        try:
            self.proc.wait(timeout=10)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
        took = time.monotonic() - t0
        if self.reader is not None:
            self.reader.join(timeout=5)
        gc.unfreeze()
        return took

    def stderr(self) -> str:
        if self.proc.poll() is None or self.proc.stderr is None:
            return ""
        return self.proc.stderr.read()


def prog_exists(prog_id: int) -> bool:
    """Does the kernel still hold BPF program `prog_id`? (bpftool prog show id N)"""
    bpftool = shutil.which("bpftool") or "/usr/sbin/bpftool"
    if not Path(bpftool).exists():
        pytest.fail("bpftool is missing: `make test` installs it (Debian package bpftool)")
    r = subprocess.run([bpftool, "prog", "show", "id", str(prog_id)], capture_output=True,
                       text=True)
    return r.returncode == 0


def assert_detached(prog_ids: set[int]) -> None:
    assert prog_ids, "offtop held no BPF program while running"
    gone = wait_until(lambda: not any(prog_exists(i) for i in prog_ids), timeout=5)
    assert gone, f"BPF programs {sorted(i for i in prog_ids if prog_exists(i))} still loaded"


@contextlib.contextmanager
def engine(**cfg: Any) -> Iterator[Any]:
    """A started in-process `BpfSource`, closed at the end."""
    from offtop.bpf.engine import BpfSource, EngineConfig

    src = BpfSource(EngineConfig(**cfg))
    src.start()
    try:
        yield src
    finally:
        src.close()


def snapshots(src: Any, n: int, interval: float = 0.5) -> list[Snapshot]:
    stop = threading.Event()
    out = []
    for _ in range(n):
        s = src.next_snapshot(interval, stop)
        assert s is not None
        out.append(s)
    return out


def rows_of(snaps: list[Snapshot], pid: int) -> list[Any]:
    return [st for s in snaps for st in s.stacks if st.pid == pid]


# --- event flood and signals --------------------------------------------------------


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP],
                         ids=["SIGTERM", "SIGINT", "SIGHUP"])
@pytest.mark.bpf
def test_flood_keeps_refreshing_counts_and_exits_fast(bpf_available: None, workloads: Any,
                                                      sig: int) -> None:
    """Threshold 0 under ~100k+ switches/s: every block is a perf event.

    bcc's perf_buffer_poll() can spin for 10 s under such a flood; offtop's
    own bounded reader must keep the batch output on time and obey signals.
    """
    for _ in range(2):
        workloads("pingrate", "100000000")  # unpaced: as fast as two threads can bounce
    interval = 0.5
    live = LiveOfftop.start("--threshold", "0", "--interval", str(interval))
    try:
        live.wait_lines(1)
        first = len(live.lines)
        live.wait_lines(first + 8, timeout=15)
        progs = live.prog_ids()
    except BaseException:
        live.stop(signal.SIGKILL)
        raise
    took = live.stop(sig)
    assert took < 1.0, f"offtop took {took:.2f}s to exit on {signal.Signals(sig).name}"
    assert live.proc.returncode == 0, live.stderr()
    assert "Traceback" not in live.stderr()
    assert_detached(progs)

    times = [t for t, _ in live.lines]
    gaps = [b - a for a, b in zip(times[first - 1:], times[first:], strict=False)]
    assert max(gaps) <= 2 * interval, f"output stalled: gaps {[round(g, 2) for g in gaps]}"
    snaps = [s for _, s in live.lines]
    stats = [s["stats"] for s in snaps]
    # A real flood, delivered as events.
    steady = stats[1:-1]
    assert min(s["switches_per_s"] for s in steady) > 20_000, steady
    assert sum(s["events"] for s in steady) / len(steady) > 5_000
    # Nothing lost goes uncounted: per-interval figures add up to the totals.
    assert sum(s["events"] for s in stats) == stats[-1]["events_total"]
    assert sum(s["lost"] for s in stats) == stats[-1]["lost_total"]
    lost_totals = [s["lost_total"] for s in stats]
    assert lost_totals == sorted(lost_totals)


@pytest.mark.bpf
def test_lost_events_are_counted(bpf_available: None, workloads: Any) -> None:
    """A one-page ring left unread overflows; the loss shows in the stats."""
    workloads("pingrate", "100000")
    with engine(threshold_ns=0, perf_pages=1, wakeup_events=1) as src:
        first = snapshots(src, 1, 0.3)
        time.sleep(1.0)  # nobody reads the ring: it fills and the kernel drops
        later = snapshots(src, 2, 0.3)
    st = [s.stats for s in first + later]
    assert sum(s.lost for s in st) > 0, st
    assert st[-1].lost_total == sum(s.lost for s in st)
    # The program also counts its failed perf_submit calls.
    assert later[-1].stats.drops.get("perf output failed", 0) > 0, later[-1].stats.drops


def _voluntary_switches(pid: int) -> int:
    """Voluntary context switches of every thread of `pid` so far (/proc)."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/status") as f:
            for line in f:
                if line.startswith("voluntary_ctxt_switches:"):
                    total += int(line.split()[1])
    return total


@pytest.mark.bpf
def test_blocks_the_full_ring_refused_keep_their_time(bpf_available: None, workloads: Any) -> None:
    """A long block whose event the full ring had no room for is summed in the kernel
    instead: the interval still has every block of the workload (its count and time);
    only the events are lost, and counted."""
    w = workloads("pingrate", "20000")
    with engine(threshold_ns=0, perf_pages=1, wakeup_events=1, pids=(w.pid,)) as src:
        snapshots(src, 1, 0.3)
        before = _voluntary_switches(w.pid)
        time.sleep(1.0)  # nobody reads the ring: it fills, and the kernel refuses the rest
        later = snapshots(src, 1, 0.3)[0]
        done = _voluntary_switches(w.pid) - before
    assert later.stats.lost_total > 0, later.stats
    assert later.stats.drops.get("perf output failed", 0) > 0, later.stats.drops
    # Each voluntary switch of the workload is a block (a pipe read); those of the
    # window read from /proc all end within the interval (bar the last one or two).
    # A one-page ring holds a few dozen events: refused blocks dropped, this was ~1%.
    blocks = sum(t.count for t in later.tasks if t.pid == w.pid)
    assert done > 2_000, done  # the workload ran
    assert blocks >= 0.95 * done, (blocks, done)
    time_ms = sum(t.offcpu_ns for t in later.tasks if t.pid == w.pid) / 1e6
    assert time_ms > 0.5 * later.interval_s * 1e3, time_ms  # two threads, each blocked half the time


def test_ring_pages_stay_within_their_budget_as_cpus_grow() -> None:
    from offtop.bpf.config import EngineConfig
    from offtop.bpf.perf_ring import ring_pages

    cfg = EngineConfig()
    for cpus, events, stacks in [(1, 256, 64), (2, 256, 64), (8, 256, 64), (16, 128, 32),
                                 (64, 32, 8), (256, 16, 8), (1024, 16, 8)]:
        got = (ring_pages(cfg.perf_pages, cfg.perf_pages_total, cpus, least=16),
               ring_pages(cfg.new_stack_pages, cfg.new_stack_pages_total, cpus, least=8))
        assert got == (events, stacks), cpus
        # Within the budget, or else at the least a ring may have.
        assert cpus * events <= max(cfg.perf_pages_total, cpus * 16), cpus
        assert cpus * stacks <= max(cfg.new_stack_pages_total, cpus * 8), cpus
    assert ring_pages(256, 2048, 3, least=16) == 256  # a power of two, rounded down
    assert ring_pages(256, 2048, 12, least=16) == 128  # 170 pages a CPU would be over
    assert ring_pages(1, 2048, 2, least=16) == 1  # the most per CPU wins over the least


@pytest.mark.parametrize("limits, want", [
    ((256, 4096), 2048 + 1024),  # raised for 1,024 CPUs' rings
    ((256, 1500), 1500),  # as far as the hard limit lets it
    ((8192, 8192), 8192),  # already enough: left alone
])
def test_the_soft_limit_on_open_files_makes_room_for_the_rings(
        limits: tuple[int, int], want: int) -> None:
    code = ("import resource, sys\n"
            "from offtop.bpf.perf_ring import make_room_for_files\n"
            f"resource.setrlimit(resource.RLIMIT_NOFILE, {limits})\n"
            "make_room_for_files(2 * 1024)\n"
            "print(*resource.getrlimit(resource.RLIMIT_NOFILE))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, check=True).stdout.split()
    assert [int(x) for x in out] == [want, limits[1]]


@pytest.mark.bpf
def test_the_engine_sizes_its_rings_by_the_budget(bpf_available: None) -> None:
    """The rings are sized by the budget over this machine's CPUs, as the kernel maps them."""
    from offtop.bpf.perf_ring import online_cpus

    page = os.sysconf("SC_PAGE_SIZE")
    cpus = len(online_cpus())

    def ring_maps() -> collections.Counter[int]:
        sizes: collections.Counter[int] = collections.Counter()
        for line in Path("/proc/self/maps").read_text().splitlines():
            if line.endswith("[perf_event]"):
                lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
                sizes[(hi - lo) // page - 1] += 1  # data pages (one more for the header)
        return sizes

    before = ring_maps()
    with engine(perf_pages_total=32 * cpus, new_stack_pages_total=8 * cpus,
                sent_map_pages_total=4 * cpus):
        during = ring_maps() - before
    assert during == collections.Counter({32: cpus, 8: cpus, 4: cpus}), during
    assert not ring_maps() - before  # unmapped at close


# --- stack map saturation ---------------------------------------------------------


@pytest.mark.bpf
def test_stack_map_saturation_is_counted_and_recovers(bpf_available: None, workloads: Any,
                                                      workload_bin: Path) -> None:
    """A 64-slot user-stack map against 4096 distinct stacks; then only one stack.

    The map is an LRU (offcpu.c): a new stack always gets in and the least
    recently used goes. Each new stack is also sent whole through a ring, here
    of one page a CPU, which these stacks overflow: a stack neither read from
    the ring nor still in the map is marked lost and counted, and its block
    keeps its time. Once the pressure is gone, a new stack is stored and read
    whole, and nothing more is lost. (With a ring that keeps up, nothing is
    lost at all: tests/test_truth_e2e.py.)
    """
    pressure = workloads("stacks", "4096")
    # The process that will need a fresh stack id once the pressure is gone:
    # a shell (its pid passes the filter from the start) that execs a sleeper later.
    later = subprocess.Popen(["/bin/sh", "-c", f"read go; exec {workload_bin} sleep 20"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                             start_new_session=True)
    try:
        with engine(ustack_entries=64, new_stack_pages=1, threshold_ns=10**9,
                    kernel_stacks=False, pids=(pressure.pid, later.pid)) as src:
            hot = snapshots(src, 4)
            lost = hot[-1].stats.user_stacks_lost
            assert lost > 100, (lost, hot[-1].stats.stack_errors)
            marked = [st for s in hot for st in s.stacks
                      if st.pid == pressure.pid and st.user
                      and st.user[0].name == "[user stack lost]"]
            assert marked, "no stack marked lost under pressure"
            # Blocks without a stack id still count, with their time.
            t = [task_of_snap(s, pressure.tid) for s in hot[1:]]
            assert all(r is not None and r.count > 100 for r in t), t
            assert hot[-1].stats.stacks_used <= hot[-1].stats.stacks_capacity

            pressure.stop()
            assert later.stdin is not None and later.stdout is not None
            later.stdin.write("go\n")
            later.stdin.flush()
            ready = later.stdout.readline()
            assert "ready" in ready, ready
            sleeper_tid = int(ready.split("tid=")[1])

            recovered = None
            calm: list[Snapshot] = []
            for _ in range(16):
                calm += snapshots(src, 1)
                rows = [st for st in calm[-1].stacks if st.tid == sleeper_tid]
                if any(st.user and st.user[0].name == "offtop_wl_sleep" for st in rows):
                    recovered = len(calm)
                    break
            assert recovered is not None, (
                f"no stack for the sleeper after the pressure went: "
                f"{calm[-1].stats.stack_errors} lost={calm[-1].stats.user_stacks_lost}")
            # Once recovered, no new failures and nothing more lost.
            after = snapshots(src, 2)
            e0, e1 = calm[-1].stats.stack_errors, after[-1].stats.stack_errors
            assert e1 == e0, (e0, e1)
            assert after[-1].stats.user_stacks_lost == calm[-1].stats.user_stacks_lost
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(later.pid, signal.SIGKILL)
        later.wait(timeout=5)


def task_of_snap(snap: Snapshot, tid: int) -> Any:
    return next((t for t in snap.tasks if t.tid == tid), None)


# --- process churn ----------------------------------------------------------------


@pytest.mark.bpf
def test_process_churn_keeps_caches_bounded(bpf_available: None, workloads: Any) -> None:
    """2000 short-lived processes a second, all tasks traced, small cache limits."""
    from offtop.bpf.engine import BpfSource, EngineConfig
    from offtop.model import Aggregator
    from offtop.procinfo import ProcessInfoCache
    from offtop.symbols import UserSymbols

    class SweptInfo(ProcessInfoCache):
        """Counts the sweeps of processes gone that reach it (every 5 snapshots)."""

        def __init__(self) -> None:
            super().__init__()
            self.sweeps: list[int] = []

        def forget_gone(self, start_time: Any) -> int:
            n = super().forget_gone(start_time)
            self.sweeps.append(n)
            assert start_time(os.getpid()) and start_time(1 << 30) is None
            return n

    workloads("churn", "2000")
    agg = Aggregator(max_threads=4000)
    # A small symbol cache: as if thousands of processes were alive at once.
    usyms = UserSymbols(max_processes=64)
    info = SweptInfo()
    src = BpfSource(EngineConfig(threshold_ns=10**9, stack_entries=1024), aggregator=agg,
                    user_symbols=usyms, process_info=info)
    src.start()
    try:
        assert src.frames.stacks is not None
        seen: list[dict[str, int]] = []
        for s in snapshots(src, 12):
            seen.append({
                "tasks": len(s.tasks),
                "tracked": agg.tracked_threads,
                "usyms": usyms.cached_processes,
                "frames": src.frames.stacks.cached,
                "stacks": s.stats.stacks_used,
                "start": sum(1 for f in src.probe.thread_fields() if f[-1] < 0),
            })
    finally:
        src.close()
    # The churn was real: thousands of distinct tasks went through.
    assert sum(x["tasks"] for x in seen) > 5_000, seen
    last = seen[-1]
    assert max(x["tracked"] for x in seen) <= 4000 + 2 * max(x["tasks"] for x in seen), seen
    assert last["tracked"] <= 4000, seen
    assert max(x["usyms"] for x in seen) <= 64 + 16, seen
    assert max(x["stacks"] for x in seen) <= 2 * 1024, seen
    assert max(x["start"] for x in seen) < 5_000, seen
    # Frames are cached per (stack, pid) only when fully resolved; dead
    # children resolve to addresses, so the cache must not follow the churn.
    assert last["frames"] < 2_000, seen
    # The per-process caches outside the stack store are swept too (the metadata's
    # stands for the unwinder's, the Python reader's and the unwound blocks').
    assert len(info.sweeps) >= 2, info.sweeps


def test_aggregator_forgets_the_oldest_threads_beyond_its_cap() -> None:
    agg = Aggregator(max_threads=100)
    for i in range(50):  # 50 intervals of 10 new threads each
        samples = [Sample(pid=1000 + i * 10 + j, tid=1000 + i * 10 + j, comm="c", state="S",
                          offcpu_ns=1, count=1, max_ns=1) for j in range(10)]
        snap = agg.build(samples, time=0.0, interval_s=1.0, threshold_ns=0)
        assert len(snap.tasks) == 10
        assert all(t.total_ns == 1 for t in snap.tasks)
        assert agg.tracked_threads <= 100
    # The newest are kept.
    snap = agg.build([Sample(pid=1499, tid=1499, comm="c", state="S", offcpu_ns=1, count=1,
                             max_ns=1)], time=0.0, interval_s=1.0, threshold_ns=0)
    assert snap.tasks[0].total_ns == 2
    # One interval with more threads than the cap: every row still gets its total.
    big = [Sample(pid=5000 + j, tid=5000 + j, comm="c", state="S", offcpu_ns=3, count=1,
                  max_ns=3) for j in range(250)]
    snap = agg.build(big, time=0.0, interval_s=1.0, threshold_ns=0)
    assert len(snap.tasks) == 250 and all(t.total_ns == 3 for t in snap.tasks)


# --- pid reuse --------------------------------------------------------------------


class _FakeImage:
    """A fake parsed ELF file: file offsets are addresses, names by address."""

    def __init__(self, names: dict[int, str]) -> None:
        self.names = names

    def vaddr_of(self, off: int) -> int:
        return off

    def lookup(self, vaddr: int) -> str | None:
        # Each function is 0x100 bytes long (callers are looked up at return address - 1).
        start = max((a for a in self.names if a <= vaddr < a + 0x100), default=None)
        return None if start is None else self.names[start]


class _FakeElfCache:
    """ElfCache's get(): each process image is a file named after its start time."""

    def __init__(self) -> None:
        self.files: dict[str, _FakeImage] = {}

    def get(self, path: str, *, deadline: float | None = None,
            expect: tuple[int, int] | None = None) -> _FakeImage | None:
        return self.files.get(path)


def _fake_process(cache: _FakeElfCache, starts: dict[int, int], pid: int,
                  names: dict[int, str]) -> None:
    cache.files[f"img-{pid}-{starts[pid]}"] = _FakeImage(names)


def _fake_maps(starts: dict[int, int]) -> Any:
    def maps(pid: int) -> list[Mapping]:
        if pid not in starts:
            return []
        img = f"img-{pid}-{starts[pid]}"
        return [Mapping(0x0, 0x100000, 0, f"/bin/{img}", img)]

    return maps


def test_user_symbols_never_reuse_a_dead_process_cache() -> None:
    now = [0.0]
    starts = {4242: 1000}
    cache = _FakeElfCache()
    _fake_process(cache, starts, 4242, {0x1000: "old_main", 0x2000: "old_wait"})
    syms = UserSymbols(clock=lambda: now[0], start_time=starts.get, grace_s=5.0,
                       maps=_fake_maps(starts), elf_cache=cache)  # type: ignore[arg-type]
    # Callers are return addresses, looked up at address - 1: 0x2001 is in old_wait.
    assert [f.name for f in syms.resolve_stack(4242, [0x1000, 0x2001])] == ["old_main", "old_wait"]

    # The process exits; within the grace period its frames are still known.
    del starts[4242]
    now[0] = 1.0
    assert syms.resolve_stack(4242, [0x1000])[0].name == "old_main"

    # A new process gets pid 4242 (another start time, another image).
    starts[4242] = 2000
    _fake_process(cache, starts, 4242, {0x1000: "new_main", 0x3000: "new_poll"})
    frames = syms.resolve_stack(4242, [0x1000, 0x2001, 0x3001])
    assert [f.name for f in frames] == ["new_main", "img-4242-2000+0x2001", "new_poll"]
    assert syms.cached_processes == 1

    # Dead and past the grace period: forgotten.
    del starts[4242]
    syms.resolve_stack(4242, [0x1000])
    now[0] = 100.0
    assert syms.evict() == 1
    assert syms.cached_processes == 0
    # A pid with no process: nothing can be trusted (a marked stack), never an old name.
    assert [f.name for f in syms.resolve_stack(4242, [0x1000])] == [MARK_PROCESS_GONE]


def test_user_symbols_stay_bounded() -> None:
    starts: dict[int, int] = {}
    cache = _FakeElfCache()
    syms = UserSymbols(start_time=starts.get, max_processes=8, grace_s=30.0,
                       maps=_fake_maps(starts), elf_cache=cache)  # type: ignore[arg-type]
    for pid in range(100, 300):
        starts[pid] = pid
        _fake_process(cache, starts, pid, {0x10: f"f{pid}"})
        assert syms.resolve_stack(pid, [0x10])[0].name == f"f{pid}"
        del starts[pid]  # exits right after
        assert syms.cached_processes <= 8 + 1


def test_user_symbols_stay_bounded_when_their_processes_were_found_gone() -> None:
    """Processes asked about again once gone (their last rows, read after they ended)
    are marked dead and kept for the grace period; and processes gone before their
    first sight are named in the mappings the kernel sent, kept the same way. A full
    cache forgets them first, or it grew past its bound: 170 of 64 with a shell loop
    of exec'd `/bin/true` beside the churn test."""
    starts: dict[int, int] = {}
    cache = _FakeElfCache()
    syms = UserSymbols(start_time=starts.get, max_processes=8, grace_s=30.0,
                       maps=_fake_maps(starts), elf_cache=cache)  # type: ignore[arg-type]
    syms.sent = lambda pid: (5, []) if pid >= 1000 else None
    for pid in range(100, 300):
        starts[pid] = pid
        _fake_process(cache, starts, pid, {0x10: f"f{pid}"})
        assert syms.resolve_stack(pid, [0x10])[0].name == f"f{pid}"
        del starts[pid]  # exits right after, and is asked about once more
        assert syms.resolve_stack(pid, [0x10])[0].name == f"f{pid}"
        syms.resolve_stack(pid + 1000, [0x10])  # gone before its first sight
        assert syms.cached_processes <= 8 + 1


def _fork_with_pid(pid: int, argv: list[str], tries: int = 50) -> subprocess.Popen[str]:
    """Start argv so that it gets `pid` (steering the kernel's next pid)."""
    for _ in range(tries):
        Path("/proc/sys/kernel/ns_last_pid").write_text(str(pid - 1))
        p = subprocess.Popen(argv, stdout=subprocess.PIPE, start_new_session=True, text=True)
        if p.pid == pid:
            return p
        p.kill()
        p.wait()
    pytest.fail(f"could not get pid {pid} back in {tries} tries (a busy machine)")


@pytest.mark.bpf
@pytest.mark.parametrize("reborn", ["same-binary", "other-binary"])
def test_pid_reuse_never_shows_the_old_process(bpf_available: None, workloads: Any,
                                               workload_bin: Path, tmp_path: Path,
                                               reborn: str) -> None:
    """A new process with an old pid gets its own name and symbols.

    same-binary: a hard link of the workload (same inode, so bcc's own
    staleness check sees no change; another name, so another comm) that
    blocks elsewhere; only offtop's (pid, start time) key tells them apart.
    other-binary: a shell, whose frames are libc's.
    """
    old = workloads("sleep", "20")
    pid = old.pid
    if reborn == "same-binary":
        link = tmp_path / "wl-reborn"
        os.link(workload_bin, link)
        argv, comm, own = [str(link), "pipe", "20"], "wl-reborn", "offtop_wl_pipe_read"
    else:
        argv, comm, own = ["/bin/sh", "-c", "while :; do /bin/sleep 0.05; done"], "sh", None
    # System-wide: with -p, a reused pid is not followed at all (see below).
    with engine(threshold_ns=10**9) as src:
        before = snapshots(src, 2)
        assert any(st.user and st.user[0].name == "offtop_wl_sleep"
                   for st in rows_of(before, pid)), "the first process was not symbolized"
        old.stop()
        snapshots(src, 1)  # its last blocks drain here
        new = _fork_with_pid(pid, argv)
        try:
            if own:
                assert new.stdout is not None and "ready" in new.stdout.readline()
            after = snapshots(src, 3)
        finally:
            new.kill()
            new.wait()
    rows = rows_of(after[1:], pid)
    blocked = [b for s in after for b in s.blocked_now if b.pid == pid]
    assert rows, "the new process was not seen"
    old_names = ("offtop_wl_sleep", "sleep_thread")
    for st in rows:
        assert st.comm == comm, st
        names = [f.name for f in st.user]
        assert not any(n in old_names for n in names), names
    for b in blocked:
        assert b.comm == comm
        assert not any(f.name in old_names for f in b.user)
    if own:
        assert any(st.user and st.user[0].name == own for st in rows), \
            [[f.name for f in st.user] for st in rows]
    else:  # its own symbols resolve: libc's, where sh waits for its child
        assert any(not f.unknown and f.module.startswith("libc") for st in rows for f in st.user)


@pytest.mark.bpf
def test_a_watched_pid_that_exits_is_said_and_its_reuse_not_followed(
        bpf_available: None, workloads: Any, workload_bin: Path) -> None:
    """-p PID: the exit is a notice, the run finishes, a new process with that pid is not shown."""
    old = workloads("sleep", "20")
    pid = old.pid
    with engine(threshold_ns=10**9, pids=(pid,)) as src:
        before = snapshots(src, 2)
        assert rows_of(before, pid), "the process was not seen"
        old.stop()
        new = _fork_with_pid(pid, [str(workload_bin), "sleep", "20"])
        try:
            assert new.stdout is not None and "ready" in new.stdout.readline()
            stop = threading.Event()
            after = []
            for _ in range(4):
                snap = src.next_snapshot(0.5, stop)
                if snap is None:
                    break
                after.append(snap)
        finally:
            new.kill()
            new.wait()
    notices = [n for s in after for n in s.notices]
    assert notices == [f"pid {pid} exited (its id now names another process: not followed)"] \
        or notices == [f"pid {pid} exited"], notices
    assert after[-1].finished.startswith("nothing left to watch"), after[-1]
    assert len(after) < 4, "the source kept going with nothing left to watch"
    # Whatever came after the exit was noticed belongs to no one: not the new process.
    noticed = next(i for i, s in enumerate(after) if s.notices)
    assert not [b for s in after[noticed:] for b in s.blocked_now if b.pid == pid]
    assert not rows_of(after[noticed + 1:], pid)


@pytest.mark.bpf
def test_a_watched_pid_that_exits_keeps_its_last_blocks(bpf_available: None,
                                                        workloads: Any) -> None:
    """-p PID: the blocks that ended just before the process exited (drained in the
    sub-tick that finds it gone) are its own: counted, up to the last one."""
    w = workloads("sleep", "100", "25")  # a thread sleeps 100 ms 25 times; main joins it
    reaper = threading.Thread(target=w.proc.wait)  # a zombie is not gone yet
    reaper.start()
    with engine(threshold_ns=50 * 10**6, pids=(w.pid,)) as src:
        stop = threading.Event()
        snaps = []
        while len(snaps) < 20:
            snap = src.next_snapshot(0.3, stop)
            if snap is None:
                break
            snaps.append(snap)
            if snap.finished:
                break
    reaper.join(timeout=10)
    assert snaps and snaps[-1].finished.startswith("nothing left to watch"), snaps[-1:]
    blocks = [b for s in snaps for b in s.long_blocks]
    ends = sorted(b.time for b in blocks if b.tid == w.tid)
    assert len(ends) >= 5, ends
    # Every block from the first seen to the exit, 100 ms apart (or its loss counted:
    # a block whose end the kernel did not show, README known limits), up to the last
    # sleep; the main thread's wait in pthread_join ended as the sleeper exited.
    missing = sum(round((b - a) / 0.1) - 1 for a, b in itertools.pairwise(ends))
    unseen = snaps[-1].stats.drops.get("block ends unseen", 0)  # since the start
    assert missing <= unseen, (missing, unseen, ends)
    joined = [b.time for b in blocks if b.tid == w.pid]
    assert joined and 0 <= joined[-1] - ends[-1] < 0.05, (joined, ends[-3:])
    counted = sum(t.count for s in snaps for t in s.tasks if t.tid == w.tid)
    assert counted == len(ends)


@pytest.mark.bpf
def test_a_watched_pid_found_gone_at_an_intervals_last_read_keeps_its_last_long_block(
        bpf_available: None) -> None:
    """-p PID: a long block that ended as the process exited is reported, even when
    its event reached the ring just after the interval's last read of it and the
    process was found gone just after that (the run ends with that snapshot: an
    event left in the ring then was never read). The moment is made, not waited
    for: Debian's `cat`, asleep on a pipe since before the start, is woken and
    reaped inside the targets' check of an interval of one sub-tick (length 0,
    as a stop's last interval is)."""
    from offtop.bpf.engine import BpfSource, EngineConfig
    from offtop.targets import TargetWatch, task_start_time

    r, w = os.pipe()
    cat = subprocess.Popen(["/usr/bin/cat"], stdin=r, stdout=subprocess.DEVNULL,
                           start_new_session=True)
    os.close(r)
    moment = {"armed": False, "done": False}

    def start_time(pid: int) -> int | None:
        if moment["armed"] and not moment["done"]:
            moment["done"] = True
            os.close(w)  # cat's block ends (an event through the ring) and cat exits
            cat.wait(timeout=30)
        return task_start_time(pid)

    try:
        assert wait_until(lambda: in_read(cat.pid), timeout=30), "cat never blocked in read"
        src = BpfSource(EngineConfig(threshold_ns=10**9, pids=(cat.pid,)),
                        targets=TargetWatch((cat.pid,), start_time=start_time))
        src.start()
        try:
            stop = threading.Event()
            first = src.next_snapshot(0.3, stop)
            time.sleep(1.2)  # cat's block is past the threshold
            moment["armed"] = True
            last = src.next_snapshot(0.0, stop)
            after = src.next_snapshot(0.3, stop)
        finally:
            src.close()
    finally:
        if not moment["done"]:
            os.close(w)
        cat.kill()
        cat.wait(timeout=5)
    assert moment["done"], "the targets were never checked"
    assert first is not None and last is not None
    assert last.finished.startswith("nothing left to watch"), last
    assert after is None  # the run is over: nothing more is read
    blocks = [b for s in (first, last) for b in s.long_blocks if b.tid == cat.pid]
    assert len(blocks) == 1 and blocks[0].before_start, blocks
    assert blocks[0].duration_ns >= 10**9, blocks


@pytest.mark.bpf
def test_a_stops_last_interval_reads_everything_the_probe_sent(
        bpf_available: None, workloads: Any) -> None:
    """A stop's last interval (what a signal leaves unfinished) reads every event the
    probe sent before it stopped recording: at --threshold 0 under a flood the
    ring holds several reads' worth (~16,000 events on two CPUs), and what one
    read left was never read. Left unread here for half a second, the ring fills;
    after the stop's last interval, a second one finds nothing more."""
    for _ in range(2):
        workloads("pingrate", "100000000")  # unpaced: as fast as two threads can bounce
    with engine(threshold_ns=0) as src:
        stop = threading.Event()
        first = src.next_snapshot(0.3, stop)
        assert first is not None and first.stats.events > 0, "no flood"
        time.sleep(0.5)  # not read meanwhile: the ring fills
        src.hurry()
        assert wait_until(lambda: src.probe.stopped_at < float("inf"), timeout=10), \
            "the probe never stopped recording"
        last = src.next_snapshot(0.0, threading.Event())
        again = src.next_snapshot(0.0, threading.Event())
    assert last is not None and again is not None
    assert last.stats.events > 4096, last.stats  # more than one read's worth
    assert again.stats.events == 0, (last.stats.events, again.stats.events)


# --- binaries deleted or replaced ------------------------------------------------------


@pytest.mark.bpf
@pytest.mark.parametrize("how", ["deleted", "replaced"])
def test_binary_deleted_or_replaced_keeps_its_own_names(
        bpf_available: None, workload_bin: Path, tmp_path: Path, how: str) -> None:
    exe = tmp_path / "victim"
    shutil.copy(workload_bin, exe)
    from tests.conftest import start_workload

    w = start_workload(exe, "sleep", "20")
    try:
        if how == "deleted":
            exe.unlink()
        else:
            # Another build, laid out differently: its symbols at the old
            # addresses would be wrong names, so they must not be used.
            other = tmp_path / "other"
            subprocess.run(["gcc", "-O0", "-fno-omit-frame-pointer", "-pthread", "-o",
                            str(other), str(ROOT / "tests/workloads/offtop_workload.c")],
                           check=True)
            other.rename(exe)
        snaps = offtop_json("-p", str(w.pid), count=2, interval="0.5")
    finally:
        w.stop()
    rows = [st for s in snaps for st in s["stacks"] if st["tid"] == w.tid]
    assert rows, "the task whose binary went away was not shown"
    assert task_of(snaps[-1], w.tid)["count"] > 5
    for st in rows:
        user, modules = st["user"], st["user_modules"]
        assert user, st
        # offtop reads the image the process runs (through /proc/PID/map_files),
        # not whatever is at the path now: the names stay right, never another
        # build's names at the old addresses.
        assert user[0] == "offtop_wl_sleep", (user, modules)
        assert "sleep_thread" in user, user
        assert modules[0] == "victim", modules


# --- two instances ---------------------------------------------------------------------


@pytest.mark.bpf
def test_two_instances_work_independently(bpf_available: None, workloads: Any) -> None:
    w = workloads("sleep", "20")
    results: dict[str, list[dict[str, Any]]] = {}

    def run(name: str, threshold: str) -> None:
        results[name] = offtop_json("-p", str(w.pid), "--threshold", threshold, count=3)

    threads = [threading.Thread(target=run, args=("events", "0")),
               threading.Thread(target=run, args=("sums", "1s"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=90)
    assert set(results) == {"events", "sums"}
    for name, snaps in results.items():
        for s in snaps[1:]:
            t = task_of(s, w.tid)
            assert t is not None, name
            frac = t["offcpu_ns"] / (s["interval_s"] * 1e9)
            assert 0.85 <= frac <= 1.05, (name, frac)
            if name == "events":
                assert s["threshold_ns"] == 0 and t["events"] == t["count"] >= 20
            else:
                assert s["threshold_ns"] == 10**9 and t["events"] == 0 and t["count"] >= 20


# --- the TUI: signals, q and a closing terminal, in a real terminal (tmux) ------------------


class Tmux:
    """A private tmux server with one 120x40 pane running sh."""

    def __init__(self) -> None:
        import uuid

        self.sock = f"offtop-test-{uuid.uuid4().hex[:8]}"
        self.run("new-session", "-d", "-s", "t", "-x", "120", "-y", "40", "sh")
        self.run("set-option", "-t", "t", "remain-on-exit", "off")
        # Type nothing before the shell is reading: wait for its prompt.
        assert wait_until(lambda: self.screen().strip() != "", timeout=10), "no shell prompt"

    def run(self, *args: str) -> str:
        r = subprocess.run(["tmux", "-L", self.sock, *args], capture_output=True, text=True,
                           timeout=10)
        assert r.returncode == 0, (args, r.stderr)
        return r.stdout

    def type(self, text: str) -> None:
        self.run("send-keys", "-t", "t", "-l", text)
        self.run("send-keys", "-t", "t", "Enter")

    def screen(self) -> str:
        return self.run("capture-pane", "-t", "t", "-p", "-J")

    def shell_pid(self) -> int:
        return int(self.run("display-message", "-t", "t", "-p", "#{pane_pid}").strip())

    def close(self) -> None:
        subprocess.run(["tmux", "-L", self.sock, "kill-server"], capture_output=True)
        # kill-server leaves its socket file behind.
        Path(f"/tmp/tmux-{os.geteuid()}/{self.sock}").unlink(missing_ok=True)


def _assert_screen_keeps_refreshing(tmux: Tmux, interval: float, seconds: float) -> None:
    """The header's snapshot number (#N) must move at least every two intervals."""
    changes: list[float] = []
    last = None
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        m = re.search(r" #(\d+) ", tmux.screen().split("\n", 1)[0])
        if m and m.group(1) != last:
            last = m.group(1)
            changes.append(time.monotonic())
        time.sleep(0.1)
    changes.append(time.monotonic())
    gaps = [b - a for a, b in itertools.pairwise(changes)]
    assert len(changes) >= 4 and max(gaps) <= 2 * interval + 0.25, (
        f"screen stalled: updates at gaps {[round(g, 2) for g in gaps]}")


def _shell_saw_exit(tmux: Tmux) -> bool:
    """The shell printed offtop's exit status (not just the typed command line)."""
    return re.search(r"offtop-exit=\d", tmux.screen()) is not None


def _children(pid: int) -> list[int]:
    out = []
    with contextlib.suppress(OSError):
        for task in Path(f"/proc/{pid}/task").iterdir():
            out += [int(c) for c in (task / "children").read_text().split()]
    return out


def _prog_ids(pid: int) -> set[int]:
    ids = set()
    with contextlib.suppress(OSError):
        for f in Path(f"/proc/{pid}/fdinfo").iterdir():
            with contextlib.suppress(OSError):
                for line in f.read_text().splitlines():
                    if line.startswith("prog_id:"):
                        ids.add(int(line.split()[1]))
    return ids


@pytest.mark.bpf
@pytest.mark.parametrize(("how", "flood"), [
    ("SIGTERM", False), ("SIGHUP", False), ("q", False), ("terminal-closed", False),
    ("SIGCONT-then-terminal-closed", False),
    ("q", True), ("SIGTERM", True), ("terminal-closed", True),
    ("SIGCONT-then-terminal-closed", True),
], ids=["SIGTERM", "SIGHUP", "q", "terminal-closed", "SIGCONT-then-terminal-closed",
        "q-under-flood", "SIGTERM-under-flood", "terminal-closed-under-flood",
        "SIGCONT-then-terminal-closed-under-flood"])
def test_tui_exits_fast_and_restores_the_terminal(bpf_available: None, workloads: Any,
                                                  how: str, flood: bool) -> None:
    if shutil.which("tmux") is None:
        pytest.fail("tmux is missing: `make test` installs it")
    w = workloads("sleep", "20")
    args = f"-p {w.pid} --interval 0.5"
    if flood:  # every block of every task an event, ~100k switches/s
        for _ in range(2):
            workloads("pingrate", "100000000")
        args = "--threshold 0 --interval 0.5"
    tmux = Tmux()
    offtop = 0
    try:
        tmux.type(f"cd {ROOT} && {sys.executable} -m offtop.cli {args}; echo offtop-exit=$?")
        shell = tmux.shell_pid()
        assert wait_until(lambda: bool(_children(shell)), timeout=10), tmux.screen()
        offtop = _children(shell)[0]
        # Running for real: the probe is attached and the screen shows the workload.
        assert wait_until(lambda: bool(_prog_ids(offtop)), timeout=30), tmux.screen()
        progs = _prog_ids(offtop)
        if not flood:
            assert wait_until(lambda: "offtop_workload" in tmux.screen(), timeout=15), \
                tmux.screen()
        else:  # a few seconds of flood on screen, the TUI behind with its output
            assert wait_until(lambda: re.search(r" #(?:[89]|\d\d+) ", tmux.screen())
                              is not None, timeout=20), tmux.screen()

        t0 = time.monotonic()
        if how == "q":
            tmux.run("send-keys", "-t", "t", "q")
        elif how.endswith("terminal-closed"):
            if how.startswith("SIGCONT"):
                # A SIGCONT with no SIGTSTP before it (as a hang-up can bring)
                # made Textual start a second output thread, which dies with
                # the terminal; its full queue then hung the shutdown for good.
                os.kill(offtop, signal.SIGCONT)
                time.sleep(0.3)
                t0 = time.monotonic()
            tmux.close()  # the pane's terminal goes away: SIGHUP to its processes
        else:
            os.kill(offtop, getattr(signal, how))
        gone = wait_until(lambda: process_ended(offtop), timeout=10, step=0.02)
        took = time.monotonic() - t0
        assert gone, f"offtop still running 10 s after {how}"
        assert took < 1.0, f"offtop took {took:.2f}s to exit after {how}"
        assert_detached(progs)
        if how.endswith("terminal-closed"):
            return

        # The shell got its terminal back, in a sane state.
        assert wait_until(lambda: _shell_saw_exit(tmux), timeout=5), tmux.screen()
        assert "offtop-exit=0" in tmux.screen(), tmux.screen()
        tmux.type("stty -a | tr '\\n' ' '; echo; echo ok-$((1+1))")
        assert wait_until(lambda: "ok-2" in tmux.screen(), timeout=5), tmux.screen()
        screen = tmux.screen()
        stty = next(line for line in screen.splitlines() if "speed" in line or "icanon" in line)
        assert re.search(r"(?<![-\w])icanon\b", stty), stty
        assert re.search(r"(?<![-\w])echo\b", stty), stty
        assert "Traceback" not in screen
        # No leftover TUI modes: mouse tracking or the alternate screen would
        # show up as escape garbage or a blank pane here.
        assert tmux.run("display-message", "-t", "t", "-p",
                        "#{alternate_on}#{mouse_any_flag}").strip() == "00"
    finally:
        tmux.close()
        if offtop:  # a hung offtop must not outlive the test (its probe stays attached)
            with contextlib.suppress(ProcessLookupError):
                os.kill(offtop, signal.SIGKILL)


@pytest.mark.bpf
def test_tui_keeps_refreshing_under_flood(bpf_available: None, workloads: Any) -> None:
    """Threshold 0, ~100k switches/s, default interval: the header's #N moves on time."""
    for _ in range(2):
        workloads("pingrate", "100000000")
    tmux = Tmux()
    offtop = 0
    try:
        tmux.type(f"cd {ROOT} && {sys.executable} -m offtop.cli --threshold 0")
        shell = tmux.shell_pid()
        assert wait_until(lambda: bool(_children(shell)), timeout=10), tmux.screen()
        offtop = _children(shell)[0]
        assert wait_until(lambda: re.search(r" #[2-9] ", tmux.screen()) is not None,
                          timeout=20), tmux.screen()
        _assert_screen_keeps_refreshing(tmux, interval=1.0, seconds=6.0)
        assert re.search(r"\blost \d", tmux.screen()), "lost events are not shown"
    finally:
        tmux.close()
        if offtop:
            with contextlib.suppress(ProcessLookupError):
                os.kill(offtop, signal.SIGKILL)


# --- the exit guard, unit-tested -------------------------------------------------------------


class _IdleSource:
    info = None
    threshold_ns = 0

    def start(self) -> None:
        pass

    def next_snapshot(self, interval_s: float, stop: threading.Event) -> None:
        return None

    def set_threshold(self, ns: int) -> None:
        pass

    def close(self) -> None:
        pass


def test_exit_guard_ends_a_process_whose_shutdown_hangs() -> None:
    import pty
    import termios

    from offtop.exit_guard import ExitGuard

    master, slave = pty.openpty()
    exits: list[int] = []
    try:
        saved = termios.tcgetattr(slave)
        guard = ExitGuard(_IdleSource(), grace_s=0.2, tty_fd=slave, hard_exit=exits.append,
                          poll_s=0.01)
        with guard:
            stop = threading.Event()
            guard.source.next_snapshot(1.0, stop)  # the app hands its stop event over
            raw = termios.tcgetattr(slave)
            raw[3] &= ~(termios.ICANON | termios.ECHO)  # as a TUI leaves it
            termios.tcsetattr(slave, termios.TCSANOW, raw)
            time.sleep(0.3)
            assert exits == []  # not asked to stop yet: nothing happens
            t0 = time.monotonic()
            stop.set()
            assert wait_until(lambda: exits == [0], timeout=2, step=0.01)
            assert 0.15 <= time.monotonic() - t0 < 0.6
            assert guard.fired
            assert termios.tcgetattr(slave)[3] == saved[3]  # icanon and echo back
    finally:
        os.close(master)
        os.close(slave)


def test_exit_guard_sees_a_stop_at_once_between_its_looks_at_the_terminal() -> None:
    """The terminal is looked at every `poll_s` (30 s here); a stop request is not
    waited for: the guard counts its grace from the request."""
    from offtop.exit_guard import ExitGuard

    exits: list[int] = []
    with ExitGuard(_IdleSource(), grace_s=0.2, hard_exit=exits.append, poll_s=30.0) as guard:
        stop = threading.Event()
        guard.source.next_snapshot(1.0, stop)
        time.sleep(0.1)  # the guard waits on the stop event now
        t0 = time.monotonic()
        stop.set()
        assert wait_until(lambda: exits == [0], timeout=5, step=0.01)
        assert time.monotonic() - t0 < 2.0
    assert guard.fired


def test_exit_guard_stays_quiet_when_the_exit_is_normal() -> None:
    from offtop.exit_guard import ExitGuard

    exits: list[int] = []
    with ExitGuard(_IdleSource(), grace_s=0.2, hard_exit=exits.append, poll_s=0.01) as guard:
        stop = threading.Event()
        guard.source.next_snapshot(1.0, stop)
        stop.set()
        time.sleep(0.05)  # the app finishes its shutdown within the grace period
    time.sleep(0.4)
    assert exits == [] and not guard.fired


def test_exit_guard_acts_at_once_when_the_terminal_hangs_up() -> None:
    import pty

    from offtop.exit_guard import ExitGuard

    master, slave = pty.openpty()
    exits: list[int] = []
    try:
        with ExitGuard(_IdleSource(), grace_s=5.0, tty_fd=slave, hard_exit=exits.append,
                       poll_s=0.01):
            time.sleep(0.1)
            assert exits == []
            t0 = time.monotonic()
            os.close(master)  # the terminal goes away; nobody asked the app to stop
            master = -1
            assert wait_until(lambda: exits == [0], timeout=2, step=0.01)
            assert time.monotonic() - t0 < 0.6
    finally:
        if master >= 0:
            os.close(master)
        os.close(slave)


#: The `offtop` command as its console script runs it (see pyproject.toml), saying
#: "started" once Python itself is up (a signal before that is Python's own matter:
#: it ends the process, or fails importing `site`, before any offtop code runs).
#: OFFTOP_SLOW_IMPORT=S makes importing offtop.cli take S seconds longer.
OFFTOP_COMMAND = [sys.executable, "-c", """
import os, signal, sys, time, weakref
def lost_sigint(ref):
    # Where Python drops what is raised (importlib's module-lock cleanup is one).
    os.kill(os.getpid(), signal.SIGINT)
    for _ in range(10000): pass
class SlowImport:
    def find_spec(self, name, path=None, target=None):
        if name == "offtop.cli":
            time.sleep(float(os.environ.get("OFFTOP_SLOW_IMPORT", "0")))
        if name == os.environ.get("OFFTOP_SIGINT_IN_CALLBACK"):
            o = SlowImport(); r = weakref.ref(o, lost_sigint); del o
        return None
sys.meta_path.insert(0, SlowImport())
print("started", flush=True)
from offtop.launch import main
sys.exit(main())
"""]


def start_offtop_command(*args: str, env: dict[str, str] | None = None
                         ) -> subprocess.Popen[str]:
    """`offtop ARGS` (OFFTOP_COMMAND), once it has said "started"."""
    p = subprocess.Popen([*OFFTOP_COMMAND, *args], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env)
    assert p.stdout is not None and p.stdout.readline() == "started\n"
    return p


@pytest.mark.bpf
def test_signal_while_python_loads_offtop_ends_it_quietly() -> None:
    """Ctrl-C while Python imports offtop (a second on a loaded machine; held here for
    two): status 0, nothing on stderr (it was a KeyboardInterrupt traceback)."""
    p = start_offtop_command("--batch", env={**os.environ, "OFFTOP_SLOW_IMPORT": "2"})
    time.sleep(0.5)
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=30)
    assert p.returncode == 0 and err == "" and out == "", (p.returncode, err)


@pytest.mark.bpf
@pytest.mark.parametrize("module", ["offtop.cli", "offtop.bpf.engine"])
def test_a_ctrl_c_python_drops_while_loading_still_ends_offtop(module: str) -> None:
    """A SIGINT whose KeyboardInterrupt Python drops (raised in a weakref callback, as
    in importlib's lock cleanup: CI saw offtop run on after a Ctrl-C at 0.1 s), while
    Python loads offtop or while offtop loads the engine: offtop ends at once anyway,
    status 0, nothing printed."""
    p = start_offtop_command("--batch", "--format", "json",
                             env={**os.environ, "OFFTOP_SIGINT_IN_CALLBACK": module})
    try:
        out, err = p.communicate(timeout=10)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 0 and err == "" and out == "", (p.returncode, err, out[:200])


@pytest.mark.bpf
@pytest.mark.parametrize("after_s", [0.1, 0.3, 0.5, 0.8])
def test_batch_signal_during_startup_exits_at_once(bpf_available: None, after_s: float) -> None:
    """A signal while offtop loads, or while its program loads (bcc compiles for
    seconds, in C, on a first start): at once, without a traceback."""
    p = start_offtop_command("--batch", "--format", "json")
    time.sleep(after_s)
    t0 = time.monotonic()
    p.send_signal(signal.SIGINT)
    try:
        out, err = p.communicate(timeout=10)
    finally:
        if p.poll() is None:
            p.kill()
    took = time.monotonic() - t0
    assert took < 1.0, f"{took:.2f}s to exit after SIGINT at {after_s}s"
    assert p.returncode == 0, err
    assert "Traceback" not in err and err == "", err
    for line in out.splitlines():  # at most a partial interval, whole lines
        json.loads(line)


@pytest.mark.bpf
def test_a_hurried_engine_counts_everything_and_resolves_nothing_new(
        bpf_available: None, workloads: Any) -> None:
    """After `hurry()` (a stop is coming) and its time to finish (0 here), the blocks
    up to the stop are still counted whole; stacks seen before keep their frames, new
    ones are marked not resolved instead of being symbolized; recording ends there
    (the probe detaches meanwhile)."""
    from offtop.bpf.engine import BpfSource, EngineConfig

    known = workloads("sleep", "20")
    src = BpfSource(EngineConfig(threshold_ns=10**9))
    src.start()
    try:
        stop = threading.Event()

        def seen(snap: Snapshot | None) -> bool:
            assert snap is not None
            return any(f.name == "offtop_wl_sleep" for st in snap.stacks
                       if st.tid == known.tid for f in st.user)

        # Seen before the stop: resolved in some snapshot (the first, on a quiet
        # machine; beside CPU hogs the engine may be behind in the first ones).
        deadline = time.monotonic() + 20
        while not seen(src.next_snapshot(0.5, stop)):
            assert time.monotonic() < deadline, "the known thread's stack was never resolved"
        new = workloads("sleep", "20")  # its stacks reach offtop only after the stop
        time.sleep(0.4)  # ~20 blocks of each summed in the kernel, not read yet
        src.hurry(within_s=0)
        snap = src.next_snapshot(0.5, stop)
        assert snap is not None
        for w, inner in ((known, "offtop_wl_sleep"), (new, MARK_NOT_RESOLVED)):
            mine = [st for st in snap.stacks if st.tid == w.tid]
            assert sum(st.count for st in mine) >= 10, mine
            assert all(st.user[0].name == inner for st in mine), (inner, mine)
        assert all(not st.kernel for st in snap.stacks if st.tid == new.tid)
        after = src.next_snapshot(0.5, stop)
        assert after is not None
        assert not [st for st in after.stacks if st.tid in (known.tid, new.tid)], \
            "still recording after a stop"
    finally:
        src.close()


@pytest.mark.bpf
def test_a_stop_ends_the_engines_wait_at_once(bpf_available: None) -> None:
    """Between sub-ticks the engine sleeps until records come; a stop (`hurry`, as the
    TUI and batch mode send with it) wakes it. Sub-ticks of 30 s here: without the
    wake-up, `next_snapshot` would sleep on for them."""
    from offtop.bpf.engine import BpfSource, EngineConfig

    src = BpfSource(EngineConfig(threshold_ns=10**9, subtick_s=30.0, first_interval_s=30.0))
    src.start()
    try:
        stop = threading.Event()
        done: list[float] = []
        waiting = threading.Thread(
            target=lambda: (src.next_snapshot(60.0, stop), done.append(time.monotonic())))
        waiting.start()
        time.sleep(1.0)  # asleep in the ring's wait by now
        assert not done
        t0 = time.monotonic()
        stop.set()
        src.hurry()
        waiting.join(timeout=20)
        assert done, "still waiting 20 s after the stop"
        assert done[0] - t0 < 5.0
    finally:
        src.close()


def _many_stacks(tmp_path: Path, stacks: int, threads: int) -> Workload:
    """tests/workloads/many_stacks.c running: `threads` threads blocking in turn at
    `stacks` distinct user stacks."""
    binary = build(tmp_path, "many_stacks.c", "-O1", "-fno-omit-frame-pointer",
                   "-fno-optimize-sibling-calls")
    return start_workload(binary, str(stacks), str(threads))


@pytest.mark.bpf
def test_an_engine_always_behind_sums_the_rest_per_thread_and_still_catches_up(
        bpf_available: None, tmp_path: Path) -> None:
    """A read of the sums resolves new rows only until the next sub-tick is due, past
    a first share (`_MIN_NEW_ROWS`); the rest are summed per thread and state,
    marked, counted in `behind_rows`, and tried again at their next read. A sub-tick
    of 1 µs here makes every read late, deterministically, whatever the machine's
    speed: 3,000 new stacks are more than a share, so the first snapshot has rows
    behind, with all their time; then the shares resolve them all. Without the
    first share nothing is ever resolved (what a starved CPU did: a read and its
    carry outlasting a sub-tick, the 20,000-stack test found no snapshot caught up
    in 60)."""
    from offtop.bpf.engine import BpfSource, EngineConfig

    load = _many_stacks(tmp_path, 3000, 2)
    try:
        src = BpfSource(EngineConfig(threshold_ns=10**9, subtick_s=1e-6, pids=(load.pid,)))
        src.start()
        try:
            stop = threading.Event()
            first = src.next_snapshot(0.5, stop)
            assert first is not None
            snaps = [first]
            while len(snaps) < 40 and snaps[-1].stats.behind_rows:
                snap = src.next_snapshot(0.5, stop)
                assert snap is not None
                snaps.append(snap)
        finally:
            src.close()
    finally:
        load.stop()
    assert first.stats.behind_rows >= 1
    behind = [st for st in first.stacks if st.user == (Frame(MARK_BEHIND),)]
    assert behind and all(not st.kernel for st in behind), behind
    assert len({(st.tid, st.state) for st in behind}) == len(behind)  # one a thread and state
    for task in first.tasks:
        mine = [st for st in first.stacks if st.tid == task.tid]
        assert sum(st.offcpu_ns for st in mine) == task.offcpu_ns  # the time is all there
    # and a share resolved (its frames as they could be had so soon: libc's symbols
    # may not be read yet, nor its unwinding rules taught)
    assert [st for st in first.stacks if st.pid == load.pid and st.user != (Frame(MARK_BEHIND),)]
    assert snaps[-1].stats.behind_rows == 0, [s.stats.behind_rows for s in snaps]
    assert not [st for st in snaps[-1].stacks if st.user == (Frame(MARK_BEHIND),)]


@pytest.mark.bpf
def test_signal_while_many_new_stacks_arrive_exits_at_once(bpf_available: None,
                                                          tmp_path: Path) -> None:
    """20,000 distinct stacks keep arriving, each new to offtop for a while: a sub-tick
    that resolves them can take seconds on a busy machine. A signal cuts it short
    (the rest of the interval is written with its stacks marked not resolved)."""
    load = _many_stacks(tmp_path, 20000, 4)
    try:
        live = LiveOfftop.start("-p", str(load.pid), "--threshold", "1s", "--interval", "0.5")
        try:
            live.wait_lines(1)
        except BaseException:
            live.stop(signal.SIGKILL)
            raise
        took = live.stop(signal.SIGINT)
        assert took < 1.0, f"offtop took {took:.2f}s to exit on SIGINT"
        assert live.proc.returncode == 0, live.stderr()
        assert "Traceback" not in live.stderr()
    finally:
        load.stop()


@pytest.mark.bpf
def test_tui_survives_tiny_and_changing_terminals(bpf_available: None, workloads: Any) -> None:
    """Shrink the terminal far below 80x24 and back while offtop runs: no crash, clean exit."""
    w = workloads("sleep", "20")
    tmux = Tmux()
    offtop = 0
    try:
        tmux.run("set-option", "-t", "t", "window-size", "manual")
        tmux.type(f"cd {ROOT} && {sys.executable} -m offtop.cli -p {w.pid} --interval 0.5; "
                  "echo offtop-exit=$?")
        shell = tmux.shell_pid()
        assert wait_until(lambda: bool(_children(shell)), timeout=10), tmux.screen()
        offtop = _children(shell)[0]
        assert wait_until(lambda: "offtop_workload" in tmux.screen(), timeout=30), tmux.screen()
        for cols, rows in [(79, 23), (60, 15), (40, 10), (20, 5), (10, 3), (200, 60), (80, 24)]:
            tmux.run("resize-window", "-t", "t", "-x", str(cols), "-y", str(rows))
            time.sleep(0.6)  # a refresh or two at this size
            assert Path(f"/proc/{offtop}").exists(), f"offtop died at {cols}x{rows}"
        assert wait_until(lambda: "offtop_workload" in tmux.screen(), timeout=5), tmux.screen()
        tmux.run("send-keys", "-t", "t", "q")
        assert wait_until(lambda: _shell_saw_exit(tmux), timeout=5), tmux.screen()
        screen = tmux.screen()
        assert "offtop-exit=0" in screen and "Traceback" not in screen, screen
    finally:
        tmux.close()
        if offtop:
            with contextlib.suppress(ProcessLookupError):
                os.kill(offtop, signal.SIGKILL)
