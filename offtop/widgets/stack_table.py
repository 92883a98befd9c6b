"""The stacks of the selected task (or of all tasks), ranked by off-CPU time."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import ClassVar

from rich.text import Text
from textual.binding import Binding, BindingType

from offtop.model import StackRow
from offtop.safe_text import printable
from offtop.units import format_ns
from offtop.widgets.line_table import Column, LineTable
from offtop.widgets.render import (
    chain_summary,
    number_text,
    state_text,
    task_label,
)


class StackTable(LineTable):
    """Callchains ranked by off-CPU time in the last interval.

    In `task` scope it lists one task's stacks; in `all` scope the top stacks
    of every task, with a TASK column. `Enter` (or a second click) asks the
    app to open the callchain tree of the stack under the cursor.
    """

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("enter", "select_cursor", "Callchain",
                tooltip="Open the callchain tree at this stack", id="stacks.drill"),
        Binding("k", "app.toggle_kernel", "Kernel frames", show=False,
                tooltip="Show / hide kernel frames", id="stacks.kernel"),
        Binding("u", "app.toggle_user", "User frames", show=False,
                tooltip="Show / hide user frames", id="stacks.user"),
    ]

    #: Rows shown at most (the pane shows a screenful; the tree has them all):
    #: of one task, and of all tasks together.
    MAX_ROWS: ClassVar[int] = 60
    MAX_ROWS_ALL: ClassVar[int] = 100

    def __init__(self, *, id: str | None = None, classes: str | None = None) -> None:
        super().__init__(id=id, classes=classes)
        self.scope = "task"
        self.show_kernel = True
        self.show_user = True
        self._by_key: dict[str, StackRow] = {}
        self._stacks: Sequence[StackRow] = ()
        self._total_ns = 0

    def on_mount(self) -> None:
        self._define_columns()

    def _define_columns(self) -> None:
        columns = [Column("s", "S", 1), Column("off", "OFF-CPU", 7),
                   Column("share", "SHARE", 6), Column("count", "COUNT", 6),
                   Column("max", "MAX", 6),
                   Column("chain", "CALLCHAIN (innermost first)", 24, flex=True)]
        if self.scope == "all":
            columns.insert(0, Column("task", "TASK", 24))
        self.set_columns(columns)
        self._sync()

    # --- data -----------------------------------------------------------

    def show(
        self,
        stacks: Sequence[StackRow],
        *,
        scope: str,
        show_kernel: bool,
        show_user: bool,
        total_ns: int | None = None,
    ) -> None:
        """Display `stacks` (already ranked), the top `MAX_ROWS` (`MAX_ROWS_ALL`) of them."""
        redefine = scope != self.scope
        self.scope = scope
        self.show_kernel = show_kernel
        self.show_user = show_user
        self._stacks = stacks[: self.MAX_ROWS_ALL if scope == "all" else self.MAX_ROWS]
        self._total_ns = total_ns if total_ns is not None else sum(s.offcpu_ns for s in stacks)
        if redefine:
            self._define_columns()
        else:
            self._sync()

    def _sync(self) -> None:
        by_key: dict[str, StackRow] = {}
        rows = []
        total = self._total_ns
        toggles = (self.show_kernel, self.show_user)
        for s in self._stacks:
            key = s.key
            if key in by_key:
                continue
            by_key[key] = s
            share = round(1000 * s.offcpu_ns / total) if total > 0 else 0
            raw: tuple[Hashable, ...] = (
                s.state, format_ns(s.offcpu_ns), share, s.count, format_ns(s.max_ns),
                (key, toggles))
            if self.scope == "all":
                raw = ((s.comm, s.pid, s.tid), *raw)
            rows.append((key, raw))
        self._by_key = by_key
        self.sync_rows(rows)

    def stack_by_key(self, key: str) -> StackRow | None:
        """A shown stack by its key."""
        return self._by_key.get(key)

    def render_cell(self, column: str, value: Hashable) -> Text:
        """A cell: the task literal, numbers right-aligned, the chain summarized."""
        if column == "task":
            assert isinstance(value, tuple)
            comm, pid, tid = value
            return task_label(printable(comm), pid, tid)
        if column == "s":
            return state_text(str(value))
        if column == "share":
            assert isinstance(value, int)
            return Text(f"{value / 10:5.1f}%", style="dim" if value == 0 else "", end="")
        if column == "count":
            assert isinstance(value, int)
            return number_text(value, width=6)
        if column == "chain":
            assert isinstance(value, tuple)
            s = self._by_key[value[0]]
            return chain_summary(s.kernel, s.user, show_kernel=self.show_kernel,
                                 show_user=self.show_user, max_kernel=3, max_user=4)
        text = str(value).rjust(7 if column == "off" else 6)
        return Text(text, style="dim" if value == "0" else "", end="")
