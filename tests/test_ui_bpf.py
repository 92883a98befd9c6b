"""The TUI on the real BPF engine: the slider writes the kernel map, live.

A known workload sleeps 100 ms in `offtop_wl_sleep`, over and over. With
the threshold at 50 ms every block comes through the perf buffer as an
event (and lands in the long-blocks log); moving the slider to 200 ms
writes `offcpu_thresh_ns` in the running program and from then on the same
blocks are summed in the kernel instead.
"""

from __future__ import annotations

from typing import Any

import pytest
from textual.pilot import Pilot

from offtop.app import OfftopApp
from offtop.model import RowKey, Snapshot
from offtop.widgets.header import OfftopHeader
from offtop.widgets.long_blocks_log import LongBlocksLog
from offtop.widgets.task_table import TaskTable
from offtop.widgets.threshold_slider import ThresholdSlider

pytestmark = [pytest.mark.bpf, pytest.mark.usefixtures("bpf_available")]

MS = 1_000_000


async def next_snapshots(pilot: Pilot[Any], app: OfftopApp, n: int,
                         timeout_s: float = 30.0) -> Snapshot:
    """Wait for `n` more snapshots on screen; return the last."""
    start = app.snapshot.seq if app.snapshot is not None else 0
    for _ in range(int(timeout_s / 0.05)):
        if app.source_error is not None:
            raise AssertionError(f"the source failed: {app.source_error}")
        if app.snapshot is not None and app.snapshot.seq >= start + n:
            await pilot.pause()
            return app.snapshot
        await pilot.pause(0.05)
    raise AssertionError(f"no {n} snapshots in {timeout_s}s (at {start})")


async def test_slider_writes_the_kernel_map_and_reroutes_blocks(workloads: Any) -> None:
    from offtop.bpf.engine import BpfSource, EngineConfig

    w = workloads("sleep", "100")
    source = BpfSource(EngineConfig(threshold_ns=50 * MS, pids=(w.pid,)))
    app = OfftopApp(source, interval_s=0.5)
    try:
        async with app.run_test(size=(140, 45)) as pilot:
            # The first interval is partial; the next ones see the workload.
            snap = await next_snapshots(pilot, app, 3)
            row = next((t for t in snap.tasks if t.tid == w.tid), None)
            assert row is not None, [t.tid for t in snap.tasks]
            assert row.events == row.count >= 3  # 100 ms >= 50 ms: every block an event
            mine = [b for b in snap.long_blocks if b.tid == w.tid]
            assert mine and all(b.user and b.user[0].name == "offtop_wl_sleep" for b in mine)
            assert all(90 * MS <= b.duration_ns <= 300 * MS for b in mine)
            log = app.query_one(LongBlocksLog)
            logged = log.total
            assert logged >= len(mine)
            assert RowKey.thread(w.tid) in app.query_one(TaskTable).row_keys_in_order

            # 50 ms -> 100 ms -> 200 ms, from the keyboard.
            await pilot.press("plus", "plus")
            await pilot.pause()
            assert app.query_one(ThresholdSlider).value_ns == 200 * MS
            assert source.kernel_threshold_ns() == 200 * MS
            assert "threshold 200ms" in app.query_one(OfftopHeader).render().plain

            # A block may straddle the change; after it, all are summed in the kernel.
            await next_snapshots(pilot, app, 2)
            snap = await next_snapshots(pilot, app, 2)
            assert snap.threshold_ns == 200 * MS
            row = next((t for t in snap.tasks if t.tid == w.tid), None)
            assert row is not None
            assert row.events == 0 and row.count >= 3
            assert not [b for b in snap.long_blocks if b.tid == w.tid]
            assert app.query_one(LongBlocksLog).total >= logged

            # And back down with the mouse: a click at the bar's left end (0).
            await pilot.click(ThresholdSlider, offset=(0, 0))
            await pilot.pause()
            assert source.kernel_threshold_ns() == app.threshold_ns < 50 * MS
    finally:
        source.close()
