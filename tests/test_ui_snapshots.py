"""SVG snapshot tests of the main screens (pytest-textual-snapshot).

Deterministic: synthetic data from a fixed seed, a replay source (the fake)
that waits like a live one once played, a frozen clock, and UTC for the
times of day shown. Update the baselines with `--snapshot-update` and look
at them before committing.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from textual.pilot import Pilot

from offtop.app import OfftopApp
from offtop.model import Snapshot
from offtop.source import ReplaySource, SourceInfo
from offtop.synthetic import synthetic_snapshots

SIZE = (140, 45)
INFO = SourceInfo(host="testhost", kernel="6.1.0-test", scope="all tasks", kind="replay")


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


def after_snapshot(seq: int, then: Callable[[Pilot[Any]], Any] | None = None):  # type: ignore[no-untyped-def]
    """A `run_before` that waits for snapshot `seq` to be on screen."""

    async def run_before(pilot: Pilot[Any]) -> None:
        app = pilot.app
        assert isinstance(app, OfftopApp)
        for _ in range(500):
            if app.snapshot is not None and app.snapshot.seq >= seq:
                break
            await pilot.pause(0.01)
        await pilot.pause()
        if then is not None:
            await then(pilot)
        await pilot.pause()

    return run_before


def test_main_screen(snap_compare: Any) -> None:
    """Tasks ranked, the top task's stacks, blocked now, slider, long blocks."""
    assert snap_compare(make_app(), terminal_size=SIZE, run_before=after_snapshot(2))


def test_drill_down_tree(snap_compare: Any) -> None:
    """Enter on the second task: its callchain tree, hottest path expanded."""
    assert snap_compare(make_app(), terminal_size=SIZE, press=["down", "enter"],
                        run_before=after_snapshot(2))


def test_help_screen(snap_compare: Any) -> None:
    """`?`: every key, from the bindings."""
    assert snap_compare(make_app(), terminal_size=SIZE, press=["question_mark"],
                        run_before=after_snapshot(2))


def test_processes_paused_small(snap_compare: Any) -> None:
    """Processes, paused, in a 80x24 terminal (side column hidden)."""
    assert snap_compare(make_app(), terminal_size=(80, 24), press=["t", "p"],
                        run_before=after_snapshot(2))
