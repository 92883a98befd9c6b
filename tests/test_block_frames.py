"""Blocks from before the start symbolized in the first interval's idle time
(offtop.bpf.block_frames.BlockFrames.warm_before_start).

The clock, the blocks and the unwound stacks are fakes (named so): the rule under
test is Python's; tests/test_truth_e2e.py runs it on Debian's sleep, beside the
real probe.
"""

from __future__ import annotations

from typing import Any

from offtop.bpf.before_start import Before
from offtop.bpf.block_frames import BlockFrames
from offtop.bpf.blocked import Blocked
from offtop.bpf.unwound import UnwoundStacks
from offtop.model import Frame
from offtop.unwind import StopReason, UnwindResult


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class FakeBeforeStart:
    def __init__(self, tids: list[int]) -> None:
        self._blocks = {tid: Before(ts=tid * 10, kernel=(), pid=tid) for tid in tids}

    def blocks(self) -> list[tuple[int, Before]]:
        return list(self._blocks.items())


class FakeUnwound:
    """Each block's symbols take `cost` seconds of the fake clock to load, once."""

    def __init__(self, clock: FakeClock, cost: float) -> None:
        self.clock, self.cost = clock, cost
        self.calls: list[int] = []
        self.loaded: set[int] = set()

    def frames(self, tid: int, ts: int, deadline: float | None, *,
               pop: bool = False) -> tuple[Frame, ...]:
        assert not pop  # warming leaves the block for the snapshot
        self.calls.append(tid)
        if tid not in self.loaded:
            self.clock.now += self.cost
            if deadline is None or self.clock.now < deadline:
                self.loaded.add(tid)
        return (Frame(f"f{tid}"),)


def warmed_rig(tids: list[int], cost: float) -> Any:
    clock = FakeClock()
    frames = BlockFrames(FakeBeforeStart(tids), clock=clock)  # type: ignore[arg-type]
    unwound = FakeUnwound(clock, cost)
    frames.unwound = unwound  # type: ignore[assignment]
    return frames, unwound, clock


def test_warming_stops_at_the_deadline_and_goes_on_where_it_stopped() -> None:
    frames, unwound, clock = warmed_rig([1, 2, 3], cost=0.03)
    assert not frames.warm_before_start(clock.now + 0.05)  # 1 loaded, 2 cut short
    assert unwound.calls == [1, 2] and unwound.loaded == {1}
    assert not frames.warm_before_start(clock.now + 0.05)  # 2 again, 3 cut short
    assert unwound.calls == [1, 2, 2, 3] and unwound.loaded == {1, 2}
    assert frames.warm_before_start(clock.now + 0.05)  # 3 done: all are
    assert unwound.loaded == {1, 2, 3}
    calls = len(unwound.calls)
    assert frames.warm_before_start(clock.now + 0.05)
    assert len(unwound.calls) == calls  # nothing done twice


def test_warming_past_its_deadline_does_nothing() -> None:
    frames, unwound, clock = warmed_rig([1], cost=0.01)
    assert not frames.warm_before_start(clock.now)
    assert unwound.calls == []


class FakeUnwinder:
    """Every blocked thread unwinds to the same two addresses, to the stack's end.
    Records the maps each walk was given, and counts reads of a process's maps."""

    def __init__(self) -> None:
        self.maps_read: list[int] = []
        self.walked_with: list[Any] = []

    def read_maps(self, pid: int) -> list[str]:
        self.maps_read.append(pid)
        return [f"maps of {pid}, read {len(self.maps_read)}"]

    def unwind_blocked(self, pid: int, tid: int, bp: int | None = None, *,
                       saved: Any = None, maps_of: Any = None) -> UnwindResult:
        self.walked_with.append(maps_of(pid))
        return UnwindResult((0x1000, 0x2000), StopReason.OUTERMOST)


class FakeSymbols:
    """Names addresses once `loaded`; until then each is a bare address. Counts calls."""

    def __init__(self) -> None:
        self.loaded = False
        self.calls = 0

    def resolve_stack(self, pid: int, addrs: Any, *, deadline: float | None = None,
                      start: int | None = None) -> tuple[Frame, ...]:
        self.calls += 1
        return tuple(Frame(f"f{a:x}" if self.loaded else f"{a:#x}") for a in addrs)


