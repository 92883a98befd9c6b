"""A table drawn with Textual's Line API: keyed rows, cached lines, a row cursor.

The base of the task, stack and blocked-now tables. Each refresh hands over
the rows wanted, in order, as `(key, raw values)` (`sync_rows`). Raw values
are what a cell shows before styling (a formatted duration rather than
nanoseconds), so a row whose values are unchanged is unchanged on screen:
the table keeps a version per row, bumped only when its values change.

Nothing is drawn per row until it is on screen. `render_line` draws one
screen line from a strip cached by (row key, row version, line of the row,
column widths, style); cells are cached too, by (column, value, width). A
tick that changes five visible rows refreshes and draws those five rows'
lines; a re-sort or a scroll re-uses the strips of rows that did not change.
A sync of thousands of rows costs a comparison of their raw tuples.

The caches hold lines and cells as plain `(text, style number)` tuples
(`StylePool`), not as Strips and Segments: a Strip is ~15 objects the
cyclic GC tracks (its seven caches), a Segment holds a Style, so each is
walked by every full GC pass, and the caches were most of what the TUI
holds (~85,000 objects at 2,000 tasks / 20,000 stacks). Tuples of strings
and ints are untracked by the GC once it has seen them. A line is made a
Strip again when drawn (a few microseconds). The caches themselves are
`PlainLru`s: no object of their own per entry, so that a full pass walks
a cache of cells as one object.

The cursor behaves as htop's: across refreshes and re-sorts it stays at its
row *position* (the row under it may change), unless `follow` is set, when
it stays on the same row key. `move_to_key` moves it explicitly.

Untrusted text never reaches the terminal as control characters: every line
of every cell goes through `offtop.safe_text.printable` before it is drawn,
and cells are `Text`, never markup.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, TypeVar

from rich.cells import cell_len
from rich.console import Console
from rich.segment import Segment
from rich.style import Style
from rich.text import Text
from textual import events
from textual.binding import Binding, BindingType
from textual.geometry import Region, Size
from textual.message import Message
from textual.scroll_view import ScrollView
from textual.strip import Strip

from offtop.safe_text import printable

#: What names a row: any hashable value (a `RowKey`, a tid, a digest).
KeyT = TypeVar("KeyT", bound=Hashable)

#: One row handed to `LineTable.sync_rows`: its key and its raw cell values.
KeyedRow = tuple[KeyT, tuple[Hashable, ...]]

#: The lines of one rendered cell, each exactly as wide as its column.
CellLines = tuple[tuple[Segment, ...], ...]

#: Segments as a cache holds them (`StylePool.pack`): plain `(text, style
#: number)` tuples, a Segment itself only for a control segment.
Packed = tuple["tuple[str, int] | Segment", ...]

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class PlainLru(Generic[K, V]):
    """At most `maxsize` entries; the one used least lately goes first.

    One `OrderedDict` and nothing per entry. textual.cache.LRUCache keeps each
    entry in a list of its own (`[prev, next, key, value]`), which the cyclic
    GC tracks and walks at every full pass: ~11,000 of them in the tables at
    2,000 tasks / 20,000 stacks (bench/bench_ui.py), a fifth of all it walked.
    Keys and values of strings, numbers and tuples of them are untracked by
    the GC once it has seen them.
    """

    __slots__ = ("_entries", "maxsize")

    def __init__(self, maxsize: int) -> None:
        self.maxsize = maxsize
        self._entries: OrderedDict[K, V] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: K) -> V | None:
        """The value kept for `key` (now the most recently used), None if none."""
        entries = self._entries
        value = entries.get(key)
        if value is not None:
            entries.move_to_end(key)
        return value

    def set(self, key: K, value: V) -> None:
        """Keep `value` for `key`, forgetting the least recently used past `maxsize`."""
        entries = self._entries
        entries[key] = value
        entries.move_to_end(key)
        if len(entries) > self.maxsize:
            entries.popitem(last=False)

    def clear(self) -> None:
        self._entries.clear()


class StylePool:
    """Numbers the styles of cached segments, so that a cache holds plain
    tuples the cyclic GC stops tracking (see the module docstring).

    Bounded: past `max_styles` the pool says so (`full`) and the caller
    empties it with the caches whose numbers it gave.
    """

    def __init__(self, max_styles: int = 4096) -> None:
        self._max = max_styles
        self._numbers: dict[Style | None, int] = {None: 0}
        self._styles: list[Style | None] = [None]

    @property
    def full(self) -> bool:
        """More styles than `max_styles` were numbered."""
        return len(self._styles) > self._max

    def clear(self) -> None:
        """Forget every number (the caches holding them must be emptied too)."""
        self._numbers = {None: 0}
        self._styles = [None]

    def pack(self, segments: Iterable[Segment]) -> Packed:
        """`segments` as plain tuples."""
        numbers, styles = self._numbers, self._styles
        out: list[tuple[str, int] | Segment] = []
        for seg in segments:
            text, style, control = seg
            if control:
                out.append(seg)
                continue
            n = numbers.get(style)
            if n is None:
                n = numbers[style] = len(styles)
                styles.append(style)
            out.append((text, n))
        return tuple(out)

    def unpack(self, packed: Packed) -> list[Segment]:
        """The segments `pack` was given."""
        styles = self._styles
        out: list[Segment] = []
        for p in packed:
            if isinstance(p, Segment):  # a control segment, kept as it was
                out.append(p)
            else:
                text, n = p
                out.append(Segment(text, styles[n]))
        return out


@dataclass(frozen=True, slots=True)
class Column:
    """A column: its key, header label and width in cells (without padding).

    A `flex` column is at least `width` wide and shares what is left of the
    table's width with the other flexible columns.
    """

    key: str
    label: str | Text
    width: int
    flex: bool = False


@dataclass(frozen=True, slots=True)
class ColumnLayout:
    """Where the columns sit at one table width (padding included)."""

    widths: tuple[int, ...]
    offsets: tuple[int, ...]
    total: int


@dataclass(frozen=True, slots=True)
class _LineStyle:
    """How a row's line is styled: `pre` under the cells' own styles, `post`
    over them (the cursor's colours win over a cell's, as in DataTable)."""

    pre: Style
    post: Style | None = None

    @classmethod
    def over(cls, base: Style, component: Style) -> _LineStyle:
        """A component's style (cursor, hover) on top of the table's."""
        return cls(base + component, Style.from_color(component.color, component.bgcolor))


@dataclass(frozen=True, slots=True)
class _Styles:
    """The table's line styles, derived from its `rich_style` (`source`). Kept while
    that is the same and Textual has not said the table's styles changed
    (`notify_style_update`): each component style walks the ancestors again, and
    the three took ~0.8 ms at every render pass of every table, a tick's worth of
    drawing at the pacer. `rich_style` itself is read at each pass: an ancestor's
    change (the faded panes while loading) reaches it without a notice to the table."""

    source: Style
    base: _LineStyle
    cursor: _LineStyle
    hover: _LineStyle
    header: Style


@dataclass(frozen=True, slots=True)
class _Pass:
    """What every line of one render pass needs: styles and geometry (read
    once: the regions cost more than drawing a cached line)."""

    base: _LineStyle
    cursor: _LineStyle
    hover: _LineStyle
    header: Style
    cursor_shown: bool
    width: int
    layout: ColumnLayout
    scroll_x: int
    scroll_y: int


class KeyedRows(Generic[KeyT]):
    """Rows by key, in order, each with a version bumped when its values change.

    The data of a `LineTable`, apart from the widget: a sync compares each
    row's raw values with the last ones and reports what changed.
    """

    def __init__(self) -> None:
        #: The keys, top to bottom.
        self.keys: list[KeyT] = []
        self._index: dict[KeyT, int] = {}
        self._raw: dict[KeyT, tuple[Hashable, ...]] = {}
        self._versions: dict[KeyT, int] = {}
        self._next_version = itertools.count(1).__next__

    def __len__(self) -> int:
        return len(self.keys)

    def sync(self, rows: Sequence[KeyedRow[KeyT]]) -> tuple[bool, list[KeyT]]:
        """Hold `rows` from now on: (whether the order of keys changed, the
        keys whose values changed or that are new). Keys must be unique."""
        raw = dict(rows)
        if len(raw) != len(rows):
            raise ValueError("duplicate row keys")
        old_raw, old_versions = self._raw, self._versions
        versions: dict[KeyT, int] = {}
        changed: list[KeyT] = []
        for key, values in rows:
            old = old_raw.get(key)
            if old is None or old != values:
                versions[key] = self._next_version()
                changed.append(key)
            else:
                versions[key] = old_versions[key]
        keys = [key for key, _ in rows]
        reordered = keys != self.keys
        if reordered:
            self.keys = keys
            self._index = {key: i for i, key in enumerate(keys)}
        self._raw, self._versions = raw, versions
        return reordered, changed

    def clear(self) -> None:
        """No rows."""
        self.sync(())

    def index(self, key: KeyT) -> int | None:
        """The position of `key`, if it is a row."""
        return self._index.get(key)

    def values(self, key: KeyT) -> tuple[Hashable, ...]:
        """The raw values of row `key` (KeyError if none)."""
        return self._raw[key]

    def version(self, key: KeyT) -> int:
        """The version of row `key`: changes exactly when its values do."""
        return self._versions[key]


def layout_columns(columns: Sequence[Column], width: int, padding: int) -> ColumnLayout:
    """Column widths and offsets in a table `width` wide: flexible columns
    share what the others leave, evenly (the leftmost take the remainder)."""
    pad = 2 * padding
    widths = [c.width for c in columns]
    flex = [i for i, c in enumerate(columns) if c.flex]
    spare = width - sum(w + pad for w in widths)
    if flex and spare > 0:
        share, extra = divmod(spare, len(flex))
        for n, i in enumerate(flex):
            widths[i] += share + (1 if n < extra else 0)
    offsets, x = [], 0
    for w in widths:
        offsets.append(x)
        x += w + pad
    return ColumnLayout(tuple(widths), tuple(offsets), x)


def cell_lines(text: Text, width: int, height: int, console: Console) -> CellLines:
    """`text` cut into `height` lines (at `\\n`) of exactly `width` cells each:
    cut with its overflow (an ellipsis by default), padded as it is justified,
    every control character shown as a visible escape."""
    plain = text.plain
    if height == 1 and not text.spans and plain.isprintable():
        # Most cells: one style, one line that fits. No Text to copy.
        length = cell_len(plain)
        if length <= width:
            style = console.get_style(text.style, default=Style.null())
            blank = Segment(" " * (width - length))
            if text.justify == "right":
                return ((blank, Segment(plain, style)),)
            return ((Segment(plain, style), blank),)
    parts = text.split("\n", allow_blank=True) if "\n" in plain else [text.copy()]
    overflow = text.overflow or "ellipsis"
    out: list[tuple[Segment, ...]] = []
    for i in range(height):
        line = parts[i] if i < len(parts) else Text()
        if line.style:
            # `Text.render` draws spans only: the text's own style must be one.
            line.stylize_before(line.style)
            line.style = ""
        if not line.plain.isprintable():
            line = _printable(line, line.render(console))
        line.truncate(width, overflow=overflow)
        gap = width - line.cell_len
        if gap > 0:
            if text.justify == "right":
                line.pad_left(gap)
            else:
                line.pad_right(gap)
        out.append(tuple(line.render(console)))
    return tuple(out)


def _printable(line: Text, segments: Iterable[Segment]) -> Text:
    """`line` (drawn as `segments`) with its control characters replaced by
    visible escapes, its styles kept."""
    out = Text(justify=line.justify, overflow=line.overflow, no_wrap=True, end="")
    for segment in segments:
        out.append(printable(segment.text), segment.style)
    return out


class LineTable(ScrollView, Generic[KeyT], can_focus=True):
    """A row-cursor table refreshed by keyed diff and drawn line by line."""

    DEFAULT_CSS = """
    LineTable {
        background: $surface;
        color: $foreground;
        &:focus {
            background-tint: $foreground 5%;
            & > .line-table--cursor {
                background: $block-cursor-background;
                color: $block-cursor-foreground;
                text-style: $block-cursor-text-style;
            }
            & > .line-table--header {
                background-tint: $foreground 5%;
            }
        }
        & > .line-table--header {
            text-style: bold;
            background: $panel;
            color: $foreground;
        }
        & > .line-table--cursor {
            background: $block-cursor-blurred-background;
            color: $block-cursor-blurred-foreground;
            text-style: $block-cursor-blurred-text-style;
        }
        & > .line-table--hover {
            background: $block-hover-background;
        }
    }
    """

    COMPONENT_CLASSES: ClassVar[set[str]] = {
        "line-table--header",
        "line-table--cursor",
        "line-table--hover",
    }

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("up", "cursor_up", "Up", show=False),
        Binding("down", "cursor_down", "Down", show=False),
        Binding("k", "cursor_up", "Up", show=False, id="table.up"),
        Binding("j", "cursor_down", "Down", show=False, id="table.down"),
        Binding("pageup", "page_up", "Page up", show=False),
        Binding("pagedown", "page_down", "Page down", show=False),
        Binding("home", "first_row", "First row", show=False, id="table.first"),
        Binding("end", "last_row", "Last row", show=False, id="table.last"),
        Binding("enter", "select_cursor", "Select", show=False),
    ]

    #: Lines per row.
    ROW_HEIGHT: ClassVar[int] = 1
    #: Draw a header line with the column labels (clicking one posts `HeaderClicked`).
    SHOW_HEADER: ClassVar[bool] = True
    #: Draw the cursor only while the table has the focus (for tables whose
    #: rows come and go, where a cursor would suggest a selection that is not kept).
    CURSOR_FOCUS_ONLY: ClassVar[bool] = False
    #: Blank cells either side of each cell.
    CELL_PADDING: ClassVar[int] = 1

    class RowHighlighted(Message):
        """The row under the cursor is another row (by key) than before:
        the cursor moved (`moved`), or other rows came under it (a refresh)."""

        def __init__(self, table: LineTable[Any], key: Hashable, index: int,
                     moved: bool = True) -> None:
            super().__init__()
            self.table = table
            self.key = key
            self.index = index
            self.moved = moved

        @property
        def control(self) -> LineTable[Any]:
            """The table (for `@on(..., selector)`)."""
            return self.table

        def can_replace(self, message: Message) -> bool:
            """Only the newest highlight of a table matters."""
            return isinstance(message, LineTable.RowHighlighted) and message.table is self.table

    class RowSelected(Message):
        """Enter, or a click on the row already under the cursor."""

        def __init__(self, table: LineTable[Any], key: Hashable, index: int) -> None:
            super().__init__()
            self.table = table
            self.key = key
            self.index = index

        @property
        def control(self) -> LineTable[Any]:
            """The table (for `@on(..., selector)`)."""
            return self.table

    class HeaderClicked(Message):
        """A column header was clicked (tables sort on it)."""

        def __init__(self, table: LineTable[Any], column: str) -> None:
            super().__init__()
            self.table = table
            self.column = column

        @property
        def control(self) -> LineTable[Any]:
            """The table (for `@on(..., selector)`)."""
            return self.table

    def __init__(self, *, id: str | None = None, classes: str | None = None) -> None:
        super().__init__(id=id, classes=classes)
        #: Keep the cursor on its row key across refreshes (htop's follow);
        #: otherwise it keeps its position.
        self.follow = False
        #: Draw the cursor at all (see also `CURSOR_FOCUS_ONLY`).
        self.show_cursor = True
        #: Lines drawn (strip cache misses) since the table was made: what a
        #: refresh really cost, for tests and benchmarks.
        self.lines_rendered = 0
        self._table_columns: tuple[Column, ...] = ()
        self._rows: KeyedRows[KeyT] = KeyedRows()
        # Bumped when what `render_cell` draws changes without the values
        # changing (new columns, `refresh_cells`): part of every cache key.
        self._generation = 0
        self._cursor = 0
        self._hover: int | None = None
        # The key last announced by `RowHighlighted`: what "the row under the
        # cursor" was, even while the rows are being replaced.
        self._highlighted: KeyT | None = None
        self._layouts: dict[int, ColumnLayout] = {}
        # Both hold packed segments (`StylePool`): lines with their cell length.
        self._styles = StylePool()
        self._cells: PlainLru[tuple[object, ...], tuple[Packed, ...]] = PlainLru(4096)
        self._lines: PlainLru[tuple[object, ...], tuple[Packed, int]] = PlainLru(1024)
        self._pass: _Pass | None = None
        self._table_styles: _Styles | None = None

    # --- columns ----------------------------------------------------------

    def set_columns(self, columns: Sequence[Column | tuple[str, str, int]]) -> None:
        """(Re)define the columns (`Column`s or `(key, label, width)`); drops all rows.

        The cursor keeps its position (and, with `follow`, its key) for the
        rows synced next.
        """
        self._table_columns = tuple(c if isinstance(c, Column) else Column(*c) for c in columns)
        self._layouts.clear()
        self._generation += 1
        self._rows.clear()
        # The virtual size once the caller's rows are in (a sync follows new
        # columns): an empty table in between would lay the screen out twice.
        self.call_later(self._update_virtual_size)
        self.refresh()

    def set_column_label(self, key: str, label: str | Text) -> None:
        """Change a column's header label in place."""
        self._table_columns = tuple(
            Column(c.key, label, c.width, c.flex) if c.key == key else c for c in self._table_columns
        )
        self._generation += 1
        if self.SHOW_HEADER:
            self.refresh(Region(0, 0, self.size.width, 1))

    @property
    def column_keys(self) -> list[str]:
        """The keys of the columns, left to right."""
        return [c.key for c in self._table_columns]

    def render_cell(self, column: str, value: Hashable) -> Text:
        """Turn one raw value into what the cell shows (override).

        The result must depend on `column` and `value` only (cells are cached
        by them); call `refresh_cells` when something else it reads changes.
        A `\\n` starts the cell's next line (for tables of 2-line rows).
        """
        return Text(str(value), end="")

    def refresh_cells(self) -> None:
        """Re-render every cell (after a change `render_cell` depends on)."""
        self._generation += 1
        self.refresh()

    def get_cell(self, key: KeyT, column: str) -> Text:
        """What the cell of row `key` in `column` shows (KeyError if none)."""
        values = self._rows.values(key)
        return self.render_cell(column, values[self.column_keys.index(column)])

    # --- rows -------------------------------------------------------------

    @property
    def row_keys_in_order(self) -> list[KeyT]:
        """The keys of the rows, top to bottom."""
        return list(self._rows.keys)

    @property
    def row_count(self) -> int:
        """The number of rows."""
        return len(self._rows)

    def sync_rows(self, rows: Sequence[KeyedRow[KeyT]]) -> None:
        """Make the table show `rows`, in this order; redraw only what changed.

        Keys must be unique (ValueError otherwise).
        """
        old_keys = self._rows.keys
        reordered, changed = self._rows.sync(rows)
        self._update_virtual_size()
        before = self._cursor
        self._place_cursor()
        self._refresh_synced(old_keys, reordered, changed, before)
        self._announce(moved=False)

    def _refresh_synced(self, old_keys: list[KeyT], reordered: bool, changed: list[KeyT],
                        cursor_before: int) -> None:
        """Redraw what a sync changed: the rows whose values changed, the cursor's
        old and new rows, and after a re-sort only the positions in view that
        show another row now (two rows that swap places redraw two rows, not
        the table: a whole pane's redraw is most of what a screen update
        costs). When most positions in view moved, the rows in view are
        redrawn at once (not the header, the border, or the empty lines
        below them), and nothing row by row."""
        rows = [cursor_before, self._cursor] if self._cursor != cursor_before else []
        if reordered:
            keys = self._rows.keys
            in_view = self._rows_in_view(max(len(keys), len(old_keys)))
            moved = [i for i in in_view
                     if i >= len(keys) or i >= len(old_keys) or keys[i] != old_keys[i]]
            if len(moved) * 2 > len(in_view):
                self._refresh_rows(in_view)
                return
            rows += moved
        index = self._rows.index
        rows += [i for i in map(index, changed) if i is not None]
        for i in rows:
            self._refresh_row(i)

    def _rows_in_view(self, count: int) -> range:
        """The positions of the rows (of `count`) whose lines are in view."""
        first = self.scroll_offset.y // self.ROW_HEIGHT
        shown = -(-max(0, self._body_height()) // self.ROW_HEIGHT) + 1
        return range(first, min(count, first + shown))

    def _place_cursor(self) -> None:
        """After a sync: the same key if following it, else the same position."""
        if self.follow and self._highlighted is not None:
            index = self._rows.index(self._highlighted)
            if index is not None:
                self._cursor = index
                self._scroll_to_cursor()
                return
        self._cursor = max(0, min(self._cursor, len(self._rows) - 1))

    # --- the cursor ---------------------------------------------------------

    @property
    def cursor_row(self) -> int:
        """The position of the cursor (0 in an empty table)."""
        return self._cursor

    @property
    def cursor_key(self) -> KeyT | None:
        """The key of the row under the cursor, if any."""
        keys = self._rows.keys
        return keys[self._cursor] if keys else None

    def move_cursor(self, row: int, *, scroll: bool = True) -> None:
        """Put the cursor on the row at position `row` (clamped)."""
        row = max(0, min(row, len(self._rows) - 1))
        if row != self._cursor:
            self._refresh_row(self._cursor)
            self._cursor = row
            self._refresh_row(row)
        if scroll:
            self._scroll_to_cursor()
        self._announce()

    def move_to_key(self, key: KeyT, *, scroll: bool = True) -> bool:
        """Put the cursor on the row with `key`; False if there is no such row."""
        index = self._rows.index(key)
        if index is None:
            return False
        self.move_cursor(index, scroll=scroll)
        return True

    def _announce(self, *, moved: bool = True) -> None:
        key = self.cursor_key
        if key is not None and key != self._highlighted:
            self._highlighted = key
            self.post_message(self.RowHighlighted(self, key, self._cursor, moved))

    def _cursor_shown(self) -> bool:
        return self.show_cursor and (self.has_focus or not self.CURSOR_FOCUS_ONLY)

    @property
    def _header_height(self) -> int:
        return 1 if self.SHOW_HEADER else 0

    def _body_height(self) -> int:
        """Lines of rows in view."""
        return self.scrollable_content_region.height - self._header_height

    def _page_rows(self) -> int:
        return max(1, self._body_height() // self.ROW_HEIGHT)

    def _scroll_to_cursor(self) -> None:
        body = self._body_height()
        if body <= 0 or not self._rows:
            return
        top = self._cursor * self.ROW_HEIGHT
        bottom = top + self.ROW_HEIGHT
        y = self.scroll_offset.y
        if top < y:
            y = top
        elif bottom > y + body:
            y = bottom - body
        if y != self.scroll_offset.y:
            self.scroll_to(y=y, animate=False, force=True)

    def action_cursor_up(self) -> None:
        """One row up."""
        self.move_cursor(self._cursor - 1)

    def action_cursor_down(self) -> None:
        """One row down."""
        self.move_cursor(self._cursor + 1)

    def action_page_up(self) -> None:
        """One screenful up."""
        self.move_cursor(self._cursor - self._page_rows())

    def action_page_down(self) -> None:
        """One screenful down."""
        self.move_cursor(self._cursor + self._page_rows())

    def action_first_row(self) -> None:
        """The first row."""
        self.move_cursor(0)

    def action_last_row(self) -> None:
        """The last row."""
        self.move_cursor(len(self._rows) - 1)

    def action_select_cursor(self) -> None:
        """Post `RowSelected` for the row under the cursor."""
        key = self.cursor_key
        if key is not None:
            self.post_message(self.RowSelected(self, key, self._cursor))

    # --- mouse and focus ------------------------------------------------------

    def _row_at(self, y: int) -> int | None:
        """The row index at line `y` of the content area (below the header)."""
        line = y - self._header_height
        if line < 0:
            return None
        row = (line + self.scroll_offset.y) // self.ROW_HEIGHT
        return row if row < len(self._rows) else None

    def _column_at(self, x: int) -> str | None:
        layout = self._layout(self.scrollable_content_region.width)
        x += self.scroll_offset.x
        for column, start, width in zip(self._table_columns, layout.offsets, layout.widths,
                                        strict=True):
            if start <= x < start + width:
                return column.key
        return None

    def on_click(self, event: events.Click) -> None:
        """A header sorts; a row moves the cursor, a second click selects it."""
        offset = event.get_content_offset(self)
        if offset is None:
            return
        if offset.y < self._header_height:
            column = self._column_at(offset.x)
            if column is not None:
                event.stop()
                self.post_message(self.HeaderClicked(self, column))
            return
        row = self._row_at(offset.y)
        if row is None or not self.show_cursor:
            return
        event.stop()
        if row == self._cursor:
            self.action_select_cursor()
        else:
            self.move_cursor(row)

    def on_mouse_move(self, event: events.MouseMove) -> None:
        """The row under the mouse is drawn hovered."""
        offset = event.get_content_offset(self)
        self._set_hover(self._row_at(offset.y) if offset is not None else None)

    def on_leave(self, _: events.Leave) -> None:
        """The mouse left: no row hovered."""
        self._set_hover(None)

    def _set_hover(self, row: int | None) -> None:
        if row != self._hover:
            if self._hover is not None:
                self._refresh_row(self._hover)
            self._hover = row
            if row is not None:
                self._refresh_row(row)

    def on_focus(self) -> None:
        """The cursor may be drawn differently (or only) while focused."""
        self._refresh_row(self._cursor)

    def on_blur(self) -> None:
        """See `on_focus`."""
        self._refresh_row(self._cursor)

    def on_resize(self, _: events.Resize) -> None:
        """Flexible columns take the new width; the cursor stays in view."""
        self._scroll_to_cursor()
        self.refresh()

    # --- drawing ----------------------------------------------------------------

    def _layout(self, width: int) -> ColumnLayout:
        """Column widths and offsets at a table width (flexible columns filled)."""
        layout = self._layouts.get(width)
        if layout is not None:
            return layout
        layout = layout_columns(self._table_columns, width, self.CELL_PADDING)
        if len(self._layouts) > 8:
            self._layouts.clear()
        self._layouts[width] = layout
        return layout

    def _update_virtual_size(self) -> None:
        # The virtual width is the narrowest the columns can be: flexible
        # columns then fill whatever is in view, and there is nothing to
        # scroll sideways unless the view is narrower than that.
        pad = 2 * self.CELL_PADDING
        width = sum(c.width + pad for c in self._table_columns)
        height = self._header_height + len(self._rows) * self.ROW_HEIGHT
        size = Size(width, height)
        if size == self.virtual_size:
            return
        if not self._scrollbars_stay(size):
            self.virtual_size = size  # lays the screen out again
            return
        # Only the length of the scroll changed: the scrollbar is told, and
        # no layout is asked for (Textual lays out the whole screen and
        # repaints what moved at every change of a virtual size: 15-30 ms
        # for a task whose stacks are one row more than the last one's).
        self.set_reactive(LineTable.virtual_size, size)
        if self.show_vertical_scrollbar:
            self.vertical_scrollbar.window_virtual_size = height
        if self.scroll_offset.y > self.max_scroll_y:
            self.scroll_to(y=self.max_scroll_y, animate=False, force=True)

    def _scrollbars_stay(self, size: Size) -> bool:
        """A virtual size of `size` would show the same scrollbars as now (the
        width unchanged, the height on the same side of the view's, by a margin
        of a horizontal scrollbar)."""
        view = self.container_size
        styles = self.styles
        if (not view or size.width != self.virtual_size.width
                or styles.overflow_x != "auto" or styles.overflow_y != "auto"):
            return False
        if self.show_vertical_scrollbar:
            return size.height > view.height
        return size.height <= view.height - styles.scrollbar_size_horizontal

    def _refresh_rows(self, rows: range) -> None:
        """Redraw the lines of `rows` (positions) as one region, if any is in view."""
        y = self._header_height + rows.start * self.ROW_HEIGHT - self.scroll_offset.y
        height = len(rows) * self.ROW_HEIGHT
        if height and y + height > self._header_height and y < self.size.height:
            self.refresh(Region(0, y, self.size.width, height))

    def _refresh_row(self, row: int) -> None:
        """Redraw the lines of row `row` if they are in view."""
        self._refresh_rows(range(row, row + 1))

    def notify_style_update(self) -> None:
        """Styles changed (focus, a class, the theme): derive them again at the next pass."""
        super().notify_style_update()
        self._table_styles = None

    def _styles_now(self) -> _Styles:
        base = self.rich_style
        styles = self._table_styles
        if styles is None or styles.source != base:
            component = self.get_component_rich_style
            styles = self._table_styles = _Styles(
                source=base,
                base=_LineStyle(base),
                cursor=_LineStyle.over(base, component("line-table--cursor")),
                hover=_LineStyle.over(base, component("line-table--hover")),
                header=base + component("line-table--header"),
            )
        return styles

    def _pass_state(self) -> _Pass:
        state = self._pass
        if state is None:
            styles = self._styles_now()
            scroll_x, scroll_y = self.scroll_offset
            state = self._pass = _Pass(
                base=styles.base,
                cursor=styles.cursor,
                hover=styles.hover,
                header=styles.header,
                cursor_shown=self._cursor_shown(),
                width=self.size.width,
                layout=self._layout(self.scrollable_content_region.width),
                scroll_x=scroll_x,
                scroll_y=scroll_y,
            )
        return state

    def render_lines(self, crop: Region) -> list[Strip]:
        """Read the styles and geometry once for the lines of this pass."""
        self._pass = None
        try:
            return super().render_lines(crop)
        finally:
            self._pass = None

    def render_line(self, y: int) -> Strip:
        """Line `y` of the view: the header, a line of a row, or blank."""
        state = self._pass_state()
        if y < self._header_height:
            return self._header_line(state)
        row, sub = divmod(y - self._header_height + state.scroll_y, self.ROW_HEIGHT)
        rows = self._rows
        if row >= len(rows):
            return Strip.blank(state.width, state.base.pre)
        key = rows.keys[row]
        if row == self._cursor and state.cursor_shown:
            style = state.cursor
        elif row == self._hover:
            style = state.hover
        else:
            style = state.base
        cache_key = (key, rows.version(key), sub, state.layout.widths, self._generation,
                     style, state.scroll_x, state.width)
        line = self._lines.get(cache_key)
        if line is None:
            self.lines_rendered += 1
            cells = [
                self._cell_line(column.key, value, width, sub)
                for column, value, width in zip(self._table_columns, rows.values(key),
                                                state.layout.widths, strict=True)
            ]
            return self._keep_line(cache_key, self._strip(cells, style, state))
        return Strip(self._styles.unpack(line[0]), line[1])

    def _header_line(self, state: _Pass) -> Strip:
        cache_key = ("\0header", self._generation, state.layout.widths, state.header,
                     state.scroll_x, state.width)
        line = self._lines.get(cache_key)
        if line is None:
            # Labels are cropped, not ellipsized: a sort mark that does not fit
            # is dropped rather than the label's last letter.
            cells = [
                cell_lines(Text(c.label, overflow="crop") if isinstance(c.label, str)
                           else c.label, w, 1, self.app.console)[0]
                for c, w in zip(self._table_columns, state.layout.widths, strict=True)
            ]
            return self._keep_line(cache_key, self._strip(cells, _LineStyle(state.header), state))
        return Strip(self._styles.unpack(line[0]), line[1])

    def _keep_line(self, cache_key: tuple[object, ...], strip: Strip) -> Strip:
        """Cache `strip` packed (see the module docstring); return it."""
        pool = self._styles
        if pool.full:  # numbers given out are in both caches
            pool.clear()
            self._lines.clear()
            self._cells.clear()
        self._lines.set(cache_key, (pool.pack(strip), strip.cell_length))
        return strip

    def _strip(self, cells: Iterable[tuple[Segment, ...]], style: _LineStyle,
               state: _Pass) -> Strip:
        """Padded cells, styled, extended with the line's style to the view's
        width (a cursor spans the whole line) and scrolled sideways."""
        pad = Segment(" " * self.CELL_PADDING)
        segments: list[Segment] = []
        for cell in cells:
            segments.append(pad)
            segments.extend(cell)
            segments.append(pad)
        fill = style.pre + style.post if style.post is not None else style.pre
        total, width, scroll_x = state.layout.total, state.width, state.scroll_x
        styled = list(Segment.simplify(Segment.apply_style(segments, style.pre, style.post)))
        if scroll_x == 0 and total <= width:
            if total < width:
                styled.append(Segment(" " * (width - total), fill))
            return Strip(styled, width)
        return Strip(styled, total).crop_extend(scroll_x, scroll_x + width, fill)

    def _cell_line(self, column: str, value: Hashable, width: int, sub: int
                   ) -> tuple[Segment, ...]:
        """Line `sub` of a cell at `width`; the cell's lines are cached by its column
        and value (a row's other lines ask for the same cell)."""
        cache_key = (column, type(value), value, width, self._generation)
        packed = self._cells.get(cache_key)
        if packed is None:
            lines = cell_lines(self.render_cell(column, value), width, self.ROW_HEIGHT,
                               self.app.console)
            pool = self._styles
            if not pool.full:  # else the next line kept empties the pool first
                self._cells.set(cache_key, tuple(pool.pack(line) for line in lines))
            return lines[sub]
        return tuple(self._styles.unpack(packed[sub]))
