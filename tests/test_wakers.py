"""Who woke each block: real BPF against threads whose wakers are known (issue 11).

tests/workloads/wakers.c makes them: a pipe reader woken by a named writer
thread, a futex waiter released by a named thread, a sleeper woken by the
timer interrupt, and a chain A wakes B wakes C.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from offtop.model import Snapshot, StackRow, Waker
from tests.conftest import ROOT, offtop_json, run_offtop

MS = 1_000_000
SRC = ROOT / "tests" / "workloads" / "wakers.c"

pytestmark = [pytest.mark.bpf, pytest.mark.usefixtures("bpf_available")]


@pytest.fixture(scope="module")
def wakers_bin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cc = shutil.which("gcc") or shutil.which("cc")
    assert cc, "no C compiler: run the README's test command (it installs gcc)"
    out = tmp_path_factory.mktemp("wakers") / "wakers"
    subprocess.run([cc, "-O1", "-g", "-fno-omit-frame-pointer", "-pthread", "-o", str(out),
                    str(SRC)], check=True)
    return out


class Workload:
    """One run of wakers.c: its pid, measured tid and the lines it printed."""

    def __init__(self, binary: Path, *args: str) -> None:
        self.proc = subprocess.Popen([str(binary), *args], stdout=subprocess.PIPE, text=True,
                                     start_new_session=True)
        assert self.proc.stdout is not None
        ready = self.proc.stdout.readline()
        m = re.search(r"ready pid=(\d+) tid=(\d+)", ready)
        assert m, ready
        self.pid, self.tid = int(m.group(1)), int(m.group(2))
        # Every mode but `timer` names its waker(s) on a second line.
        self.lines = [self.proc.stdout.readline()] if args[0] != "timer" else []

    def value(self, name: str) -> int:
        for line in self.lines:
            m = re.search(rf"\b{name}=(\d+)", line)
            if m:
                return int(m.group(1))
        raise AssertionError(f"{name} not in {self.lines}")

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=5)


@pytest.fixture
def run(wakers_bin: Path) -> Iterator[Any]:
    started: list[Workload] = []

    def start(*args: str) -> Workload:
        w = Workload(wakers_bin, *args)
        started.append(w)
        return w

    yield start
    for w in started:
        w.stop()


def snapshots(pids: tuple[int, ...], n: int, *, threshold_ns: int = 10**9,
              **cfg: Any) -> list[Snapshot]:
    from offtop.bpf.engine import BpfSource, EngineConfig

    src = BpfSource(EngineConfig(pids=pids, threshold_ns=threshold_ns, **cfg))
    src.start()
    try:
        stop = threading.Event()
        out = []
        for _ in range(n):
            snap = src.next_snapshot(1.0, stop)
            assert snap is not None
            out.append(snap)
        return out
    finally:
        src.close()


def stacks_of(snaps: list[Snapshot], tid: int) -> list[StackRow]:
    # The first snapshot covers start-up (rules for the unwinder still being learned).
    return [s for snap in snaps[1:] for s in snap.stacks if s.tid == tid]


def waker_share(stacks: list[StackRow], ok: Any) -> float:
    """The share of these stacks' off-CPU time ended by a waker for which ok(waker)."""
    total = sum(s.offcpu_ns for s in stacks)
    good = sum(w.offcpu_ns for s in stacks for w in s.wakers if ok(w.waker))
    assert total > 0, "no off-CPU time seen"
    return good / total


def names(frames: Any) -> list[str]:
    return [f.name for f in frames]