def test_an_unwound_block_is_symbolized_until_every_frame_is_named_then_kept() -> None:
    """A thread blocked for hours is shown at every snapshot: its frames are named
    again only while a name is missing (a big file's symbols may come later)."""
    symbols = FakeSymbols()
    stacks = UnwoundStacks(FakeUnwinder(), symbols, clock=FakeClock())  # type: ignore[arg-type]
    assert stacks.unwind(7, 70, 1234, 0, until=1.0)
    first = stacks.frames(70, 1234, None)
    assert first is not None and all(f.unknown for f in first)
    assert stacks.frames(70, 1234, None) == first and symbols.calls == 2  # tried again
    symbols.loaded = True
    named = stacks.frames(70, 1234, None)
    assert named is not None and [f.name for f in named] == ["f1000", "f2000"]
    for _ in range(5):
        assert stacks.frames(70, 1234, None) == named
    assert symbols.calls == 3  # kept once named
    assert stacks.frames(70, 1234, None, pop=True) == named  # the long block's event takes it
    assert stacks.frames(70, 1234, None) is None and symbols.calls == 3


def test_a_process_s_maps_are_read_once_a_pass_over_its_blocked_threads() -> None:
    """A process of 5,000 idle threads has a maps file of ~0.5 MB (a mapping per
    thread's stack): read once per thread, each pass took ~6 ms a thread."""
    unwinder = FakeUnwinder()
    stacks = UnwoundStacks(unwinder, FakeSymbols(), clock=FakeClock())  # type: ignore[arg-type]
    stacks.new_pass()
    for tid in (70, 71, 72):
        assert stacks.unwind(7, tid, 1234, 0, until=1.0)
    assert stacks.unwind(8, 80, 1234, 0, until=1.0)
    assert unwinder.maps_read == [7, 8]
    assert unwinder.walked_with == [["maps of 7, read 1"]] * 3 + [["maps of 8, read 2"]]
    stacks.new_pass()  # the next snapshot: the maps may have changed since
    assert stacks.unwind(7, 73, 1234, 0, until=1.0)
    assert unwinder.maps_read == [7, 8, 7]
    assert unwinder.walked_with[-1] == ["maps of 7, read 3"]


class FailingUnwinder:
    """A thread whose registers cannot be read (another user's /proc files). Counts calls."""

    def __init__(self) -> None:
        self.calls = 0

    def read_maps(self, pid: int) -> list[str]:
        return []

    def unwind_blocked(self, pid: int, tid: int, bp: int | None = None, *,
                       saved: Any = None, maps_of: Any = None) -> UnwindResult:
        self.calls += 1
        return UnwindResult((), StopReason.NOT_BLOCKED)


def test_a_block_that_cannot_be_unwound_is_tried_again_only_now_and_then() -> None:
    clock = FakeClock()
    unwinder = FailingUnwinder()
    stacks = UnwoundStacks(unwinder, FakeSymbols(), clock=clock)  # type: ignore[arg-type]
    for _ in range(5):  # five snapshots within a few seconds
        assert not stacks.unwind(1, 10, 555, 0, until=clock.now + 1)
        clock.now += 1.0
    assert unwinder.calls == 1
    clock.now += UnwoundStacks.RETRY_S
    assert not stacks.unwind(1, 10, 555, 0, until=clock.now + 1)
    assert unwinder.calls == 2
    assert not stacks.unwind(1, 10, 556, 0, until=clock.now + 1)  # another block: tried
    assert unwinder.calls == 3


