"""The main view: threads (or processes) ranked by off-CPU time."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from rich.text import Text
from textual.binding import Binding, BindingType
from textual.message import Message

from offtop.model import ProcessRow, TaskRow
from offtop.safe_text import printable
from offtop.units import format_ns
from offtop.widgets.line_table import LineTable
from offtop.widgets.render import number_text, rate_parts, rate_text

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
    """The filter: a case-insensitive substring of the comm, or of the pid/tid."""
    if not needle:
        return True
    n = needle.lower()
    if n in row.comm.lower() or n in str(row.pid):
        return True
    return isinstance(row, TaskRow) and n in str(row.tid)


class TaskTable(LineTable):
    """Threads or processes ranked by off-CPU time, refreshed by keyed diff.

    Click a column header to sort by it (again to reverse); `s` cycles the sort.
    As in htop, the cursor keeps its row position across refreshes and
    re-sorts; with `follow` set it keeps its task instead, and that task stays
    listed (with zero time) while it has nothing to report.
    """

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("j", "cursor_down", "Down", show=False, id="tasks.down"),
        Binding("k", "cursor_up", "Up", show=False, id="tasks.up"),
        Binding("enter", "select_cursor", "Callchain",
                tooltip="Open the callchain tree of the task", id="tasks.drill"),
    ]

    #: Rows shown at most; the rest are counted ("N more") and found by filter.
    MAX_ROWS: ClassVar[int] = 150

    class SortChanged(Message):
        """The sort column or direction changed."""

        def __init__(self, sort: SortSpec) -> None:
            super().__init__()
            self.sort = sort

    def __init__(self, *, id: str | None = None, classes: str | None = None) -> None:
        super().__init__(id=id, classes=classes)
        self.processes = False
        self.compact = False
        self.sort_spec = SortSpec("off", True)
        self.filter_text = ""
        self.interval_s = 1.0
        self.total_rows = 0
        self.matching_rows = 0
        self._source: Sequence[Row] = ()
        self._shown: dict[str, Row] = {}

    def on_mount(self) -> None:
        self._define_columns()

    # --- configuration --------------------------------------------------

    def _columns(self) -> list[tuple[str, str, int]]:
        cols = [
            ("pid", 7),
            ("tid", 7),
            ("comm", 15),
            ("s", 6),
            ("d", 6),
            ("off", 12),
            ("count", 6),
            ("max", 6),
            ("total", 7),
        ]
        if self.compact:
            cols = [c for c in cols if c[0] not in ("s", "d")]
            cols = [(k, 12 if k == "comm" else w) for k, w in cols]
        return [(k, self._title(k), w) for k, w in cols]

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

    def set_mode(self, *, processes: bool) -> None:
        """Show threads or processes (no rows until the next `show`)."""
        if processes == self.processes:
            return
        self.processes = processes
        self._shown.clear()
        self._source = ()
        self.set_columns(self._columns())

    def set_compact(self, compact: bool) -> None:
        """Fewer, narrower columns for small terminals."""
        if compact != self.compact:
            self.compact = compact
            self._define_columns()

    def sort_by(self, column: str, reverse: bool | None = None) -> None:
        """Sort by `column`; with `reverse=None`, its natural direction."""
        if column not in COLUMN_TITLES:
            return
        if reverse is None:
            reverse = _DEFAULT_REVERSE.get(column, True)
        self.sort_spec = SortSpec(column, reverse)
        for key, _, _ in self._columns():
            self.set_column_label(key, self._title(key))
        self._refill()
        self.post_message(self.SortChanged(self.sort_spec))

    def cycle_sort(self) -> None:
        """Next column in `SORT_CYCLE`."""
        keys = [k for k, _ in SORT_CYCLE]
        if self.compact:
            keys = [k for k in keys if k not in ("s", "d")]
        try:
            i = keys.index(self.sort_spec.column)
        except ValueError:
            i = -1
        self.sort_by(keys[(i + 1) % len(keys)])

    def set_filter(self, text: str) -> None:
        """Show only rows whose comm or pid/tid contains `text`."""
        if text != self.filter_text:
            self.filter_text = text
            self._refill()

    # --- data -----------------------------------------------------------

    def show(self, rows: Sequence[Row], interval_s: float) -> None:
        """Display a snapshot's tasks (or processes)."""
        self._source = rows
        self.interval_s = interval_s
        self._refill()

    def _refill(self) -> None:
        rows = self._source
        # Only a followed task is kept listed: otherwise the cursor stays at
        # its position whatever task comes under it.
        cursor = self.cursor_key if self.follow else None
        self.total_rows = len(rows)
        needle = self.filter_text.strip()
        matching = [r for r in rows if row_matches(r, needle)] if needle else list(rows)
        # The followed task stays listed while it has nothing to report, so
        # the cursor (and the stacks pane) do not jump away from it.
        if cursor is not None and all(r.key != cursor for r in matching):
            last = self._shown.get(cursor)
            if last is not None and row_matches(last, needle):
                matching.append(_idle(last))
        self.matching_rows = len(matching)
        spec = self.sort_spec
        value = _sort_value(spec.column, self.processes)
        matching.sort(key=lambda r: r.key)
        matching.sort(key=value, reverse=spec.reverse)
        shown = matching[: self.MAX_ROWS]
        if cursor is not None and all(r.key != cursor for r in shown):
            kept = next((r for r in matching if r.key == cursor), None)
            if kept is not None:
                shown[-1:] = [kept]
        self._shown = {r.key: r for r in shown}
        self.sync_rows([(r.key, self._raw_row(r)) for r in shown])

    def _raw_row(self, r: Row) -> tuple[Hashable, ...]:
        second = r.threads if isinstance(r, ProcessRow) else r.tid
        raw: list[Hashable] = [
            r.pid,
            second,
            r.comm,
            format_ns(r.state_ns.get("S", 0)),
            format_ns(r.state_ns.get("D", 0)),
            rate_parts(r.offcpu_ns, self.interval_s),
            r.count,
            format_ns(r.max_ns),
            format_ns(r.total_ns),
        ]
        if self.compact:
            del raw[3:5]
        return tuple(raw)

    def render_cell(self, column: str, value: Hashable) -> Text:
        """A cell: numbers right-aligned, zero dim, the comm literal."""
        if column in ("pid", "tid"):
            return Text(str(value).rjust(7), end="")
        if column == "comm":
            # A comm is whatever the process chose: shown escaped, never markup.
            return Text(printable(str(value)), no_wrap=True, overflow="ellipsis", end="")
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

    def on_line_table_header_clicked(self, event: LineTable.HeaderClicked) -> None:
        """Click a header to sort by it; click it again to reverse."""
        event.stop()
        column = event.column
        if column == self.sort_spec.column:
            self.sort_by(column, not self.sort_spec.reverse)
        else:
            self.sort_by(column)


def _idle(row: Row) -> Row:
    """A row with its interval figures zeroed (kept listed while idle)."""
    return dataclasses.replace(row, offcpu_ns=0, count=0, max_ns=0, state_ns={}, events=0)
