"""Pilot tests of the TUI, fed by a replay source (the fake) and synthetic data.

Grouped by feature: start and errors, the header, the task table, the stacks
pane (table, tree, flame graph, merge, idle waits, since start, export),
blocked now, long blocks, the threshold, layouts, keys.
"""

from __future__ import annotations

import dataclasses
import gc
import gzip
import json
import os
import signal
import threading
import weakref
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
from textual.binding import Binding
from textual.content import Content
from textual.pilot import Pilot
from textual.widget import Widget

import offtop.widgets.export_screen as export_screen_module
import offtop.widgets.stacks_pane as stacks_pane_module
from offtop.app import OfftopApp
from offtop.app_keys import APP_BINDINGS
from offtop.gc_pacing import GcPacing, Parcel
from offtop.model import (
    BlockedNow,
    Frame,
    LongBlock,
    RowKey,
    SinceStart,
    Snapshot,
    SnapshotIndex,
    StackRow,
    is_idle_wait,
)
from offtop.source import ReplaySource, SourceInfo
from offtop.synthetic import synthetic_snapshots
from offtop.units import MAX_THRESHOLD_NS, format_ns
from offtop.widgets.blocked_now import BlockedNowTable
from offtop.widgets.callchain_tree import CallchainTree, merge_stacks
from offtop.widgets.choice_screen import ChoiceScreen
from offtop.widgets.filter_input import FilterInput
from offtop.widgets.flame_graph import FlameGraph, FlameTree
from offtop.widgets.header import OfftopHeader
from offtop.widgets.help_screen import HelpScreen
from offtop.widgets.long_blocks_log import LongBlocksLog, long_block_line
from offtop.widgets.stack_table import StackTable
from offtop.widgets.stacks_pane import StacksPane
from offtop.widgets.task_table import TaskTable
from offtop.widgets.threshold_pane import ThresholdInput, ThresholdPane
from offtop.widgets.threshold_slider import ThresholdSlider

SNAPS = synthetic_snapshots(4, tasks=50, stacks=200, seed=0)
INFO = SourceInfo(host="testhost", kernel="6.1.0-test", scope="all tasks", kind="replay")
SIZE = (140, 45)
S = 1_000_000_000
MS = 1_000_000


class FakeLiveReplay(ReplaySource):
    """A replay source that, once out of snapshots, waits like a live one."""

    def next_snapshot(self, interval_s: float, stop: threading.Event) -> Snapshot | None:
        snap = super().next_snapshot(interval_s, stop)
        if snap is None:
            stop.wait()
        return snap


class FakeSlowStart(FakeLiveReplay):
    """start() blocks until released, like a BPF compile."""

    def __init__(self, snapshots: list[Snapshot], **kwargs: Any) -> None:
        super().__init__(snapshots, **kwargs)
        self.release = threading.Event()

    def start(self) -> None:
        self.release.wait(10)
        super().start()


class FakeBrokenStart(FakeLiveReplay):
    """start() fails the way a missing kernel header tree would."""

    def start(self) -> None:
        raise RuntimeError("cannot compile the BPF program: [no kernel headers]")


class FakeLiveWaits(FakeLiveReplay):
    """Blocked-now waits as the live source reads them: whatever the test sets."""

    def __init__(self, snapshots: list[Snapshot], **kwargs: Any) -> None:
        super().__init__(snapshots, **kwargs)
        self.waits: dict[int, int] = {}
        self.asked: list[list[int]] = []

    def blocked_waits(self, tids: Iterable[int]) -> Mapping[int, int]:
        wanted = list(tids)
        self.asked.append(wanted)
        return {tid: self.waits[tid] for tid in wanted if tid in self.waits}


class FakeClock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class NotedApp(OfftopApp):
    """The app, keeping what it notifies (to check what a toast says)."""

    CSS_PATH = str(Path(__file__).resolve().parent.parent / "offtop" / "app.tcss")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.noted: list[str] = []

    def notify(self, message: str, *args: Any, **kwargs: Any) -> None:
        self.noted.append(message)
        super().notify(message, *args, **kwargs)


class CountingFlameTree(FlameTree):
    """A flame tree that counts how many are built (a fake, patched in)."""

    built = 0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        type(self).built += 1
        super().__init__(*args, **kwargs)


def fake_source(n: int = 1, cls: type[ReplaySource] = FakeLiveReplay,
                snaps: list[Snapshot] | None = None) -> ReplaySource:
    """The replay source standing in for BPF."""
    return cls((SNAPS if snaps is None else snaps)[:n], realtime=False, info=INFO)


async def shown(pilot: Pilot[object], app: OfftopApp, seq: int = 1) -> None:
    """Wait until snapshot `seq` is on screen."""
    for _ in range(500):
        if app.snapshot is not None and app.snapshot.seq >= seq:
            break
        await pilot.pause(0.01)
    assert app.snapshot is not None and app.snapshot.seq >= seq, "snapshot never shown"
    await pilot.pause()


async def shown_then(pilot: Pilot[object], app: OfftopApp, *keys: str) -> None:
    """Wait until the first snapshot is on screen, press `keys`, let the app draw."""
    await shown(pilot, app)
    await pilot.press(*keys)
    await pilot.pause()


async def until(pilot: Pilot[object], test: Any, what: str, tries: int = 300) -> None:
    """Wait (a worker, a timer) until `test()` is true."""
    for _ in range(tries):
        if test():
            return
        await pilot.pause(0.01)
    raise AssertionError(f"never: {what}")


def tree_labels(tree: CallchainTree) -> list[str]:
    """Every label of a callchain tree, the root's first."""
    out, todo = [], [tree.root]
    while todo:
        node = todo.pop()
        out.append(str(node.label))
        todo.extend(node.children)
    return out


def header_text(app: OfftopApp) -> str:
    return app.query_one(OfftopHeader).render().plain


def in_new_tuples(snap: Snapshot) -> Snapshot:
    """`snap` with each stack's frames in new tuples: chains the catalog has not seen."""
    return dataclasses.replace(snap, stacks=tuple(
        dataclasses.replace(s, kernel=tuple(list(s.kernel)), user=tuple(list(s.user)))
        for s in snap.stacks))


def pane(app: OfftopApp) -> StacksPane:
    return app.query_one(StacksPane)


def title(widget: Widget) -> str:
    """A border title as shown (titles are kept as markup)."""
    return Content.from_markup(str(widget.border_title or "")).plain


def subtitle(widget: Widget) -> str:
    """A border subtitle as shown."""
    return Content.from_markup(str(widget.border_subtitle or "")).plain


def shown_stacks(app: OfftopApp) -> list[StackRow]:
    table = app.query_one(StackTable)
    rows = [table.stack_by_key(k) for k in table.row_keys_in_order]
    return [r for r in rows if r is not None]


def with_stats(snap: Snapshot, **stats: Any) -> Snapshot:
    return dataclasses.replace(snap, stats=dataclasses.replace(snap.stats, **stats))


# --- start, failure, the header ---------------------------------------------------


async def test_shows_ranked_tasks_and_the_header() -> None:
    src = fake_source()
    app = OfftopApp(src, clock=FakeClock())
    async with app.run_test(size=SIZE) as pilot:
        await shown(pilot, app)
        table = app.query_one(TaskTable)
        assert table.row_keys_in_order == [t.key for t in SNAPS[0].tasks]
        assert table.cursor_key == RowKey.thread(SNAPS[0].tasks[0].tid)
        text = header_text(app)
        assert "testhost" in text and "6.1.0-test" in text and "all tasks" in text
        assert "threshold 100ms" in text and "interval 1s" in text
        assert "lost 0" in text and "stack errors" in text and "ns/switch" in text
        # offtop's own cost beside the probe's.
        stats = SNAPS[0].stats
        assert f"offtop {stats.offtop_cpu_pct:.1f}% CPU 80 MB" in text
        assert "PAUSED" not in text
        assert title(table) == "Threads by off-CPU time"
        assert subtitle(table).startswith("50 threads")
        assert src.threshold_writes == []


