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

    def __init__(self, *, id: str | None = None, classes: str | None = None) -> None:
        super().__init__(max_lines=self.MAX_LINES, min_width=20, wrap=False, markup=False,
                         highlight=False, auto_scroll=True, id=id, classes=classes)
        self.total = 0

    def add_blocks(self, blocks: Iterable[LongBlock], *, show_kernel: bool = True,
                   show_user: bool = True) -> int:
        """Append blocks in arrival order; returns how many were added."""
        n = 0
        for block in blocks:
            self.write(long_block_line(block, show_kernel=show_kernel, show_user=show_user))
            n += 1
        self.total += n
        return n
