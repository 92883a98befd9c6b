"""Pilot tests of the TUI, fed by a replay source (the fake) and synthetic data."""

from __future__ import annotations

import os
import signal
import threading

import pytest
from textual.binding import Binding
from textual.pilot import Pilot
from textual.widgets import ContentSwitcher

from offtop.app import OfftopApp
from offtop.model import Snapshot
from offtop.source import ReplaySource, SourceInfo
from offtop.synthetic import synthetic_snapshots
from offtop.widgets.blocked_now import BlockedNowTable
from offtop.widgets.callchain_tree import CallchainTree
from offtop.widgets.header import OfftopHeader
from offtop.widgets.help_screen import HelpScreen
from offtop.widgets.long_blocks_log import LongBlocksLog
from offtop.widgets.stack_table import StackTable
from offtop.widgets.task_table import TaskTable
from offtop.widgets.threshold_slider import ThresholdSlider

SNAPS = synthetic_snapshots(4, tasks=50, stacks=200, seed=0)
INFO = SourceInfo(host="testhost", kernel="6.1.0-test", scope="all tasks", kind="replay")
SIZE = (140, 45)


class FakeLiveReplay(ReplaySource):
    """A replay source that, once out of snapshots, waits like a live one."""

    def next_snapshot(self, interval_s: float, stop: threading.Event) -> Snapshot | None:
        snap = super().next_snapshot(interval_s, stop)
        if snap is None:
            stop.wait()
        return snap