async def test_counted_errors_reach_the_header() -> None:
    snap = with_stats(
        SNAPS[0], drops={"aggregate map full": 5}, lost=2, lost_total=7, truncated_stacks=11,
        depth_limited_stacks=4, user_stacks_lost=6, symbol_misses=3, symbol_deadline_misses=9,
        symbol_errors={"bad ELF": 2}, stacks_used=12_000, stacks_capacity=16_384,
        stack_errors={"user EEXIST": 8}, python_failures={"read failed": 1},
        flood_threshold_ns=2 * S)
    app = OfftopApp(fake_source(snaps=[snap]), clock=FakeClock())
    async with app.run_test(size=(240, 45)) as pilot:
        await shown(pilot, app)
        text = header_text(app)
        for said in ("dropped aggregate map full 5", "events lost 7 in all",
                     "stack ids failed user EEXIST 8", "11 truncated", "4 at the depth limit",
                     "6 user stacks lost", "stack map 12,000/16,384 used", "3 unresolved",
                     "9 left for later", "errors: bad ELF 2", "python stacks not read: read failed 1",
                     "threshold raised to 2.00s by flood control", "lost 2"):
            assert said in text, said
        assert len(text.splitlines()) == 3


async def test_notices_and_the_end_of_the_run_are_said_and_the_app_stays() -> None:
    end = dataclasses.replace(SNAPS[2], notices=("pid 1052 exited",),
                              finished="nothing left to watch: pid 1052 exited")
    app = OfftopApp(ReplaySource([SNAPS[0], SNAPS[1], end], realtime=False, info=INFO),
                    clock=FakeClock())
    async with app.run_test(size=SIZE) as pilot:
        await shown(pilot, app, seq=3)
        await until(pilot, lambda: app.status == "ended", "the source ended")
        await pilot.pause()
        text = header_text(app)
        assert "RUN OVER" in text and "nothing left to watch: pid 1052 exited" in text
        assert "the last data stays on screen" in text
        assert "pid 1052 exited" in text.splitlines()[2]
        assert app.query_one(OfftopHeader).has_class("-finished")
        assert app.is_running and app.query_one(TaskTable).row_count == len(end.tasks)


async def test_loading_state_until_the_source_starts() -> None:
    src = FakeSlowStart(SNAPS[:1], realtime=False, info=INFO)
    app = OfftopApp(src, clock=FakeClock())
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause(0.1)
        assert app.has_class("-loading") and app.loading
        # The class has a rule: the empty panes are faded while loading.
        assert app.query_one("#main").styles.opacity < 1
        assert "loading the BPF program" in header_text(app)
        src.release.set()
        await shown(pilot, app)
        assert not app.has_class("-loading")
        assert app.query_one("#main").styles.opacity == 1
        assert app.focused is app.query_one(TaskTable)


async def test_a_started_source_is_running_before_its_first_snapshot() -> None:
    app = OfftopApp(FakeLiveReplay([], realtime=False, info=INFO), clock=FakeClock())
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: app.status == "running", "the source started")
        await pilot.pause()
        assert app.query_one(OfftopHeader).status == "running"
        assert app.snapshot is None


async def test_a_stalled_source_is_said_to_be() -> None:
    clock = FakeClock()
    app = OfftopApp(fake_source(), clock=clock)
    async with app.run_test(size=SIZE) as pilot:
        await shown(pilot, app)
        assert "no data" not in header_text(app)
        clock.now += 10
        await until(pilot, lambda: "no data for 10s" in header_text(app), "the stall said")


async def test_start_failure_is_shown_and_q_quits() -> None:
    app = OfftopApp(fake_source(cls=FakeBrokenStart), clock=FakeClock())
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: app.source_error is not None, "the failure")
        await pilot.pause()
        assert isinstance(app.source_error, RuntimeError)
        assert app.has_class("-failed") and not app.loading
        error = app.query_one("#error")
        assert error.display
        assert "[no kernel headers]" in str(error.render())
        await pilot.press("q")
        await pilot.pause()
    assert app.return_code == 0
    assert app.source_error is not None


async def test_with_idle_waits_hidden_a_snapshot_is_given_its_idle_pass_off_the_event_loop(
) -> None:
    """Hiding idle waits needs a pass over every stack of a snapshot (~20 ms at
    20,000): while they are hidden, it is made where the snapshot is indexed, in
    the source's thread, not on the event loop at its first use."""
    app = OfftopApp(fake_source(), clock=FakeClock())
    on_loop: list[bool] = []
    catalog = app.pump.catalog
    infos = catalog.infos

    def watched(stacks: Any) -> Any:
        on_loop.append(threading.current_thread() is threading.main_thread())
        return infos(stacks)
    catalog.infos = watched  # type: ignore[method-assign]
    async with app.run_test(size=SIZE) as pilot:
        await shown(pilot, app)
        await pilot.press("i")
        await pilot.pause()
        assert app.hide_idle and app.pump.idle_hidden
        on_loop.clear()
        source_thread = threading.Thread(target=app.publish, args=(SNAPS[1],))
        source_thread.start()
        source_thread.join()
        await shown(pilot, app, SNAPS[1].seq)
        await pilot.pause()
        assert on_loop == [False]
        await pilot.press("i")
        await pilot.pause()
        assert not app.pump.idle_hidden


async def test_a_failure_handling_a_snapshot_is_said_not_a_silent_stall() -> None:
    """Anything that fails in the source's thread, taking in a snapshot as well
    as reading one, is said on screen and the app stays: the thread once
    ended silently there, leaving an app that only said "no data"."""
    app = OfftopApp(fake_source(3), clock=FakeClock())
    add = app.pump.since_start.add

    def broken_at_the_second(index: SnapshotIndex) -> None:
        if index.snapshot.seq >= 2:
            raise ValueError("since-start totals: broken")
        add(index)
    app.pump.since_start.add = broken_at_the_second  # type: ignore[method-assign]
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: app.source_error is not None, "the failure said")
        await pilot.pause()
        assert app.snapshot is not None and app.snapshot.seq == 1
        assert isinstance(app.source_error, ValueError) and app.status == "failed"
        assert app.is_running


# --- the task table ------------------------------------------------------------------


async def test_navigation_keys_and_the_stacks_pane_follows() -> None:
    app = OfftopApp(fake_source(), clock=FakeClock())
    async with app.run_test(size=SIZE) as pilot:
        await shown(pilot, app)
        table = app.query_one(TaskTable)
        keys = table.row_keys_in_order
        await pilot.press("down", "down")
        assert table.cursor_key == keys[2]
        await pilot.press("k")
        assert table.cursor_key == keys[1]
        await pilot.press("j", "j")
        assert table.cursor_key == keys[3]
        await pilot.press("end")
        assert table.cursor_key == keys[-1]
        await pilot.press("home")
        assert table.cursor_key == keys[0]
        await pilot.press("pagedown")
        assert table.cursor_row > 5
        await pilot.press("home", "down")
        await pilot.pause()
        tid = keys[1].id
        assert len(shown_stacks(app)) == len(SNAPS[0].stacks_of(tid))
        assert {s.tid for s in shown_stacks(app)} == {tid}
        assert title(pane(app)).startswith(f"Stacks of {SNAPS[0].tasks[1].comm}")
        # k means up in every pane: in the stacks table too, never a frame toggle.
        app.query_one(StackTable).focus()
        await pilot.press("down", "k")
        assert app.query_one(StackTable).cursor_row == 0
        assert app.show_kernel and app.show_user


@pytest.mark.parametrize("follow", [False, True], ids=["position", "follow"])
async def test_cursor_across_a_resort_keeps_its_position_or_follows(follow: bool) -> None:
    app = OfftopApp(fake_source(), clock=FakeClock())
    async with app.run_test(size=SIZE) as pilot:
        await shown(pilot, app)
        table = app.query_one(TaskTable)
        if follow:
            await pilot.press("F")  # htop's F
            assert table.follow and "following" in subtitle(table)
        first = [t.key for t in SNAPS[0].tasks]
        second = [t.key for t in SNAPS[1].tasks]
        # A task whose rank changes between the two snapshots.
        key = next(k for k in first[3:] if k in second and second.index(k) != first.index(k))
        table.move_to_key(key)
        await pilot.pause()
        before = table.cursor_row
        app.publish(SNAPS[1])
        await shown(pilot, app, seq=2)
        assert table.row_keys_in_order == second
        if follow:  # htop's F: the cursor stays on its task
            assert table.cursor_key == key
            assert table.cursor_row == second.index(key) != before
        else:  # htop's default: the cursor stays at its row, on whatever task is there
            assert table.cursor_row == before
            assert table.cursor_key == second[before] != key
        await pilot.pause()
        cursor = table.cursor_key
        assert cursor is not None
        assert {s.tid for s in shown_stacks(app)} == {cursor.id}


