"""A DataTable updated by keyed diff, keeping its cursor on the same row.

The base of the task, stack and blocked-now tables. Each refresh hands over
the rows wanted, in order, as `(key, raw values)`; the table removes stale
rows, re-renders only the cells whose raw value changed (`update_cell`),
adds new rows and sorts once, then puts the cursor back on the row (key) it
was on. Raw values are cheap to compare (numbers, strings, tuples); turning
them into `Text` is left to `render_cell` and only done for what changed.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import ClassVar

from rich.console import RenderableType
from rich.text import Text
from textual.binding import Binding, BindingType
from textual.widgets import DataTable
from textual.widgets.data_table import CellDoesNotExist, RowKey

#: One row handed to `KeyedTable.sync_rows`: its key and its raw cell values.
KeyedRow = tuple[str, tuple[Hashable, ...]]


class KeyedTable(DataTable[RenderableType]):
    """A row-cursor DataTable refreshed by keyed diff (see module docstring)."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("home", "scroll_top", "First row", show=False, id="table.first"),
        Binding("end", "scroll_bottom", "Last row", show=False, id="table.last"),
    ]

    #: Lines per row.
    ROW_HEIGHT: ClassVar[int] = 1
    #: Above this share of rows replaced, clearing and re-adding is cheaper than
    #: removing rows one by one (DataTable re-indexes all rows on each removal).
    REBUILD_RATIO: ClassVar[float] = 0.4

    def __init__(self, *, id: str | None = None, classes: str | None = None) -> None:
        super().__init__(
            id=id, classes=classes, cursor_type="row", zebra_stripes=False, cell_padding=1
        )
        self._raw: dict[str, tuple[Hashable, ...]] = {}
        self._order: list[str] = []
        self._column_keys: list[str] = []

    # --- for subclasses -------------------------------------------------

    def set_columns(self, columns: Sequence[tuple[str, str, int]]) -> None:
        """(Re)define the columns as `(key, label, width)`; drops all rows."""
        self.clear(columns=True)
        self._raw.clear()
        self._order.clear()
        self._column_keys = [key for key, _, _ in columns]
        for key, label, width in columns:
            self.add_column(Text(label, style="bold", end=""), key=key, width=width)

    def set_column_label(self, key: str, label: Text) -> None:
        """Change a column's header label in place."""
        for column in self.columns.values():
            if column.key.value == key:
                column.label = label
                self.refresh()
                return

    def render_cell(self, column: str, value: Hashable) -> RenderableType:
        """Turn one raw value into what the cell shows (override)."""
        return Text(str(value), end="")

    # --- state ----------------------------------------------------------

    @property
    def row_keys_in_order(self) -> list[str]:
        """The keys of the rows shown, top to bottom."""
        return list(self._order)

    @property
    def cursor_key(self) -> str | None:
        """The key of the row under the cursor, if any."""
        if not self._order or self.row_count == 0:
            return None
        try:
            key = self.coordinate_to_cell_key(self.cursor_coordinate).row_key
        except CellDoesNotExist:
            return None
        return key.value

    def move_to_key(self, key: str, *, scroll: bool = True) -> bool:
        """Put the cursor on the row with `key`; False if there is no such row."""
        if key not in self._raw:
            return False
        index = self.get_row_index(key)
        if index != self.cursor_row:
            self.move_cursor(row=index, animate=False, scroll=scroll)
        return True

    # --- the diff -------------------------------------------------------

    def sync_rows(self, rows: Sequence[KeyedRow]) -> None:
        """Make the table show `rows`, in this order, touching only what changed."""
        cursor_key = self.cursor_key
        wanted = {key for key, _ in rows}
        stale = [key for key in self._order if key not in wanted]
        if self._order and len(stale) > self.REBUILD_RATIO * max(len(self._order), len(rows)):
            self._rebuild(rows)
        else:
            self._diff(rows, stale, wanted)
        if cursor_key is not None and cursor_key in self._raw:
            self.move_to_key(cursor_key)

    def _rebuild(self, rows: Sequence[KeyedRow]) -> None:
        self.clear()
        self._raw.clear()
        for key, raw in rows:
            self._add(key, raw)
        self._order = [key for key, _ in rows]

    def _add(self, key: str, raw: tuple[Hashable, ...]) -> None:
        cells = [self.render_cell(c, v) for c, v in zip(self._column_keys, raw, strict=True)]
        self.add_row(*cells, key=key, height=self.ROW_HEIGHT)
        self._raw[key] = raw

    def _diff(self, rows: Sequence[KeyedRow], stale: list[str], wanted: set[str]) -> None:
        for key in stale:
            self.remove_row(key)
            del self._raw[key]
        added: list[str] = []
        columns = self._column_keys
        for key, raw in rows:
            old = self._raw.get(key)
            if old is None:
                self._add(key, raw)
                added.append(key)
            elif old != raw:
                for column, new_value, old_value in zip(columns, raw, old, strict=True):
                    if new_value != old_value:
                        self.update_cell(key, column, self.render_cell(column, new_value))
                self._raw[key] = raw
        now = [key for key in self._order if key in wanted] + added
        want = [key for key, _ in rows]
        if now != want:
            self._sort_to(want)
        self._order = want

    def _sort_to(self, order: list[str]) -> None:
        """Sort the rows into `order` with one `DataTable.sort`.

        `sort` hands the key function cell values only, never row keys; rank
        the rows by the identity of their first cell, which is one object per
        row (`render_cell` results are never shared between rows here: a
        shared object would be copied first).
        """
        if not order:
            return
        first = self._column_keys[0]
        rank: dict[int, int] = {}
        for i, key in enumerate(order):
            cell = self.get_cell(key, first)
            if id(cell) in rank:
                cell = cell.copy() if isinstance(cell, Text) else Text(str(cell), end="")
                self.update_cell(key, first, cell)
            rank[id(cell)] = i
        self.sort(first, key=lambda cell: rank[id(cell)])

    def row_key_at(self, index: int) -> str | None:
        """The key of the row at `index` on screen."""
        if 0 <= index < len(self._order):
            return self._order[index]
        return None

    @staticmethod
    def key_of(row_key: RowKey) -> str:
        """A row key's string value."""
        return row_key.value or ""
