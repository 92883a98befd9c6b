"""Wakers in the headless outputs: JSON round trip and offwaketime-style folded lines."""

from __future__ import annotations

from offtop.model import Frame, Snapshot, StackRow, Waker, WakerRow
from offtop.report import folded_lines, snapshot_from_json, snapshot_to_json

K = True


def _stack(wakers: tuple[WakerRow, ...]) -> StackRow:
    return StackRow(pid=1, tid=2, comm="reader", state="S", offcpu_ns=10_000_000, count=4,
                    max_ns=3_000_000, kernel=(Frame("schedule", "kernel", K),
                                              Frame("pipe_read", "kernel", K)),
                    user=(Frame("read", "libc.so.6"), Frame("main", "app")), waker_rows=wakers)


WRITER = Waker(pid=1, tid=3, comm="writer", kernel=(Frame("try_to_wake_up", "kernel", K),
                                                    Frame("pipe_write", "kernel", K)),
               user=(Frame("write", "libc.so.6"), Frame("write_loop", "app")))
TIMER = Waker(pid=0, tid=0, comm="", kind="timer",
              kernel=(Frame("hrtimer_wakeup", "kernel", K),))


def test_folded_with_wakers_puts_each_waker_stack_after_a_separator() -> None:
    snap = Snapshot(seq=1, time=0.0, interval_s=1.0, threshold_ns=0, stacks=(
        _stack((WakerRow(WRITER, 7_000_000, 3), WakerRow(TIMER, 2_000_000, 1))),))
    plain = folded_lines(snap)
    assert plain == ["reader;main;read;pipe_read;schedule 10000"]
    lines = folded_lines(snap, wakers=True)
    assert lines == [
        "reader;main;read;pipe_read;schedule;--;try_to_wake_up;pipe_write;write;write_loop;"
        "writer 7000",
        "reader;main;read;pipe_read;schedule;--;hrtimer_wakeup;[timer_interrupt] 2000",
        "reader;main;read;pipe_read;schedule;--;[unknown_waker] 1000",
    ]
    # Every line is one well-formed folded line.
    assert all(line.count(" ") == 1 for line in lines)


def test_json_round_trip_keeps_wakers() -> None:
    from offtop.model import LongBlock

    snap = Snapshot(seq=1, time=1.0, interval_s=1.0, threshold_ns=0,
                    stacks=(_stack((WakerRow(WRITER, 7_000_000, 3),)),),
                    long_blocks=(LongBlock(time=1.0, pid=1, tid=2, comm="reader", state="S",
                                           duration_ns=5, waker=TIMER),))
    d = snapshot_to_json(snap)
    assert d["stacks"][0]["wakers"][0]["tid"] == 3
    assert d["long_blocks"][0]["waker"]["kind"] == "timer"
    back = snapshot_from_json(d)
    assert back.stacks[0].wakers[0].waker.tid == 3
    assert [f.name for f in back.stacks[0].wakers[0].waker.user] == ["write", "write_loop"]
    assert back.long_blocks[0].waker is not None
    assert back.long_blocks[0].waker.label == "[timer interrupt]"
