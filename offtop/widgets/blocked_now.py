"""Tasks off the CPU right now, and for how long so far: "why is it stuck?".

The engine reads the BPF program's start-timestamp records at each snapshot:
a task with a record has switched out and not come back yet. Between
snapshots the waits keep growing on screen (`advance`), from the app's clock.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import ClassVar

from rich.text import Text
from textual.binding import Binding, BindingType

from offtop.model import BlockedNow
from offtop.safe_text import printable
from offtop.units import format_ns
from offtop.widgets.line_table import Column, LineTable
from offtop.widgets.render import (
    bar,
    chain_summary,
    log_fraction,
    severity_style,
    state_text,
    task_label,
)


class BlockedNowTable(LineTable):
    """Blocked tasks, longest wait first: wait and a log bar, state, task, where.

    Each row is two lines: the task, then the innermost frames it waits in.
    `Enter` (or a second click) selects the task in the task table.
    """

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("enter", "select_cursor", "Go to task",
                tooltip="Select this task in the task table", id="blocked.goto"),
    ]

    ROW_HEIGHT: ClassVar[int] = 2
    SHOW_HEADER: ClassVar[bool] = False
    #: Rows come and go under the cursor: it is drawn only while focused.
    CURSOR_FOCUS_ONLY: ClassVar[bool] = True
    #: Rows shown at most.
    MAX_ROWS: ClassVar[int] = 100

    def __init__(self, *, id: str | None = None, classes: str | None = None) -> None:
        super().__init__(id=id, classes=classes)
        self.show_kernel = True
        self.show_user = True
        self._blocked: Sequence[BlockedNow] = ()
        self._by_key: dict[str, BlockedNow] = {}
        self._elapsed_ns = 0

    def on_mount(self) -> None:
        self.set_columns([Column("wait", "WAIT", 7), Column("s", "S", 1),
                          Column("where", "TASK / WHERE", 16, flex=True)])
        self._sync()

    def show(
        self, blocked: Sequence[BlockedNow], *, show_kernel: bool = True, show_user: bool = True
    ) -> None:
        """Display a snapshot's blocked tasks; their waits restart from the snapshot."""
        self._blocked = blocked[: self.MAX_ROWS]
        self._elapsed_ns = 0
        self.show_kernel, self.show_user = show_kernel, show_user
        self._sync()

    def advance(self, elapsed_ns: int) -> None:
        """Let the waits grow by the time elapsed since the snapshot."""
        if elapsed_ns != self._elapsed_ns:
            self._elapsed_ns = max(0, elapsed_ns)
            self._sync()

    def _sync(self) -> None:
        rows = []
        self._by_key = {}
        view = (self.show_kernel, self.show_user)
        for b in self._blocked:
            key = f"t{b.tid}"
            if key in self._by_key:
                continue
            self._by_key[key] = b
            wait = b.blocked_ns + self._elapsed_ns
            rows.append((key, ((format_ns(wait), round(log_fraction(wait) * 48),
                                severity_style(wait)),
                               b.state, (b.comm, b.pid, b.tid, b.kernel, b.user, view))))
        self.sync_rows(rows)

    def blocked_at_cursor(self) -> BlockedNow | None:
        """The blocked task under the cursor."""
        key = self.cursor_key
        return self._by_key.get(key) if key is not None else None

    def render_cell(self, column: str, value: Hashable) -> Text:
        """Two lines a cell: wait over its bar; the task over where it waits."""
        if column == "wait":
            assert isinstance(value, tuple)
            text, eighths, style = value
            t = Text(f"{text:>7}\n", style=style, end="")
            t.append(" " + bar(eighths / 48, 6), style=style or "#5fafd7")
            return t
        if column == "s":
            return state_text(str(value))
        assert isinstance(value, tuple)
        comm, pid, tid, kernel, user, (show_kernel, show_user) = value
        t = task_label(printable(comm), pid, tid)
        t.append("\n")
        t.append_text(chain_summary(kernel, user, show_kernel=show_kernel, show_user=show_user,
                                    max_kernel=1, max_user=3))
        t.no_wrap, t.overflow = True, "ellipsis"
        return t
