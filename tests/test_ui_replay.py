"""Pilot tests of a replay's time travel in the TUI (`offtop --replay FILE`).

The source is a real `ReplaySource` over synthetic snapshots, holding at its
end as the CLI makes it, on a clock the test moves by hand: the first
interval comes at once, the next ones only when the test advances the
clock or presses a key. Grouped by feature: the bar and the header, steps
and seeks, pause and speed, a click on the time cursor, what a jump does to
the long-block log and the since-start totals, the keys of a live source.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

from textual.pilot import Pilot

from offtop.app import OfftopApp
from offtop.exit_guard import ExitGuard
from offtop.model import RowKey, Snapshot
from offtop.outputs import Outputs, TeeSource
from offtop.recording import RecordingHeader, RecordingWriter
from offtop.source import ReplaySource, SourceInfo
from offtop.synthetic import synthetic_snapshots
from offtop.widgets.header import OfftopHeader
from offtop.widgets.help_screen import HelpScreen
from offtop.widgets.key_bar import KeyBar
from offtop.widgets.long_blocks_log import LongBlocksLog
from offtop.widgets.render import clock_time, number_text
from offtop.widgets.replay_bar import ReplayBar, speed_text, track_cell, track_index
from offtop.widgets.task_table import TaskTable

SNAPS = synthetic_snapshots(6, tasks=30, stacks=100, seed=3)
INFO = SourceInfo(host="recorded-host", kernel="5.10.0-recorded", scope="pid 4242",
                  kind="replay")
SIZE = (160, 45)


class FakeClock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def travel(clock: FakeClock | None = None, snaps: list[Snapshot] = SNAPS) -> ReplaySource:
    """A replay as `offtop --replay` makes it (holds at its end), in real time on `clock`."""
    return ReplaySource(snaps, info=INFO, realtime=True, hold_at_end=True,
                        clock=clock or FakeClock())


class LiveLike(ReplaySource):
    """A source that ends like a live one (no time travel): the other tests' fake."""

    def next_snapshot(self, interval_s: float, stop: threading.Event) -> Snapshot | None:
        snap = super().next_snapshot(interval_s, stop)
        if snap is None:
            stop.wait()
        return snap


async def showing(pilot: Pilot[Any], app: OfftopApp, seq: int) -> None:
    """Wait until snapshot `seq` (exactly) is on screen."""
    for _ in range(500):
        if app.snapshot is not None and app.snapshot.seq == seq:
            break
        await pilot.pause(0.01)
    shown = app.snapshot.seq if app.snapshot is not None else None
    assert shown == seq, f"snapshot {seq} never shown (showing {shown})"
    await pilot.pause()


def header(app: OfftopApp) -> str:
    return app.query_one(OfftopHeader).render().plain


def bar(app: OfftopApp) -> str:
    return app.query_one(ReplayBar).render().plain


def busiest_changing_tid() -> int:
    """A thread in every interval whose count differs from one interval to the next."""
    counts = [{t.tid: t.count for t in s.tasks} for s in SNAPS]
    common = set.intersection(*(set(c) for c in counts))
    return next(tid for tid in sorted(common)
                if len({c[tid] for c in counts}) == len(SNAPS))


def expected_count(seq: int, tid: int) -> str:
    """The COUNT cell of `tid` in interval `seq`, from the snapshot itself."""
    task = next(t for t in SNAPS[seq - 1].tasks if t.tid == tid)
    return number_text(task.count, width=6).plain.strip()


def count_cell(app: OfftopApp, tid: int) -> str:
    return app.query_one(TaskTable).get_cell(RowKey.thread(tid), "count").plain.strip()


# --- the bar, the header ---------------------------------------------------------------


def test_speed_and_track_arithmetic() -> None:
    assert [speed_text(x) for x in (1.0, 4.0, 64.0, 0.5, 1 / 16)] == \
        ["1x", "4x", "64x", "1/2x", "1/16x"]
    assert [track_cell(i, 6, 11) for i in range(6)] == [0, 2, 4, 6, 8, 10]
    assert [track_index(c, 6, 11) for c in (0, 2, 5, 10, 99)] == [0, 1, 2, 5, 5]
    assert track_cell(0, 1, 30) == 0 and track_index(17, 1, 30) == 0


