"""Who woke me, in the TUI (issue 11): the waker tree, the long-block log, `g`.

A hand-made snapshot whose wakers are known: a pipe reader woken mostly by
a writer thread of its own process, then by the timer interrupt, network
softirqs and a disk interrupt, with some time whose waker was not seen; a
thread woken by tasks with hostile names; long blocks with and without
wakers. Fed through the replay source, driven with Pilot.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from rich.text import Text
from textual.pilot import Pilot

from offtop.app import OfftopApp
from offtop.model import (
    Aggregator,
    Frame,
    LongBlock,
    RowKey,
    Sample,
    Snapshot,
    StackRow,
    Waker,
)
from offtop.widgets.callchain_tree import CallchainTree, passes_through, stack_path
from offtop.widgets.help_screen import HelpScreen
from offtop.widgets.long_blocks_log import LongBlocksLog, long_block_line
from offtop.widgets.scopes import Scope
from offtop.widgets.stack_table import StackTable
from offtop.widgets.stacks_pane import StacksPane
from offtop.widgets.task_table import TaskTable
from offtop.widgets.waker_tree import WakerTree, sum_wakers
from tests.test_ui_app import INFO, FakeClock, FakeLiveReplay, NotedApp, shown, until

MS = 1_000_000
SIZE = (140, 45)
PID, READER, WRITER, VICTIM = 4000, 4001, 4002, 4003


def k(*names: str) -> tuple[Frame, ...]:
    return tuple(Frame(n, "kernel", True) for n in names)


def u(*names: str) -> tuple[Frame, ...]:
    return tuple(Frame(n, "wk") for n in names)


PIPE_READ = k("schedule", "pipe_read", "vfs_read", "ksys_read")
NANOSLEEP = k("schedule", "do_nanosleep", "hrtimer_nanosleep")
WRITER_WAKER = Waker(PID, WRITER, "wl-writer", "task",
                     k("__wake_up_common", "pipe_write", "vfs_write"),
                     u("write", "offtop_wk_write_loop", "main"))
# The same writer, seen once without its stack (a block shorter than --waker-stacks-min).
WRITER_BARE = Waker(PID, WRITER, "wl-writer")
TIMER = Waker(0, 0, "", "timer", k("hrtimer_wakeup", "__hrtimer_run_queues"))
NET_RX = Waker(0, 0, "NET_RX", "softirq", k("sock_def_readable", "net_rx_action"))
DISK = Waker(0, 0, "", "irq", k("blk_mq_end_request", "nvme_irq"))
# Wakers whose names a process chose: an OSC that would retitle the terminal, and markup.
OSC = Waker(5000, 5001, "\x1b]0;PWNED\x07", "task", k("futex_wake"), u("evil_unlock"))
MARKUP = Waker(5000, 5002, "[bold]x[/]", "task", k("futex_wake"), u("evil_unlock"))
# A kernel thread that spends no time off the CPU here: never in the task table.
KTHREAD = Waker(77, 77, "jbd2/sda1-8", "task", k("__wake_up", "kjournald2"))


def sample(tid: int, comm: str, kernel: tuple[Frame, ...], user: tuple[Frame, ...],
           ns: int, count: int, waker: Waker | None) -> Sample:
    return Sample(pid=PID, tid=tid, comm=comm, state="S", offcpu_ns=ns, count=count,
                  max_ns=ns // count, kernel=kernel, user=user, waker=waker)


def woken_snapshot() -> Snapshot:
    """The reader: 100 ms in pipe_read (writer 70, timer 0, unseen 10 of it ...)."""
    read_user = u("read", "offtop_wk_read_loop", "main")
    sleep_user = u("nanosleep", "offtop_wk_nap", "main")
    samples = [
        # pipe_read: the writer 70 ms (60 with its stack, 10 without), 10 not seen.
        sample(READER, "wl-reader", PIPE_READ, read_user, 60 * MS, 6, WRITER_WAKER),
        sample(READER, "wl-reader", PIPE_READ, read_user, 10 * MS, 2, WRITER_BARE),
        sample(READER, "wl-reader", PIPE_READ, read_user, 10 * MS, 1, None),
        # nanosleep: the timer 15 ms, network 3 ms, disk 2 ms (a made-up mix).
        sample(READER, "wl-reader", NANOSLEEP, sleep_user, 15 * MS, 3, TIMER),
        sample(READER, "wl-reader", NANOSLEEP, sleep_user, 3 * MS, 1, NET_RX),
        sample(READER, "wl-reader", NANOSLEEP, sleep_user, 2 * MS, 1, DISK),
        # The writer blocks too (so it is in the task table): woken by the timer.
        sample(WRITER, "wl-writer", NANOSLEEP, sleep_user, 50 * MS, 1, TIMER),
        # A victim woken by hostile names and a kernel thread.
        sample(VICTIM, "victim", PIPE_READ, read_user, 40 * MS, 4, OSC),
        sample(VICTIM, "victim", PIPE_READ, read_user, 30 * MS, 3, MARKUP),
        sample(VICTIM, "victim", PIPE_READ, read_user, 20 * MS, 2, KTHREAD),
    ]
    blocks = [
        LongBlock(time=1_700_000_000.5, pid=PID, tid=READER, comm="wl-reader", state="S",
                  duration_ns=52 * MS, kernel=PIPE_READ, user=read_user, waker=WRITER_WAKER),
        LongBlock(time=1_700_000_000.6, pid=PID, tid=READER, comm="wl-reader", state="S",
                  duration_ns=40 * MS, kernel=NANOSLEEP, user=sleep_user, waker=TIMER),
        LongBlock(time=1_700_000_000.7, pid=PID, tid=VICTIM, comm="victim", state="S",
                  duration_ns=45 * MS, kernel=PIPE_READ, user=read_user, waker=OSC),
        LongBlock(time=1_700_000_000.8, pid=PID, tid=VICTIM, comm="victim", state="S",
                  duration_ns=44 * MS, kernel=PIPE_READ, user=read_user, waker=MARKUP),
        LongBlock(time=1_700_000_000.9, pid=PID, tid=VICTIM, comm="victim", state="S",
                  duration_ns=33 * MS, kernel=PIPE_READ, user=read_user),
    ]
    return Aggregator().build(samples, time=1_700_000_001.0, interval_s=1.0,
                              threshold_ns=30 * MS, long_blocks=blocks)


SNAP = woken_snapshot()


def make_app() -> NotedApp:
    return NotedApp(FakeLiveReplay([SNAP], realtime=False, info=INFO), clock=FakeClock())


def top_labels(tree: WakerTree) -> list[str]:
    return [node.label.plain for node in tree.root.children]


async def open_tree(pilot: Pilot[Any], app: OfftopApp, tid: int) -> WakerTree:
    """The task table's cursor on `tid`, Enter: its callchain tree, and wakers under it."""
    await shown(pilot, app)
    assert app.query_one(TaskTable).move_to_key(RowKey.thread(tid))
    await pilot.pause()
    await pilot.press("enter")
    await pilot.pause()
    assert app.drilled
    wakers = app.query_one(WakerTree)
    await until(pilot, lambda: wakers.root.children, "wakers shown")
    return wakers


