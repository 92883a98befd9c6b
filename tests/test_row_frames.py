"""Summed rows' frames kept across intervals (offtop.bpf.row_frames): kept only while
nothing in them can change, and never given to another process or another stack.

The stack maps and symbolizers here are fakes (named so): the rules under test
are Python's; tests/test_bpf_e2e.py runs the real probe.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

from offtop.bpf import block_frames
from offtop.bpf.block_frames import BlockFrames
from offtop.bpf.row_frames import RowFrames
from offtop.bpf.stack_store import StackStore
from offtop.bpf.wakers import Wakers, interrupt_path
from offtop.model import Frame

PID = os.getpid()
NO_WAKER = (0, 0, -1, -1, 0, b"")


class FakeStackMaps:
    """Stack ids -> addresses, as the probe's maps would hold them."""

    def __init__(self) -> None:
        self.stacks = {("k", 1): (0xFFFF1,), ("u", 7): (0x401000, 0x402000),
                       ("u", 8): (0x403000,)}

    def stack(self, kind: str, sid: int) -> tuple[int, ...] | None:
        return self.stacks.get((kind, sid))

    def stack_ids(self, kind: str) -> list[int]:
        return [sid for k, sid in self.stacks if k == kind]

    def delete_stacks(self, kind: str, sids: Any, max_gone: int | None = None) -> tuple[int, int]:
        freed = sum(self.stacks.pop((kind, sid), None) is not None for sid in sids)
        return freed, len(sids)


class FakeKernelSymbols:
    def resolve_stack(self, addrs: Any) -> tuple[Frame, ...]:
        return tuple(Frame(f"k{a:x}", kernel=True) for a in addrs)


class FakeUserSymbols:
    """Names addresses after the process's start time; 0x403000 never resolves."""

    def __init__(self) -> None:
        self.calls = 0

    def resolve_stack(self, pid: int, addrs: Any, *, deadline: float | None = None,
                      start: int | None = None) -> tuple[Frame, ...]:
        self.calls += 1
        return tuple(Frame(f"0x{a:x}") if a == 0x403000 else Frame(f"f{a:x}@{start}", "m")
                     for a in addrs)


class FakePython:
    def __init__(self, pids: set[int]) -> None:
        self.pids = pids

    def is_python(self, pid: int) -> bool:
        return pid in self.pids

    def of_site(self, tid: int, ustack: int) -> None:
        return None

    def of_block(self, tid: int, ts: int, *, pop: bool = False) -> None:
        return None


@pytest.fixture
def rig(monkeypatch: pytest.MonkeyPatch) -> Any:
    starts = {PID: 1000}
    monkeypatch.setattr(block_frames, "task_start_time", lambda pid: starts.get(pid))
    frames = BlockFrames(before=None)  # type: ignore[arg-type]  # no before-start rows here
    usyms = FakeUserSymbols()
    frames.stacks = StackStore(FakeStackMaps(), kernel_symbols=FakeKernelSymbols(),  # type: ignore[arg-type]
                               user_symbols=usyms, capacity={"k": 4, "u": 4},  # type: ignore[arg-type]
                               kernel_depth=64, user_depth=64)
    rows = RowFrames(frames, Wakers(frames.kernel, lambda pid, sid: frames.user(pid, sid, None)))

    class Rig:
        pass

    r = Rig()
    r.frames, r.rows, r.usyms, r.starts = frames, rows, usyms, starts  # type: ignore[attr-defined]
    return r


def resolve(rig: Any, us: int = 7) -> Any:
    rig.frames.new_subtick()
    return rig.rows.resolve(PID, PID, 1, us, 1, NO_WAKER, float("inf"))


def test_a_final_row_is_resolved_once_and_its_ids_stay_in_use(rig: Any) -> None:
    first = resolve(rig)
    assert [f.name for f in first[1]] == ["f401000@1000", "f402000@1000"]
    rig.frames.stacks.next_interval(5)
    again = resolve(rig)
    assert again == first and again[1] is first[1]
    assert rig.rows.hits == 1 and rig.usyms.calls == 1
    # The hit stamped its ids as a resolution would: not reclaimable as unused.
    stacks = rig.frames.stacks
    assert (stacks.last_use("k", 1), stacks.last_use("u", 7), stacks.used) == (5, 5, 2)


def test_a_row_with_unresolved_frames_is_looked_at_again(rig: Any) -> None:
    resolve(rig, us=8)
    resolve(rig, us=8)
    assert rig.rows.hits == 0 and len(rig.rows) == 0


def test_a_reused_pid_is_another_process(rig: Any) -> None:
    resolve(rig)
    rig.starts[PID] = 2000  # the pid now names a process started later
    user = resolve(rig)[1]
    assert [f.name for f in user] == ["f401000@2000", "f402000@2000"]
    assert rig.rows.hits == 0


def test_deleted_stack_ids_forget_every_kept_row(rig: Any) -> None:
    resolve(rig)
    rig.frames.stacks.generation += 1  # what reclaim does once it deletes ids
    resolve(rig)
    assert rig.rows.hits == 0 and rig.rows.misses == 2