async def test_the_bar_shows_the_interval_its_time_speed_and_state() -> None:
    app = OfftopApp(travel(), clock=FakeClock())
    async with app.run_test(size=SIZE) as pilot:
        await showing(pilot, app, 1)
        text = bar(app)
        assert "playing" in text and "1x" in text and "1/6" in text, text
        assert clock_time(SNAPS[0].time) in text
        assert "●" in text  # the time cursor, the interval shown marked
        # The header says what was recorded, not this machine.
        assert "recorded-host" in header(app) and "pid 4242" in header(app)
        assert "5.10.0-recorded" in header(app) and "#1" in header(app)
        # Below the panes, above the key bar, which offers the replay's keys.
        replay_bar, keys = app.query_one(ReplayBar), app.query_one(KeyBar)
        assert replay_bar.region.bottom <= keys.region.y
        assert replay_bar.region.y > app.query_one(TaskTable).region.y
        keys_text = keys.render().plain
        assert "Back" in keys_text and "Forward" in keys_text and "Play/pause" in keys_text


# --- steps and seeks ----------------------------------------------------------------------


async def test_steps_show_the_interval_stepped_to() -> None:
    tid = busiest_changing_tid()
    app = OfftopApp(travel(), clock=FakeClock())
    async with app.run_test(size=SIZE) as pilot:
        await showing(pilot, app, 1)
        cells = {1: count_cell(app, tid)}
        for seq in range(2, 7):  # one interval forward at a time
            await pilot.press("full_stop")
            await showing(pilot, app, seq)
            cells[seq] = count_cell(app, tid)
            assert cells[seq] == expected_count(seq, tid)
        assert len(set(cells.values())) > 1, cells  # the value differs between intervals
        assert "at end" in bar(app) and "6/6" in bar(app)
        # Back: the header's number and time, the table's value, the bar.
        await pilot.press("comma")
        await showing(pilot, app, 5)
        assert "#5" in header(app) and clock_time(SNAPS[4].time) in header(app)
        assert count_cell(app, tid) == cells[5]
        assert "paused" in bar(app) and "5/6" in bar(app)
        assert clock_time(SNAPS[4].time) in bar(app)
        await pilot.press("comma", "comma")  # steps add up
        await showing(pilot, app, 3)
        assert count_cell(app, tid) == cells[3]
        await pilot.press("less_than_sign")  # ten back: clamped at the first
        await showing(pilot, app, 1)
        assert count_cell(app, tid) == cells[1] and "1/6" in bar(app)
        await pilot.press("greater_than_sign")  # ten forward: the last
        await showing(pilot, app, 6)
        await pilot.press("g")
        await showing(pilot, app, 1)
        await pilot.press("G")
        await showing(pilot, app, 6)
        assert count_cell(app, tid) == cells[6]
        assert app.replay is not None and app.replay.paused  # seeks kept the pause


async def test_steps_pause_the_replay_and_the_clock_no_longer_plays_it() -> None:
    clock = FakeClock()
    app = OfftopApp(travel(clock), clock=clock)
    async with app.run_test(size=SIZE) as pilot:
        await showing(pilot, app, 1)
        clock.now += 1.01
        await showing(pilot, app, 2)  # playing: the next interval a second later
        await pilot.press("comma")
        await showing(pilot, app, 1)
        clock.now += 10
        await pilot.pause(0.2)
        assert app.snapshot is not None and app.snapshot.seq == 1
        # Paused is not stalled: a replay is never "late".
        assert "no data" not in header(app)


# --- pause, speed -------------------------------------------------------------------------


async def test_p_pauses_the_replay_not_the_display_and_speed_changes_are_shown() -> None:
    clock = FakeClock()
    src = travel(clock)
    app = OfftopApp(src, clock=clock)
    async with app.run_test(size=SIZE) as pilot:
        await showing(pilot, app, 1)
        await pilot.press("p")
        await pilot.pause()
        assert src.paused and not app.paused and "PAUSED" not in header(app)
        assert "paused" in bar(app) and app.query_one(ReplayBar).has_class("-paused")
        clock.now += 5
        await pilot.pause(0.2)
        assert app.snapshot is not None and app.snapshot.seq == 1
        await pilot.press("space")
        await pilot.pause()
        assert not src.paused and "playing" in bar(app)
        assert not app.query_one(ReplayBar).has_class("-paused")
        await pilot.press("right_square_bracket", "right_square_bracket")
        await pilot.pause()
        assert src.speed == 4 and " 4x" in bar(app)
        for _ in range(3):
            await pilot.press("left_square_bracket")
        await pilot.pause()
        assert src.speed == 0.5 and "1/2x" in bar(app)
        # At half speed the next interval comes two (recorded) seconds later.
        clock.now += 1.5
        await pilot.pause(0.2)
        assert app.snapshot is not None and app.snapshot.seq == 1
        clock.now += 0.6
        await showing(pilot, app, 2)


