"""The main view: threads (or processes) ranked by off-CPU time.

The table is its own pane: it sets its border title and subtitle from what
it is given (how many rows, how many match the filter, what is hidden, the
sort). Its inputs are reactives the app binds: the snapshot's index, threads
or processes, the filter text and whether idle waits are hidden. It tells
the app about the task under the cursor with typed messages (`RowKey`s).

As in htop the cursor keeps its row *position* across refreshes and re-sorts;
with `follow_task` (htop's F) it keeps its task instead, and that task stays
listed (with zero time) while it has nothing to report. The columns follow
the table's own width: fewer below 90 cells; from 134 on, the frame each task
is blocked in and its command line.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from rich.text import Text
from textual import events
from textual.binding import Binding, BindingType
from textual.message import Message
from textual.reactive import var

from offtop.model import Frame, ProcessRow, RowKey, SnapshotIndex, TaskRow
from offtop.safe_text import printable
from offtop.units import format_ns
from offtop.widgets.choice_screen import ChoiceScreen
from offtop.widgets.line_table import Column, LineTable
from offtop.widgets.render import (
    TitledPane,
    frame_style,
    number_text,
    rate_parts,
    rate_text,
    set_titles,
    untrusted_text,
)

#: A row of the table: a thread or a process.
Row = TaskRow | ProcessRow


@dataclass(frozen=True, slots=True)
class SortSpec:
    """Which column the table is sorted by, and which way."""

    column: str
    reverse: bool

    def label(self) -> str:
        """A short description, e.g. `OFF-CPU ▼`."""
        return f"{COLUMN_TITLES[self.column]} {'▼' if self.reverse else '▲'}"


#: Column keys in display order, with their titles.
COLUMN_TITLES: dict[str, str] = {
    "pid": "PID",
    "tid": "TID",
    "comm": "COMM",
    "s": "S",
    "d": "D",
    "off": "OFF ms/s   %",
    "count": "COUNT",
    "max": "MAX",
    "total": "TOTAL",
}

#: The columns a wide table adds (not sortable).
WIDE_TITLES: dict[str, str] = {"where": "BLOCKED IN", "cmd": "COMMAND"}

#: The order `s` cycles through, each with the direction it starts in.
SORT_CYCLE: tuple[tuple[str, bool], ...] = (
    ("off", True),
    ("count", True),
    ("max", True),
    ("total", True),
    ("d", True),
    ("s", True),
    ("comm", False),
    ("pid", False),
    ("tid", False),
)
_DEFAULT_REVERSE = dict(SORT_CYCLE)

#: Table widths below which the S and D columns go, and from which the
#: BLOCKED IN and COMMAND columns come.
COMPACT_BELOW = 90
WIDE_FROM = 134


def _sort_value(column: str, processes: bool) -> Callable[[Row], Any]:
    if column == "pid":
        return lambda r: r.pid
    if column == "tid":
        if processes:
            return lambda r: r.threads if isinstance(r, ProcessRow) else 1
        return lambda r: r.tid if isinstance(r, TaskRow) else r.pid
    if column == "comm":
        return lambda r: r.comm.lower()
    if column == "s":
        return lambda r: r.state_ns.get("S", 0)
    if column == "d":
        return lambda r: r.state_ns.get("D", 0)
    if column == "count":
        return lambda r: r.count
    if column == "max":
        return lambda r: r.max_ns
    if column == "total":
        return lambda r: r.total_ns
    return lambda r: r.offcpu_ns


def row_matches(row: Row, needle: str) -> bool:
    """The name filter: a case-insensitive substring of the comm, or of the pid/tid."""
    if not needle:
        return True
    n = needle.lower()
    if n in row.comm.lower() or n in str(row.pid):
        return True
    return isinstance(row, TaskRow) and n in str(row.tid)


class TaskTable(LineTable[RowKey], TitledPane):
    """Threads or processes ranked by off-CPU time (see module docstring)."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("enter", "select_cursor", "Callchain",
                tooltip="Open the callchain tree of the task", id="tasks.drill"),
    ]

    #: Rows shown at most; the rest are counted ("N more") and found by filter.
    MAX_ROWS: ClassVar[int] = 150

    # `var`s, not `reactive`s: a change redraws what its watcher says changed
    # (a reactive would also repaint the whole pane, at every tick).
    index: var[SnapshotIndex] = var(SnapshotIndex.empty, init=False)
    """The snapshot shown, with its lookups."""
    processes: var[bool] = var(False, init=False)
    """Rank processes instead of threads."""
    filter_text: var[str] = var("", init=False)
    """Only rows whose name, pid or frames contain this."""
    hide_idle: var[bool] = var(False, init=False)
    """Hide the rows whose off-CPU time was all idle waits (`model.is_idle_wait`)."""
    follow_task: var[bool] = var(False, init=False)
    """Keep the cursor on its task across refreshes (htop's F), not on its row."""

    class TaskHighlighted(Message):
        """The cursor is on another task: moved there (`moved`), or the
        rows changed under it (a refresh, a re-sort)."""

        def __init__(self, table: TaskTable, key: RowKey, moved: bool) -> None:
            super().__init__()
            self.table = table
            self.key = key
            self.moved = moved

    class TaskChosen(Message):
        """Enter on a task (or a second click)."""

        def __init__(self, table: TaskTable, key: RowKey) -> None:
            super().__init__()
            self.table = table
            self.key = key

    def __init__(self, *, id: str | None = None, classes: str | None = None) -> None:
        super().__init__(id=id, classes=classes)
        self.sort_spec = SortSpec("off", True)
        #: "compact", "normal" or "wide": the column set, from the table's width.
        self.width_class = "normal"
        self.total_rows = 0
        self.matching_rows = 0
        self.idle_rows = 0
        self._shown: dict[RowKey, Row] = {}

    def on_mount(self) -> None:
        self._define_columns()

    # --- configuration --------------------------------------------------

    def _columns(self) -> list[Column]:
        widths = [("pid", 7), ("tid", 7), ("comm", 15), ("s", 6), ("d", 6), ("off", 12),
                  ("count", 6), ("max", 6), ("total", 7)]
        if self.width_class == "compact":
            widths = [(k, 12 if k == "comm" else w) for k, w in widths if k not in ("s", "d")]
        cols = [Column(k, self._title(k), w) for k, w in widths]
        if self.width_class == "wide":
            cols += [Column("where", WIDE_TITLES["where"], 24),
                     Column("cmd", WIDE_TITLES["cmd"], 16, flex=True)]
        return cols

    def _title(self, key: str) -> str:
        title = COLUMN_TITLES[key]
        if key == "tid" and self.processes:
            title = "THR"
        if key == self.sort_spec.column:
            title += "▼" if self.sort_spec.reverse else "▲"
        return title

    def _define_columns(self) -> None:
        self.set_columns(self._columns())
        self._refill()

    def on_resize(self, event: events.Resize) -> None:
        """The column set follows the table's width."""
        width = event.size.width
        width_class = ("compact" if width < COMPACT_BELOW
                       else "wide" if width >= WIDE_FROM else "normal")
        if width_class != self.width_class:
            self.width_class = width_class
            self._define_columns()

    def watch_processes(self, processes: bool) -> None:
        # The cursor goes to the same task in the other mode: a thread's
        # process, a process's main (or hottest) thread.
        old = self.cursor_key
        self._shown.clear()
        self.set_columns(self._columns())
        self._refill()
        target = self.index.counterpart(old) if old is not None else None
        if target is not None:
            self.move_to_key(target)

    def watch_index(self) -> None:
        self._refill()

    def watch_filter_text(self) -> None:
        self._refill()

    def watch_hide_idle(self) -> None:
        self._refill()

    def watch_follow_task(self, follow: bool) -> None:
        self.follow = follow
        self._update_titles()

    def sort_by(self, column: str, reverse: bool | None = None) -> None:
        """Sort by `column`; with `reverse=None`, its natural direction."""
        if column not in COLUMN_TITLES:
            return
        if reverse is None:
            reverse = _DEFAULT_REVERSE.get(column, True)
        self.sort_spec = SortSpec(column, reverse)
        for c in self._columns():
            self.set_column_label(c.key, c.label)
        self._refill()

    def sort_menu(self) -> ChoiceScreen:
        """F6: the columns shown, to pick one (the current one highlighted)."""
        choices = [(c, COLUMN_TITLES[c]) for c, _ in SORT_CYCLE if c in self.column_keys]
        return ChoiceScreen("Sort by", choices, current=self.sort_spec.column)

    def cycle_sort(self) -> None:
        """Next column in `SORT_CYCLE` (of those shown)."""
        keys = [k for k, _ in SORT_CYCLE if k in self.column_keys]
        i = keys.index(self.sort_spec.column) if self.sort_spec.column in keys else -1
        self.sort_by(keys[(i + 1) % len(keys)])

    # --- data -----------------------------------------------------------

    def _matches(self, row: Row, needle: str) -> bool:
        return row_matches(row, needle) or self.index.frames_contain(row.key, needle)

    def _refill(self) -> None:
        index = self.index
        rows: Sequence[Row] = (index.snapshot.processes if self.processes
                               else index.snapshot.tasks)
        # Only a followed task is kept listed: otherwise the cursor stays at
        # its position whatever task comes under it.
        cursor = self.cursor_key if self.follow else None
        self.total_rows = len(rows)
        needle = self.filter_text.strip()
        matching = [r for r in rows if self._matches(r, needle)] if needle else list(rows)
        if self.hide_idle:
            busy = [r for r in matching if index.idle_ns(r.key) < r.offcpu_ns]
            self.idle_rows = len(matching) - len(busy)
            matching = busy
        else:
            self.idle_rows = 0
        # The followed task stays listed while it has nothing to report, so
        # the cursor (and the stacks pane) do not jump away from it.
        # Rows are told by their ids here, not by `RowKey`s: a key made per
        # row and compared per row costs milliseconds at 2,000 rows.
        ident = _pid if self.processes else _tid
        if cursor is not None and all(ident(r) != cursor.id for r in matching):
            last = self._shown.get(cursor)
            if last is not None:
                matching.append(_idle(last))
        self.matching_rows = len(matching)
        spec = self.sort_spec
        matching.sort(key=ident)
        matching.sort(key=_sort_value(spec.column, self.processes), reverse=spec.reverse)
        shown = matching[: self.MAX_ROWS]
        if cursor is not None and all(ident(r) != cursor.id for r in shown):
            kept = next((r for r in matching if ident(r) == cursor.id), None)
            if kept is not None:
                shown[-1:] = [kept]
        self._shown = {r.key: r for r in shown}
        interval_s = index.snapshot.interval_s
        self.sync_rows([(r.key, self._raw_row(r, interval_s)) for r in shown])
        self._update_titles()

    def _raw_row(self, r: Row, interval_s: float) -> tuple[Hashable, ...]:
        second = r.threads if isinstance(r, ProcessRow) else r.tid
        raw: list[Hashable] = [
            r.pid,
            second,
            r.comm,
            format_ns(r.state_ns.get("S", 0)),
            format_ns(r.state_ns.get("D", 0)),
            rate_parts(r.offcpu_ns, interval_s),
            r.count,
            format_ns(r.max_ns),
            format_ns(r.total_ns),
        ]
        if self.width_class == "compact":
            del raw[3:5]
        elif self.width_class == "wide":
            top = self.index.hottest(r.key)
            raw.append(self.index.facts(top).blocked_in if top is not None else None)
            raw.append(r.cmdline if isinstance(r, ProcessRow) else self.index.cmdline(r.pid))
        return tuple(raw)

    def _update_titles(self) -> None:
        what = "processes" if self.processes else "threads"
        title = f"{what.capitalize()} by off-CPU time"
        # A Text, not a string: Textual parses a string title as markup, and
        # the filter is typed text ("[/usr]" would raise MarkupError).
        sub = Text(f"{self.total_rows:,} {what}", end="")
        if self.filter_text:
            sub.append(f" · {self.matching_rows:,} match “")
            sub.append_text(untrusted_text(self.filter_text))
            sub.append("”")
        if self.idle_rows:
            sub.append(f" · {self.idle_rows:,} idle hidden")
        if self.hidden_rows:
            sub.append(f" · {self.hidden_rows:,} more")
        if self.follow:
            sub.append(" · following")
        sub.append(f" · sort {self.sort_spec.label()}")
        set_titles(self, title, sub)

    def render_cell(self, column: str, value: Hashable) -> Text:
        """A cell: numbers right-aligned, zero dim, names literal."""
        if column in ("pid", "tid"):
            return Text(str(value).rjust(7), end="")
        if column in ("comm", "cmd"):
            # Whatever the process chose: shown escaped, never markup.
            return Text(printable(str(value)), no_wrap=True, overflow="ellipsis", end="",
                        style="dim" if column == "cmd" else "")
        if column == "where":
            if not isinstance(value, Frame):
                return Text("", end="")
            return Text(printable(value.name), style=frame_style(value), no_wrap=True,
                        overflow="ellipsis", end="")
        if column == "off":
            assert isinstance(value, tuple)
            return rate_text(value)
        if column == "count":
            assert isinstance(value, int)
            return number_text(value, width=6)
        text = str(value).rjust(7 if column == "total" else 6)
        if value == "0":
            return Text(text, style="dim", end="")
        return Text(text, style="#ff8080" if column == "d" else "", end="")

    @property
    def hidden_rows(self) -> int:
        """Matching rows not shown because of `MAX_ROWS`."""
        return max(0, self.matching_rows - self.row_count)

    # --- events ---------------------------------------------------------

    def on_line_table_header_clicked(self, event: LineTable.HeaderClicked) -> None:
        """Click a header to sort by it; click it again to reverse."""
        event.stop()
        column = event.column
        if column not in COLUMN_TITLES:
            return
        if column == self.sort_spec.column:
            self.sort_by(column, not self.sort_spec.reverse)
        else:
            self.sort_by(column)

    def on_line_table_row_highlighted(self, event: LineTable.RowHighlighted) -> None:
        """Tell the app which task is under the cursor now."""
        event.stop()
        if isinstance(event.key, RowKey) and event.key == self.cursor_key:
            self.post_message(self.TaskHighlighted(self, event.key, event.moved))

    def on_line_table_row_selected(self, event: LineTable.RowSelected) -> None:
        """Enter: ask the app to open the task's callchains."""
        event.stop()
        if isinstance(event.key, RowKey):
            self.post_message(self.TaskChosen(self, event.key))


def _tid(row: Row) -> int:
    return row.tid if isinstance(row, TaskRow) else row.pid


def _pid(row: Row) -> int:
    return row.pid


def _idle(row: Row) -> Row:
    """A row with its interval figures zeroed (kept listed while idle)."""
    return dataclasses.replace(row, offcpu_ns=0, count=0, max_ns=0, state_ns={}, events=0)
