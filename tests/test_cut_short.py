"""Long blocks whose user frames a time budget cut short are named again before their
snapshot (offtop.bpf.cut_short). The resolver and clock are fakes (named so);
tests/test_bpf_e2e.py runs the real probe and symbolizer."""

from __future__ import annotations

from collections import deque

from offtop.bpf.cut_short import CutShort
from offtop.model import Frame, LongBlock

UNNAMED = (Frame("prog+0x131b", "prog"), Frame("start_thread", "libc"))
NAMED = (Frame("wait_here", "prog"), Frame("start_thread", "libc"))


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class FakeResolver:
    """Resolves again to `frames`, taking `takes_s` of the fake clock, out of time if
    that passes the deadline (as StackStore.user_again says); calls recorded."""

    def __init__(self, clock: FakeClock, frames: tuple[Frame, ...], takes_s: float = 0.0) -> None:
        self.clock, self.frames, self.takes_s = clock, frames, takes_s
        self.calls: list[tuple[int, int, int, float]] = []

    def __call__(self, pid: int, start: int, sid: int, deadline: float
                 ) -> tuple[tuple[Frame, ...], bool]:
        self.calls.append((pid, start, sid, deadline))
        self.clock.now += self.takes_s
        short = self.clock.now >= deadline and any(f.unknown for f in self.frames)
        return self.frames, short


def block(tid: int, user: tuple[Frame, ...] = UNNAMED, pid: int = 10) -> LongBlock:
    return LongBlock(time=float(tid), pid=pid, tid=tid, comm="w", state="S",
                     duration_ns=100_000_000, user=user)


def test_blocks_cut_short_are_named_in_their_place_each_stack_resolved_once() -> None:
    clock = FakeClock()
    again = FakeResolver(clock, NAMED)
    pending = CutShort(again, clock)
    first, second, other = block(1), block(2), block(3, NAMED)
    blocks = deque([first, other, second], maxlen=10)
    pending.note(first, 7, 42)
    pending.note(second, 7, 42)
    pending.retry(blocks, deadline=1.0)
    assert [b.tid for b in blocks] == [1, 3, 2]  # in order, in place
    assert [b.user for b in blocks] == [NAMED, NAMED, NAMED]
    assert blocks[1] is other
    assert again.calls == [(10, 7, 42, 1.0)]  # one stack: resolved once
    assert len(pending) == 0


def test_a_stack_cut_short_again_is_tried_at_the_next_retry_until_the_interval_ends() -> None:
    clock = FakeClock()
    again = FakeResolver(clock, UNNAMED, takes_s=2.0)  # still out of time
    pending = CutShort(again, clock)
    blocks = deque([block(1)])
    pending.note(blocks[0], 7, 42)
    pending.retry(blocks, deadline=1.0)
    assert len(pending) == 1 and len(again.calls) == 1
    again.frames, again.takes_s = NAMED, 0.0
    pending.retry(blocks, deadline=clock.now + 1.0)
    assert blocks[0].user == NAMED and len(pending) == 0
    pending.note(blocks[0], 7, 42)
    pending.clear()  # the snapshot is out
    pending.retry(blocks, deadline=clock.now + 1.0)
    assert len(again.calls) == 2


def test_nothing_is_resolved_once_the_deadline_has_passed() -> None:
    clock = FakeClock()
    clock.now = 5.0
    again = FakeResolver(clock, NAMED)
    pending = CutShort(again, clock)
    blocks = deque([block(1)])
    pending.note(blocks[0], 7, 42)
    pending.retry(blocks, deadline=1.0)
    assert again.calls == [] and len(pending) == 1 and blocks[0].user == UNNAMED


def test_frames_unnamed_within_the_budget_are_not_tried_again() -> None:
    clock = FakeClock()
    again = FakeResolver(clock, UNNAMED)  # no time spent: a stripped binary
    pending = CutShort(again, clock)
    blocks = deque([block(1)])
    pending.note(blocks[0], 7, 42)
    pending.retry(blocks, deadline=1.0)
    assert len(pending) == 0 and len(again.calls) == 1


def test_frames_no_better_than_the_block_s_do_not_replace_them() -> None:
    """Its process gone since, a stack resolves to the mark alone: the block keeps the
    addresses it had."""
    clock = FakeClock()
    again = FakeResolver(clock, (Frame("[process gone]"),))
    pending = CutShort(again, clock)
    blocks = deque([block(1)])
    pending.note(blocks[0], 7, 42)
    pending.retry(blocks, deadline=1.0)
    assert blocks[0].user == UNNAMED and len(pending) == 0
