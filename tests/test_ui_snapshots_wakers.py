"""SVG snapshot of the waker view (pytest-textual-snapshot), as tests/test_ui_snapshots.py.

Synthetic data with wakers (`synthetic_snapshots(wakers=True)`): the second
task's callchain tree, and under it who woke it, the waker tree focused.
Update the baseline with `--snapshot-update` and look at it before committing.
"""

from __future__ import annotations

from typing import Any

from offtop.app import OfftopApp
from offtop.synthetic import synthetic_snapshots
from tests.test_ui_snapshots import INFO, SIZE, FakeLiveReplay, after_snapshot, keys, utc

__all__ = ["utc"]  # the fixture: times of day in UTC


def test_waker_tree_under_the_callchain(snap_compare: Any) -> None:
    """Enter on the second task, Tab: its wakers, largest first, the top one open
    on its stack (kernel frames innermost first); the long-block log names wakers."""
    snaps = synthetic_snapshots(2, tasks=50, stacks=200, seed=0, wakers=True)
    app = OfftopApp(FakeLiveReplay(snaps, realtime=False, info=INFO), clock=lambda: 0.0)
    assert snap_compare(app, terminal_size=SIZE,
                        run_before=after_snapshot(2, keys("down", "enter", "tab")))