class FakeSlowStart(FakeLiveReplay):
    """start() blocks until released, like a BPF compile."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.release = threading.Event()

    def start(self) -> None:
        self.release.wait(10)
        super().start()


class FakeBrokenStart(FakeLiveReplay):
    """start() fails the way a missing kernel header tree would."""

    def start(self) -> None:
        raise RuntimeError("cannot compile the BPF program: [no kernel headers]")


class FakeClock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def fake_source(n: int = 1, cls: type[ReplaySource] = FakeLiveReplay) -> ReplaySource:
    """The replay source standing in for BPF."""
    return cls(SNAPS[:n], realtime=False, info=INFO)


async def shown(pilot: Pilot[object], app: OfftopApp, seq: int = 1) -> None:
    """Wait until snapshot `seq` is on screen."""
    for _ in range(500):
        if app.snapshot is not None and app.snapshot.seq >= seq:
            break
        await pilot.pause(0.01)
    assert app.snapshot is not None and app.snapshot.seq >= seq, "snapshot never shown"
    await pilot.pause()


def header_text(app: OfftopApp) -> str:
    return app.query_one(OfftopHeader).render().plain


async def test_shows_ranked_tasks_and_header() -> None:
    src = fake_source()
    app = OfftopApp(src, clock=FakeClock())
    async with app.run_test(size=SIZE) as pilot:
        await shown(pilot, app)
        table = app.query_one(TaskTable)
        assert table.row_keys_in_order == [t.key for t in SNAPS[0].tasks]
        assert table.cursor_key == SNAPS[0].tasks[0].key
        text = header_text(app)
        assert "testhost" in text and "6.1.0-test" in text and "all tasks" in text
        assert "threshold 100ms" in text and "interval 1s" in text
        assert "lost 0" in text and "stack errors" in text and "ns/switch" in text
        assert "PAUSED" not in text
        assert src.threshold_writes == []


async def test_loading_state_until_the_source_starts() -> None:
    src = fake_source(cls=FakeSlowStart)
    assert isinstance(src, FakeSlowStart)
    app = OfftopApp(src, clock=FakeClock())
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause(0.1)
        assert app.has_class("-loading")
        assert app.query_one(TaskTable).loading
        assert "compiling the BPF program" in header_text(app)
        src.release.set()
        await shown(pilot, app)
        assert not app.has_class("-loading")
        assert not app.query_one(TaskTable).loading


async def test_start_failure_is_shown_and_q_quits() -> None:
    app = OfftopApp(fake_source(cls=FakeBrokenStart), clock=FakeClock())
    async with app.run_test(size=SIZE) as pilot:
        for _ in range(200):
            if app.source_error is not None:
                break
            await pilot.pause(0.01)
        await pilot.pause()
        assert isinstance(app.source_error, RuntimeError)
        assert app.has_class("-failed")
        error = app.query_one("#error")
        assert error.display
        assert "[no kernel headers]" in str(error.render())
        await pilot.press("q")
        await pilot.pause()
    assert app.return_code == 0
    assert app.source_error is not None


async def test_navigation_keys() -> None:
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
        # The stacks pane follows the cursor.
        await pilot.press("home", "down")
        await pilot.pause()
        tid = int(keys[1][1:])
        stacks = app.query_one(StackTable)
        assert stacks.row_count == len(SNAPS[0].stacks_of(tid))
        assert all(s.tid == tid for s in map(stacks.stack_by_key, stacks.row_keys_in_order)
                   if s is not None)


@pytest.mark.parametrize("follow", [False, True], ids=["position", "follow"])
async def test_cursor_across_a_resort_keeps_its_position_or_follows(follow: bool) -> None:
    app = OfftopApp(fake_source(), clock=FakeClock())
    async with app.run_test(size=SIZE) as pilot:
        await shown(pilot, app)
        table = app.query_one(TaskTable)
        table.follow = follow
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
        # The stacks pane shows the task under the cursor.
        await pilot.pause()
        tid = int(str(table.cursor_key)[1:])
        stacks = app.query_one(StackTable)
        assert {s.tid for s in map(stacks.stack_by_key, stacks.row_keys_in_order)
                if s is not None} == {tid}


async def test_selected_task_stays_listed_while_idle() -> None:
    app = OfftopApp(fake_source(), clock=FakeClock())
    async with app.run_test(size=SIZE) as pilot:
        await shown(pilot, app)
        table = app.query_one(TaskTable)
        table.follow = True
        key = SNAPS[0].tasks[5].key
        table.move_to_key(key)
        await pilot.pause()
        # The next snapshot has nothing for this task.
        snap = SNAPS[1]
        idle = Snapshot(seq=snap.seq, time=snap.time, interval_s=snap.interval_s,
                        threshold_ns=snap.threshold_ns,
                        tasks=tuple(t for t in snap.tasks if t.key != key),
                        stacks=tuple(s for s in snap.stacks if f"t{s.tid}" != key),
                        stats=snap.stats)
        app.publish(idle)
        await shown(pilot, app, seq=2)
        assert table.cursor_key == key
        assert "last seen" in str(app.query_one("#stacks-pane").border_subtitle)


async def test_sort_key_cycles_and_header_click_sorts() -> None:
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
        # Click the COMM header (PID and TID columns are 7 wide, plus padding).
        await pilot.click(TaskTable, offset=(20, 0))
        assert table.sort_spec.column == "comm" and not table.sort_spec.reverse
        comms = [by_key[k].comm.lower() for k in table.row_keys_in_order]
        assert comms == sorted(comms)
        await pilot.click(TaskTable, offset=(20, 0))
        assert table.sort_spec.reverse
        comms = [by_key[k].comm.lower() for k in table.row_keys_in_order]
        assert comms == sorted(comms, reverse=True)
        assert "COMM" in str(app.query_one("#tasks-pane").border_subtitle)


async def test_drill_down_into_the_callchain_tree_and_back() -> None:
    app = OfftopApp(fake_source(), clock=FakeClock())
    async with app.run_test(size=SIZE) as pilot:
        await shown(pilot, app)
        task = SNAPS[0].tasks[1]
        await pilot.press("down", "enter")
        await pilot.pause()
        assert app.drilled
        assert app.query_one(ContentSwitcher).current == "tree"
        tree = app.query_one(CallchainTree)
        assert app.focused is tree
        assert task.comm in tree.root.label.plain  # type: ignore[union-attr]
        top = SNAPS[0].stacks_of(task.tid)[0]
        outermost = top.user[-1].name
        labels = [n.label.plain for n in tree.root.children]  # type: ignore[union-attr]
        assert any(outermost in label for label in labels)
        # The hottest path is expanded down to a kernel frame.
        assert any(p[-1].startswith("k:") for p in tree.expanded_paths() if p)
        await pilot.press("escape")
        assert not app.drilled
        assert app.query_one(ContentSwitcher).current == "stacks"
        assert app.focused is app.query_one(TaskTable)


async def test_tree_keeps_expansion_across_snapshots() -> None:
    app = OfftopApp(fake_source(), clock=FakeClock())
    async with app.run_test(size=SIZE) as pilot:
        await shown(pilot, app)
        await pilot.press("enter")
        await pilot.pause()
        tree = app.query_one(CallchainTree)
        # Expand every node: all of them must stay expanded.
        tree.root.expand_all()
        await pilot.pause()
        expanded = tree.expanded_paths()
        nodes = {p: tree.node_at(p) for p in expanded}
        await pilot.press("down", "down", "down")
        cursor = tree.cursor_node
        assert cursor is not None and cursor.data is not None
        cursor_path = cursor.data.path
        app.publish(SNAPS[1])
        await shown(pilot, app, seq=2)
        still = [p for p in expanded if tree.node_at(p) is not None]
        assert still, "no path survived the update"
        for p in still:
            node = tree.node_at(p)
            assert node is nodes[p], "node rebuilt instead of diffed"
            assert node is not None and node.is_expanded
        after = tree.cursor_node
        if tree.node_at(cursor_path) is not None:
            assert after is not None and after.data is not None and after.data.path == cursor_path


async def test_stack_row_enter_focuses_its_path() -> None:
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


async def test_frame_toggles() -> None:
    app = OfftopApp(fake_source(), clock=FakeClock())
    async with app.run_test(size=SIZE) as pilot:
        await shown(pilot, app)
        await pilot.press("enter")
        await pilot.pause()
        tree = app.query_one(CallchainTree)
        await pilot.press("k")  # in the tree: kernel frames off
        await pilot.pause()
        assert not app.show_kernel
        tree.root.expand_all()
        await pilot.pause()
        paths = [p for p in tree.expanded_paths() if p]
        assert paths and all(not step.startswith("k:") for p in paths for step in p)
        await pilot.press("k", "u")
        await pilot.pause()
        assert app.show_kernel and not app.show_user
        await pilot.press("escape", "U")  # shift: anywhere
        assert app.show_user
        await pilot.press("u")  # in the task table, u is not a frame toggle
        assert app.show_user
        await pilot.press("K", "U")  # hiding both brings the other back
        assert app.show_kernel and not app.show_user


async def test_pause_freezes_the_display() -> None:
    app = OfftopApp(fake_source(), clock=FakeClock())
    async with app.run_test(size=SIZE) as pilot:
        await shown(pilot, app)
        await pilot.press("p")
        assert app.paused and app.has_class("-paused")
        assert "PAUSED" in header_text(app)
        rows = app.query_one(TaskTable).row_keys_in_order
        for n, snap in enumerate(SNAPS[1:3], start=2):
            app.publish(snap)
            for _ in range(100):
                if app.received >= n:
                    break
                await pilot.pause(0.01)
        assert app.received == 3
        assert app.snapshot is not None and app.snapshot.seq == 1
        assert "#1" in header_text(app) and "+2" in header_text(app)
        assert app.query_one(TaskTable).row_keys_in_order == rows
        await pilot.press("space")
        await pilot.pause()
        assert not app.paused
        assert app.snapshot.seq == 3
        assert "PAUSED" not in header_text(app) and "#3" in header_text(app)


async def test_long_blocks_are_not_lost_when_snapshots_collapse() -> None:
    app = OfftopApp(fake_source(), clock=FakeClock())
    async with app.run_test(size=SIZE) as pilot:
        await shown(pilot, app)
        for s in SNAPS[1:]:
            app.publish(s)
        await shown(pilot, app, seq=len(SNAPS))
        log = app.query_one(LongBlocksLog)
        assert log.total == sum(len(s.long_blocks) for s in SNAPS)


async def test_filter_hides_non_matching_rows() -> None:
    app = OfftopApp(fake_source(), clock=FakeClock())
    async with app.run_test(size=SIZE) as pilot:
        await shown(pilot, app)
        table = app.query_one(TaskTable)
        await pilot.press("slash")
        assert app.has_class("-filtering")
        await pilot.press(*"nginx")
        await pilot.pause()
        by_key = {t.key: t for t in SNAPS[0].tasks}
        keys = table.row_keys_in_order
        assert keys and all(by_key[k].comm == "nginx" for k in keys)
        assert len(keys) == sum(1 for t in SNAPS[0].tasks if t.comm == "nginx")
        # A pid matches too.
        await pilot.press(*["backspace"] * 5, *str(SNAPS[0].tasks[0].pid))
        await pilot.pause()
        assert all(by_key[k].pid == SNAPS[0].tasks[0].pid for k in table.row_keys_in_order)
        await pilot.press("enter")
        assert app.focused is table and app.has_class("-filtering")
        await pilot.press("escape")
        await pilot.pause()
        assert not app.has_class("-filtering")
        assert len(table.row_keys_in_order) == len(SNAPS[0].tasks)


async def test_help_is_built_from_the_bindings() -> None:
    app = OfftopApp(fake_source(), clock=FakeClock())
    async with app.run_test(size=SIZE) as pilot:
        await shown(pilot, app)
        await pilot.press("question_mark")
        await pilot.pause()
        screen = app.screen
        assert isinstance(screen, HelpScreen)
        lines = dict(screen.lines)
        shown_keys = {k for keys in lines for k in keys.split(" / ")}
        for b in OfftopApp.BINDINGS:
            assert isinstance(b, Binding)
            assert screen.key_display(b) in shown_keys, b
            if b.show:
                assert (b.tooltip or b.description) in lines.values()
        for key in ("q / ^c", "p / space", "+ / =", "?", "/", "K", "U", "j", "k", "u", "e"):
            assert key in lines
        svg = app.export_screenshot().replace("&#160;", " ")
        assert "Pause / resume the display" in svg and "p / space" in svg
        await pilot.press("escape")
        assert not isinstance(app.screen, HelpScreen)


async def test_slider_keys_write_the_threshold() -> None:
    src = fake_source()
    app = OfftopApp(src, clock=FakeClock())
    async with app.run_test(size=SIZE) as pilot:
        await shown(pilot, app)
        await pilot.press("plus")
        await pilot.pause()
        assert src.threshold_writes == [200_000_000]
        assert "threshold 200ms" in header_text(app)
        app.query_one(ThresholdSlider).focus()
        await pilot.press("right", "right")
        await pilot.pause()
        assert src.threshold_writes == [200_000_000, 500_000_000, 1_000_000_000]
        await pilot.press("left", "minus")
        await pilot.pause()
        assert src.threshold_writes[-2:] == [500_000_000, 200_000_000]
        assert src.threshold_ns == 200_000_000 == app.threshold_ns
        assert "threshold 200ms" in header_text(app)
        await pilot.press("home")
        await pilot.pause()
        assert src.threshold_writes[-1] == 0


async def test_slider_mouse_click_and_drag() -> None:
    src = fake_source()
    app = OfftopApp(src, clock=FakeClock())
    async with app.run_test(size=SIZE) as pilot:
        await shown(pilot, app)
        slider = app.query_one(ThresholdSlider)
        await pilot.click(ThresholdSlider, offset=(2, 2))  # left end of the bar
        await pilot.pause()
        assert src.threshold_writes and src.threshold_writes[-1] < 100_000
        await pilot.click(ThresholdSlider, offset=(slider.outer_size.width - 3, 2))
        await pilot.pause()
        assert src.threshold_writes[-1] == 10_000_000_000
        assert slider.value_ns == app.threshold_ns == src.threshold_ns


async def test_threads_processes_toggle() -> None:
    app = OfftopApp(fake_source(), clock=FakeClock())
    async with app.run_test(size=SIZE) as pilot:
        await shown(pilot, app)
        table = app.query_one(TaskTable)
        await pilot.press("down")
        thread = next(t for t in SNAPS[0].tasks if t.key == table.cursor_key)
        await pilot.press("t")
        await pilot.pause()
        assert app.processes
        assert table.row_keys_in_order == [p.key for p in SNAPS[0].processes]
        assert table.cursor_key == f"p{thread.pid}"
        stacks = app.query_one(StackTable)
        assert stacks.row_count == min(len(SNAPS[0].stacks_of_process(thread.pid)),
                                       StackTable.MAX_ROWS)
        await pilot.press("t")
        await pilot.pause()
        assert not app.processes
        assert table.row_keys_in_order == [t.key for t in SNAPS[0].tasks]


async def test_all_stacks_view() -> None:
    app = OfftopApp(fake_source(), clock=FakeClock())
    async with app.run_test(size=SIZE) as pilot:
        await shown(pilot, app)
        await pilot.press("a")
        await pilot.pause()
        stacks = app.query_one(StackTable)
        assert stacks.scope == "all"
        assert stacks.row_count == min(len(SNAPS[0].stacks), StackTable.MAX_ROWS_ALL)
        tids = {s.tid for s in map(stacks.stack_by_key, stacks.row_keys_in_order) if s}
        assert len(tids) > 1
        stacks.focus()
        await pilot.press("down", "enter")
        await pilot.pause()
        assert app.drilled
        await pilot.press("a")
        assert not app.drilled and stacks.scope == "task"


async def test_blocked_now_waits_grow_and_enter_selects_the_task() -> None:
    clock = FakeClock()
    app = OfftopApp(fake_source(), clock=clock)
    async with app.run_test(size=SIZE) as pilot:
        await shown(pilot, app)
        blocked = app.query_one(BlockedNowTable)
        first = SNAPS[0].blocked_now[0]
        assert blocked.row_count == len(SNAPS[0].blocked_now)
        cell = blocked.get_cell(f"t{first.tid}", "wait")
        assert "1.70s" in str(cell)
        clock.now += 2.0
        # The waits are re-drawn by a timer: give it time on a loaded machine.
        for _ in range(50):
            await pilot.pause(0.1)
            cell = blocked.get_cell(f"t{first.tid}", "wait")
            if "3.70s" in str(cell):
                break
        assert "3.70s" in str(cell)
        blocked.focus()
        await pilot.press("enter")
        await pilot.pause()
        assert app.query_one(TaskTable).cursor_key == f"t{first.tid}"
        assert app.focused is app.query_one(TaskTable)


async def test_markup_in_comm_is_shown_literally() -> None:
    app = OfftopApp(fake_source(), clock=FakeClock())
    async with app.run_test(size=SIZE) as pilot:
        await shown(pilot, app)
        await pilot.press("slash", *"evil", "enter")
        await pilot.pause()
        table = app.query_one(TaskTable)
        key = table.cursor_key
        assert key is not None
        assert table.get_cell(key, "comm").plain == "evil[red]comm"  # type: ignore[union-attr]
        assert "[red]" in str(app.query_one("#stacks-pane").border_title)
        svg = app.export_screenshot()
        assert "evil[red]comm" in svg


async def test_small_terminal_degrades_without_crashing() -> None:
    app = OfftopApp(fake_source(2), clock=FakeClock())
    async with app.run_test(size=(60, 20)) as pilot:
        await shown(pilot, app, seq=2)
        assert app.screen.has_class("-narrow")
        assert not app.query_one("#right").display or app.query_one("#right").size.width == 0
        await pilot.press("down", "enter", "k", "escape", "t", "s", "a", "question_mark")
        await pilot.pause()
        await pilot.press("escape", "slash", "x", "escape", "plus", "p", "p")
        await pilot.pause()
        await pilot.resize_terminal(40, 10)
        await pilot.pause()
        await pilot.resize_terminal(140, 45)
        await pilot.pause()
        assert app.query_one("#right").display


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


async def test_ctrl_c_quits() -> None:
    app = OfftopApp(fake_source(), clock=FakeClock())
    async with app.run_test(size=SIZE) as pilot:
        await shown(pilot, app)
        await pilot.press("ctrl+c")
        await pilot.pause()
        assert app._exit


async def test_sigterm_exits_cleanly() -> None:
    app = OfftopApp(fake_source(), clock=FakeClock())
    async with app.run_test(size=SIZE) as pilot:
        await shown(pilot, app)
        if signal.SIGTERM not in app._signals:
            pytest.skip("signal handlers need the main thread")
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(100):
            if app._exit:
                break
            await pilot.pause(0.01)
        assert app._exit
    assert app._stop.is_set()