async def test_a_resort_that_brings_another_task_under_the_cursor_draws_its_stacks_once(
        ) -> None:
    app = OfftopApp(fake_source(), clock=FakeClock())
    async with app.run_test(size=SIZE) as pilot:
        await shown(pilot, app)
        table = app.query_one(TaskTable)
        first = [t.key for t in SNAPS[0].tasks]
        second = [t.key for t in SNAPS[1].tasks]
        row = next(i for i in range(len(first)) if first[i] != second[i])
        table.move_cursor(row)
        await pilot.pause()
        stacks_pane = pane(app)
        drawn: list[object] = []
        draw = stacks_pane._refresh_table
        stacks_pane._refresh_table = lambda: (drawn.append(stacks_pane.selected), draw())[1]
        app.publish(SNAPS[1])
        await shown(pilot, app, seq=2)
        await pilot.pause()
        # Drawn once, for the task the re-sort brought under the cursor; not
        # first for the one that was there and again when the table said so.
        assert table.cursor_key == second[row]
        assert drawn == [second[row]]
        assert {s.tid for s in shown_stacks(app)} == {second[row].id}


async def test_a_followed_task_stays_listed_while_idle() -> None:
    app = OfftopApp(fake_source(), clock=FakeClock())
    async with app.run_test(size=SIZE) as pilot:
        await shown(pilot, app)
        table = app.query_one(TaskTable)
        await pilot.press("F")
        key = SNAPS[0].tasks[5].key
        table.move_to_key(key)
        await pilot.pause()
        snap = SNAPS[1]
        idle = dataclasses.replace(snap, tasks=tuple(t for t in snap.tasks if t.key != key),
                                   stacks=tuple(s for s in snap.stacks if s.tid != key.id))
        app.publish(idle)
        await shown(pilot, app, seq=2)
        assert table.cursor_key == key
        assert "last seen" in subtitle(pane(app))
        assert len(shown_stacks(app)) == len(SNAPS[0].stacks_of(key.id))


async def test_sort_key_cycles_header_click_sorts_and_f6_is_a_menu() -> None:
    app = OfftopApp(fake_source(), clock=FakeClock())
    async with app.run_test(size=SIZE) as pilot:
        await shown(pilot, app)
        table = app.query_one(TaskTable)
        by_key = {t.key: t for t in SNAPS[0].tasks}
        await pilot.press("s")
        assert table.sort_spec.column == "count" and table.sort_spec.reverse
        counts = [by_key[k].count for k in table.row_keys_in_order]
        assert counts == sorted(counts, reverse=True)
        await pilot.press("s")
        assert table.sort_spec.column == "max"
        # Click the COMM header (PID and TID columns are 7 wide, plus padding and border).
        await pilot.click(TaskTable, offset=(21, 1))
        assert table.sort_spec.column == "comm" and not table.sort_spec.reverse
        comms = [by_key[k].comm.lower() for k in table.row_keys_in_order]
        assert comms == sorted(comms)
        await pilot.click(TaskTable, offset=(21, 1))
        assert table.sort_spec.reverse
        assert "COMM" in subtitle(table)
        # htop's F6: a menu of the columns, the current one highlighted.
        await pilot.press("f6")
        await pilot.pause()
        assert isinstance(app.screen, ChoiceScreen)
        await pilot.press("home", "down", "enter")
        await pilot.pause()
        assert not isinstance(app.screen, ChoiceScreen)
        assert table.sort_spec.column == "count"


async def test_threads_processes_toggle_keeps_the_task() -> None:
    app = OfftopApp(fake_source(), clock=FakeClock())
    async with app.run_test(size=SIZE) as pilot:
        await shown(pilot, app)
        table = app.query_one(TaskTable)
        await pilot.press("down")
        thread = next(t for t in SNAPS[0].tasks if t.key == table.cursor_key)
        await pilot.press("t")
        await pilot.pause()
        assert app.processes and title(table) == "Processes by off-CPU time"
        assert table.row_keys_in_order == [p.key for p in SNAPS[0].processes]
        assert table.cursor_key == RowKey.process(thread.pid)
        assert len(shown_stacks(app)) == min(len(SNAPS[0].stacks_of_process(thread.pid)),
                                             StackTable.MAX_ROWS)
        await pilot.press("t")
        await pilot.pause()
        assert not app.processes
        assert table.row_keys_in_order == [t.key for t in SNAPS[0].tasks]


async def test_filter_by_name_pid_or_frame_text() -> None:
    app = OfftopApp(fake_source(), clock=FakeClock())
    async with app.run_test(size=SIZE) as pilot:
        await shown(pilot, app)
        table = app.query_one(TaskTable)
        await pilot.press("slash")
        assert app.query_one(FilterInput).is_open
        await pilot.press(*"nginx")
        await pilot.pause()
        by_key = {t.key: t for t in SNAPS[0].tasks}
        keys = table.row_keys_in_order
        assert keys and all(by_key[k].comm == "nginx" for k in keys)
        assert "match “nginx”" in subtitle(table)
        await pilot.press(*["backspace"] * 5, *str(SNAPS[0].tasks[0].pid))
        await pilot.pause()
        assert all(by_key[k].pid == SNAPS[0].tasks[0].pid for k in table.row_keys_in_order)
        # Frame text: the tasks with a stack in that function, whatever their name.
        await pilot.press(*["backspace"] * 4, *"tcp_recvmsg")
        await pilot.pause()
        expected = {s.tid for s in SNAPS[0].stacks
                    if any(f.name == "tcp_recvmsg" for f in s.kernel)}
        assert expected and {k.id for k in table.row_keys_in_order} == expected
        # All stacks: only those with the text in their frames.
        await pilot.press("enter", "a")
        await pilot.pause()
        stacks = shown_stacks(app)
        assert stacks and all(any(f.name == "tcp_recvmsg" for f in s.kernel) for s in stacks)
        assert app.focused is table and app.query_one(FilterInput).is_open
        await pilot.press("escape")
        await pilot.pause()
        assert not app.query_one(FilterInput).is_open and app.filter_text == ""
        assert len(table.row_keys_in_order) == len(SNAPS[0].tasks)


# --- the stacks pane: table, tree, flame graph ------------------------------------------


async def test_drill_down_into_the_callchain_tree_and_back() -> None:
    app = OfftopApp(fake_source(), clock=FakeClock())
    async with app.run_test(size=SIZE) as pilot:
        await shown(pilot, app)
        task = SNAPS[0].tasks[1]
        await pilot.press("down", "enter")
        await pilot.pause()
        assert app.drilled and pane(app).current == "tree"
        tree = app.query_one(CallchainTree)
        assert app.focused is tree
        assert task.comm in str(tree.root.label)
        assert title(pane(app)).startswith(f"Callchain of {task.comm}")
        top = SNAPS[0].stacks_of(task.tid)[0]
        labels = [str(n.label) for n in tree.root.children]
        assert any(top.user[-1].name in label for label in labels)
        assert any(p[-1].startswith("k:") for p in tree.expanded_paths() if p)
        await pilot.press("escape")
        assert not app.drilled and pane(app).current == "stacks"
        assert app.focused is app.query_one(TaskTable)