def test_a_reclaim_forgets_only_what_is_kept_by_the_kernel_ids_it_deleted(rig: Any) -> None:
    """A reclaim deletes kernel ids no row used lately; rows and wakers kept by other ids
    stay kept (a busy server's interrupts fill the map every ~15 s: forgetting all
    then had every row resolved afresh in one interval)."""
    stacks = rig.frames.stacks
    stacks._maps.stacks[("k", 2)] = (0xFFFF2,)
    irq = 2 << 24

    def row(ks: int) -> Any:
        rig.frames.new_subtick()
        return rig.rows.resolve(PID, PID, 1, 7, ks, NO_WAKER, float("inf"))

    stacks.next_interval(1)
    row(1), row(2)
    assert rig.rows.waker((0, 0, -1, 2, irq, b""))[1]  # an interrupt's waker, kept by id 2
    stacks.next_interval(4)
    row(1)  # id 1 used now, id 2 not since interval 1
    stacks.reclaim(live=set())
    assert (stacks.kernel_frees, stacks.freed_kernel_ids, stacks.generation) == (1, {2}, 0)
    hits = rig.rows.hits
    row(1)
    assert rig.rows.hits == hits + 1  # kept on
    row(2)
    assert rig.rows.hits == hits + 1 and rig.rows.misses == 3  # resolved afresh
    assert rig.rows.kept_interrupt_waker(irq, 2) is None


def test_rows_of_a_python_process_are_never_kept(rig: Any) -> None:
    rig.frames.python = FakePython({PID})
    resolve(rig)
    resolve(rig)
    assert rig.rows.hits == 0 and len(rig.rows) == 0


def test_an_interrupts_waker_path_stops_at_its_entry(rig: Any) -> None:
    """Two timer expiries that stopped different code are one waker: what was
    interrupted says nothing of the wakeup."""
    def frames(*names: str) -> tuple[Frame, ...]:
        return tuple(Frame(n, kernel=True) for n in names)

    path = ("try_to_wake_up", "hrtimer_wakeup", "__hrtimer_run_queues", "hrtimer_interrupt",
            "__sysvec_apic_timer_interrupt", "sysvec_apic_timer_interrupt",
            "asm_sysvec_apic_timer_interrupt")
    stacks = {3: frames(*path, "pv_native_safe_halt", "default_idle"),
              4: frames(*path, "copy_user_generic", "ksys_read")}
    wakers = Wakers(lambda sid: stacks[sid], lambda pid, sid: ())  # 2 << 24: an interrupt
    a = wakers.waker((0, 0, -1, 3, 2 << 24, b""))
    b = wakers.waker((0, 0, -1, 4, 2 << 24, b""))
    assert a is not None and a == b and a.kind == "timer"
    assert [f.name for f in a.kernel] == list(path)
    # A stack with no entry frame (a softirq in ksoftirqd) is kept whole.
    assert interrupt_path(stacks[3][:2]) == stacks[3][:2]


def test_rows_not_asked_for_in_a_whole_interval_are_dropped(rig: Any) -> None:
    resolve(rig)
    rig.rows.next_interval()
    resolve(rig)  # asked for again: kept on
    rig.rows.next_interval()
    rig.rows.next_interval()
    assert rig.rows.hits == 1 and len(rig.rows) == 0  # a process gone: nothing left
    resolve(rig)
    assert rig.rows.misses == 2


def test_a_kept_row_woken_by_another_is_given_that_waker(rig: Any) -> None:
    # A task waker (1 << 24) with a user stack: kept whole with the row, and
    # only for that waker and that waking process.
    WAKER_PID = PID + 1
    rig.starts[WAKER_PID] = 500
    by_a = (WAKER_PID, WAKER_PID, 7, 1, 1 << 24, b"a")
    by_b = (WAKER_PID, WAKER_PID + 1, 7, 1, 1 << 24, b"b")

    def row(waker: Any) -> Any:
        rig.frames.new_subtick()
        return rig.rows.resolve(PID, PID, 1, 7, 1, waker, float("inf"))

    first = row(by_a)
    assert first[3].comm == "a" and [f.name for f in first[3].user] == ["f401000@500",
                                                                         "f402000@500"]
    assert row(by_a) == first  # kept
    other = row(by_b)
    assert other[3].comm == "b" and other[:3] == first[:3]
    assert row(by_a) == first  # kept whole again, for waker a
    rig.starts[WAKER_PID] = 600  # the waker's pid now names a process started later
    again = row(by_a)
    assert [f.name for f in again[3].user] == ["f401000@600", "f402000@600"]
    assert rig.rows.hits == 4 and rig.rows.misses == 1