# --- the time cursor --------------------------------------------------------------------


async def test_a_click_on_the_time_cursor_seeks_there() -> None:
    app = OfftopApp(travel(), clock=FakeClock())
    async with app.run_test(size=SIZE) as pilot:
        await showing(pilot, app, 1)
        await pilot.press("p")
        widget = app.query_one(ReplayBar)
        left = widget.styles.padding.left
        text = bar(app)
        start, end = text.index("●"), text.rindex("─")  # the cursor's ends
        await pilot.click(ReplayBar, offset=(left + end, 0))
        await showing(pilot, app, 6)
        assert "6/6" in bar(app)
        await pilot.click(ReplayBar, offset=(left + (start + end) // 2, 0))
        await showing(pilot, app, 3)  # the middle of six intervals: the third
        await pilot.click(ReplayBar, offset=(left + start, 0))
        await showing(pilot, app, 1)
        assert app.replay is not None and app.replay.paused  # a seek keeps the pause
        # A click beside the cursor (on the time) seeks nowhere.
        await pilot.click(ReplayBar, offset=(left + 2, 0))
        await pilot.pause(0.1)
        assert app.snapshot is not None and app.snapshot.seq == 1


# --- a jump and what accumulates --------------------------------------------------------


async def test_a_step_back_starts_the_long_block_log_and_totals_again() -> None:
    assert all(s.long_blocks for s in SNAPS[:4])
    app = OfftopApp(travel(), clock=FakeClock())
    async with app.run_test(size=SIZE) as pilot:
        await showing(pilot, app, 1)
        log = app.query_one(LongBlocksLog)
        for seq in (2, 3, 4):
            await pilot.press("full_stop")
            await showing(pilot, app, seq)
        played = [b for s in SNAPS[:4] for b in s.long_blocks]
        assert log.blocks == played and log.seen == len(played)
        assert app.pump.since_start.snapshots == 4
        # Back one: interval 3 is shown again, its blocks listed once, not twice.
        await pilot.press("comma")
        await showing(pilot, app, 3)
        assert log.blocks == list(SNAPS[2].long_blocks)
        assert log.seen == len(SNAPS[2].long_blocks)
        since = app.pump.since_start
        assert since.snapshots == 1 and since.since == SNAPS[2].time - SNAPS[2].interval_s
        assert sum(r.offcpu_ns for r in since.ranked()) == \
            sum(s.offcpu_ns for s in SNAPS[2].stacks)
        # On from there, one interval at a time: an unbroken stretch again.
        await pilot.press("full_stop")
        await showing(pilot, app, 4)
        assert log.blocks == [*SNAPS[2].long_blocks, *SNAPS[3].long_blocks]
        assert since.snapshots == 2


async def test_the_since_start_view_follows_a_step_back() -> None:
    app = OfftopApp(travel(), clock=FakeClock())
    async with app.run_test(size=SIZE) as pilot:
        await showing(pilot, app, 1)
        await pilot.press("a", "c")  # all tasks' stacks, since start
        for seq in (2, 3):
            await pilot.press("full_stop")
            await showing(pilot, app, seq)
        pane = app.query_one("#stacks-pane")

        def total() -> int:
            return sum(r.offcpu_ns for r in pane.scopes.since or ())  # type: ignore[attr-defined]

        want = sum(s.offcpu_ns for snap in SNAPS[:3] for s in snap.stacks)
        for _ in range(300):
            if total() == want:
                break
            await pilot.pause(0.01)
        assert total() == want
        await pilot.press("comma")  # back to 2: its own interval, not 1+2+3 nor older
        await showing(pilot, app, 2)
        want = sum(s.offcpu_ns for s in SNAPS[1].stacks)
        for _ in range(300):
            if total() == want:
                break
            await pilot.pause(0.01)
        assert total() == want


# --- the help, a live source ------------------------------------------------------------


async def test_the_help_lists_the_replay_keys_in_a_replay() -> None:
    app = OfftopApp(travel(), clock=FakeClock())
    async with app.run_test(size=SIZE) as pilot:
        await showing(pilot, app, 1)
        await pilot.press("f1")
        await pilot.pause()
        screen = app.screen
        assert isinstance(screen, HelpScreen)
        lines = dict(screen.lines)
        # (g is also the waker tree's "go to the waking task", when it has the focus.)
        for keys, desc in ((",", "One interval back (and pause)"),
                           (".", "One interval forward (and pause)"),
                           ("<", "Ten intervals back (and pause)"),
                           (">", "Ten intervals forward (and pause)"),
                           ("g", "The first interval of the recording"),
                           ("G", "The last interval of the recording"),
                           ("[", "Play at half the speed (down to 1/16x)"),
                           ("]", "Play at twice the speed (up to 64x)"),
                           ("p / space", "Pause / play the replay")):
            assert (keys, desc) in screen.lines, (keys, lines.get(keys))
        assert not any(d.startswith("Pause / resume the display") for d in lines.values())


async def test_a_live_source_has_no_bar_and_no_replay_keys() -> None:
    src = LiveLike(SNAPS[:2], realtime=False, info=INFO)
    app = OfftopApp(src, clock=FakeClock())
    async with app.run_test(size=SIZE) as pilot:
        await showing(pilot, app, 2)
        assert app.replay is None and not app.query(ReplayBar)
        keys_text = app.query_one(KeyBar).render().plain
        assert "Back" not in keys_text and "Play/pause" not in keys_text
        assert "Pause" in keys_text
        await pilot.press("comma", "less_than_sign", "g")
        await pilot.pause(0.1)
        assert app.snapshot is not None and app.snapshot.seq == 2
        await pilot.press("p")  # the display's pause, as before
        assert app.paused and not src.paused and "PAUSED" in header(app)
        await pilot.press("f1")
        await pilot.pause()
        assert isinstance(app.screen, HelpScreen)
        lines = dict(app.screen.lines)
        assert "," not in lines and "G" not in lines
        assert lines["p / space"].startswith("Pause / resume the display")


async def test_a_recording_file_replays_with_its_header(tmp_path: Path) -> None:
    path = tmp_path / "rec.gz"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    writer = RecordingWriter(fd, RecordingHeader(
        host="db-7", kernel="6.1.0-27-amd64", scope="cgroup /app", stacks="kernel+user",
        threshold_ns=100_000_000, interval_s=1.0, started=SNAPS[0].time - 1, states="SDI"))
    for snap in SNAPS:
        writer.add(snap)
    writer.close()
    src = ReplaySource.from_file(path, hold_at_end=True)
    app = OfftopApp(src, clock=FakeClock())
    async with app.run_test(size=SIZE) as pilot:
        # It plays in real time: where it is by now depends on the machine's load.
        for _ in range(500):
            if app.snapshot is not None:
                break
            await pilot.pause(0.01)
        await pilot.press("G")
        await showing(pilot, app, 6)
        text = header(app)
        assert "db-7" in text and "cgroup /app" in text and "6.1.0-27-amd64" in text
        assert "source replay" in text
        await pilot.press("comma")
        await showing(pilot, app, 5)
        assert "5/6" in bar(app)


async def test_a_replay_wrapped_as_the_cli_wraps_it_still_travels() -> None:
    """The CLI hands the app its source inside an `ExitGuard` (and records
    through a `TeeSource`): time travel is found by shape, through them."""
    src = travel()
    app = OfftopApp(TeeSource(ExitGuard(src).source, Outputs()), clock=FakeClock())
    async with app.run_test(size=SIZE) as pilot:
        await showing(pilot, app, 1)
        assert app.replay is not None and app.query(ReplayBar)
        await pilot.press("full_stop", "full_stop")
        await showing(pilot, app, 3)
        await pilot.press("comma")
        await showing(pilot, app, 2)
        assert src.paused and "2/6" in bar(app)
        assert app.query_one(LongBlocksLog).blocks == list(SNAPS[1].long_blocks)