async def test_a_short_screen_shows_the_task_table_or_the_drilled_view() -> None:
    app = OfftopApp(fake_source(), clock=FakeClock())
    async with app.run_test(size=(100, 20)) as pilot:
        await shown(pilot, app)
        tasks, stacks = app.query_one(TaskTable), pane(app)
        assert tasks.display and not stacks.display
        for key, view in (("enter", "tree"), ("escape", "stacks"), ("f", "flame")):
            await pilot.press(key)
            await pilot.pause()
            drilled = view != "stacks"
            assert stacks.current == view and tasks.display is not drilled
            assert stacks.display is drilled
        # Drilled while tall: both panes; made short: the drilled view alone.
        await pilot.press("f")
        await pilot.resize_terminal(100, 40)
        await pilot.pause()
        await pilot.press("f")
        await pilot.pause()
        assert tasks.display and stacks.display and stacks.current == "flame"
        await pilot.resize_terminal(100, 20)
        await pilot.pause()
        assert stacks.display and not tasks.display
        await pilot.press("f")
        await pilot.pause()
        assert tasks.display and not stacks.display


async def test_tree_keeps_expansion_and_cursor_across_snapshots() -> None:
    app = OfftopApp(fake_source(), clock=FakeClock())
    async with app.run_test(size=SIZE) as pilot:
        await shown(pilot, app)
        tid = SNAPS[0].tasks[0].tid
        await pilot.press("enter")
        await pilot.pause()
        tree = app.query_one(CallchainTree)
        tree.root.expand_all()
        await pilot.pause()
        expanded = tree.expanded_paths()
        nodes = {p: tree.node_at(p) for p in expanded}
        await pilot.press("down", "down", "down")
        cursor = tree.cursor_node
        assert cursor is not None and cursor.data is not None
        cursor_path = cursor.data.path
        # The next snapshot still has that path (the outer frames of a busy task).
        assert cursor_path in merge_stacks(SNAPS[1].stacks_of(tid))
        app.publish(SNAPS[1])
        await shown(pilot, app, seq=2)
        still = [p for p in expanded if tree.node_at(p) is not None]
        assert still, "no path survived the update"
        for p in still:
            node = tree.node_at(p)
            assert node is nodes[p], "node rebuilt instead of diffed"
            assert node is not None and node.is_expanded
        after = tree.cursor_node
        assert after is not None and after.data is not None and after.data.path == cursor_path


async def test_stack_row_enter_opens_the_tree_at_its_path() -> None:
    app = OfftopApp(fake_source(), clock=FakeClock())
    async with app.run_test(size=SIZE) as pilot:
        await shown(pilot, app)
        app.query_one(StackTable).focus()
        await pilot.press("down", "enter")
        await pilot.pause()
        tree = app.query_one(CallchainTree)
        stack = SNAPS[0].stacks_of(SNAPS[0].tasks[0].tid)[1]
        node = tree.cursor_node
        assert node is not None and node.data is not None and node.data.frame is not None
        assert node.data.frame.name == stack.kernel[0].name


async def test_frame_toggles_are_shift_k_and_u_everywhere() -> None:
    app = OfftopApp(fake_source(), clock=FakeClock())
    async with app.run_test(size=SIZE) as pilot:
        await shown_then(pilot, app, "enter")
        tree = app.query_one(CallchainTree)
        await pilot.press("K")
        await pilot.pause()
        assert not app.show_kernel
        tree.root.expand_all()
        await pilot.pause()
        paths = [p for p in tree.expanded_paths() if p]
        assert paths and all(not step.startswith("k:") for p in paths for step in p)
        # In the tree k is "up", as everywhere.
        await pilot.press("down", "down", "k")
        assert not app.show_kernel and tree.cursor_line == 1
        await pilot.press("K", "U")
        await pilot.pause()
        assert app.show_kernel and not app.show_user
        await pilot.press("escape", "U")
        assert app.show_user
        await pilot.press("K", "U")  # hiding both brings the other back
        assert app.show_kernel and not app.show_user
        assert app.query_one(BlockedNowTable).show_user is False  # bound, not passed by hand


async def test_all_stacks_merge_and_their_tree() -> None:
    app = OfftopApp(fake_source(), clock=FakeClock())
    async with app.run_test(size=SIZE) as pilot:
        await shown_then(pilot, app, "a")
        table = app.query_one(StackTable)
        assert table.scope == "all" and title(pane(app)) == "All stacks by off-CPU time"
        assert table.row_count == min(len(SNAPS[0].stacks), StackTable.MAX_ROWS_ALL)
        assert len({s.tid for s in shown_stacks(app)}) > 1
        # Merged across the threads of a process, then across one command.
        await pilot.press("m")
        await pilot.pause()
        by_process = shown_stacks(app)
        assert "merged by process" in subtitle(pane(app)) and "tasks" in table.column_keys
        assert sum(s.offcpu_ns for s in by_process) <= sum(s.offcpu_ns for s in SNAPS[0].stacks)
        keys = [(s.pid, s.state, s.kernel, s.user) for s in by_process]
        assert len(keys) == len(set(keys)), "identical stacks of a process left apart"
        await pilot.press("m")
        await pilot.pause()
        by_command = shown_stacks(app)
        keys2 = [(s.comm, s.state, s.kernel, s.user) for s in by_command]
        assert len(keys2) == len(set(keys2))
        top = by_command[0]
        same = [s for s in SNAPS[0].stacks if (s.comm, s.state, s.kernel, s.user) == keys2[0]]
        assert top.offcpu_ns == sum(s.offcpu_ns for s in same)
        # Enter: the tree of every process with that command.
        table.focus()
        await pilot.press("enter")
        await pilot.pause()
        assert app.drilled and f"Callchain of every {top.comm} process" in title(pane(app))
        await pilot.press("escape")
        assert app.focused is table  # back where the drill started
        await pilot.press("m", "a")
        assert not app.drilled and table.scope == "task"