def test_the_blocks_of_processes_gone_are_let_go_at_the_sweep() -> None:
    """Blocks unwound are bounded by a count; under process churn most of them were
    of processes gone. The engine's sweep drops those (and their named frames)."""
    stacks = UnwoundStacks(FakeUnwinder(), FakeSymbols(), clock=FakeClock())  # type: ignore[arg-type]
    for pid, tid, ts in ((7, 70, 1), (7, 71, 2), (8, 80, 3)):
        assert stacks.unwind(pid, tid, ts, 0, until=1.0)
        assert stacks.frames(tid, ts, None) is not None
    alive = {7: 1000}
    assert stacks.forget_gone(alive.get) == 1
    assert stacks.frames(80, 3, None) is None
    assert stacks.frames(70, 1, None) is not None and stacks.frames(71, 2, None) is not None
    assert stacks.forget_gone(alive.get) == 0


def test_a_process_gone_keeps_its_start_time_until_its_last_sums_are_read() -> None:
    # A real process (Debian's sleep), its start time read from /proc while it
    # lives. Once it is gone, its rows still name it by that start time (its
    # frames stay cached) through the read of the kernel's sums after the one
    # it was found gone before (its blocks between that read's cut and its
    # exit), then it is forgotten: a pid gone longer may be another process's.
    import subprocess

    from offtop.targets import task_start_time

    frames = BlockFrames(FakeBeforeStart([]))  # type: ignore[arg-type]
    p = subprocess.Popen(["sleep", "30"])
    try:
        start = frames.start_of(p.pid)
        assert start == task_start_time(p.pid) and start > 0
    finally:
        p.kill()
        p.wait()
    assert task_start_time(p.pid) is None
    frames.new_subtick()
    assert frames.start_of(p.pid) == start  # found gone: still itself
    frames.sums_read()  # the read it was found gone before
    frames.new_subtick()
    assert frames.start_of(p.pid) == start  # its last sums are read next
    frames.sums_read()
    frames.new_subtick()
    assert frames.start_of(p.pid) == 0  # forgotten
    frames.sums_read()
    frames.new_subtick()
    assert frames.start_of(p.pid) == 0


def test_a_pid_found_alive_again_keeps_the_new_process_s_start_time(monkeypatch: Any) -> None:
    # The pid of a process gone is another process's by the next look: that one's
    # start time is not forgotten with the gone one's.
    import offtop.bpf.block_frames as module

    fake_proc_starts = {7: 100}
    monkeypatch.setattr(module, "task_start_time", fake_proc_starts.get)
    frames = BlockFrames(FakeBeforeStart([]))  # type: ignore[arg-type]
    assert frames.start_of(7) == 100
    del fake_proc_starts[7]
    frames.new_subtick()
    assert frames.start_of(7) == 100  # gone, still itself
    frames.sums_read()
    fake_proc_starts[7] = 200  # the pid reused
    frames.new_subtick()
    assert frames.start_of(7) == 200
    frames.sums_read()  # the gone one is forgotten, not the new one
    frames.sums_read()
    del fake_proc_starts[7]
    frames.new_subtick()
    assert frames.start_of(7) == 200  # the new one, gone now, still itself


class FakeStackStore:
    """What the stack store has kept per (pid, start), and how it was asked."""

    def __init__(self, kept: dict[tuple[int, int, int], tuple[Frame, ...]]) -> None:
        self.kept = kept
        self.resolved: list[tuple[int, int, int]] = []

    def kept_user(self, pid: int, start: int, sid: int) -> tuple[Frame, ...] | None:
        return self.kept.get((pid, start, sid))

    def user(self, pid: int, start: int, sid: int, *, deadline: float | None = None
             ) -> tuple[Frame, ...]:
        self.resolved.append((pid, start, sid))
        return self.kept.get((pid, start, sid), (Frame(f"resolved-{pid}-{start}-{sid}"),))


