"""The waker view on the real BPF engine (issue 11): a pipe reader woken by its writer.

tests/workloads/wakers.c `pipe 50`: wl-reader blocks in read() on a pipe,
wl-writer writes a byte every 50 ms. With the threshold at 30 ms every
block is a long block too. The reader's waker tree must name wl-writer,
with `pipe_write` in its kernel frames, for nearly all the reader's
off-CPU time, and the long-block log must name it on the reader's lines.
"""

from __future__ import annotations

from typing import Any

import pytest

from offtop.app import OfftopApp
from offtop.model import RowKey
from offtop.widgets.long_blocks_log import LongBlocksLog
from offtop.widgets.task_table import TaskTable
from offtop.widgets.waker_tree import WakerTree
from tests.test_ui_bpf import next_snapshots
from tests.test_wakers import run, wakers_bin

pytestmark = [pytest.mark.bpf, pytest.mark.usefixtures("bpf_available")]

__all__ = ["run", "wakers_bin"]  # the fixtures: the workload, built once

MS = 1_000_000


async def test_the_reader_s_waker_tree_names_the_writer_with_pipe_write(run: Any) -> None:
    from offtop.bpf.engine import BpfSource, EngineConfig

    w = run("pipe", "50")
    writer = w.value("tid")
    source = BpfSource(EngineConfig(pids=(w.pid,), threshold_ns=30 * MS))
    app = OfftopApp(source, interval_s=1.0)
    try:
        async with app.run_test(size=(160, 45)) as pilot:
            await next_snapshots(pilot, app, 2)  # the first interval covers start-up
            table = app.query_one(TaskTable)
            assert table.move_to_key(RowKey.thread(w.tid)), table.row_keys_in_order
            await pilot.pause()
            table.focus()
            await pilot.press("enter")
            await next_snapshots(pilot, app, 1)
            wakers = app.query_one(WakerTree)
            summary = wakers.summary
            assert summary.total_ns > 0
            by_writer = [t for t in summary.wakers if t.waker.kind == "task"
                         and (t.waker.pid, t.waker.tid, t.waker.comm) == (w.pid, writer,
                                                                            "wl-writer")]
            assert by_writer, [t.waker for t in summary.wakers]
            piped = sum(s.ns for s in by_writer[0].stacks
                        if any(f.name.endswith("pipe_write") for f in s.stack[0]))
            assert piped >= 0.9 * summary.total_ns, (piped, summary)
            # On screen: the writer first, its stack open, pipe_write among its frames.
            top = wakers.root.children[0]
            assert top.label.plain.endswith(f"wl-writer {w.pid}/{writer}"), top.label.plain
            assert top.is_expanded
            frames = [n.label.plain for n in top.children]
            frames += [c.label.plain for n in top.children for c in n.children]
            assert any(f.startswith("k ") and "pipe_write" in f for f in frames), frames

            log = app.query_one(LongBlocksLog)
            mine = [b for b in log.blocks if b.tid == w.tid]
            assert mine, [b.tid for b in log.blocks]
            named = [b for b in mine if b.waker is not None and b.waker.tid == writer]
            assert len(named) >= 0.9 * len(mine), [b.waker for b in mine][:5]
            lines = [line.text for line, b in zip(log.lines, log.blocks, strict=True)
                     if b.tid == w.tid]
            assert sum(f"← wl-writer {w.pid}/{writer}" in line for line in lines) \
                >= 0.9 * len(lines), lines[:3]
    finally:
        source.close()