async def test_a_merge_meeting_many_new_chains_works_them_out_in_a_thread_first(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Lowered from 2,000 so that the 200 synthetic stacks count as many.
    monkeypatch.setattr(StacksPane, "MERGE_ON_LOOP", 50)
    gate, on_loop = threading.Event(), threading.get_ident()
    facts_of = SnapshotIndex.facts_of

    def gated_facts(self: SnapshotIndex, stacks: Sequence[StackRow]) -> Any:
        if threading.get_ident() != on_loop:
            assert gate.wait(10), "the test never opened the gate"
        return facts_of(self, stacks)

    monkeypatch.setattr(SnapshotIndex, "facts_of", gated_facts)
    app = OfftopApp(fake_source(), clock=FakeClock())
    async with app.run_test(size=SIZE) as pilot:
        await shown_then(pilot, app, "a")
        table = app.query_one(StackTable)
        before = table.row_keys_in_order
        await pilot.press("m")
        await pilot.pause()
        # The chains are being worked out in a thread: the rows shown stay.
        assert subtitle(pane(app)) == f"merging {len(SNAPS[0].stacks)} stacks…"
        assert table.row_keys_in_order == before and "tasks" not in table.column_keys
        gate.set()
        await until(pilot, lambda: "merged by process" in subtitle(pane(app)), "merged rows")
        keys = [(s.pid, s.state, s.kernel, s.user) for s in shown_stacks(app)]
        assert len(keys) == len(set(keys)) and "tasks" in table.column_keys
        assert f"rows of {len(SNAPS[0].stacks)} stacks" in subtitle(pane(app))
        # New data with new chains for the merge shown: its rows stay, without
        # "merging…" at every tick, until the new chains are known.
        merged = table.row_keys_in_order
        gate.clear()
        app.publish(in_new_tuples(SNAPS[1]))
        await shown(pilot, app, SNAPS[1].seq)
        assert "merged by process" in subtitle(pane(app)) and table.row_keys_in_order == merged
        gate.set()
        await until(pilot, lambda: table.row_keys_in_order != merged, "the new data merged")
        assert "merged by process" in subtitle(pane(app))
        # Chains known: the next merge is drawn at once.
        gate.clear()
        await pilot.press("m")
        await pilot.pause()
        assert "merged by command" in subtitle(pane(app))


@pytest.fixture
def no_cyclic_gc() -> Iterator[None]:
    """Python's cyclic GC off: what only a pass of it would free stays."""
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


@pytest.mark.usefixtures("no_cyclic_gc")
async def test_a_worker_that_merged_a_snapshot_does_not_keep_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # A finished Textual worker is a reference cycle: only the app's full GC
    # pass (one in 30 snapshots) frees it. Given a snapshot's index as its
    # argument, each kept a snapshot until then (at a busy server with all
    # stacks merged, 8 or 9 of them: a 0.7 s pass and 70 MB more).
    monkeypatch.setattr(StacksPane, "MERGE_ON_LOOP", 50)
    app = OfftopApp(fake_source(), clock=FakeClock())
    async with app.run_test(size=SIZE) as pilot:
        await shown_then(pilot, app, "a", "m")
        await until(pilot, lambda: "merged by process" in subtitle(pane(app)), "merged rows")
        merged = weakref.ref(pane(app).index)
        app.publish(in_new_tuples(SNAPS[1]))
        await shown(pilot, app, SNAPS[1].seq)
        await until(pilot, lambda: pane(app).index is not merged(), "the next index")
        await until(pilot, lambda: merged() is None, "the merged snapshot's index freed")


class RecordedParcel(Parcel[Any]):
    """A parcel that is remembered, to ask once its worker ran whether it was taken."""

    made: list[RecordedParcel] = []

    def __init__(self, value: Any) -> None:
        super().__init__(value)
        RecordedParcel.made.append(self)


async def test_the_flame_and_export_workers_take_their_inputs_out(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # As the merge's worker (above): a finished worker keeps its arguments until
    # the full GC pass, so the flame graph's rows and the export's view are
    # handed over in a parcel the worker empties as it starts.
    monkeypatch.setattr(stacks_pane_module, "Parcel", RecordedParcel)
    monkeypatch.setattr(export_screen_module, "Parcel", RecordedParcel)
    RecordedParcel.made = []
    app = NotedApp(fake_source(), clock=FakeClock(), export_dir=tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await shown(pilot, app)
        await pilot.press("f")
        flame = app.query_one(FlameGraph)
        await until(pilot, lambda: flame.flame_tree.total_ns > 0, "the flame tree")
        await pilot.press("escape")
        await pilot.pause()
        flames = len(RecordedParcel.made)
        await pilot.press("w")
        await pilot.pause()
        assert isinstance(app.screen, ChoiceScreen)
        await pilot.press("enter")
        # Each worker takes its parcel before it posts its result (the tree, the note).
        await until(pilot, lambda: any("written to" in n for n in app.noted), "the file")
    assert flames >= 1 and len(RecordedParcel.made) > flames
    assert all(parcel.take() is None for parcel in RecordedParcel.made)


async def test_idle_waits_hidden_with_a_key() -> None:
    app = OfftopApp(fake_source(), clock=FakeClock())
    async with app.run_test(size=SIZE) as pilot:
        await shown(pilot, app)
        snap = SNAPS[0]
        idle = [s for s in snap.stacks if is_idle_wait(s.kernel, s.user)]
        assert idle, "the synthetic data has idle waits (epoll, idle Go threads)"
        await pilot.press("a", "i")
        await pilot.pause()
        assert app.hide_idle and "idle hidden" in subtitle(pane(app))
        assert not any(is_idle_wait(s.kernel, s.user) for s in shown_stacks(app))
        # Tasks whose whole time was idle leave the table; blocked-now drops idle waits.
        only_idle = {t.tid for t in snap.tasks
                     if all(is_idle_wait(s.kernel, s.user) for s in snap.stacks_of(t.tid))
                     and snap.stacks_of(t.tid)}
        table = app.query_one(TaskTable)
        assert not only_idle & {k.id for k in table.row_keys_in_order}
        assert f"{len(only_idle)} idle hidden" in subtitle(table) if only_idle else True
        blocked = app.query_one(BlockedNowTable)
        assert all(not is_idle_wait(b.kernel, b.user) for b in snap.blocked_now
                   if b.tid in blocked.tids)
        await pilot.press("i")
        await pilot.pause()
        assert any(is_idle_wait(s.kernel, s.user) for s in shown_stacks(app))


async def test_since_start_sums_the_stacks_of_every_snapshot() -> None:
    app = OfftopApp(fake_source(), clock=FakeClock())
    async with app.run_test(size=SIZE) as pilot:
        await shown(pilot, app)
        for snap in SNAPS[1:3]:
            app.publish(snap)
            await shown(pilot, app, seq=snap.seq)
        tid = SNAPS[2].tasks[0].tid
        app.query_one(TaskTable).move_to_key(RowKey.thread(tid))
        await pilot.press("c")
        await until(pilot, lambda: "since start" in title(pane(app))
                    and "summing" not in subtitle(pane(app)), "the since-start totals")
        total = sum(s.offcpu_ns for snap in SNAPS[:3] for s in snap.stacks_of(tid))
        assert sum(s.offcpu_ns for s in shown_stacks(app)) == total
        assert "not kept" not in subtitle(pane(app))  # nothing was past the bound
        await pilot.press("c")
        await pilot.pause()
        assert sum(s.offcpu_ns for s in shown_stacks(app)) == sum(
            s.offcpu_ns for s in SNAPS[2].stacks_of(tid))


async def test_the_since_start_view_says_what_its_bound_did_not_keep() -> None:
    """Past its bound the since-start totals drop their lightest stacks; the view
    says how much time those held, so what is shown plus that is every block."""
    app = OfftopApp(fake_source(), clock=FakeClock())
    app.pump.since_start = SinceStart(max_entries=100)  # SNAPS have 200 stacks each
    async with app.run_test(size=SIZE) as pilot:
        await shown(pilot, app)
        for snap in SNAPS[1:3]:
            app.publish(snap)
            await shown(pilot, app, seq=snap.seq)
        await pilot.press("a", "c")
        await until(pilot, lambda: "since start" in title(pane(app))
                    and "summing" not in subtitle(pane(app)), "the since-start totals")
        dropped = app.pump.since_start.dropped_ns
        assert dropped > 0
        assert f"{format_ns(dropped)} in lighter stacks not kept" in subtitle(pane(app))
        total = sum(s.offcpu_ns for snap in SNAPS[:3] for s in snap.stacks)
        assert sum(s.offcpu_ns for s in shown_stacks(app)) + dropped == total


async def test_the_since_start_sum_waits_until_its_snapshot_is_shown() -> None:
    app = OfftopApp(fake_source(), clock=FakeClock())
    async with app.run_test(size=SIZE) as pilot:
        await shown(pilot, app)
        since = app.pump.since_start
        await until(pilot, lambda: since.pending == 0, "the first snapshot summed")
        app.paused = True
        app.publish(SNAPS[1])
        await until(pilot, lambda: app.behind == 1, "the snapshot held")
        await pilot.pause(0.05)
        assert since.pending == 1 and since.snapshots == 2  # queued, not summed
        app.paused = False
        await shown(pilot, app, seq=SNAPS[1].seq)
        await until(pilot, lambda: since.pending == 0, "the shown snapshot summed")
        tid = SNAPS[1].tasks[0].tid
        assert sum(r.offcpu_ns for r in since.ranked() if r.tid == tid) == sum(
            s.offcpu_ns for snap in SNAPS[:2] for s in snap.stacks_of(tid))


async def test_an_app_owning_the_gc_makes_its_full_passes_after_drawing() -> None:
    before = gc.get_threshold()
    full: list[int] = []

    def count(phase: str, info: dict[str, int]) -> None:
        if phase == "stop" and info["generation"] == 2 and app.received:
            full.append(app.received)

    app = OfftopApp(fake_source(), clock=FakeClock(), freeze_gc=True)
    app.gc_pacing.every = 2  # a full pass every other snapshot shown
    gc.callbacks.append(count)
    try:
        async with app.run_test(size=SIZE) as pilot:
            await shown(pilot, app)
            await until(pilot, lambda: gc.get_threshold()[2] == GcPacing.NO_FULL_GC,
                        "Python's own full passes stopped")
            # The first pass froze what was alive. (Python's own passes until the
            # first draw are not the app's to stop: counted from here.)
            assert 1 in full and gc.get_freeze_count() > 0
            full.clear()
            for snap in SNAPS[1:]:
                app.publish(snap)
                await shown(pilot, app, seq=snap.seq)
            assert len(SNAPS) == 4
            await until(pilot, lambda: len(full) >= 1, "a full pass")
            await pilot.pause()
            # Then every other snapshot shown, and none of Python's own meanwhile.
            assert full == [3]
            # Paused (no snapshot shown), one comes at least every max_s.
            app.paused = True
            app.gc_pacing.max_s = 0.0
            await until(pilot, lambda: len(full) >= 3, "a full pass while paused")
        assert gc.get_threshold() == before
    finally:
        gc.callbacks.remove(count)
        gc.unfreeze()


async def test_flame_graph_of_the_scope_built_only_while_shown(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stacks_pane_module, "FlameTree", CountingFlameTree)
    CountingFlameTree.built = 0
    app = OfftopApp(fake_source(), clock=FakeClock())
    async with app.run_test(size=SIZE) as pilot:
        await shown(pilot, app)
        assert CountingFlameTree.built == 0
        task = SNAPS[0].tasks[0]
        await pilot.press("f")
        flame = app.query_one(FlameGraph)
        await until(pilot, lambda: flame.flame_tree.total_ns > 0, "the flame tree")
        assert app.focused is flame and pane(app).styles.border_top[0] == ""
        assert flame.flame_tree.title.startswith(f"{task.comm} {task.pid}")
        assert flame.flame_tree.total_ns == sum(s.offcpu_ns for s in SNAPS[0].stacks_of(task.tid))
        assert "Flame graph of" in str(flame.border_title)
        # The filter highlights frames; Enter zooms.
        await pilot.press("slash", *"nanosleep", "enter")
        await pilot.pause()
        assert flame.search_result is not None and flame.search_result.text == "nanosleep"
        flame.focus()
        await pilot.press("down", "enter")
        assert flame.zoom_node != 0
        built = CountingFlameTree.built
        # + is the threshold here too (one meaning per key), not a zoom.
        await pilot.press("plus")
        assert app.threshold_ns == 200 * MS
        # Back: no more trees are built, however many snapshots come.
        await pilot.press("escape", "escape")
        await pilot.pause()
        assert pane(app).view == "stacks"
        for snap in SNAPS[1:3]:
            app.publish(snap)
            await shown(pilot, app, seq=snap.seq)
        assert CountingFlameTree.built == built
        # Of all tasks: grouped by process.
        await pilot.press("a", "f")
        await until(pilot, lambda: flame.flame_tree.group_by == "process", "the whole graph")
        assert flame.flame_tree.total_ns == SNAPS[2].total_offcpu_ns


@pytest.mark.parametrize("fmt", ["folded", "pprof", "speedscope"])
async def test_the_export_key_writes_the_view_and_says_where(fmt: str, tmp_path: Path) -> None:
    app = NotedApp(fake_source(), clock=FakeClock(), export_dir=tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await shown(pilot, app)
        task = SNAPS[0].tasks[0]
        await pilot.press("w")
        await pilot.pause()
        assert isinstance(app.screen, ChoiceScreen)
        await pilot.press(*["down"] * ["folded", "pprof", "speedscope"].index(fmt), "enter")
        await until(pilot, lambda: list(tmp_path.iterdir()), "the file")
        await until(pilot, lambda: any("written to" in n for n in app.noted), "the notification")
        (path,) = tmp_path.iterdir()
        note = next(n for n in app.noted if "written to" in n)
        assert str(path) in note and f"{len(SNAPS[0].stacks_of(task.tid))} stacks" in note
        data = path.read_bytes()
        if fmt == "folded":
            lines = data.decode().splitlines()
            assert len(lines) == len(SNAPS[0].stacks_of(task.tid))
            assert all(line.startswith(f"{task.comm};") for line in lines)
        elif fmt == "pprof":
            assert path.suffix == ".gz" and gzip.decompress(data)
        else:
            doc = json.loads(data)
            assert doc["$schema"].startswith("https://www.speedscope.app")


# --- blocked now ------------------------------------------------------------------------


async def test_blocked_now_waits_are_read_from_the_source_and_woken_tasks_said() -> None:
    src = FakeLiveWaits(SNAPS[:1], realtime=False, info=INFO)
    src.waits = {b.tid: b.blocked_ns for b in SNAPS[0].blocked_now}
    app = OfftopApp(src, clock=FakeClock())
    async with app.run_test(size=SIZE) as pilot:
        await shown(pilot, app)
        blocked = app.query_one(BlockedNowTable)
        first, second = SNAPS[0].blocked_now[0], SNAPS[0].blocked_now[1]
        assert blocked.tids == [b.tid for b in SNAPS[0].blocked_now]
        src.waits[first.tid] = 5_500 * MS
        del src.waits[second.tid]  # ran meanwhile
        await until(pilot, lambda: "5.50s" in blocked.get_cell(first.tid, "wait").plain,
                    "the wait read")
        assert src.asked[-1] == blocked.tids
        assert "woke" in blocked.get_cell(second.tid, "wait").plain
        assert "1 woke since" in title(blocked)
        # Paused: nothing is read.
        await pilot.press("p")
        asked = len(src.asked)
        await pilot.pause(0.6)
        assert len(src.asked) == asked


async def test_blocked_now_waits_never_grow_by_guess() -> None:
    clock = FakeClock()
    app = OfftopApp(fake_source(), clock=clock)
    async with app.run_test(size=SIZE) as pilot:
        await shown(pilot, app)
        blocked = app.query_one(BlockedNowTable)
        first = SNAPS[0].blocked_now[0]
        assert "1.70s" in blocked.get_cell(first.tid, "wait").plain
        clock.now += 2.0
        await pilot.pause(0.6)  # two reads of the (replayed, as recorded) waits
        assert "1.70s" in blocked.get_cell(first.tid, "wait").plain


async def test_blocked_now_enter_opens_its_stack_even_without_a_task_row() -> None:
    # Blocked since before offtop started: no off-CPU time counted yet, no task row.
    frames = (Frame("schedule", "kernel", True), Frame("do_nanosleep", "kernel", True))
    user = (Frame("clock_nanosleep", "libc.so.6"), Frame("napper", "/bin/sleeper"))
    sleeper = BlockedNow(pid=777, tid=778, comm="sleeper", state="S", blocked_ns=90 * S,
                         kernel=frames, user=user, before_start=True)
    snap = dataclasses.replace(SNAPS[0], blocked_now=(sleeper, *SNAPS[0].blocked_now))
    app = OfftopApp(fake_source(snaps=[snap]), clock=FakeClock())
    async with app.run_test(size=SIZE) as pilot:
        await shown(pilot, app)
        assert RowKey.thread(778) not in app.query_one(TaskTable).row_keys_in_order
        blocked = app.query_one(BlockedNowTable)
        assert blocked.get_cell(778, "wait").plain.split()[0] == "~1m30s"
        assert "blocked before offtop started" in subtitle(blocked)
        blocked.focus()
        await pilot.press("enter")
        await pilot.pause()
        assert app.drilled
        assert "blocked now" in title(pane(app)) and "sleeper 777/778" in title(pane(app))
        labels = " ".join(tree_labels(app.query_one(CallchainTree)))
        assert "napper" in labels and "do_nanosleep" in labels


# --- long blocks ------------------------------------------------------------------------


async def test_long_blocks_are_not_lost_when_snapshots_collapse() -> None:
    app = OfftopApp(fake_source(), clock=FakeClock())
    async with app.run_test(size=SIZE) as pilot:
        await shown(pilot, app)
        for s in SNAPS[1:]:
            app.publish(s)
        await shown(pilot, app, seq=len(SNAPS))
        log = app.query_one(LongBlocksLog)
        assert log.blocks == [b for s in SNAPS for b in s.long_blocks]
        assert log.seen == sum(len(s.long_blocks) for s in SNAPS)


async def test_seen_counts_the_long_blocks_cut_under_a_flood() -> None:
    flood = with_stats(SNAPS[1], events=25_000, lost=12)
    app = OfftopApp(fake_source(snaps=[SNAPS[0], flood], n=2), clock=FakeClock())
    async with app.run_test(size=SIZE) as pilot:
        await shown(pilot, app, seq=2)
        log = app.query_one(LongBlocksLog)
        seen = len(SNAPS[0].long_blocks) + 25_000
        assert log.seen == seen
        assert subtitle(log) == (f"{seen:,} seen · newest {len(log.blocks)} listed · 12 lost")
        assert title(log) == "Long blocks ≥ 100ms"


async def test_long_block_enter_opens_its_stack_and_marks_estimates() -> None:
    app = OfftopApp(fake_source(), clock=FakeClock())
    async with app.run_test(size=SIZE) as pilot:
        await shown(pilot, app)
        log = app.query_one(LongBlocksLog)
        first = SNAPS[0].long_blocks[0]
        assert first.before_start
        assert f"~{first.duration_ns // MS}ms" in log.lines[0].text
        log.focus()
        await pilot.press("home", "enter")
        await pilot.pause()
        assert app.drilled and "long block that ended at" in title(pane(app))
        assert f"{first.comm} {first.pid}" in title(pane(app))


async def test_the_log_and_tables_are_not_laid_out_again_when_only_values_change(
        monkeypatch: pytest.MonkeyPatch) -> None:
    app = OfftopApp(fake_source(), clock=FakeClock())
    async with app.run_test(size=SIZE) as pilot:
        await shown(pilot, app)
        layouts: list[str] = []
        for widget in (app.query_one(LongBlocksLog), app.query_one(TaskTable),
                       app.query_one(StackTable), app.query_one(BlockedNowTable)):
            original = widget.refresh

            def spy(*regions: Any, _w: Widget = widget, _o: Any = original,
                    **kwargs: Any) -> Any:
                if kwargs.get("layout"):
                    layouts.append(type(_w).__name__)
                return _o(*regions, **kwargs)

            monkeypatch.setattr(widget, "refresh", spy)
        snap = SNAPS[0]
        for n in range(2, 5):  # the same rows, other values; long blocks arriving
            tasks = tuple(dataclasses.replace(t, offcpu_ns=t.offcpu_ns // n)
                          for t in snap.tasks)
            app.publish(dataclasses.replace(snap, seq=n, tasks=tasks))
            await shown(pilot, app, seq=n)
        assert app.query_one(LongBlocksLog).seen == 4 * len(snap.long_blocks)
        assert layouts == []


# --- the threshold ----------------------------------------------------------------------


async def test_threshold_keys_write_the_source() -> None:
    src = fake_source()
    app = OfftopApp(src, clock=FakeClock())
    async with app.run_test(size=SIZE) as pilot:
        await shown_then(pilot, app, "plus")
        assert src.threshold_writes == [200 * MS]
        assert "threshold 200ms" in header_text(app)
        assert title(app.query_one(LongBlocksLog)) == "Long blocks ≥ 200ms"
        app.query_one(ThresholdSlider).focus()
        await pilot.press("right", "right")
        await pilot.pause()
        assert src.threshold_writes == [200 * MS, 500 * MS, 1 * S]
        await pilot.press("left", "minus")
        await pilot.pause()
        assert src.threshold_writes[-2:] == [500 * MS, 200 * MS]
        assert src.threshold_ns == 200 * MS == app.threshold_ns
        assert app.query_one(ThresholdInput).value == "200ms"
        await pilot.press("home")
        await pilot.pause()
        assert src.threshold_writes[-1] == 0


async def test_plus_never_lowers_a_threshold_given_on_the_command_line() -> None:
    snap = dataclasses.replace(SNAPS[0], threshold_ns=30 * S)
    src = fake_source(snaps=[snap])
    app = OfftopApp(src, clock=FakeClock())
    async with app.run_test(size=SIZE) as pilot:
        await shown(pilot, app)
        assert app.threshold_ns == 30 * S
        await pilot.press("plus")
        await pilot.pause()
        assert src.threshold_writes == [60 * S]  # one step up: a minute, not 10 s
        app.query_one(ThresholdSlider).focus()
        await pilot.press("end")
        await pilot.pause()
        assert src.threshold_writes[-1] == MAX_THRESHOLD_NS  # the parser's limit: 1 h


async def test_the_threshold_can_be_typed() -> None:
    src = fake_source()
    app = NotedApp(src, clock=FakeClock())
    async with app.run_test(size=SIZE) as pilot:
        await shown(pilot, app)
        box = app.query_one(ThresholdInput)
        assert box.value == "100ms"
        box.focus()
        await pilot.press(*"250ms+", "backspace", "enter")  # all selected; "+" is text here
        await pilot.pause()
        assert src.threshold_writes == [250 * MS]
        assert "threshold 250ms" in header_text(app)
        assert app.focused is app.query_one(ThresholdSlider)
        box.focus()
        await pilot.press(*"7200s", "enter")
        await pilot.pause()
        assert src.threshold_writes == [250 * MS]  # refused: above the limit
        assert any("too large" in n for n in app.noted)
        await pilot.press("escape")
        assert box.value == "250ms"


async def test_slider_mouse_click_and_drag() -> None:
    src = fake_source()
    app = OfftopApp(src, clock=FakeClock())
    async with app.run_test(size=SIZE) as pilot:
        await shown(pilot, app)
        slider = app.query_one(ThresholdSlider)
        await pilot.click(ThresholdSlider, offset=(1, 0))
        await pilot.pause()
        assert src.threshold_writes and src.threshold_writes[-1] < 100_000
        await pilot.click(ThresholdSlider, offset=(slider.size.width - 1, 0))
        await pilot.pause()
        assert src.threshold_writes[-1] == MAX_THRESHOLD_NS
        assert slider.value_ns == app.threshold_ns == src.threshold_ns
        assert app.query_one(ThresholdPane).value_ns == MAX_THRESHOLD_NS


# --- layouts ----------------------------------------------------------------------------


async def test_at_80_columns_the_side_panes_go_below() -> None:
    app = OfftopApp(fake_source(), clock=FakeClock())
    async with app.run_test(size=(80, 24)) as pilot:
        await shown(pilot, app)
        assert app.screen.has_class("-narrow")
        left, right = app.query_one("#left").region, app.query_one("#right").region
        assert right.width > 60 and right.y >= left.bottom
        for widget in (app.query_one(BlockedNowTable), app.query_one(LongBlocksLog),
                       app.query_one(ThresholdSlider)):
            assert widget.region.height > 0 and widget.region.width > 20
        assert app.query_one(TaskTable).width_class == "compact"


async def test_at_200_columns_the_tasks_say_where_they_block_and_their_command() -> None:
    app = OfftopApp(fake_source(), clock=FakeClock())
    async with app.run_test(size=(200, 50)) as pilot:
        await shown(pilot, app)
        table = app.query_one(TaskTable)
        assert table.width_class == "wide"
        assert "where" in table.column_keys and "cmd" in table.column_keys
        py = next(t for t in SNAPS[0].tasks if t.comm == "python3")
        assert table.get_cell(py.key, "where").plain == "py:Queue.get (queue.py:171)"
        assert table.get_cell(py.key, "cmd").plain.startswith("/usr/bin/python3 --workers")
        pg = next(t for t in SNAPS[0].tasks if t.comm == "postgres")
        assert table.get_cell(pg.key, "where").plain in ("BackgroundWriterMain", "PostgresMain",
                                                        "WalWriterMain", "WaitEventSetWait",
                                                        "XLogFlush", "mdread")


async def test_small_terminals_degrade_without_crashing() -> None:
    app = OfftopApp(fake_source(2), clock=FakeClock())
    async with app.run_test(size=(60, 20)) as pilot:
        await shown(pilot, app, seq=2)
        assert app.screen.has_class("-narrow") and app.screen.has_class("-short")
        await pilot.press("down", "enter", "k", "escape", "t", "s", "a", "f", "f1")
        await pilot.pause()
        await pilot.press("escape", "escape", "slash", "x", "escape", "plus", "p", "p")
        await pilot.pause()
        await pilot.resize_terminal(40, 10)
        await pilot.pause()
        await pilot.resize_terminal(140, 45)
        await pilot.pause()
        assert app.query_one("#right").display and not app.screen.has_class("-narrow")


async def test_a_short_terminal_shows_one_pane_at_a_time_on_the_left() -> None:
    app = OfftopApp(fake_source(), clock=FakeClock())
    async with app.run_test(size=(120, 20)) as pilot:
        await shown(pilot, app)
        assert app.screen.has_class("-short")
        tasks, stacks = app.query_one(TaskTable), pane(app)
        assert tasks.display and not stacks.display
        await pilot.press("enter")
        await pilot.pause()
        assert app.drilled and stacks.display and not tasks.display
        await pilot.press("escape")
        await pilot.pause()
        assert not app.drilled and tasks.display and not stacks.display


async def test_markup_in_comm_is_shown_literally() -> None:
    app = OfftopApp(fake_source(), clock=FakeClock())
    async with app.run_test(size=SIZE) as pilot:
        await shown_then(pilot, app, "slash", *"evil", "enter")
        table = app.query_one(TaskTable)
        key = table.cursor_key
        assert key is not None
        assert table.get_cell(key, "comm").plain == "evil[red]comm"
        assert "[red]" in title(pane(app))
        assert "evil[red]comm" in app.export_screenshot()


# --- keys --------------------------------------------------------------------------------


async def test_pause_freezes_the_display() -> None:
    app = OfftopApp(fake_source(), clock=FakeClock())
    async with app.run_test(size=SIZE) as pilot:
        await shown(pilot, app)
        border = app.query_one(BlockedNowTable).styles.border_top
        await pilot.press("p")
        assert app.paused and app.has_class("-paused")
        assert app.query_one(BlockedNowTable).styles.border_top != border  # the rule shows it
        assert "PAUSED" in header_text(app)
        rows = app.query_one(TaskTable).row_keys_in_order
        for n, snap in enumerate(SNAPS[1:3], start=2):
            app.publish(snap)
            await until(pilot, lambda n=n: app.received >= n, "the snapshot received")
        assert app.received == 3
        assert app.snapshot is not None and app.snapshot.seq == 1
        assert "#1" in header_text(app) and "+2" in header_text(app)
        assert app.query_one(TaskTable).row_keys_in_order == rows
        await pilot.press("space")
        await pilot.pause()
        assert not app.paused and app.snapshot.seq == 3
        assert "PAUSED" not in header_text(app) and "#3" in header_text(app)
        assert app.query_one(LongBlocksLog).seen == sum(len(s.long_blocks) for s in SNAPS[:3])


async def test_help_is_built_from_the_bindings() -> None:
    app = OfftopApp(fake_source(), clock=FakeClock())
    async with app.run_test(size=SIZE) as pilot:
        await shown_then(pilot, app, "f1")
        screen = app.screen
        assert isinstance(screen, HelpScreen)
        lines = dict(screen.lines)
        shown_keys = {k for keys in lines for k in keys.split(" / ")}
        for b in APP_BINDINGS:  # a replay's keys are listed only in a replay
            assert isinstance(b, Binding)
            assert screen.key_display(b) in shown_keys, b
            if b.show:
                assert (b.tooltip or b.description) in lines.values()
        for key in ("q / F10 / ^c", "F1 / ?", "p / space", "+ / =", "/ / F3", "F6", "K", "U",
                    "F", "f", "i", "m", "c", "w", "j", "k", "e", "x"):
            assert key in lines, key
        # One meaning per key: no key is bound twice across the panes' sections.
        assert "u" not in lines
        svg = app.export_screenshot().replace("&#160;", " ")
        assert "Pause / resume the display" in svg and "p / space" in svg
        await pilot.press("escape")
        assert not isinstance(app.screen, HelpScreen)
        await pilot.press("question_mark")
        assert isinstance(app.screen, HelpScreen)


async def test_command_palette_sorts() -> None:
    app = OfftopApp(fake_source(), clock=FakeClock())
    async with app.run_test(size=SIZE) as pilot:
        await shown(pilot, app)
        await pilot.press("ctrl+p")
        await pilot.pause(0.2)
        await pilot.press(*"Sort by COUNT")
        await pilot.pause(0.5)
        await pilot.press("enter")
        await pilot.pause(0.2)
        assert app.query_one(TaskTable).sort_spec.column == "count"


@pytest.mark.parametrize("key", ["ctrl+c", "f10", "q"])
async def test_quit_keys(key: str) -> None:
    app = OfftopApp(fake_source(), clock=FakeClock())
    async with app.run_test(size=SIZE) as pilot:
        await shown_then(pilot, app, key)
        assert app.stopping.is_set() and not app.is_running


async def test_q_is_text_where_typed_and_closes_screens_of_its_own() -> None:
    """q quits before the focused pane sees it (a priority key), except where it is
    typed (the filter, the threshold) or a screen over the tasks takes it (help)."""
    src = fake_source()
    app = OfftopApp(src, clock=FakeClock())
    async with app.run_test(size=SIZE) as pilot:
        await shown_then(pilot, app, "slash", *"squid")
        assert app.query_one(FilterInput).value == "squid"
        await pilot.press("escape")
        box = app.query_one(ThresholdInput)
        box.focus()
        await pilot.press("q")
        await pilot.pause()
        assert "q" in box.value
        await pilot.press("escape")
        app.query_one(TaskTable).focus()
        await pilot.press("f1")
        await pilot.pause()
        assert isinstance(app.screen, HelpScreen)
        await pilot.press("q")
        await pilot.pause()
        assert not isinstance(app.screen, HelpScreen)
        assert app.is_running and not app.stopping.is_set()
        await pilot.press("q")
        await pilot.pause()
        assert app.stopping.is_set() and not app.is_running


async def test_sigterm_exits_cleanly() -> None:
    app = OfftopApp(fake_source(), clock=FakeClock())
    async with app.run_test(size=SIZE) as pilot:
        await shown(pilot, app)
        if signal.SIGTERM not in app.signals.installed:
            pytest.skip("signal handlers need the main thread")
        os.kill(os.getpid(), signal.SIGTERM)
        await until(pilot, lambda: not app.is_running, "the app exits")
    assert app.stopping.is_set() and app.signals.installed == []


async def test_replay_sources_give_their_recorded_waits() -> None:
    src = ReplaySource(SNAPS[:2], realtime=False)
    assert src.blocked_waits([1]) == {}
    src.start()
    stop = threading.Event()
    src.next_snapshot(1.0, stop)
    tids = [b.tid for b in SNAPS[0].blocked_now]
    assert src.blocked_waits(tids[:2]) == {b.tid: b.blocked_ns for b in SNAPS[0].blocked_now[:2]}
    src.next_snapshot(1.0, stop)
    assert src.blocked_waits(tids) == {b.tid: b.blocked_ns for b in SNAPS[1].blocked_now}


def test_python_frames_and_estimates_in_long_block_lines() -> None:
    py = (Frame("read", "libc.so.6"), Frame("py:Queue.get (queue.py:171)", "queue.py"))
    block = LongBlock(1.0, 1, 2, "app", "S", 2 * S, (Frame("pipe_read", "kernel", True),), py,
                      before_start=True)
    line = long_block_line(block).plain
    assert "~2.00s" in line and "k pipe_read ← u read ← py Queue.get (queue.py:171)" in line


async def test_a_message_arriving_as_the_app_closes_is_dropped_not_a_traceback() -> None:
    """At exit the widgets go first, and a message a child posted just before
    (a busy server's refresh moving the cursor) still arrives: seen on a
    headless run of the real engine under load, it ended the app with
    NoMatches and a traceback."""
    app = OfftopApp(fake_source(), clock=FakeClock())
    async with app.run_test(size=SIZE) as pilot:
        await shown(pilot, app)
        table = app.query_one(TaskTable)
        key = table.cursor_key
        assert key is not None
        blocked = app.query_one(BlockedNowTable)
        block = SNAPS[0].blocked_now[0]
        await app.query_one(StacksPane).remove()
        await app.query_one("#left").remove()
        for message in (TaskTable.TaskHighlighted(table, key, moved=False),
                        TaskTable.TaskChosen(table, key),
                        BlockedNowTable.Chosen(blocked, block),
                        StacksPane.ViewChanged("tree"), FilterInput.Done()):
            app.post_message(message)
        await pilot.pause()
        assert app.is_running