def test_an_interrupts_waker_is_kept_by_its_kind_and_kernel_stack(rig: Any) -> None:
    # An interrupt (2 << 24 | its irq) names its waker by its kernel stack alone:
    # once resolved, it is found by (what, kernel stack id), without the row's
    # raw waker (the engine's carried rows), and not for another kind or stack.
    irq = 2 << 24 | 5
    w, final = rig.rows.waker((0, 0, -1, 1, irq, b""))
    assert final and w is not None and w.kind == "interrupt" and w.pid == 0
    assert rig.rows.kept_interrupt_waker(irq, 1) is w
    assert rig.rows.waker((0, 0, -1, 1, irq, b"")) == (w, True)
    assert rig.rows.kept_interrupt_waker(2 << 24 | 6, 1) is None  # another irq
    assert rig.rows.kept_interrupt_waker(irq, 2) is None  # another stack
    assert rig.rows.kept_interrupt_waker(1 << 24, 1) is None  # a task's: never by this
    rig.frames.stacks.next_interval(5)
    assert rig.rows.kept_interrupt_waker(irq, 1) is w
    assert rig.frames.stacks.last_use("k", 1) == 5  # stamped as used, as resolving would
    rig.frames.stacks.generation += 1  # ids deleted: nothing kept holds
    assert rig.rows.kept_interrupt_waker(irq, 1) is None


def test_a_read_of_rows_finds_interrupts_wakers_as_kept_after_one_generation_check(
        rig: Any) -> None:
    # `interrupt_wakers` answers as `kept_interrupt_waker` for one read of rows: ids
    # freed before the read void what was kept (checked as it begins), and a hit
    # does not stamp the stack (the interval's rows are, at its snapshot).
    irq = 2 << 24 | 5
    w, _final = rig.rows.waker((0, 0, -1, 1, irq, b""))
    kept = rig.rows.interrupt_wakers()
    rig.frames.stacks.next_interval(5)
    assert kept(irq, 1) is w
    assert kept(2 << 24 | 6, 1) is None and kept(irq, 2) is None and kept(1 << 24, 1) is None
    assert rig.frames.stacks.last_use("k", 1) != 5
    rig.frames.stacks.generation += 1  # ids deleted before the next read
    assert rig.rows.interrupt_wakers()(irq, 1) is None


def test_wakers_not_asked_for_in_a_whole_interval_are_forgotten() -> None:
    stacks = {3: (Frame("hrtimer_wakeup", kernel=True),
                  Frame("asm_sysvec_apic_timer_interrupt", kernel=True))}
    wakers = Wakers(lambda sid: stacks[sid], lambda pid, sid: ())
    raw = (0, 0, -1, 3, 2 << 24, b"")  # an interrupt
    a = wakers.waker(raw)
    wakers.next_interval()
    assert wakers.waker(raw) is a  # asked for again: kept on
    wakers.next_interval()
    wakers.next_interval()
    assert len(wakers) == 0
    assert wakers.waker(raw) == a


def test_recent_is_bounded_over_both_generations() -> None:
    """The caches built on `Recent` (kept rows, wakers, chains) hold at most
    `max_kept` entries, the older generation counted too."""
    from offtop.recent import Recent

    kept: Recent[int, str] = Recent(4)
    for k in range(3):
        kept.put(k, "old")
    kept.rotate()
    kept.put(10, "new")
    assert len(kept) == 4
    kept.put(11, "new")  # full: emptied first
    assert len(kept) == 1 and kept.get(11) == "new" and kept.get(0) is None


def test_recent_get_many_finds_both_generations_and_keeps_what_it_found() -> None:
    """`get_many` is `get` of each key: what it finds in the older generation is
    moved into the newer (kept past the next rotation), what it misses stays missed."""
    from offtop.recent import Recent

    kept: Recent[int, str] = Recent(10)
    kept.put(1, "one")
    kept.put(2, "two")
    kept.rotate()
    kept.put(3, "three")
    assert kept.get_many([3, 1, 9, 3]) == ["three", "one", None, "three"]
    kept.rotate()  # 2 was not asked for over a generation: gone; 1 and 3 stay
    assert kept.get_many([1, 2, 3]) == ["one", None, "three"]


def test_a_waker_not_final_is_resolved_once_an_interval(rig: Any) -> None:
    """The threads of a process that exits are woken by its main thread: their rows,
    read once it is gone, share one raw waker whose stack nothing keeps (its
    process is gone). It is resolved once for all of them, and again at the next
    interval (it may be named better then), not once a row."""
    GONE = PID + 2  # no start time: gone before the read
    by_gone = (GONE, GONE, 7, 1, 1 << 24, b"exiting")
    resolve(rig)  # the rows' own stack, resolved and kept
    first, final = rig.rows.waker(by_gone)
    assert not final and first is not None and first.comm == "exiting"
    calls = rig.usyms.calls
    for tid in (PID + 10, PID + 11, PID + 12):
        w, final = rig.rows.resolve(PID, tid, 1, 7, 1, by_gone, float("inf"))[3:6:2]
        assert w is first and not final
    assert rig.usyms.calls == calls  # the waker's stack was not resolved again
    rig.rows.next_interval()
    again, final = rig.rows.waker(by_gone)
    assert again == first and not final
    assert rig.usyms.calls == calls + 1  # resolved afresh in the next interval