# --- the summary, alone -----------------------------------------------------------


def test_sum_wakers_ranks_who_ended_the_time_and_counts_what_was_not_seen() -> None:
    reader = [s for s in SNAP.stacks if s.tid == READER]
    summary = sum_wakers(reader)
    assert summary.total_ns == 100 * MS
    assert [(w.waker.label, w.ns, w.count) for w in summary.wakers] == [
        ("wl-writer", 70 * MS, 8), ("[timer interrupt]", 15 * MS, 3),
        ("[softirq NET_RX]", 3 * MS, 1), ("[device interrupt]", 2 * MS, 1)]
    writer = summary.wakers[0]
    # Its stack first (the most time), then the blocks whose stack was not taken.
    assert [(s.stack, s.ns) for s in writer.stacks] == [
        ((WRITER_WAKER.kernel, WRITER_WAKER.user), 60 * MS), (((), ()), 10 * MS)]
    assert writer.waker.kernel == WRITER_WAKER.kernel  # named with its heaviest stack
    assert (summary.unseen_ns, summary.unseen_count) == (10 * MS, 1)
    empty = sum_wakers([StackRow(1, 1, "x", "S", 5, 1, 5, (), ())])
    assert empty.wakers == () and empty.unseen_ns == 5


def test_passes_through_agrees_with_the_stacks_tree_paths() -> None:
    stacks = [s for s in SNAP.stacks if s.tid == READER]
    for s in stacks:
        for kernel, user in ((True, True), (True, False), (False, True)):
            path = stack_path(s, show_kernel=kernel, show_user=user)
            for other in stacks:
                mine = stack_path(other, show_kernel=kernel, show_user=user)
                for n in range(len(path) + 1):
                    assert passes_through(other, path[:n], show_kernel=kernel,
                                          show_user=user) == (mine[:n] == path[:n])
            # A path longer than the stack is not passed through.
            assert not passes_through(s, (*path, "k:deeper"), show_kernel=kernel,
                                      show_user=user)


