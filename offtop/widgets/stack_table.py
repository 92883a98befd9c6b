"""Callchains ranked by off-CPU time: of one task, of a process, or of all tasks.

Rows are `MergedStack`s: a single task's stack, or identical stacks summed
across the threads of a process or across processes with the same command
(`model.merge_identical`), with a TASKS column saying how many. The table
shows what it is given (the stacks pane chooses); Enter posts `StackChosen`.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import ClassVar

from rich.text import Text
from textual.binding import Binding, BindingType
from textual.message import Message

from offtop.model import MergedStack, StackRow
from offtop.safe_text import printable
from offtop.units import format_ns
from offtop.widgets.line_table import Column, LineTable
from offtop.widgets.render import (
    chain_summary,
    number_text,
    state_text,
    task_label,
)

#: A row's key: (owner, state, began before offtop, chain number); the owner is
#: a tid, or a pid or comm when merged.
StackKey = tuple[Hashable, ...]


class StackTable(LineTable[StackKey]):
    """Callchains ranked by off-CPU time (see module docstring)."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("enter", "select_cursor", "Callchain",
                tooltip="Open the callchain tree at this stack", id="stacks.drill"),
    ]

    #: Rows shown at most (a screenful or two; the tree has them all): of one
    #: task, and of all tasks together.
    MAX_ROWS: ClassVar[int] = 60
    MAX_ROWS_ALL: ClassVar[int] = 100

    class StackChosen(Message):
        """Enter on a stack (or a second click)."""

        def __init__(self, table: StackTable, merged: MergedStack) -> None:
            super().__init__()
            self.table = table
            self.merged = merged

    def __init__(self, *, id: str | None = None, classes: str | None = None) -> None:
        super().__init__(id=id, classes=classes)
        #: "task" (one task or process) or "all" (a TASK column).
        self.scope = "task"
        #: Rows are merged: a TASKS column says how many tasks each sums.
        self.merged = False
        self.show_kernel = True
        self.show_user = True
        self._by_key: dict[StackKey, MergedStack] = {}

    def on_mount(self) -> None:
        self._define_columns()

    def _define_columns(self) -> None:
        columns = [Column("s", "S", 1), Column("off", "OFF-CPU", 7),
                   Column("share", "SHARE", 6), Column("count", "COUNT", 6),
                   Column("max", "MAX", 6),
                   Column("chain", "CALLCHAIN (innermost first)", 24, flex=True)]
        if self.merged:
            columns.insert(5, Column("tasks", "TASKS", 7))
        if self.scope == "all":
            columns.insert(0, Column("task", "TASK", 24))
        self.set_columns(columns)

    # --- data -----------------------------------------------------------

    def show(
        self,
        rows: Sequence[tuple[StackKey, MergedStack]],
        *,
        scope: str,
        merged: bool,
        total_ns: int,
        show_kernel: bool,
        show_user: bool,
    ) -> None:
        """Display `rows` (already ranked and cut to what is to be shown).

        `total_ns` is what the SHARE column divides by.
        """
        if (scope, merged) != (self.scope, self.merged):
            self.scope, self.merged = scope, merged
            self._define_columns()
        if (show_kernel, show_user) != (self.show_kernel, self.show_user):
            self.show_kernel, self.show_user = show_kernel, show_user
            self.refresh_cells()
        self._by_key = dict(rows)
        out = []
        for key, m in rows:
            s = m.row
            share = round(1000 * s.offcpu_ns / total_ns) if total_ns > 0 else 0
            off = ("~" if s.before_start else "") + format_ns(s.offcpu_ns)
            raw: tuple[Hashable, ...] = (
                s.state, off, share, s.count, format_ns(s.max_ns),
                (s.kernel, s.user))
            if merged:
                raw = (*raw[:5], (m.threads, m.processes), raw[5])
            if scope == "all":
                raw = ((s.comm, s.pid, s.tid, m.threads, m.processes), *raw)
            out.append((key, raw))
        self.sync_rows(out)

    def stack_by_key(self, key: StackKey) -> StackRow | None:
        """A shown stack by its key (the sums, for a merged row)."""
        m = self._by_key.get(key)
        return m.row if m is not None else None

    def on_line_table_row_selected(self, event: LineTable.RowSelected) -> None:
        """Enter: ask for the callchain tree at this stack."""
        event.stop()
        merged = self._by_key.get(event.key) if isinstance(event.key, tuple) else None
        if merged is not None:
            self.post_message(self.StackChosen(self, merged))

    def render_cell(self, column: str, value: Hashable) -> Text:
        """A cell: the task literal, numbers right-aligned, the chain summarized."""
        if column == "task":
            assert isinstance(value, tuple)
            comm, pid, tid, threads, processes = value
            if processes > 1:
                t = Text(printable(comm), style="bold", end="")
                t.append(f" ({processes} processes)", style="dim")
                return t
            return task_label(printable(comm), pid, tid if threads == 1 else None)
        if column == "tasks":
            assert isinstance(value, tuple)
            threads, processes = value
            text = f"{threads}t" if processes == 1 else f"{processes}p {threads}t"
            return Text(text.rjust(7), style="dim" if threads == 1 else "", end="")
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
            kernel, user = value
            return chain_summary(kernel, user, show_kernel=self.show_kernel,
                                 show_user=self.show_user, max_kernel=3, max_user=4)
        text = str(value).rjust(7 if column == "off" else 6)
        return Text(text, style="dim" if value == "0" else "", end="")