def test_a_process_gone_gets_its_kept_frames_else_is_resolved_as_gone(monkeypatch: Any) -> None:
    # While it lived, process 7 (started at 100) had stack 1 resolved and kept.
    # Gone, its rows find that stack kept under its start time; a stack never
    # resolved while it lived is resolved as any process gone is (start 0: in
    # the process it was forked from, nothing kept), and its new stacks are not
    # resolved at sub-ticks, nor is it seen by the unwind rules' repair
    # (`start_if_alive` is 0).
    import offtop.bpf.block_frames as module

    fake_proc_starts = {7: 100}
    monkeypatch.setattr(module, "task_start_time", fake_proc_starts.get)
    frames = BlockFrames(FakeBeforeStart([]))  # type: ignore[arg-type]
    store = FakeStackStore({(7, 100, 1): (Frame("kept"),)})
    frames.stacks = store  # type: ignore[assignment]
    assert frames.user(7, 1, None) == (Frame("kept"),)
    assert frames.start_if_alive(7) == 100
    del fake_proc_starts[7]
    frames.new_subtick()
    assert frames.start_of(7) == 100 and frames.start_if_alive(7) == 0
    store.resolved.clear()
    assert frames.user(7, 1, None) == (Frame("kept"),)
    assert store.resolved == []  # found kept: nothing resolved
    assert frames.user(7, 2, None) == (Frame("resolved-7-0-2"),)
    assert store.resolved == [(7, 0, 2)]


class FakeResolvingStore:
    """A stack store that holds nothing until asked to resolve: `whole_ids` resolve
    to stacks that reach their end, the others to a cut one."""

    def __init__(self, whole_ids: set[int]) -> None:
        self.whole_ids = whole_ids
        self.cached: dict[int, tuple[Frame, ...]] = {}

    def final(self, pid: int, start: int, sid: int) -> bool:
        return sid in self.cached

    def whole(self, pid: int, start: int, sid: int) -> bool:
        return sid in self.cached and sid in self.whole_ids

    def user(self, pid: int, start: int, sid: int, *, deadline: float | None = None
             ) -> tuple[Frame, ...]:
        if sid not in self.cached:
            self.cached[sid] = ((Frame(f"whole-{sid}"),) if sid in self.whole_ids
                                else (Frame(f"cut-{sid}"), Frame("[stack truncated]")))
        return self.cached[sid]

    def kernel(self, sid: int) -> tuple[Frame, ...]:
        return (Frame("schedule", "kernel", True),)


class FakeBlockedReader:
    def __init__(self, rows: list[Blocked]) -> None:
        self.rows = rows

    def read(self) -> tuple[list[Blocked], set[tuple[str, int]]]:
        return self.rows, set()


class FakeUnwoundCalls:
    """Records which threads were unwound; knows none of them."""

    def __init__(self) -> None:
        self.unwound: list[int] = []

    def new_pass(self) -> None:
        pass

    def unwind(self, pid: int, tid: int, ts: int, ubp: int, until: float) -> bool:
        self.unwound.append(tid)
        return False

    def trim(self) -> None:
        pass


def test_a_blocked_thread_s_new_stack_is_resolved_before_any_unwinding(monkeypatch: Any) -> None:
    """Unwinding a blocked thread (~0.4 ms) is for stacks the probe could not walk
    whole. A stack new since the last look is resolved first: whole, the thread is
    not unwound (on a busy server, ten a snapshot were, each for nothing)."""
    import offtop.bpf.block_frames as module

    monkeypatch.setattr(module, "task_start_time", lambda pid: 100)
    monkeypatch.setattr(module, "_comm_of", lambda pid, tid: "fake")
    frames = BlockFrames(FakeBeforeStart([]))  # type: ignore[arg-type]
    frames.stacks = FakeResolvingStore(whole_ids={1})  # type: ignore[assignment]
    unwound = FakeUnwoundCalls()
    frames.unwound = unwound  # type: ignore[assignment]
    rows = [Blocked(tid=71, pid=7, state=1, waited_ns=10**9, ustack=1, kstack=3, ts=5, ubp=0),
            Blocked(tid=72, pid=7, state=1, waited_ns=10**9, ustack=2, kstack=3, ts=6, ubp=0)]
    shown, _live = frames.blocked_now(FakeBlockedReader(rows), lambda pid, tid: True,  # type: ignore[arg-type]
                                      symbol_budget_s=1.0, unwind_budget_s=1.0)
    assert unwound.unwound == [72]  # only the stack the probe walked cut short
    assert [b.user[0].name for b in shown] == ["whole-1", "cut-2"]