# --- the waker tree ----------------------------------------------------------------


async def test_the_waker_tree_lists_who_woke_the_task_largest_first() -> None:
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        wakers = await open_tree(pilot, app, READER)
        labels = top_labels(wakers)
        assert len(labels) == 5, labels
        assert "70.0ms" in labels[0] and " 70.0%" in labels[0]
        assert labels[0].endswith("wl-writer 4000/4002")
        # Interrupts by what interrupted, never as a task.
        assert labels[1].endswith("[timer interrupt]") and " 15.0%" in labels[1]
        assert labels[2].endswith("[softirq NET_RX]")
        assert labels[3].endswith("[device interrupt]")
        assert labels[4].endswith("[waker not seen]") and "10.0ms" in labels[4]
        title = Text.from_markup(str(wakers.border_title)).plain
        assert title.startswith("Who woke wl-reader 4000/4001") and "4 wakers" in title
        assert "90% of the time seen" in title
        # The top waker is open at once: its stack, then the blocks it woke without one.
        writer = wakers.root.children[0]
        assert writer.is_expanded
        stack, bare = writer.children
        assert stack.label.plain.endswith(
            "k __wake_up_common ← pipe_write ← vfs_write ← u write ← offtop_wk_write_loop")
        assert "(stack not taken" in bare.label.plain
        stack.expand()
        await pilot.pause()
        # Its frames: kernel then user, innermost first, as offtop folds them.
        assert [c.label.plain.split("  ")[0] for c in stack.children] == [
            "k __wake_up_common", "k pipe_write", "k vfs_write", "u write",
            "u offtop_wk_write_loop", "u main"]
        # An interrupt expands straight to its frames (one stack).
        timer = wakers.root.children[1]
        assert [c.label.plain for c in timer.children] == [
            "k hrtimer_wakeup", "k __hrtimer_run_queues"]


async def test_the_waker_tree_follows_the_callchain_cursor_and_keeps_its_state() -> None:
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        wakers = await open_tree(pilot, app, READER)
        tree = app.query_one(CallchainTree)
        sleep = next(s for s in SNAP.stacks if s.tid == READER and s.kernel == NANOSLEEP)
        path = stack_path(sleep)
        for i in range(len(path)):
            parent = tree.node_at(path[:i])
            assert parent is not None
            parent.expand()
        await pilot.pause()
        node = tree.node_at(path)
        assert node is not None
        tree.move_cursor(node)
        await until(pilot, lambda: len(wakers.root.children) == 3, "the sleep's wakers")
        # Only the blocks below the cursor: the sleep's, shares of its 20 ms.
        labels = top_labels(wakers)
        assert labels[0].endswith("[timer interrupt]") and " 75.0%" in labels[0]
        assert "below" in Text.from_markup(str(wakers.border_title)).plain
        wakers.root.children[0].expand()  # the timer, expanded by hand
        await pilot.pause()
        # Back at the root: every waker again, the timer still expanded.
        tree.move_cursor(tree.root)
        await until(pilot, lambda: len(wakers.root.children) == 5, "all wakers")
        timer = next(n for n in wakers.root.children if "[timer" in n.label.plain)
        assert timer.is_expanded
        # A tick with the same figures changes nothing (no rebuild).
        before = list(wakers.root.children)
        app.publish(dataclasses.replace(SNAP, seq=2))
        await shown(pilot, app, seq=2)
        await pilot.pause()
        assert list(wakers.root.children) == before


