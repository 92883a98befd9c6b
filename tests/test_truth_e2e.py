"""The truth on programs nobody built for offtop (issue 13), real BPF.

- Debian's own /usr/bin/sleep, blocked since before offtop started: in
  blocked-now from the first snapshot, unwound to libc's start code, no junk.
- Debian's `cat` asleep on a pipe since before offtop started: when the block
  ends it is counted once, whole, marked.
- A program built -O2 -fomit-frame-pointer that blocks three calls deep: the
  three functions named, in order, in blocked-now and in the summed stacks.
- 20,000 distinct user stacks: fewer than 1% of blocks without their user stack.
- Process churn: the unwinding rules of processes gone go back to the budget,
  so a new process without frame pointers is still unwound whole.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from offtop.model import MARK_PROCESS_GONE, MARK_TRUNCATED, MARK_USER_STACK_LOST, Snapshot
from tests.conftest import (
    ROOT,
    build,
    in_read,
    offtop_json,
    offtop_lines,
    remove_cgroup,
    wait_until,
)

MS = 1_000_000

pytestmark = [pytest.mark.bpf, pytest.mark.usefixtures("bpf_available")]


@contextlib.contextmanager
def running(*argv: str, ready: bool = True) -> Iterator[tuple[subprocess.Popen[str], int]]:
    proc = subprocess.Popen(list(argv), stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        tid = proc.pid
        if ready:
            assert proc.stdout is not None
            m = re.search(r"tid=(\d+)", proc.stdout.readline())
            assert m
            tid = int(m.group(1))
        yield proc, tid
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=5)


def engine_snapshots(n: int, *, settle: int = 0, **cfg: Any) -> list[Snapshot]:
    """`n` snapshots of a real engine; with `settle`, they come once it has caught up:
    after at least `settle` snapshots, and after one with no rows it was too far
    behind to resolve (new stacks arriving faster than it resolves them make it
    shed work rather than stretch its intervals: how long it takes to catch up
    depends on the machine's speed; 60 snapshots at most)."""
    from offtop.bpf.engine import BpfSource, EngineConfig
    from offtop.model import Aggregator

    src = BpfSource(EngineConfig(**cfg), aggregator=Aggregator(max_stacks=500_000))
    src.start()
    try:
        stop = threading.Event()

        def snapshot() -> Snapshot:
            snap = src.next_snapshot(1.0, stop)
            assert snap is not None
            return snap

        for i in range(60 if settle else 0):
            if snapshot().stats.behind_rows == 0 and i + 1 >= settle:
                break
        else:
            assert not settle, "the engine never caught up"
        return [snapshot() for _ in range(n)]
    finally:
        src.close()


def test_debian_sleep_blocked_before_offtop_is_shown_whole_from_the_first_snapshot() -> None:
    with running("/usr/bin/sleep", "1000", ready=False) as (proc, _):
        time.sleep(0.5)  # asleep well before offtop starts
        snaps = offtop_json("-p", str(proc.pid), count=2)
    first = [b for b in snaps[0]["blocked_now"] if b["tid"] == proc.pid]
    assert first, snaps[0]["blocked_now"]
    row = first[0]
    assert row["before_start"] and row["state"] == "S"
    assert row["blocked_ns"] >= 400 * MS
    assert "hrtimer_nanosleep" in row["kernel"] or "do_nanosleep" in row["kernel"], row
    user = row["user"]
    # Unwound with sleep's and libc's own unwind tables, to libc's start code.
    assert user[0] in ("clock_nanosleep", "__clock_nanosleep"), user
    assert "__libc_start_main" in user, user
    # No junk: every frame is named, or module+offset inside sleep or libc, and
    # nothing was cut.
    assert MARK_TRUNCATED not in user
    for f in user:
        assert re.fullmatch(r"[A-Za-z_][\w.@]*|(sleep|libc\.so\.6)\+0x[0-9a-f]+", f), user


def _nontask_ns() -> list[int]:
    """Per CPU, the interrupt, softirq and steal time since boot (/proc/stat, ns):
    the time the scheduler's task clock leaves out."""
    tick_ns = 1_000_000_000 // os.sysconf("SC_CLK_TCK")
    out = []
    for line in Path("/proc/stat").read_text().splitlines():
        name, *fields = line.split()
        if name.startswith("cpu") and name != "cpu":
            irq, softirq, steal = (int(f) for f in fields[5:8])
            out.append((irq + softirq + steal) * tick_ns)
    return out


def _told_of(snaps: list[dict[str, Any]], tid: int) -> list[dict[str, Any]]:
    """What each snapshot said of thread `tid` and of itself: for a failure's message."""
    return [{"seq": s.get("seq"), "interval_s": s.get("interval_s"), "notices": s.get("notices"),
             "finished": s.get("finished"), "threshold_ns": s.get("threshold_ns"),
             "tasks": [t for t in s["tasks"] if t["tid"] == tid],
             "stacks": [(x["state"], x["offcpu_ns"], x["count"], x.get("before_start"))
                        for x in s["stacks"] if x["tid"] == tid],
             "blocked_now": [(x["blocked_ns"], x["before_start"]) for x in s["blocked_now"]
                             if x["tid"] == tid],
             "stats": {k: v for k, v in s.get("stats", {}).items()
                       if k in ("lost", "drops", "events", "stack_errors", "flood_threshold_ns")}}
            for s in snaps]


def test_a_block_from_before_the_start_is_counted_once_whole_and_marked() -> None:
    """Debian's `cat`, asleep reading a pipe since before offtop started, is woken
    only after offtop's first snapshot, so the block cannot end before the probe
    is armed however slow the start. Its length is bounded by the clock: from
    between spawn and "seen in read" to between the close and cat's exit.
    (A `sleep 3` here ended before a start slowed by a CPU hog was done.)"""
    r, w = os.pipe()
    t_spawn = time.monotonic_ns()
    nontask_before = _nontask_ns()
    cat = subprocess.Popen(["/usr/bin/cat"], stdin=r, stdout=subprocess.DEVNULL,
                           start_new_session=True)
    os.close(r)
    off: subprocess.Popen[str] | None = None
    try:
        assert wait_until(lambda: in_read(cat.pid), timeout=30), "cat never blocked in read"
        t_blocked = time.monotonic_ns()
        off = offtop_lines("-p", str(cat.pid), "--threshold", "1s", "--count", "4",
                           "--interval", "1")
        assert off.stdout is not None
        lines = [off.stdout.readline()]  # armed: the probe is attached
        assert lines[0].startswith("{"), lines
        # Past offtop's start: its clock offset is measured.
        nontask = max(b - a for a, b in zip(nontask_before, _nontask_ns(), strict=True))
        time.sleep(max(0.0, (t_blocked + 1_500 * MS - time.monotonic_ns()) / 1e9))  # ≥ 1.5 s
        t_close = time.monotonic_ns()
        os.close(w)
        w = -1
        cat.wait(timeout=30)
        t_exit = time.monotonic_ns()
        lines += off.stdout.read().splitlines()
        # 3: cat is gone, so offtop may end before its count ("nothing left to watch").
        assert off.wait(timeout=60) in (0, 3)
    finally:
        if w >= 0:
            os.close(w)
        cat.kill()
        cat.wait(timeout=5)
        if off is not None and off.poll() is None:
            off.kill()
            off.wait(timeout=5)
    snaps = [json.loads(line) for line in lines if line.strip()]
    blocks = [b for s in snaps for b in s["long_blocks"] if b["tid"] == cat.pid]
    assert len(blocks) == 1, (blocks, _told_of(snaps, cat.pid))  # once, when it ends
    b = blocks[0]
    assert b["before_start"]
    # Whole, from before offtop. Its start comes from the scheduler's clock,
    # which leaves out interrupt and steal time (offtop/proc_tasks.py): the
    # estimate is short by what of that fell on cat's CPU before offtop
    # measured the clock's offset (on a quiet machine a fraction of a
    # percent; a VM's host can steal more). So 1% either way, beyond that.
    low, high = 0.99 * (t_close - t_blocked) - nontask, 1.01 * (t_exit - t_spawn)
    assert low <= b["duration_ns"] <= high, (low, b["duration_ns"], high, nontask)
    total = sum(t["offcpu_ns"] for s in snaps for t in s["tasks"] if t["tid"] == cat.pid)
    assert total == b["duration_ns"]  # never twice


def test_no_frame_pointers_three_calls_deep_in_blocked_now_and_in_the_sums(
        tmp_path: Path) -> None:
    binary = build(tmp_path, "nofp_deep.c", "-O2", "-fomit-frame-pointer")
    want = ["offtop_nofp_f3", "offtop_nofp_f2", "offtop_nofp_f1", "main"]

    def in_order(user: list[str]) -> bool:
        it = iter(user)
        return all(any(f == w for f in it) for w in want)

    with running(str(binary), "0") as (proc, tid):  # blocked for good
        snaps = offtop_json("-p", str(proc.pid), count=2)
    blocked = [b["user"] for s in snaps for b in s["blocked_now"] if b["tid"] == tid]
    assert blocked and in_order(blocked[-1]), blocked
    assert blocked[-1][0] == "read", blocked[-1]

    with running(str(binary), "5") as (proc, tid):  # woken every 5 ms: summed in the kernel
        snaps = offtop_json("-p", str(proc.pid), count=5)
    # The probe learns the unwinding rules in the first second or so.
    late = [st for st in snaps[-1]["stacks"] if st["tid"] == tid]
    total = sum(st["offcpu_ns"] for st in late)
    named = sum(st["offcpu_ns"] for st in late if in_order(st["user"]))
    assert total > 0 and named >= 0.95 * total, [(st["user"], st["offcpu_ns"]) for st in late]


def test_processes_gone_give_their_rules_back_so_new_ones_are_still_unwound(
        tmp_path: Path) -> None:
    """The probe holds a bounded number of unwinding rules, taught per process.
    Here the budget is 24 and one no-frame-pointer process takes 15: each of
    three in a row, started after the one before is gone, must be unwound to
    main. (Teaching once stopped for good at the budget: with process churn,
    after ~1,000 processes no new one was unwound past its first frames.)"""
    from offtop.bpf.engine import BpfSource, EngineConfig
    from offtop.cgroups import cgroup2_mounts
    from offtop.model import Aggregator

    binary = build(tmp_path, "nofp_deep.c", "-O2", "-fomit-frame-pointer")
    want = ["read", "offtop_nofp_f3", "offtop_nofp_f2", "offtop_nofp_f1", "main"]
    mounts = cgroup2_mounts()
    assert mounts, "no cgroup v2 mount on this machine"
    cg = mounts[0] / f"offtop-test-rules-{os.getpid()}"
    cg.mkdir()
    # Only this cgroup's processes: nothing else on the machine takes rules.
    src = BpfSource(EngineConfig(cgroup=str(cg), unwind_rules=24),
                    aggregator=Aggregator(max_stacks=500_000))

    def join() -> None:
        (cg / "cgroup.procs").write_text(str(os.getpid()))

    try:
        src.start()
        stop = threading.Event()
        for turn in range(3):
            proc = subprocess.Popen([str(binary), "5"], stdout=subprocess.PIPE, text=True,
                                    preexec_fn=join)
            try:
                assert proc.stdout is not None
                m = re.search(r"tid=(\d+)", proc.stdout.readline())
                assert m
                tid = int(m.group(1))
                snaps = [src.next_snapshot(0.5, stop) for _ in range(8)]
            finally:
                proc.kill()
                proc.wait(timeout=5)
            last = snaps[-1]
            assert last is not None
            late = [st for st in last.stacks if st.tid == tid]
            total = sum(st.offcpu_ns for st in late)
            whole = sum(st.offcpu_ns for st in late
                        if [f.name for f in st.user][:len(want)] == want)
            assert total > 0 and whole >= 0.95 * total, (
                turn, [([f.name for f in st.user], st.offcpu_ns) for st in late])
            for _ in range(6):  # gone: its rules go at the next sweep (every 5 intervals)
                src.next_snapshot(0.5, stop)
    finally:
        src.close()
        remove_cgroup(cg)


GzipStacks = list[tuple[tuple[str, ...], int]]


def two_gzips(**cfg: Any) -> tuple[int, GzipStacks, int, GzipStacks]:
    """Debian's gzip (no frame pointers) reading a slow pipe, then a second one once
    the first is gone, in a cgroup of their own: each one's pid and its read()
    stacks (frames, count)."""
    from offtop.bpf.engine import BpfSource, EngineConfig
    from offtop.cgroups import cgroup2_mounts
    from offtop.model import Aggregator

    gzip = shutil.which("gzip")
    assert gzip, "no gzip"
    mounts = cgroup2_mounts()
    assert mounts, "no cgroup v2 mount on this machine"
    cg = mounts[0] / f"offtop-test-gzip-{os.getpid()}"
    cg.mkdir()
    src = BpfSource(EngineConfig(cgroup=str(cg), **cfg), aggregator=Aggregator(max_stacks=500_000))

    def join() -> None:
        (cg / "cgroup.procs").write_text(str(os.getpid()))

    def read_stacks(snaps: list[Snapshot], pid: int) -> list[tuple[tuple[str, ...], int]]:
        return [(tuple(f.name for f in st.user), st.count) for snap in snaps
                for st in snap.stacks if st.pid == pid and st.user and st.user[0].name == "read"]

    def one_gzip(snapshots: int, until_whole: bool) -> tuple[int, list[tuple[tuple[str, ...], int]]]:
        proc = subprocess.Popen([gzip, "-1"], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                preexec_fn=join)
        stop_feed = threading.Event()

        def feed() -> None:  # a slow producer: gzip waits in read() between chunks
            assert proc.stdin is not None
            with contextlib.suppress(BrokenPipeError, ValueError):
                while not stop_feed.wait(0.02):
                    proc.stdin.write(os.urandom(20_000))
                    proc.stdin.flush()

        feeder = threading.Thread(target=feed)
        feeder.start()
        snaps: list[Snapshot] = []
        try:
            for _ in range(snapshots):
                snap = src.next_snapshot(0.5, stop)
                assert snap is not None
                snaps.append(snap)
                whole = [u for u, _ in read_stacks(snaps[-1:], proc.pid) if MARK_TRUNCATED not in u]
                if until_whole and whole and len(snaps) >= 2:
                    break
        finally:
            stop_feed.set()
            feeder.join()
            proc.kill()
            proc.wait(timeout=5)
        return proc.pid, read_stacks(snaps, proc.pid)

    try:
        src.start()
        stop = threading.Event()
        first_pid, first = one_gzip(40, until_whole=True)
        for _ in range(2):
            src.next_snapshot(0.5, stop)
        second_pid, second = one_gzip(6, until_whole=False)
    finally:
        src.close()
        remove_cgroup(cg)

    return first_pid, first, second_pid, second


def _versions(stacks: GzipStacks) -> set[tuple[str, ...]]:
    return {u for u, _ in stacks if u[-1] == MARK_TRUNCATED}


def test_a_second_gzip_is_unwound_whole_from_the_start_with_the_first_ones_sites() -> None:
    """Debian's gzip (no frame pointers) reading a pipe. The probe's walk reveals one
    frame more per rule taught, so the first gzip's read() stack comes in several
    truncated versions (a frame deeper each) before it is whole. The sites it needed
    are kept for its program: a second gzip, started after the first is gone, is
    taught them when first seen, and its stack is whole (the same frames) from then:
    one truncated version at most (its first sighting: the blocks walked before it was
    seen; two if a walk ran while the rules were being written), not one per frame.
    Without the probe's stack copies, which teach the first gzip its rules at once
    (the next test)."""
    first_pid, first, second_pid, second = two_gzips(stack_copies=False)

    whole_first = {u for u, _ in first if MARK_TRUNCATED not in u}
    assert whole_first, first
    # Learned a frame per sighting: the control that shows this test can fail.
    assert len(_versions(first)) >= 4, first
    # The second gzip: whole once first seen, as the first one ended.
    assert second and first_pid != second_pid
    assert len(_versions(second)) <= 2, second
    whole = sum(n for u, n in second if u in whole_first)
    assert whole >= 0.5 * sum(n for _, n in second), (second, whole_first)


def test_frame_pointer_code_blocked_before_offtop_is_unwound_whole(tmp_path: Path) -> None:
    # With frame pointers each function's frame is rbp-based, and libc's read
    # wrapper does not save rbp: /proc has no rbp for a thread that blocked
    # before offtop started, so without the kernel's saved registers the
    # walk stops after `read` (marked cut). It must reach main.
    binary = build(tmp_path, "nofp_deep.c", "-O2", "-fno-omit-frame-pointer")
    want = ["read", "offtop_nofp_f3", "offtop_nofp_f2", "offtop_nofp_f1", "main"]
    with running(str(binary), "0") as (proc, tid):  # blocked for good, before offtop starts
        time.sleep(0.3)
        snaps = offtop_json("-p", str(proc.pid), count=2)
    rows = [b for s in snaps for b in s["blocked_now"] if b["tid"] == tid]
    assert rows and all(b["before_start"] for b in rows), rows
    for b in rows:
        assert b["user"][:len(want)] == want, b["user"]
        assert MARK_TRUNCATED not in b["user"], b["user"]
        assert "__libc_start_main" in b["user"] or len(b["user"]) == len(want) + 2, b["user"]


def test_a_pool_of_thousands_of_threads_idle_since_before_the_start_is_shown_whole(
        tmp_path: Path) -> None:
    """A process of 3,000 threads waiting since before offtop started (a thread pool):
    the blocked-now list (its 200 longest waits) shows each with its whole stack. Each
    unwind read the process's maps (a mapping per thread's stack, ~0.3 MB): about 7
    threads a second fitted the unwinding budget, and the third snapshot had 37 of 200
    whole (the rest with no user stack at all)."""
    cc = shutil.which("gcc") or shutil.which("cc")
    assert cc, "no C compiler: run the README's test command (it installs gcc)"
    binary = tmp_path / "idle_threads"
    subprocess.run([cc, "-O1", "-fno-omit-frame-pointer", "-pthread", "-o", str(binary),
                    str(ROOT / "bench" / "workloads" / "idle_threads.c")], check=True)
    with running(str(binary), "3000", ready=False) as (proc, _):
        assert proc.stdout is not None and proc.stdout.readline().startswith("ready")
        time.sleep(0.5)
        snaps = offtop_json("-p", str(proc.pid), count=3)
    rows = snaps[-1]["blocked_now"]
    assert len(rows) == 200 and all(r["before_start"] for r in rows), len(rows)
    whole = [r for r in rows if r["user"][-3:] == ["idle", "start_thread", "clone3"]
             and MARK_TRUNCATED not in r["user"]]
    assert len(whole) == len(rows), [r["user"] for r in rows if r not in whole][:3]


def test_twenty_thousand_distinct_stacks_keep_their_user_stacks(tmp_path: Path) -> None:
    binary = build(tmp_path, "many_stacks.c", "-O1", "-fno-omit-frame-pointer",
                   "-fno-optimize-sibling-calls")
    with running(str(binary), "20000", "4") as (proc, _):
        # After the probe has learned the rules (each distinct stack is briefly
        # stored in several versions meanwhile) and offtop has resolved them,
        # a steady state.
        steady = engine_snapshots(3, settle=4, pids=(proc.pid,), threshold_ns=10**9)
    blocks = sum(t.count for s in steady for t in s.tasks)
    without = sum(st.count for s in steady for st in s.stacks
                  if not st.user or st.user[0].name == MARK_USER_STACK_LOST)
    distinct = {tuple(f.name for f in st.user) for st in steady[-1].stacks}
    assert len(distinct) >= 19_000, len(distinct)
    assert blocks > 50_000
    assert without / blocks < 0.01, (without, blocks)


def test_a_new_process_is_seen_as_its_first_stacks_come_not_a_sub_tick_later(
        tmp_path: Path) -> None:
    """A second process of a program whose threads block at 400 sites at once. libc's
    start_thread keeps no frame pointer: each walk ends there, cut, until the probe
    has the rule the first process's stacks taught its program (`_teach_ahead`).
    The engine sees the new process as its first stacks come (the stack ring wakes
    its loop), not at the next sub-tick: here sub-ticks are 5 s apart, past the
    2 s interval, so seen a sub-tick later every one of its stacks would end cut
    (measured with the stack ring read only at sub-ticks: every block
    `clock_nanosleep ← [stack truncated]`, libc's nanosleep taught no rule either)."""
    from offtop.bpf.engine import BpfSource, EngineConfig
    from offtop.model import Aggregator

    binary = build(tmp_path, "many_stacks.c", "-O1", "-fno-omit-frame-pointer",
                   "-fno-optimize-sibling-calls")
    src = BpfSource(EngineConfig(threshold_ns=10**9, subtick_s=5.0),
                    aggregator=Aggregator(max_stacks=500_000))
    src.start()
    try:
        stop = threading.Event()
        with running(str(binary), "400", "4", "1000000"):
            for _ in range(3):  # the first process's stacks teach the program's sites
                assert src.next_snapshot(1.0, stop) is not None
            with running(str(binary), "400", "4", "1000000") as (second, _):
                snap = src.next_snapshot(2.0, stop)
    finally:
        src.close()
    assert snap is not None
    mine = [st for st in snap.stacks if st.pid == second.pid and st.tid != second.pid]
    blocks = sum(st.count for st in mine)
    whole = sum(st.count for st in mine if st.user and st.user[-1].name != MARK_TRUNCATED
                and any(f.name == "offtop_ms_a0" or f.name == "offtop_ms_b0" for f in st.user)
                and any(f.name == "start_thread" for f in st.user))
    assert blocks > 1_000, blocks
    # Seen a sub-tick later: every block `clock_nanosleep ← [stack truncated]`.
    assert whole >= 0.95 * blocks, (whole, blocks, [[f.name for f in st.user] for st in mine[:3]])


def test_user_stacks_the_map_evicts_before_they_are_read_still_resolve(tmp_path: Path) -> None:
    # 400 distinct stacks through a user-stack map of 64 ids: the map's LRU
    # evicts each ~64 blocks after storing it (~35 ms here), long before the
    # engine's next sub-tick reads it. The probe sends each new stack whole as
    # it stores it (new_user_stacks), so no block loses its user stack.
    binary = build(tmp_path, "many_stacks.c", "-O1", "-fno-omit-frame-pointer",
                   "-fno-optimize-sibling-calls")
    with running(str(binary), "400", "2", "1000000") as (proc, _):
        snaps = engine_snapshots(6, pids=(proc.pid,), threshold_ns=10**9, ustack_entries=64,
                                 new_stack_pages=256)
    steady = snaps[3:]  # once the probe has its rules (stacks whole)
    blocks = sum(t.count for s in steady for t in s.tasks)
    lost = sum(st.count for s in steady for st in s.stacks
               if st.user and st.user[0].name == MARK_USER_STACK_LOST)
    distinct = {tuple(f.name for f in st.user) for s in steady for st in s.stacks
                if any(f.name.startswith("offtop_ms_") for f in st.user)}
    assert blocks > 1_000 and len(distinct) >= 390, (blocks, len(distinct))
    assert lost / blocks < 0.01, (lost, blocks)


def test_a_process_born_and_gone_within_one_interval_keeps_its_names(workloads: Any) -> None:
    # Each sub-tick (0.25 s) reads the sums and resolves new keys while their
    # process lives. A process that starts and is reaped within one interval
    # (the snapshot made after it is gone, /proc/PID with it) is still shown
    # by its functions' names. Resolved only at the snapshot, its stack would
    # be "[not resolved: process gone]" (seen with subtick_s=10).
    from offtop.bpf.engine import BpfSource, EngineConfig

    src = BpfSource(EngineConfig(threshold_ns=10**9))
    src.start()
    life: dict[str, Any] = {}

    def run() -> None:
        life["w"] = w = workloads("sleep", "10", "40")  # 40 blocks of 10 ms, then it exits
        w.proc.wait(timeout=10)
        life["gone"] = time.monotonic()

    try:
        stop = threading.Event()
        assert src.next_snapshot(1.0, stop) is not None  # the first one is short
        beside = threading.Thread(target=run)
        beside.start()
        snap = src.next_snapshot(3.0, stop)
        read = time.monotonic()
        beside.join()
    finally:
        src.close()
    assert snap is not None
    assert life["gone"] < read, "the workload outlived the interval: the test proves nothing"
    mine = [st for st in snap.stacks if st.tid == life["w"].tid]
    blocks = sum(st.count for st in mine)
    named = sum(st.count for st in mine if [f.name for f in st.user][:2]
                == ["offtop_wl_sleep", "sleep_thread"])
    # Every block is counted, or its loss is: a block whose end (switch-in) the
    # kernel ran no probe for is dropped and counted (README, Known limits; CI
    # saw 39 once, 2026-11-25; machine-wide, 1 such end in a third of 15 runs
    # here), as test_bpf_e2e's split test allows too.
    unseen = snap.stats.drops.get("block ends unseen", 0)
    assert 40 - unseen <= blocks <= 40, (unseen, mine)
    assert named == blocks, mine


@contextlib.contextmanager
def fresh_cgroup(name: str) -> Iterator[Path]:
    from offtop.cgroups import cgroup2_mounts

    mounts = cgroup2_mounts()
    assert mounts, "no cgroup v2 mount on this machine"
    cg = mounts[0] / f"offtop-test-{name}-{os.getpid()}"
    cg.mkdir()
    try:
        yield cg
    finally:
        remove_cgroup(cg)


def _children_stacks(snaps: list[dict[str, Any]], parent: int) -> list[tuple[list[str], int]]:
    return [(st["user"], st["count"]) for s in snaps for st in s["stacks"] if st["pid"] != parent]


def test_forked_children_gone_within_a_millisecond_keep_their_names(workloads: Any) -> None:
    # 100 children a second, forked (no exec), each asleep 1 ms and gone: none is
    # ever seen alive, so its addresses mean nothing without the map of the
    # process it was forked from, which lives (offtop.bpf.lineage). They were all
    # "[not resolved: process gone]" before, as offtop -c on a pre-fork server.
    with fresh_cgroup("forks") as cg:
        def join() -> None:
            (cg / "cgroup.procs").write_text(str(os.getpid()))

        w = workloads("churn", "100", preexec=join)
        try:
            snaps = offtop_json("-c", str(cg), "--limit", "0", count=4)
        finally:
            w.stop()  # before the cgroup is removed (it cannot be while in use)
    # From the second snapshot: a child forked before the probe noted forks and
    # reaped after it began recording (offtop's start, a millisecond's window)
    # has no note, and stays "gone" (README, Known limits): CI saw one, once.
    children = _children_stacks(snaps[1:], w.pid)
    blocks = sum(n for _, n in children)
    named = sum(n for user, n in children if user[:2] == ["offtop_wl_child_sleep", "main"])
    gone = sum(n for user, n in children if MARK_PROCESS_GONE in user)
    assert blocks >= 100, children
    assert gone == 0 and named >= 0.95 * blocks, children
    # Whole: each child walked by its parent's unwinding rules (offcpu.c
    # rules_owner), libc's start code included (before: cut there, `main ←
    # __libc_start_call_main ← [stack truncated]`, a child having no rules).
    whole = sum(n for user, n in children if user[-2:] == ["__libc_start_main", "_start"])
    assert whole >= 0.95 * blocks, children


def sleeps_of_a_loop(name: str, argv: list[str], comm: str) -> list[tuple[list[str], int]]:
    """A shell loop that execs a `sleep 0.01` again and again (`argv`: the shell, its
    script joining the cgroup `{cg}` first), watched by `offtop -c` for 4 intervals:
    the user stacks of the sleeps `comm` blocked in the kernel's nanosleep, and their
    counts, from the second interval (a process that exec'd before offtop's start
    has no records: README, Known limits). Beside busy CPUs a sleep is also preempted
    on its way, in ld.so, or waits in its exec while its user stack is still the
    shell's: those are not its sleep, and not counted."""
    with fresh_cgroup(name) as cg:
        loop = subprocess.Popen([a.replace("{cg}", str(cg)) for a in argv], start_new_session=True)
        try:
            assert wait_until(lambda: str(loop.pid) in (cg / "cgroup.procs").read_text())
            snaps = offtop_json("-c", str(cg), "--limit", "0", count=4)
        finally:
            os.killpg(loop.pid, signal.SIGKILL)
            loop.wait(timeout=5)
            wait_until(lambda: not (cg / "cgroup.procs").read_text().strip())
    return [(st["user"], st["count"]) for s in snaps[1:] for st in s["stacks"]
            if st["comm"] == comm and "do_nanosleep" in st["kernel"]]


def test_exec_d_processes_gone_within_milliseconds_are_named_in_their_own_mappings() -> None:
    # A shell loop of Debian's `sleep 0.01`: each is a fresh exec that lives ~10 ms
    # and blocks once; it is gone before offtop reads /proc, and, exec'd, it has no
    # forker's memory to be named in. The kernel's records of its executable
    # mappings (offtop.bpf.sent_maps) name it, and the copy of its stack's top the
    # probe sent unwinds it in them (it had no rules: every walk stopped in libc).
    # Before: every block `[not resolved: process gone]` but the few seen alive.
    asleep = sleeps_of_a_loop("execs", ["sh", "-c", "echo $$ > {cg}/cgroup.procs; "
                                         "while :; do /usr/bin/sleep 0.01; done"], "sleep")
    blocks = sum(n for _, n in asleep)
    named = sum(n for user, n in asleep if user and user[0] == "clock_nanosleep")
    whole = sum(n for user, n in asleep if user[-3:-1] == ["__libc_start_call_main", "__libc_start_main"]
                and MARK_TRUNCATED not in user)
    assert blocks >= 100, asleep
    assert named == blocks, [(u, n) for u, n in asleep if not u or u[0] != "clock_nanosleep"]
    # Whole as gdb shows `sleep 1000`'s (README): `clock_nanosleep ← nanosleep ←
    # sleep+0x… ← … ← __libc_start_main ← sleep+0x…`, one seen alive for a moment
    # too (its map_files gone with it: unwound in the files the kernel sent). Where
    # the probe sent no copy (they are paced, 8 ms apart a CPU: offcpu.c copy_stack)
    # the stack is cut, marked. Measured: 268 of 268, 273 of 273 blocks.
    assert whole >= 0.9 * blocks, [(u, n) for u, n in asleep if MARK_TRUNCATED in u]


def test_exec_d_processes_gone_at_once_in_another_mount_namespace_are_unwound_too() -> None:
    # The same loop inside a mount namespace of its own (as a container's): its
    # `sleep` is a copy on a tmpfs mounted at /mnt there, which this namespace does
    # not see. The kernel gives the path as the process saw it, so the binary is
    # found through the root of the shell that forked it (/proc/PID/root), its
    # device and inode checked. Without it the binary's call-frame information could
    # not be read: every stack was cut after its first frame in it (`clock_nanosleep
    # ← nanosleep ← nsleep+0x64af ← [stack truncated]`, 2 of 272 blocks whole).
    unshare = shutil.which("unshare")
    assert unshare, "no unshare (util-linux)"
    asleep = sleeps_of_a_loop("execs-ns", [
        unshare, "--mount", "--propagation", "private", "sh", "-c",
        "echo $$ > {cg}/cgroup.procs; mount -t tmpfs tmpfs /mnt && cp /usr/bin/sleep /mnt/nsleep"
        " && while :; do /mnt/nsleep 0.01; done"], "nsleep")
    assert not os.path.exists("/mnt/nsleep")  # not in this namespace
    blocks = sum(n for _, n in asleep)
    whole = sum(n for user, n in asleep if user[-3:-1] == ["__libc_start_call_main", "__libc_start_main"]
                and user[-1].startswith("nsleep+0x") and MARK_TRUNCATED not in user)
    assert blocks >= 100, asleep
    assert whole >= 0.9 * blocks, [(u, n) for u, n in asleep if MARK_TRUNCATED in u]


def test_debian_pythons_forked_children_are_named_where_their_stacks_are_known(tmp_path: Path) -> None:
    # Debian's python3 (no frame pointers) forks children that sleep 2 ms and
    # exit. Their first frame is named in the parent's map. A child walks by its
    # parent's unwinding rules until offtop has seen it (offcpu.c rules_owner),
    # and the frames only children reach are taught to the parent as their
    # stacks are checked, a frame a check at first: within a few intervals the
    # children's stacks are whole (before, each was `clock_nanosleep ←
    # [stack truncated]`: a process that lived 2 ms had no rules). Where the
    # walk stops early the stack is marked cut, never shown as if whole.
    script = ("import os, sys, time\nprint('ready', flush=True)\nwhile True:\n"
              "    pid = os.fork()\n    if pid == 0:\n        time.sleep(0.002)\n        os._exit(0)\n"
              "    os.waitpid(pid, 0)\n    time.sleep(0.01)\n")
    with fresh_cgroup("pyforks") as cg:
        def join() -> None:
            (cg / "cgroup.procs").write_text(str(os.getpid()))

        proc = subprocess.Popen(["/usr/bin/python3", "-c", script], stdout=subprocess.PIPE,
                                text=True, preexec_fn=join)
        try:
            assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
            snaps = offtop_json("-c", str(cg), "--limit", "0", count=6)
        finally:
            proc.kill()
            proc.wait(timeout=5)
    # From the second snapshot, as for the churn test above: a child forked
    # before the probe noted forks has no note (CI saw one beside a CPU hog).
    children = _children_stacks(snaps[1:], proc.pid)
    blocks = sum(n for _, n in children)
    sleeping = [(user, n) for user, n in children if user[:1] == ["clock_nanosleep"]]
    assert blocks >= 50 and sum(n for _, n in sleeping) >= 0.9 * blocks, children
    assert not any(MARK_PROCESS_GONE in user for user, _ in children), children
    for user, _ in sleeping:
        # libc's clock_nanosleep keeps no frame pointer: a walk that stopped at
        # it stopped early, and says so.
        assert len(user) > 1 and (user[-1] == MARK_TRUNCATED or "_start" in user[-1]), user
    # The last two snapshots: whole, down to the interpreter's main and libc's start.
    late = [(user, n) for user, n in _children_stacks(snaps[-2:], proc.pid)
            if user[:1] == ["clock_nanosleep"]]
    whole = sum(n for user, n in late if user[-1] == "_start" and "Py_BytesMain" in user)
    assert whole >= 0.9 * sum(n for _, n in late) > 0, late


def test_the_probe_notes_who_forked_whom_and_who_exec_d() -> None:
    from offtop.bpf.engine import BpfSource, EngineConfig
    from offtop.bpf.lineage import Lineage
    from offtop.targets import task_start_time

    src = BpfSource(EngineConfig())
    src.start()
    try:
        before = time.clock_gettime_ns(time.CLOCK_BOOTTIME)
        forked = os.fork()
        if forked == 0:
            time.sleep(0.5)
            os._exit(0)
        spawned = subprocess.Popen(["/usr/bin/sleep", "0.5"])
        time.sleep(0.2)
        after = time.clock_gettime_ns(time.CLOCK_BOOTTIME)
        f, s = src.probe.forked(forked), src.probe.forked(spawned.pid)
        lineage = Lineage(src.probe.forked)
        assert f is not None and s is not None
        assert f.parent == os.getpid() and before <= f.fork_ns <= after and f.exec_ns == 0
        assert s.parent == os.getpid() and before <= s.fork_ns <= s.exec_ns <= after
        # Alive, each is its own; here, as if gone, who stands in for it.
        assert lineage.stand_in(forked) == (os.getpid(), task_start_time(os.getpid()))
        assert lineage.stand_in(spawned.pid) is None  # another program since its exec
        # Until offtop has seen it, the forked child walks by our rules; the exec'd
        # one by its own (its memory is another program's).
        probe = src.probe
        owners = probe.rule_owners()
        assert owners.get(forked) == os.getpid() and spawned.pid not in owners
        probe.drop_rule_owners([forked])
        assert forked not in probe.rule_owners()
        os.waitpid(forked, 0)
        spawned.wait(timeout=5)
    finally:
        src.close()


def test_the_first_gzip_is_whole_from_its_second_sighting_with_a_copy_of_its_stack() -> None:
    """The probe sends a new stack whose walk ended on a broken rbp chain with a copy
    of its top 4 KiB (offcpu.c copy_stack); offtop unwinds the copy with gzip's and
    libc's call-frame information and teaches every rule the stack needs at once.
    The first gzip's read() stack is whole from its next walk: two truncated
    versions at most, where learning a frame per sighting took 4 or more (the test
    before this one, its control)."""
    first_pid, first, second_pid, second = two_gzips()
    whole_first = {u for u, _ in first if MARK_TRUNCATED not in u}
    assert whole_first, first
    # Whole: down to libc's start code (gzip's own functions have no symbols).
    assert all("__libc_start_call_main" in u for u in whole_first), first
    assert len(_versions(first)) <= 2, first
    assert second and first_pid != second_pid
    assert len(_versions(second)) <= 2, second
