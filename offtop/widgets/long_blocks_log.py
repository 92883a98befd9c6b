"""A log of long blocks (≥ threshold), newest at the bottom, as they arrive."""

from __future__ import annotations

from collections.abc import Iterable
from typing import ClassVar

from rich.text import Text
from textual.widgets import RichLog

from offtop.model import LongBlock
from offtop.units import format_ns
from offtop.widgets.render import (
    chain_summary,
    clock_time,
    severity_style,
    state_text,
    task_label,
)


def long_block_line(block: LongBlock, *, show_kernel: bool = True, show_user: bool = True) -> Text:
    """`12:00:01.250 D 1.23s postgres 1052/1053 io_schedule ← … ← pread64`."""
    t = Text(no_wrap=True, end="")
    t.append(clock_time(block.time, millis=True), style="dim")
    t.append(" ")
    t.append_text(state_text(block.state))
    t.append(f" {format_ns(block.duration_ns):>6} ", style=severity_style(block.duration_ns))
    t.append_text(task_label(block.comm, block.pid, block.tid))
    t.append("  ")
    t.append_text(chain_summary(block.kernel, block.user, show_kernel=show_kernel,
                                show_user=show_user, max_kernel=1, max_user=2))
    return t


class LongBlocksLog(RichLog):
    """The last `MAX_LINES` long blocks, one line each (untrusted text as `Text`)."""

    MAX_LINES: ClassVar[int] = 500
    #: Lines written per update. Each write costs a layout pass, and under an
    #: event flood (threshold 0) hundreds arrive per interval: writing them all
    #: kept the app busy for seconds, keys included. Only the newest are shown;
    #: the others are counted in `skipped`.
    MAX_PER_UPDATE: ClassVar[int] = 100

    def __init__(self, *, id: str | None = None, classes: str | None = None) -> None:
        super().__init__(max_lines=self.MAX_LINES, min_width=20, wrap=False, markup=False,
                         highlight=False, auto_scroll=True, id=id, classes=classes)
        self.total = 0
        self.skipped = 0

    def add_blocks(self, blocks: Iterable[LongBlock], *, show_kernel: bool = True,
                   show_user: bool = True) -> int:
        """Append the newest blocks in arrival order; returns how many were written."""
        items = list(blocks)
        shown = items[-self.MAX_PER_UPDATE:]
        for block in shown:
            self.write(long_block_line(block, show_kernel=show_kernel, show_user=show_user))
        self.total += len(items)
        self.skipped += len(items) - len(shown)
        return len(shown)