async def test_a_stack_chosen_in_the_stacks_table_shows_its_own_wakers() -> None:
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await shown(pilot, app)
        assert app.query_one(TaskTable).move_to_key(RowKey.thread(READER))
        await pilot.pause()
        table = app.query_one(StackTable)
        table.focus()
        await pilot.press("down", "enter")  # the second stack: the sleep
        await pilot.pause()
        wakers = app.query_one(WakerTree)
        await until(pilot, lambda: len(wakers.root.children) == 3, "the stack's wakers")
        assert [w.waker.label for w in wakers.summary.wakers] == [
            "[timer interrupt]", "[softirq NET_RX]", "[device interrupt]"]


async def test_no_waker_recorded_no_waker_tree() -> None:
    bare = Aggregator().build([sample(READER, "wl-reader", PIPE_READ, (), 5 * MS, 1, None)],
                              time=1.0, interval_s=1.0, threshold_ns=0)
    app = OfftopApp(FakeLiveReplay([bare], realtime=False, info=INFO), clock=FakeClock())
    async with app.run_test(size=SIZE) as pilot:
        await shown(pilot, app)
        await pilot.press("enter")
        await pilot.pause()
        wakers = app.query_one(WakerTree)
        assert wakers.has_class("-empty") and not wakers.display
        assert "Tab: wakers" not in str(app.query_one(StacksPane).border_subtitle)


async def test_hostile_waker_names_are_shown_escaped_never_as_markup() -> None:
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        wakers = await open_tree(pilot, app, VICTIM)
        labels = top_labels(wakers)
        assert labels[0].endswith("\\x1b]0;PWNED\\x07 5000/5001"), labels
        assert labels[1].endswith("[bold]x[/] 5000/5002"), labels
        log = app.query_one(LongBlocksLog)
        lines = [line.text for line in log.lines]
        assert any("← \\x1b]0;PWNED\\x07 5000/5001" in line for line in lines), lines
        assert any("← [bold]x[/] 5000/5002" in line for line in lines), lines
        # Nothing a terminal would act on reaches the screen.
        screen = app.export_screenshot()
        assert "\x1b" not in screen and "\x07" not in screen
        assert "PWNED" in screen


# --- the long-block log -------------------------------------------------------------


async def test_the_long_block_log_names_each_waker() -> None:
    app = make_app()
    async with app.run_test(size=(200, 45)) as pilot:
        await shown(pilot, app)
        log = app.query_one(LongBlocksLog)
        lines = [line.text for line in log.lines]
        assert "wl-reader 4000/4001 ← wl-writer 4000/4002  k pipe_read" in lines[0]
        assert "wl-reader 4000/4001 ← [timer interrupt]  k do_nanosleep" in lines[1]
        assert "←" not in lines[4].split("  ")[0]  # no waker recorded: none named
        # As drawn, at the pane's width (56 columns at 200): the waker stays in view.
        drawn = [log.render_line(y).text for y in range(len(SNAP.long_blocks))]
        assert log.size.width < len(lines[0])
        assert drawn[0].rstrip().endswith("← wl-writer"), drawn
        assert drawn[1].rstrip().endswith("← [timer interr…"), drawn  # cut, not dropped