def test_pipe_writer_wakes_the_reader_in_summed_stacks_and_long_blocks(run: Any) -> None:
    w = run("pipe", "50")
    writer = w.value("tid")
    # Blocks of ~50 ms: a 30 ms threshold sends them as events, a higher one sums them.
    for threshold, kind in ((30 * MS, "events"), (10**9, "sums")):
        snaps = snapshots((w.pid,), 4, threshold_ns=threshold)
        stacks = stacks_of(snaps, w.tid)

        def by_writer(k: Waker) -> bool:
            return (k.kind == "task" and k.tid == writer and k.pid == w.pid
                    and k.comm == "wl-writer"
                    and any(n.endswith("pipe_write") for n in names(k.kernel)))

        share = waker_share(stacks, by_writer)
        assert share >= 0.9, (kind, share, [(x.waker, x.offcpu_ns) for s in stacks
                                            for x in s.wakers][:5])
        if kind == "events":
            blocks = [b for snap in snaps[1:] for b in snap.long_blocks if b.tid == w.tid]
            assert blocks, "no long block of the reader"
            woken = [b for b in blocks if b.waker is not None and b.waker.tid == writer]
            assert len(woken) >= 0.9 * len(blocks), [b.waker for b in blocks][:5]
            assert any("offtop_wk_write_loop" in names(b.waker.user) for b in woken
                       if b.waker is not None), [names(b.waker.user) for b in woken][:3]


def test_futex_released_by_a_named_thread(run: Any) -> None:
    w = run("futex", "50")
    unlocker = w.value("tid")
    stacks = stacks_of(snapshots((w.pid,), 4), w.tid)

    def by_unlocker(k: Waker) -> bool:
        return k.tid == unlocker and k.comm == "wl-unlocker" and any(
            "futex_wake" in n for n in names(k.kernel)) and "offtop_wk_unlock" in names(k.user)

    assert waker_share(stacks, by_unlocker) >= 0.9


def test_timer_expiry_is_an_interrupt_with_its_path(run: Any) -> None:
    """Also while the timer interrupts a task running in user mode, which (on x86-64) is
    handled on that task's own stack: the interrupted task is never taken for the waker."""
    w = run("timer", "50")
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                for _ in range(os.cpu_count() or 2)]
    try:
        stacks = stacks_of(snapshots((w.pid,), 4), w.tid)
    finally:
        for p in spinners:
            p.kill()
            p.wait()

    def by_timer(k: Waker) -> bool:
        return (k.kind == "timer" and k.pid == 0 and k.tid == 0
                and "hrtimer_wakeup" in names(k.kernel))

    assert waker_share(stacks, by_timer) >= 0.9
    # Never the task that happened to be interrupted.
    assert not any(x.waker.kind == "task" for s in stacks for x in s.wakers
                   if "hrtimer_wakeup" in names(x.waker.kernel))


def test_a_chain_a_wakes_b_wakes_c(run: Any) -> None:
    w = run("chain", "50")
    a, b, c = w.value("a"), w.value("b"), w.value("c")
    snaps = snapshots((w.pid,), 4)
    assert waker_share(stacks_of(snaps, b), lambda k: k.tid == a and k.comm == "wl-a") >= 0.9
    assert waker_share(stacks_of(snaps, c), lambda k: k.tid == b and k.comm == "wl-b") >= 0.9


def test_json_carries_wakers_and_no_wakers_turns_them_off(run: Any) -> None:
    w = run("pipe", "50")
    writer = w.value("tid")
    snaps = offtop_json("-p", str(w.pid), "--threshold", "30ms", count=3)
    blocks = [b for s in snaps[1:] for b in s["long_blocks"] if b["tid"] == w.tid]
    assert blocks and all(set(b["waker"]) >= {"pid", "tid", "comm", "kernel", "user"}
                          for b in blocks if b["waker"])
    assert sum(1 for b in blocks if b["waker"] and b["waker"]["tid"] == writer) >= 0.9 * len(blocks)
    stacks = [s for snap in snaps[1:] for s in snap["stacks"] if s["tid"] == w.tid]
    assert any(x["tid"] == writer and x["offcpu_ns"] > 0 for s in stacks for x in s["wakers"])
    quiet = offtop_json("-p", str(w.pid), "--threshold", "30ms", "--no-wakers", count=3)
    assert [b for s in quiet[1:] for b in s["long_blocks"] if b["tid"] == w.tid]
    assert not any(b["waker"] for s in quiet for b in s["long_blocks"])
    assert [s for snap in quiet[1:] for s in snap["stacks"] if s["tid"] == w.tid]
    assert not any(s["wakers"] for snap in quiet for s in snap["stacks"])


