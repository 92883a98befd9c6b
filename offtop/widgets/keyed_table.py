"""A DataTable updated by keyed diff, keeping its cursor on the same row.

The base of the task, stack and blocked-now tables. Each refresh hands over
the rows wanted, in order, as `(key, raw values)`; the table removes stale
rows, re-renders only the cells whose raw value changed (`update_cell`),
adds new rows and sorts once, then puts the cursor back on the row (key) it
was on. Raw values are what the cell shows, before styling (a formatted
duration rather than nanoseconds), so a cell is only touched when what it
shows changes; turning them into `Text` is left to `render_cell`, cached by
(column, raw value) for every column but the first.
"""

from __future__ import annotations

import contextlib
from collections.abc import Hashable, Sequence
from typing import Any, ClassVar

from rich.console import RenderableType
from rich.segment import Segment
from rich.style import Style
from rich.text import Text
from textual._two_way_dict import TwoWayDict
from textual.binding import Binding, BindingType
from textual.cache import LRUCache
from textual.widgets import DataTable
from textual.widgets.data_table import CellDoesNotExist, ColumnKey, Row, RowKey

#: Rendered lines of a cell, as DataTable keeps them.
SegmentLines = list[list[Segment]]

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
    REBUILD_RATIO: ClassVar[float] = 0.6

    def __init__(self, *, id: str | None = None, classes: str | None = None) -> None:
        super().__init__(
            id=id, classes=classes, cursor_type="row", zebra_stripes=False, cell_padding=1
        )
        self._raw: dict[str, tuple[Hashable, ...]] = {}
        self._order: list[str] = []
        self._column_keys: list[str] = []
        self._rendered: LRUCache[tuple[str, Hashable], RenderableType] = LRUCache(4_000)
        self._lines_cache: LRUCache[tuple[Any, ...], tuple[object, SegmentLines]] = LRUCache(
            2_000)
        # `_render_cell` below caches cells itself, and DataTable's line caches
        # are keyed on its update counter, which moves every tick: smaller
        # caches mean fewer live objects for the garbage collector to scan.
        for cache, size in (("_cell_render_cache", 500), ("_row_render_cache", 300),
                            ("_line_cache", 300)):
            with contextlib.suppress(AttributeError):
                getattr(self, cache).maxsize = size

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

    def _cell(self, column: str, value: Hashable) -> RenderableType:
        """`render_cell`, cached; the first column is rendered per row (see `_sort_to`)."""
        if column == self._column_keys[0]:
            return self.render_cell(column, value)
        key = (column, value)
        cell = self._rendered.get(key)
        if cell is None:
            cell = self.render_cell(column, value)
            self._rendered.set(key, cell)
        return cell

    def refresh_cells(self) -> None:
        """Re-render every cell (after a change `render_cell` depends on)."""
        self._rendered.clear()
        changes = [
            (key, column, self._cell(column, value))
            for key, raw in self._raw.items()
            for column, value in zip(self._column_keys, raw, strict=True)
        ]
        self.update_cells(changes)

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
        # Every column has a fixed width and every row a fixed height, so the
        # measuring of each new row's cells that DataTable does on idle (for
        # auto widths and heights) would be wasted: most of the cost of adding
        # rows. The virtual size is still recomputed.
        new_rows = getattr(self, "_new_rows", None)
        if isinstance(new_rows, set):
            new_rows.clear()
        if cursor_key is not None and cursor_key in self._raw:
            self.move_to_key(cursor_key)

    def _rebuild(self, rows: Sequence[KeyedRow]) -> None:
        self.clear()
        self._raw.clear()
        self._add_rows(rows)
        self._order = [key for key, _ in rows]

    def _add_rows(self, rows: Sequence[KeyedRow]) -> None:
        """Append rows at the bottom (`_sort_to` puts them in place)."""
        columns = self._column_keys
        self.add_rows_batch([
            (key, [self._cell(c, v) for c, v in zip(columns, raw, strict=True)])
            for key, raw in rows
        ])
        for key, raw in rows:
            self._raw[key] = raw

    def _diff(self, rows: Sequence[KeyedRow], stale: list[str], wanted: set[str]) -> None:
        if stale:
            self.remove_rows(stale)
            for key in stale:
                del self._raw[key]
        new: list[KeyedRow] = []
        columns = self._column_keys
        changes: list[tuple[str, str, RenderableType]] = []
        for key, raw in rows:
            old = self._raw.get(key)
            if old is None:
                new.append((key, raw))
            elif old != raw:
                for column, new_value, old_value in zip(columns, raw, old, strict=True):
                    if new_value != old_value:
                        changes.append((key, column, self._cell(column, new_value)))
                self._raw[key] = raw
        self.update_cells(changes)
        self._add_rows(new)
        now = [key for key in self._order if key in wanted] + [key for key, _ in new]
        want = [key for key, _ in rows]
        if now != want:
            self._sort_to(want)
        self._order = want

    # --- batched DataTable operations ------------------------------------
    #
    # `DataTable.remove_row` re-indexes every row after the removed one, and
    # `update_cell` schedules a refresh per call: with hundreds of rows per
    # tick that is most of the tick. These do the same bookkeeping once per
    # batch. They touch DataTable's private state (Textual is pinned < 9),
    # and fall back to the public calls if it moved; tests/test_ui_widgets.py
    # checks both paths give the same table.

    def update_cells(self, changes: Sequence[tuple[str, str, RenderableType]]) -> None:
        """`update_cell` for many cells (no width update), with one refresh."""
        if not changes:
            return
        try:
            data = self._data
            targets = [(data[RowKey(row)], ColumnKey(column), value)
                       for row, column, value in changes]
        except (AttributeError, KeyError, TypeError):
            for row, column, value in changes:
                self.update_cell(row, column, value)
            return
        for cells, column_key, value in targets:
            cells[column_key] = value
        self._update_count += 1
        self.refresh()

    def add_rows_batch(self, rows: Sequence[tuple[str, Sequence[RenderableType]]]) -> None:
        """`add_row` for many rows (fixed height, no label), with one refresh."""
        if not rows:
            return
        height = self.ROW_HEIGHT
        try:
            columns = [column.key for column in self.ordered_columns]
            locations, data, meta = self._row_locations, self._data, self.rows
            start = self.row_count
            entries = [(RowKey(key), cells) for key, cells in rows]
            if any(row_key in locations for row_key, _ in entries):
                raise ValueError("duplicate row key")
        except (AttributeError, TypeError, ValueError):
            for key, cells in rows:
                self.add_row(*cells, key=key, height=height)
            return
        for i, (row_key, cells) in enumerate(entries):
            locations[row_key] = start + i
            data[row_key] = dict(zip(columns, cells, strict=True))
            meta[row_key] = Row(row_key, height)
        self._require_update_dimensions = True
        self._update_count += 1
        self.cursor_coordinate = self.cursor_coordinate
        if start == 0 and self.show_cursor and self.cursor_type != "none":
            self._highlight_cursor()  # a row under the cursor appeared
        self.refresh()
        self.check_idle()

    def remove_rows(self, keys: Sequence[str]) -> None:
        """`remove_row` for many rows, re-indexing once."""
        try:
            # Everything that can fail is read or built before anything changes.
            gone = {RowKey(k) for k in keys}
            rows, data = self.rows, self._data
            updated = {c for c in self._updated_cells if c.row_key not in gone}
            new_rows = self._new_rows - gone
            remaining = [RowKey(k) for k in self._order if RowKey(k) not in gone]
            locations = TwoWayDict({k: i for i, k in enumerate(remaining)})
        except (AttributeError, TypeError):
            for key in keys:
                if key in self.rows:
                    self.remove_row(key)
            return
        for row_key in gone:
            rows.pop(row_key, None)
            data.pop(row_key, None)
        self._updated_cells = updated
        self._new_rows = new_rows
        self._row_locations = locations
        # DataTable re-measures on idle (`_require_update_dimensions`); the
        # virtual size, hence the layout, only changes if the row count does.
        self._require_update_dimensions = True
        self._update_count += 1
        self.cursor_coordinate = self.cursor_coordinate
        self.hover_coordinate = self.hover_coordinate
        self.refresh()
        self.check_idle()

    def _render_cell(
        self,
        row_index: int,
        column_index: int,
        base_style: Style,
        width: int,
        cursor: bool = False,
        hover: bool = False,
    ) -> SegmentLines:
        """DataTable's cell render, cached by the cell's own identity.

        DataTable keys its render cache on a table-wide update counter, so any
        `update_cell` re-renders every visible cell. Here a changed cell is a
        new object (`update_cells` stores a new renderable), so the object
        itself says whether the cell changed; the row index stays in the key
        because the rendered segments carry it (for mouse clicks).
        """
        try:
            row_key = self._row_locations.get_key(row_index) if row_index >= 0 else None
            column_key = self._column_locations.get_key(column_index)
            cell = (self._data[row_key][column_key]
                    if row_key is not None and column_key is not None else None)
        except (AttributeError, KeyError):
            cell = None
        if cell is None:
            return super()._render_cell(row_index, column_index, base_style, width,
                                        cursor, hover)
        key = (row_index, column_index, id(cell), base_style, width, cursor, hover,
               self._show_hover_cursor, self._pseudo_class_state)
        hit = self._lines_cache.get(key)
        if hit is not None and hit[0] is cell:
            return hit[1]
        lines = super()._render_cell(row_index, column_index, base_style, width, cursor, hover)
        # The cell is kept with its lines: its id cannot be reused while cached.
        self._lines_cache.set(key, (cell, lines))
        return lines

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
