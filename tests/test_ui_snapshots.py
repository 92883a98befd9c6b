"""SVG snapshot tests of the main screens (pytest-textual-snapshot).

Deterministic: synthetic data from a fixed seed, a replay source (the fake)
that waits like a live one once played, a frozen clock, and UTC for the
times of day shown. Update the baselines with `--snapshot-update` and look
at them before committing.

Grouped by what they show: the layouts (80, 140 and 200 columns), the
stacks pane's views (tree, flame graph, merged stacks, a blocked task's
stack), and the help.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import pytest
from textual.pilot import Pilot

from offtop.app import OfftopApp
from offtop.model import Snapshot
from offtop.source import ReplaySource, SourceInfo
from offtop.synthetic import synthetic_snapshots
from offtop.widgets.flame_graph import FlameGraph
from offtop.widgets.header import OfftopHeader

SIZE = (140, 45)
INFO = SourceInfo(host="testhost", kernel="6.1.0-test", scope="all tasks", kind="replay")

#: What a test does once the snapshots are on screen.
Then = Callable[[Pilot[Any]], Awaitable[None]]


class FakeLiveReplay(ReplaySource):
    """A replay source that, once out of snapshots, waits like a live one."""

    def next_snapshot(self, interval_s: float, stop: threading.Event) -> Snapshot | None:
        snap = super().next_snapshot(interval_s, stop)
        if snap is None:
            stop.wait()
        return snap


@pytest.fixture(autouse=True)
def utc(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Times of day are shown in local time: make it UTC for stable pictures."""
    monkeypatch.setenv("TZ", "UTC")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


def make_app(n: int = 2) -> OfftopApp:
    snaps = synthetic_snapshots(n, tasks=50, stacks=200, seed=0)
    return OfftopApp(FakeLiveReplay(snaps, realtime=False, info=INFO), clock=lambda: 0.0)


def after_snapshot(seq: int, then: Then | None = None) -> Then:
    """A `run_before` that waits for snapshot `seq` to be on screen."""

    async def run_before(pilot: Pilot[Any]) -> None:
        app = pilot.app
        assert isinstance(app, OfftopApp)
        for _ in range(3000):  # 30 s: a busy machine is slow, never wrong
            if app.snapshot is not None and app.snapshot.seq >= seq:
                break
            await pilot.pause(0.01)
        else:
            raise AssertionError(f"snapshot {seq} never shown")
        await settled(pilot)
        if then is not None:
            await then(pilot)
        await settled(pilot)

    return run_before


async def settled(pilot: Pilot[Any]) -> None:
    """Wait until the screen has been laid out (the header has its three lines):
    on a busy machine the layout pass can come a frame after the data."""
    header = pilot.app.query_one(OfftopHeader)
    for _ in range(3000):
        await pilot.pause()
        if header.size.height == 3:
            return
        await pilot.pause(0.01)
    raise AssertionError("the header's layout never settled")


def keys(*pressed: str) -> Then:
    """Press keys, letting each land."""

    async def press(pilot: Pilot[Any]) -> None:
        for key in pressed:
            await pilot.press(key)
            await pilot.pause()
        await settled(pilot)

    return press


async def flame_built(pilot: Pilot[Any]) -> None:
    """`f`, then wait for the worker's tree to be drawn."""
    await pilot.press("f")
    flame = pilot.app.query_one(FlameGraph)
    for _ in range(3000):
        if flame.flame_tree.total_ns > 0:
            break
        await pilot.pause(0.01)
    else:
        raise AssertionError("the flame graph was never built")
    await pilot.pause()


# --- layouts -----------------------------------------------------------------------------


def test_main_screen(snap_compare: Any) -> None:
    """Tasks ranked, the top task's stacks, blocked now, threshold, long blocks;
    the header's third line lists the counted errors."""
    assert snap_compare(make_app(), terminal_size=SIZE, run_before=after_snapshot(2))


def test_80_columns_side_panes_below(snap_compare: Any) -> None:
    """At 80x24 the side panes go below the task table and stacks, side by side."""
    assert snap_compare(make_app(), terminal_size=(80, 24), run_before=after_snapshot(2))


def test_200_columns_blocked_in_and_command(snap_compare: Any) -> None:
    """At 200 columns the task table says where each task blocks, and its command."""
    assert snap_compare(make_app(), terminal_size=(200, 50), run_before=after_snapshot(2))


def test_processes_paused_small(snap_compare: Any) -> None:
    """Processes, paused, in a 80x24 terminal."""
    assert snap_compare(make_app(), terminal_size=(80, 24),
                        run_before=after_snapshot(2, keys("t", "p")))


# --- the stacks pane's views ---------------------------------------------------------------


def test_drill_down_tree(snap_compare: Any) -> None:
    """Enter on the second task: its callchain tree, hottest path expanded."""
    assert snap_compare(make_app(), terminal_size=SIZE, press=["down", "enter"],
                        run_before=after_snapshot(2))


def test_flame_graph_of_all_tasks(snap_compare: Any) -> None:
    """`a` then `f`: every task's stacks as a flame graph, grouped by process."""
    async def all_then_flame(pilot: Pilot[Any]) -> None:
        await pilot.press("a")
        await flame_built(pilot)

    assert snap_compare(make_app(), terminal_size=SIZE,
                        run_before=after_snapshot(2, all_then_flame))


def test_all_stacks_merged_by_command(snap_compare: Any) -> None:
    """`a`, `m`, `m`: all stacks, identical ones merged across one command."""
    assert snap_compare(make_app(), terminal_size=SIZE,
                        run_before=after_snapshot(2, keys("a", "m", "m")))


def test_blocked_task_stack(snap_compare: Any) -> None:
    """Enter on the first blocked-now row (blocked since before offtop started)."""

    async def open_blocked(pilot: Pilot[Any]) -> None:
        pilot.app.query_one("#blocked").focus()
        await pilot.pause()
        await pilot.press("enter")

    assert snap_compare(make_app(), terminal_size=SIZE,
                        run_before=after_snapshot(2, open_blocked))


def test_help_screen(snap_compare: Any) -> None:
    """F1: every key, from the bindings."""
    assert snap_compare(make_app(), terminal_size=SIZE, press=["f1"],
                        run_before=after_snapshot(2))