def test_folded_wakers_stand_the_writer_on_the_reader(run: Any) -> None:
    """--folded-wakers: the reader's stack, `--`, then the writer's kernel stack and name."""
    w = run("pipe", "50")
    r = run_offtop("--batch", "--format", "folded", "--folded-wakers", "--count", "3",
                   "--interval", "1", "-p", str(w.pid))
    assert r.returncode == 0, r.stderr
    reader = [line for line in r.stdout.splitlines() if "pipe_read" in line.partition(";--;")[0]]
    assert reader, r.stdout
    total = sum(int(line.rsplit(" ", 1)[1]) for line in reader)
    woken = sum(int(line.rsplit(" ", 1)[1]) for line in reader
                if "pipe_write" in line.partition(";--;")[2] and "wl-writer" in line)
    assert woken >= 0.9 * total, r.stdout
    plain = run_offtop("--batch", "--format", "folded", "--count", "2", "--interval", "1",
                       "-p", str(w.pid))
    assert plain.returncode == 0 and plain.stdout and ";--;" not in plain.stdout


def test_waker_options_refused_in_one_line() -> None:
    for args, why in ((["--folded-wakers"], "--folded-wakers needs --format folded"),
                      (["--format", "folded", "--folded-wakers", "--no-wakers"],
                       "--folded-wakers needs"),
                      (["--no-wakers", "--waker-stacks-min", "5ms"], "with --no-wakers"),
                      (["--waker-stacks-min", "soon"], "--waker-stacks-min:")):
        r = run_offtop("--batch", "--count", "1", *args)
        assert r.returncode == 2 and why in r.stderr and len(r.stderr.splitlines()) == 1, \
            (args, r.stderr)


def test_timer_woken_rows_carried_across_intervals_keep_their_interrupt_wakers(run: Any) -> None:
    """Threads woken by their timers interval after interval, while spinners are what
    the timer interrupts: their rows are carried from one interval to the next,
    and the interrupt's kernel stack differs from block to block (what it
    stopped), so each carried row's waker is named again, from a memo of the
    interrupts' stacks that rows share (`BpfSource._sum_rows`). Each must stay
    its timer's, with its path up to the interrupt's entry, never the
    interrupted task."""
    from offtop.bpf.engine import BpfSource, EngineConfig
    from offtop.symbols import KernelSymbols

    ws = [run("timer", "20") for _ in range(4)]
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                for _ in range(os.cpu_count() or 2)]
    src = BpfSource(EngineConfig(pids=tuple(w.pid for w in ws), threshold_ns=10**9))
    try:
        src.start()
        stop = threading.Event()
        snaps = [src.next_snapshot(1.0, stop) for _ in range(3)]
        carried = src.carried
        snaps += [src.next_snapshot(1.0, stop) for _ in range(3)]
        assert src.carried > carried  # their rows were carried, their wakers named again
        # The probe kept the interrupts' stacks cut after their entry (offcpu.c
        # irq_path_id): a few paths, whatever the spinners were doing when stopped,
        # and no kernel_stacks id for each.
        entry = KernelSymbols().entry_text
        assert entry is not None
        paths = [src.probe.stack("i", sid) for sid in src.probe.stack_ids("i")]
        assert paths and all(p and entry[0] <= p[-1] < entry[1] for p in paths), paths
        assert len(paths) <= 16, len(paths)
    finally:
        src.close()
        for p in spinners:
            p.kill()
            p.wait()

    def by_timer(k: Waker) -> bool:
        return (k.kind == "timer" and k.pid == 0 and k.tid == 0
                and "hrtimer_wakeup" in names(k.kernel)
                and bool(k.kernel) and k.kernel[-1].name.startswith("asm_"))

    for snap in snaps[3:]:
        assert snap is not None
        for w in ws:
            stacks = [s for s in snap.stacks if s.tid == w.tid]
            assert waker_share(stacks, by_timer) >= 0.9, [s.wakers for s in stacks]
            assert not any(x.waker.kind == "task" for s in stacks for x in s.wakers
                           if "hrtimer_wakeup" in names(x.waker.kernel))