def test_long_block_lines_narrow_sensibly() -> None:
    block = SNAP.long_blocks[0]
    full = long_block_line(block).plain
    assert full.endswith("← wl-writer 4000/4002  k pipe_read ← u read ← offtop_wk_read_loop")
    assert long_block_line(block, width=len(full)).plain == full
    # Room for the waker with its ids: the callchain is cut by the line's end.
    wide = long_block_line(block, width=70).plain
    assert "← wl-writer 4000/4002  k pipe" in wide
    # Narrower: the waker by name, the clock to the second, no callchain.
    mid = long_block_line(block, width=50).plain
    assert mid.endswith("wl-reader 4000/4001 ← wl-writer") and "." not in mid.split()[0]
    assert len(mid) <= 50
    # Narrower still: the waker's name cut with an ellipsis, never past the width.
    for width in (44, 42):
        narrow = long_block_line(block, width=width).plain
        assert len(narrow) <= width and "← w" in narrow and narrow.endswith("…"), narrow
    assert len(long_block_line(block, width=30).plain) <= 38  # the task first: cropped after


async def test_a_long_block_opened_from_the_log_names_its_waker() -> None:
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await shown(pilot, app)
        log = app.query_one(LongBlocksLog)
        log.focus()
        await pilot.press("home", "enter")
        await pilot.pause()
        wakers = app.query_one(WakerTree)
        await until(pilot, lambda: wakers.root.children, "the block's waker")
        assert [w.waker for w in wakers.summary.wakers] == [WRITER_WAKER]
        assert top_labels(wakers)[0].endswith("wl-writer 4000/4002")


# --- going to a waker ------------------------------------------------------------------


async def test_g_on_a_task_waker_selects_it_and_opens_its_callchains() -> None:
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        wakers = await open_tree(pilot, app, READER)
        wakers.focus()
        await pilot.pause()
        wakers.move_cursor(wakers.root.children[0])
        await pilot.press("g")
        await pilot.pause()
        table = app.query_one(TaskTable)
        assert table.cursor_key == RowKey.thread(WRITER)
        pane = app.query_one(StacksPane)
        assert pane.view == "tree" and pane.opened == Scope.task(RowKey.thread(WRITER))
        assert app.focused is app.query_one(CallchainTree)
        await until(pilot, lambda: top_labels(wakers)
                    and top_labels(wakers)[0].endswith("[timer interrupt]"), "its wakers")
        # Processes: the waker's process.
        await pilot.press("escape", "t")
        await pilot.pause()
        await pilot.press("enter")
        await pilot.pause()
        assert pane.opened == Scope.task(RowKey.process(PID))
        wakers.focus()
        await pilot.pause()
        writer = next(n for n in wakers.root.children if "wl-writer" in n.label.plain)
        wakers.move_cursor(writer.children[0])  # from a frame below the waker too
        await pilot.press("g")
        await pilot.pause()
        assert table.cursor_key == RowKey.process(PID)


async def test_g_on_an_interrupt_or_an_unlisted_task_says_so() -> None:
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        wakers = await open_tree(pilot, app, VICTIM)
        wakers.focus()
        await pilot.pause()
        table = app.query_one(TaskTable)
        before = table.cursor_key
        kthread = next(n for n in wakers.root.children if "jbd2" in n.label.plain)
        wakers.move_cursor(kthread)
        await pilot.press("g")
        await pilot.pause()
        assert table.cursor_key == before
        assert any("jbd2/sda1-8 77/77 is not in the task table" in n for n in app.noted)
        assert app.query_one(StacksPane).opened == Scope.task(RowKey.thread(VICTIM))
        # An interrupt is no task to go to.
        reader = await open_tree(pilot, app, READER)
        reader.focus()
        await pilot.pause()
        reader.move_cursor(reader.root.children[1])
        await pilot.press("g")
        await pilot.pause()
        assert any("[timer interrupt] is an interrupt" in n for n in app.noted)
        assert table.cursor_key == RowKey.thread(READER)


async def test_help_lists_the_waker_key() -> None:
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await shown(pilot, app)
        await pilot.press("f1")
        await pilot.pause()
        screen = app.screen
        assert isinstance(screen, HelpScreen)
        lines = dict(screen.lines)
        assert "g" in lines and "task table" in lines["g"]
        svg = app.export_screenshot().replace("&#160;", " ")
        assert "Who woke it" in svg

