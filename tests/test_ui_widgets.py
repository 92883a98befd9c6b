"""The widgets' own logic: keyed diffs, the slider's scale, callchain merging,
key hints, rendering of untrusted text, and the synthetic data behind the UI tests."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Hashable
from pathlib import Path
from typing import Any

import pytest
from rich.text import Text
from textual import events
from textual.app import App, ComposeResult
from textual.containers import Container
from textual.geometry import Region
from textual.strip import Strip
from textual.widget import Widget

from offtop.model import (
    CaptureStats,
    Frame,
    LongBlock,
    RowKey,
    Snapshot,
    SnapshotIndex,
    StackRow,
    TaskRow,
)
from offtop.safe_text import printable
from offtop.synthetic import synthetic_snapshots
from offtop.units import MAX_THRESHOLD_NS
from offtop.widgets.arrivals import Taken
from offtop.widgets.blocked_now import BlockedNowTable
from offtop.widgets.callchain_tree import merge_stacks, stack_path
from offtop.widgets.choice_screen import ChoiceScreen
from offtop.widgets.flame_graph import KERNEL, PYTHON, USER, FlameTree
from offtop.widgets.header import OfftopHeader, problems_text
from offtop.widgets.key_bar import KeyBar
from offtop.widgets.line_table import (
    Column,
    KeyedRow,
    KeyedRows,
    LineTable,
    PlainLru,
    StylePool,
    layout_columns,
)
from offtop.widgets.long_blocks_log import LongBlocksLog
from offtop.widgets.render import (
    KERNEL_STYLE,
    MARK_STYLE,
    PYTHON_STYLE,
    UNKNOWN_STYLE,
    USER_STYLE,
    TitledPane,
    chain_summary,
    frame_style,
    frame_text,
    set_titles,
    task_label,
)
from offtop.widgets.scopes import ALL, NOTHING, Scope, ScopeStacks
from offtop.widgets.stacks_pane import ViewData
from offtop.widgets.task_table import SortSpec, TaskTable
from offtop.widgets.threshold_pane import ThresholdInput, ThresholdPane
from offtop.widgets.threshold_slider import (
    HIGH_NS,
    STEPS,
    ThresholdSlider,
    cell_of,
    step_down,
    step_up,
    value_at,
)
from offtop.widgets.view_export import export_name, write_view


class NumberTable(LineTable):
    """A line table of (name, value) rows that counts what it draws."""

    def __init__(self) -> None:
        super().__init__()
        self.drawn: list[int] = []
        self.cells_rendered = 0

    def on_mount(self) -> None:
        self.set_columns([("name", "NAME", 8), ("value", "VALUE", 8)])

    def render_cell(self, column: str, value: Hashable) -> Text:
        self.cells_rendered += 1
        return Text(str(value), end="")

    def render_line(self, y: int) -> Strip:
        self.drawn.append(y)
        return super().render_line(y)


class TwoLineTable(LineTable):
    """Rows of two lines, no header, a cursor only while focused."""

    ROW_HEIGHT = 2
    SHOW_HEADER = False
    CURSOR_FOCUS_ONLY = True

    def on_mount(self) -> None:
        self.set_columns([Column("what", "WHAT", 10, flex=True)])


class TableApp(App[None]):
    """A table and the messages it posts."""

    def __init__(self, table: LineTable) -> None:
        super().__init__()
        self.table = table
        self.highlighted: list[str] = []
        self.moved: list[bool] = []
        self.selected: list[str] = []
        self.headers: list[str] = []

    def compose(self) -> ComposeResult:
        yield self.table

    def on_line_table_row_highlighted(self, event: LineTable.RowHighlighted) -> None:
        self.highlighted.append(event.key)
        self.moved.append(event.moved)

    def on_line_table_row_selected(self, event: LineTable.RowSelected) -> None:
        self.selected.append(event.key)

    def on_line_table_header_clicked(self, event: LineTable.HeaderClicked) -> None:
        self.headers.append(event.column)


def screen_lines(table: LineTable) -> list[str]:
    """What the table draws now, line by line (trailing blanks dropped)."""
    return [table.render_line(y).text.rstrip() for y in range(table.size.height)]


def backgrounds(table: LineTable, y: int) -> set[object]:
    """The background colours of line `y` as drawn."""
    return {segment.style.bgcolor for segment in table.render_line(y) if segment.style}


def random_rounds(seed: int, rounds: int = 12) -> list[list[KeyedRow]]:
    rng = random.Random(seed)
    out = []
    for _ in range(rounds):
        keys = rng.sample(range(60), rng.randrange(0, 40))
        out.append([(f"k{k}", (f"n{k}", rng.randrange(5))) for k in keys])
    return out


def test_keyed_rows_version_rows_by_their_values() -> None:
    rows = KeyedRows()
    assert rows.sync([("a", (1,)), ("b", (2,))]) == (True, ["a", "b"])
    a, b = rows.version("a"), rows.version("b")
    # Same rows, same order: nothing changed, nothing redrawn.
    assert rows.sync([("a", (1,)), ("b", (2,))]) == (False, [])
    assert (rows.version("a"), rows.version("b")) == (a, b)
    # A re-sort changes the order only; a new value changes its row's version only.
    assert rows.sync([("b", (2,)), ("a", (3,))]) == (True, ["a"])
    assert rows.version("b") == b and rows.version("a") not in (a, b)
    assert rows.keys == ["b", "a"] and rows.index("a") == 1 and rows.values("a") == (3,)
    # A row that goes and comes back is new again.
    rows.sync([("b", (2,))])
    assert rows.index("a") is None
    assert rows.sync([("b", (2,)), ("a", (3,))]) == (True, ["a"])
    with pytest.raises(ValueError):
        rows.sync([("a", (1,)), ("a", (1,))])


def test_flexible_columns_share_the_width() -> None:
    columns = [Column("a", "A", 4), Column("b", "B", 5, flex=True), Column("c", "C", 2),
               Column("d", "D", 3, flex=True)]
    # Padded: 6 + 7 + 4 + 5 = 22; 9 cells to share between b and d.
    layout = layout_columns(columns, 31, padding=1)
    assert layout.widths == (4, 10, 2, 7)
    assert layout.offsets == (0, 6, 18, 22) and layout.total == 31
    # Narrower than the columns: their own widths (the table scrolls sideways).
    assert layout_columns(columns, 10, padding=1).widths == (4, 5, 2, 3)


async def test_line_table_shows_the_rows_it_is_given() -> None:
    app = TableApp(NumberTable())
    async with app.run_test(size=(40, 50)) as pilot:
        table = app.table
        for rows in random_rounds(seed=7):
            table.sync_rows(rows)
            await pilot.pause()
            assert table.row_keys_in_order == [k for k, _ in rows]
            assert table.row_count == len(rows)
            want = [f" {name:<8}  {value:<8}".rstrip() for _, (name, value) in rows]
            lines = screen_lines(table)
            assert lines[0].split() == ["NAME", "VALUE"]
            assert lines[1:1 + len(rows)] == want
            assert not any(lines[1 + len(rows):])
            for key, (_, value) in rows:
                assert table.get_cell(key, "value").plain == str(value)
        with pytest.raises(ValueError):
            table.sync_rows([("a", ("a", 1)), ("a", ("a", 2))])


async def number_table(app: TableApp, pilot: Any, count: int
                       ) -> tuple[NumberTable, list[tuple[str, tuple[str, int]]]]:
    """The app's NumberTable showing `count` rows (key kI, name nI, value I), drawn."""
    table = app.table
    assert isinstance(table, NumberTable)
    rows = [(f"k{i}", (f"n{i}", i)) for i in range(count)]
    table.sync_rows(rows)
    await pilot.pause()
    return table, rows


async def test_line_table_redraws_only_the_rows_that_changed() -> None:
    app = TableApp(NumberTable())
    async with app.run_test(size=(40, 50)) as pilot:
        table, rows = await number_table(app, pilot, 40)
        table.drawn.clear()
        lines, cells = table.lines_rendered, table.cells_rendered
        # A tick that changes 3 rows, in place: 3 lines and 3 cells drawn.
        changed = {5, 17, 30}
        table.sync_rows([(k, (n, v + 100 if i in changed else v))
                         for i, (k, (n, v)) in enumerate(rows)])
        await pilot.pause()
        assert table.lines_rendered - lines == 3
        assert table.cells_rendered - cells == 3
        assert sorted(set(table.drawn)) == [1 + i for i in sorted(changed)]
        # A re-sort of unchanged rows draws no cell, and only the lines of the
        # rows that come to and leave the cursor (at its position, 0).
        rows = [(k, (n, v + 100 if i in changed else v)) for i, (k, (n, v)) in enumerate(rows)]
        lines, cells = table.lines_rendered, table.cells_rendered
        table.sync_rows(rows[::-1])
        await pilot.pause()
        assert screen_lines(table)[1].split() == ["n39", "39"]
        assert table.lines_rendered - lines == 2
        assert table.cells_rendered == cells


async def test_a_resort_of_most_rows_redraws_their_lines_not_the_header_or_the_blank_ones(
        ) -> None:
    app = TableApp(NumberTable())
    async with app.run_test(size=(40, 50)) as pilot:
        table, rows = await number_table(app, pilot, 5)
        table.drawn.clear()
        table.sync_rows(rows[::-1])
        await pilot.pause()
        assert sorted(set(table.drawn)) == [1, 2, 3, 4, 5]
        assert screen_lines(table)[1:3] == [" n4        4", " n3        3"]


class TitledBox(TitledPane):
    """A bordered pane of ten lines."""

    DEFAULT_CSS = "TitledBox { border: round white; height: 10; }"


class PlainBox(Widget):
    DEFAULT_CSS = "PlainBox { border: round white; height: 10; }"


class BoxesApp(App[None]):
    def compose(self) -> ComposeResult:
        yield TitledBox()
        yield PlainBox()


async def test_a_titled_panes_new_titles_redraw_its_border_lines_only(
        monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[tuple[Widget, tuple[Region, ...]]] = []
    refresh = Widget.refresh

    def recording(self: Widget, *regions: Region, **kw: Any) -> Any:
        asked.append((self, regions))
        return refresh(self, *regions, **kw)

    monkeypatch.setattr(Widget, "refresh", recording)
    app = BoxesApp()
    async with app.run_test(size=(40, 20)) as pilot:
        box, plain = app.query_one(TitledBox), app.query_one(PlainBox)
        await pilot.pause()
        asked.clear()
        set_titles(box, "NEWTITLE42", "SUB7")
        set_titles(plain, "PLAINTITLE", "")
        lines = {(r.y, r.height) for w, regions in asked if w is box for r in regions}
        assert lines == {(-1, 1), (8, 1)}  # content coordinates: the border's top, bottom
        assert [regions for w, regions in asked if w is plain] == [()]  # Textual's own: whole
        await pilot.pause()
        screen = app.export_screenshot()
        assert "NEWTITLE42" in screen and "SUB7" in screen and "PLAINTITLE" in screen
        # Other refreshes of the pane are whole, as ever.
        asked.clear()
        box.refresh()
        assert [regions for w, regions in asked if w is box] == [()]


async def test_rows_that_swap_places_redraw_those_two_rows_not_the_table() -> None:
    app = TableApp(NumberTable())
    async with app.run_test(size=(40, 50)) as pilot:
        table, rows = await number_table(app, pilot, 40)
        # A tick where two tasks trade places (top's most common change).
        rows[5], rows[6] = rows[6], rows[5]
        table.drawn.clear()
        table.sync_rows(rows)
        await pilot.pause()
        assert sorted(set(table.drawn)) == [6, 7]
        assert screen_lines(table)[6:8] == [" n6        6", " n5        5"]
        # Rows gone from the end: their lines are drawn blank; the rest stay.
        table.drawn.clear()
        table.sync_rows(rows[:38])
        await pilot.pause()
        assert sorted(set(table.drawn)) == [39, 40]
        assert not any(screen_lines(table)[39:41])
    # Scrolled down, rows in view that move are redrawn where they are seen.
    app = TableApp(NumberTable())
    async with app.run_test(size=(40, 12)) as pilot:
        small, rows = await number_table(app, pilot, 100)
        small.scroll_to(y=50, animate=False)
        await pilot.pause()
        top = small.scroll_offset.y
        rows[top + 2], rows[top + 3] = rows[top + 3], rows[top + 2]
        small.drawn.clear()
        small.sync_rows(rows)
        await pilot.pause()
        assert sorted(set(small.drawn)) == [3, 4]
        assert screen_lines(small)[3].split() == [f"n{top + 3}", str(top + 3)]


async def test_a_line_table_scrolls_further_or_less_without_laying_the_screen_out(
        monkeypatch: pytest.MonkeyPatch) -> None:
    table = NumberTable()
    app = TableApp(table)
    async with app.run_test(size=(40, 12)) as pilot:
        table.sync_rows([(f"r{i}", (f"r{i}", i)) for i in range(100)])
        await pilot.pause()
        assert table.show_vertical_scrollbar
        layouts: list[bool] = []
        original = table.refresh

        def spy(*regions: object, **kwargs: bool) -> object:
            layouts.append(bool(kwargs.get("layout")))
            return original(*regions, **kwargs)

        monkeypatch.setattr(table, "refresh", spy)
        table.action_last_row()
        await pilot.pause()
        assert table.scroll_offset.y == table.max_scroll_y == 101 - 12
        # Fewer rows, still more than fit: the scroll is shorter, the view
        # moves up to its new end, the scrollbar says so; no layout.
        table.sync_rows([(f"r{i}", (f"r{i}", i)) for i in range(60)])
        await pilot.pause()
        assert not any(layouts)
        assert table.virtual_size.height == 61 and table.max_scroll_y == 61 - 12
        assert table.scroll_offset.y == table.max_scroll_y
        assert table.vertical_scrollbar.window_virtual_size == 61
        assert screen_lines(table)[-1].split() == ["r59", "59"]
        # So few that the scrollbar goes: then the screen is laid out again.
        table.sync_rows([(f"r{i}", (f"r{i}", i)) for i in range(3)])
        await pilot.pause()
        assert any(layouts) and not table.show_vertical_scrollbar
        assert table.scroll_offset.y == 0 and screen_lines(table)[1].split() == ["r0", "0"]


async def test_line_table_cursor_keeps_its_position_or_follows_its_key() -> None:
    app = TableApp(NumberTable())
    async with app.run_test(size=(40, 20)) as pilot:
        table = app.table
        rows = [(f"k{i}", (f"n{i}", i)) for i in range(10)]
        table.sync_rows(rows)
        await pilot.pause()
        assert app.highlighted == ["k0"]
        assert table.move_to_key("k3") and not table.move_to_key("nope")
        await pilot.pause()
        assert app.highlighted == ["k0", "k3"]
        # htop: the cursor stays on its row; the row under it is another task.
        table.sync_rows(rows[::-1])
        await pilot.pause()
        assert (table.cursor_row, table.cursor_key) == (3, "k6")
        assert app.highlighted[-1] == "k6"
        # Fewer rows than the cursor's position: it goes to the last one.
        table.sync_rows(rows[:2])
        assert (table.cursor_row, table.cursor_key) == (1, "k1")
        # Follow mode: the cursor stays on its key, wherever the row goes.
        table.follow = True
        table.sync_rows(rows)
        assert table.move_to_key("k3")
        table.sync_rows(rows[::-1])
        assert (table.cursor_row, table.cursor_key) == (6, "k3")
        # ... and at its position when its key is gone.
        table.sync_rows([r for r in rows if r[0] != "k3"])
        assert table.cursor_row == 6 and table.cursor_key == "k7"
        await pilot.pause()
        assert app.highlighted[-1] == "k7"


async def test_line_table_keys_and_mouse() -> None:
    app = TableApp(NumberTable())
    async with app.run_test(size=(40, 12)) as pilot:
        table = app.table
        table.sync_rows([(f"k{i}", (f"n{i}", i)) for i in range(50)])
        table.focus()
        await pilot.pause()
        page = table.size.height - 1  # rows in view under the header
        await pilot.press("down", "down")
        assert table.cursor_row == 2
        await pilot.press("pagedown")
        assert table.cursor_row == 2 + page
        assert table.scroll_offset.y == table.cursor_row + 1 - page  # scrolled into view
        await pilot.press("end")
        assert table.cursor_key == "k49"
        await pilot.press("pageup", "up")
        assert table.cursor_row == 49 - page - 1
        await pilot.press("home", "enter")
        await pilot.pause()
        assert table.cursor_row == 0 and table.scroll_offset.y == 0
        assert app.selected == ["k0"]
        # A click moves the cursor, a second click on it selects.
        await pilot.click(NumberTable, offset=(2, 3))
        assert table.cursor_key == "k2" and app.selected == ["k0"]
        await pilot.click(NumberTable, offset=(2, 3))
        await pilot.pause()
        assert app.selected == ["k0", "k2"]
        # A header click names its column.
        await pilot.click(NumberTable, offset=(12, 0))
        await pilot.pause()
        assert app.headers == ["value"]
        # The row under the mouse is drawn hovered; it moves with the mouse.
        plain = backgrounds(table, 6)
        await pilot.hover(NumberTable, offset=(2, 5))
        await pilot.pause()
        assert backgrounds(table, 5) != plain == backgrounds(table, 6)
        await pilot.hover(NumberTable, offset=(2, 6))
        await pilot.pause()
        assert backgrounds(table, 6) != plain == backgrounds(table, 5)
        # The wheel scrolls the view, not the cursor.
        table.post_message(events.MouseScrollDown(table, 2, 3, 0, 1, 0, False, False, False))
        await pilot.pause()
        assert table.scroll_offset.y > 0 and table.cursor_key == "k2"


async def test_two_line_rows_and_a_cursor_only_while_focused() -> None:
    table = TwoLineTable()
    app = TableApp(table)
    async with app.run_test(size=(30, 9)) as pilot:
        table.sync_rows([(f"k{i}", (f"task {i}\nwaits in f{i}",)) for i in range(10)])
        await pilot.pause()
        assert screen_lines(table)[:4] == [" task 0", " waits in f0", " task 1", " waits in f1"]
        app.set_focus(None)
        await pilot.pause()
        assert backgrounds(table, 0) == backgrounds(table, 2)  # no cursor drawn
        table.focus()
        await pilot.pause()
        # Both lines of the cursor's row are drawn as the cursor, and only they.
        assert backgrounds(table, 0) == backgrounds(table, 1) != backgrounds(table, 2)
        assert backgrounds(table, 2) == backgrounds(table, 3)
        # The second line of a row belongs to it.
        await pilot.click(TwoLineTable, offset=(3, 3))
        assert table.cursor_key == "k1"
        await pilot.press("end")
        assert table.scroll_offset.y == 2 * 10 - table.size.height
        assert screen_lines(table)[-2:] == [" task 9", " waits in f9"]


class FadingApp(App[None]):
    """A table in a box that the app's class fades (as the panes are while loading)."""

    CSS = "FadingApp.-faded #box { opacity: 50%; }"

    def __init__(self) -> None:
        super().__init__()
        self.table = NumberTable()

    def compose(self) -> ComposeResult:
        with Container(id="box"):
            yield self.table


async def test_a_table_is_drawn_in_its_ancestors_styles_as_they_change() -> None:
    """A table keeps its line styles between render passes (deriving them is dear),
    yet a change to an ancestor alone, of which Textual gives the table no
    notice, reaches its lines: faded with the box, and back."""
    app = FadingApp()
    async with app.run_test(size=(40, 10)) as pilot:
        table = app.table
        table.sync_rows([(f"k{i}", (f"n{i}", i)) for i in range(3)])
        await pilot.pause()
        clear = backgrounds(table, 2)
        app.set_class(True, "-faded")
        await pilot.pause()
        faded = backgrounds(table, 2)
        assert faded != clear
        app.set_class(False, "-faded")
        await pilot.pause()
        assert backgrounds(table, 2) == clear


async def test_task_table_header_click_sorts() -> None:
    table = TaskTable()
    app = TableApp(table)
    snap = synthetic_snapshots(1, tasks=30, stacks=60, seed=2)[0]
    async with app.run_test(size=(120, 40)) as pilot:
        table.index = SnapshotIndex(snap)
        await pilot.pause()
        header = screen_lines(table)[0]
        await pilot.click(TaskTable, offset=(header.index("COUNT"), 0))
        await pilot.pause()
        assert table.sort_spec == SortSpec("count", True)
        counts = [t.count for t in sorted(snap.tasks, key=lambda t: t.key)]
        by_key = {t.key: t.count for t in snap.tasks}
        assert [by_key[k] for k in table.row_keys_in_order] == sorted(counts, reverse=True)
        assert "COUNT▼" in screen_lines(table)[0]
        await pilot.click(TaskTable, offset=(header.index("COUNT"), 0))
        assert table.sort_spec == SortSpec("count", False)
        assert app.headers == []  # the table handles its own header clicks


async def test_untrusted_text_in_a_table_is_literal_and_escaped() -> None:
    table = TaskTable()
    app = TableApp(table)
    evil = "evil[red]\x1b]0;PWNED\x07"
    row = TaskRow(pid=7, tid=7, comm=evil, offcpu_ns=5, count=1, max_ns=5,
                  state_ns={"S": 5}, total_ns=5)
    async with app.run_test(size=(120, 10)) as pilot:
        table.index = SnapshotIndex(Snapshot(seq=1, time=0.0, interval_s=1.0, threshold_ns=0,
                                             tasks=(row,)))
        await pilot.pause()
        assert table.get_cell(RowKey.thread(7), "comm").plain == printable(evil) == \
            "evil[red]\\x1b]0;PWNED\\x07"
        line = table.render_line(1)
        assert "evil[red]\\x1b]…" in line.text  # cut to the column, escaped
        assert "\x1b" not in line.text and "\x07" not in line.text
    # The table escapes what a careless `render_cell` lets through, too.
    plain = NumberTable()
    app = TableApp(plain)
    async with app.run_test(size=(40, 5)) as pilot:
        plain.sync_rows([("k", ("a\x1bb", "[bold]x"))])
        await pilot.pause()
        assert screen_lines(plain)[1].split() == ["a\\x1bb", "[bold]x"]

def test_slider_scale() -> None:
    # One range, the command line's: the slider never moves a threshold given
    # there the wrong way (30 s, then +, was 10 s).
    assert STEPS[0] == 0 and STEPS[-1] == HIGH_NS == MAX_THRESHOLD_NS
    assert list(STEPS) == sorted(set(STEPS))
    assert step_up(0) == 10_000 and step_up(100_000_000) == 200_000_000
    assert step_up(150_000_000) == 200_000_000 and step_up(HIGH_NS) == HIGH_NS
    assert step_up(30 * 10**9) == 60 * 10**9 and step_down(30 * 10**9) == 10 * 10**9
    assert all(step_up(ns) > ns for ns in range(0, HIGH_NS, HIGH_NS // 997))
    assert step_down(100_000_000) == 50_000_000 and step_down(10_000) == 0 and step_down(0) == 0
    width = 40
    values = [value_at(c, width) for c in range(width)]
    assert values[0] == 0 and values[1] == 10_000 and values[-1] == HIGH_NS
    assert values == sorted(values)
    for c in range(width):
        assert cell_of(values[c], width) == c
    assert cell_of(1_000_000, width) < cell_of(100_000_000, width) < cell_of(HIGH_NS, width)


def _stack(tid: int, ns: int, kernel: list[str], user: list[str]) -> StackRow:
    return StackRow(pid=1, tid=tid, comm="x", state="S", offcpu_ns=ns, count=1, max_ns=ns,
                    kernel=tuple(Frame(n, kernel=True) for n in kernel),
                    user=tuple(Frame(n) for n in user))


def test_merge_stacks_builds_an_outermost_first_prefix_tree() -> None:
    a = _stack(1, 30, ["schedule", "do_nanosleep"], ["nanosleep", "work", "main"])
    b = _stack(1, 10, ["schedule", "pipe_read"], ["read", "work", "main"])
    nodes = merge_stacks([a, b])
    assert nodes[()].ns == 40
    assert nodes[("u:main",)].ns == 40
    assert nodes[("u:main", "u:work")].ns == 40
    assert nodes[("u:main", "u:work", "u:nanosleep")].ns == 30
    leaf = stack_path(a)
    assert leaf[-1] == "k:schedule" and nodes[leaf].ns == 30
    no_kernel = merge_stacks([a, b], show_kernel=False)
    assert all(not step.startswith("k:") for p in no_kernel for step in p)
    no_user = merge_stacks([a, b], show_user=False)
    assert set(no_user) == {(), ("k:do_nanosleep",), ("k:do_nanosleep", "k:schedule"),
                            ("k:pipe_read",), ("k:pipe_read", "k:schedule")}


def test_untrusted_text_is_never_markup() -> None:
    assert task_label("evil[red]comm", 1, 2).plain == "evil[red]comm 1/2"
    f = Frame("handle[bold]request", module="lib[x].so")
    assert frame_text(f, module=True).plain == "u handle[bold]request  lib[x].so"
    chain = chain_summary((Frame("schedule", kernel=True), Frame("pipe_read", kernel=True)),
                          (f,))
    assert chain.plain == "k pipe_read ← u handle[bold]request"


class KeysApp(App[None]):
    BINDINGS = [("x", "hit", "Hit me"), ("y", "other", "Hidden")]
    hits = 0

    def compose(self) -> ComposeResult:
        yield KeyBar()

    def action_hit(self) -> None:
        self.hits += 1


async def test_key_bar_shows_bindings_and_clicks_press_them() -> None:
    app = KeysApp()
    async with app.run_test(size=(80, 5)) as pilot:
        await pilot.pause()
        bar = app.query_one(KeyBar)
        text = bar.render().plain
        assert "x Hit me" in text and "y Hidden" in text
        await pilot.click(KeyBar, offset=(text.index("Hit me"), 0))
        await pilot.pause()
        assert app.hits == 1


def test_synthetic_snapshots_are_deterministic_and_complete() -> None:
    a = synthetic_snapshots(3, tasks=40, stacks=160, seed=3)
    b = synthetic_snapshots(3, tasks=40, stacks=160, seed=3)
    assert a == b
    assert synthetic_snapshots(1, seed=4) != synthetic_snapshots(1, seed=3)
    for snap in a:
        assert snap.tasks and snap.processes and snap.stacks
        assert snap.long_blocks and snap.blocked_now
        assert snap.stats.probe_runs > 0
        assert all(t.offcpu_ns <= snap.interval_s * 1e9 for t in snap.tasks)
    assert [s.time for s in a] == [1_700_000_001.0, 1_700_000_002.0, 1_700_000_003.0]
    assert any("[" in t.comm for t in a[0].tasks)
    # Waits grow from one snapshot to the next.
    assert a[1].blocked_now[0].blocked_ns > a[0].blocked_now[0].blocked_ns


# --- frames: tags and colours ---------------------------------------------------------------

def test_frames_are_tagged_k_u_or_py_and_coloured_by_kind() -> None:
    kernel = Frame("do_nanosleep", "kernel", True)
    user = Frame("nanosleep", "libc.so.6")
    py = Frame("py:Queue.get (queue.py:171)", "/usr/lib/python3.11/queue.py")
    assert frame_text(kernel).plain == "k do_nanosleep"
    assert frame_text(user).plain == "u nanosleep"
    assert frame_text(py).plain == "py Queue.get (queue.py:171)"
    styles = {frame_style(f) for f in (kernel, user, py)}
    assert styles == {KERNEL_STYLE, USER_STYLE, PYTHON_STYLE}
    assert frame_style(Frame("[stack truncated]")) == MARK_STYLE
    assert frame_style(Frame("libfoo.so+0x1a2b", "libfoo.so")) == UNKNOWN_STYLE
    chain = chain_summary((kernel,), (user, py, Frame("py:main (app.py:3)", "app.py")))
    assert chain.plain == "k do_nanosleep ← u nanosleep ← py Queue.get (queue.py:171) ← main (app.py:3)"
    assert chain_summary((kernel,), (user,), tags=False).plain == "do_nanosleep ← nanosleep"


# --- the long-block log ---------------------------------------------------------------------

class LogApp(App[None]):
    """A long-block log and the blocks it asks to open."""

    def __init__(self) -> None:
        super().__init__()
        self.log_widget = LongBlocksLog()
        self.chosen: list[LongBlock] = []

    def compose(self) -> ComposeResult:
        yield self.log_widget

    def on_long_blocks_log_chosen(self, event: LongBlocksLog.Chosen) -> None:
        self.chosen.append(event.block)


def blocks(first: int, n: int) -> list[LongBlock]:
    return [LongBlock(time=1_700_000_000.0 + i, pid=100, tid=100 + i, comm=f"t{i}", state="S",
                      duration_ns=(i + 1) * 1_000_000) for i in range(first, first + n)]


def log_lines(log: LongBlocksLog) -> list[str]:
    return [log.render_line(y).text.rstrip() for y in range(log.size.height)]


async def test_the_log_follows_the_newest_until_moved_and_counts_all() -> None:
    app = LogApp()
    async with app.run_test(size=(60, 5)) as pilot:
        log = app.log_widget
        log.arrived = Taken(tuple(blocks(0, 8)), seen=8, lost=0, notices=())
        await pilot.pause()
        assert [line.split()[3] for line in log_lines(log)] == ["t3", "t4", "t5", "t6", "t7"]
        log.focus()
        await pilot.press("up", "up")  # the cursor moves; the view holds at the end
        log.arrived = Taken(tuple(blocks(8, 2)), seen=40, lost=3, notices=())
        await pilot.pause()
        # Moved away from the newest: new blocks do not scroll the view.
        assert [line.split()[3] for line in log_lines(log)] == ["t3", "t4", "t5", "t6", "t7"]
        assert "End: follow" in str(log.border_subtitle)
        assert log.seen == 48 and log.lost == 3
        await pilot.press("enter")
        assert [b.comm for b in app.chosen] == ["t5"]
        await pilot.press("end")
        assert [line.split()[3] for line in log_lines(log)][-1] == "t9"
        assert str(log.border_subtitle) == "48 seen · newest 10 listed · 3 lost"
        await pilot.press("home", "enter")
        assert app.chosen[-1].comm == "t0"


async def test_new_blocks_redraw_only_their_lines_while_the_view_stays(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A log with room: new blocks redraw their own lines and the newest line before
    them (a following cursor leaves it), not the lines above; once the view moves
    (the log is full), it is drawn again whole."""
    asked: list[tuple[Region, ...]] = []
    refresh = Widget.refresh

    def recording(self: Widget, *regions: Region, **kw: Any) -> Any:
        if isinstance(self, LongBlocksLog):
            asked.append(regions)
        return refresh(self, *regions, **kw)

    monkeypatch.setattr(Widget, "refresh", recording)
    app = LogApp()
    async with app.run_test(size=(60, 8)) as pilot:
        log = app.log_widget
        log.arrived = Taken(tuple(blocks(0, 3)), seen=3, lost=0, notices=())
        await pilot.pause()
        asked.clear()
        log.arrived = Taken(tuple(blocks(3, 2)), seen=2, lost=0, notices=())
        # Lines 2-4: the newest before, then the two new (and the titles' border lines).
        assert () not in asked and asked[-1] == (Region(0, 2, log.size.width, 3),), asked
        await pilot.pause()
        assert [line.split()[3] for line in log_lines(log)[:5]] == ["t0", "t1", "t2", "t3", "t4"]
        asked.clear()
        log.arrived = Taken(tuple(blocks(5, 4)), seen=4, lost=0, notices=())
        assert () in asked  # the view moved: whole
        await pilot.pause()
        assert log_lines(log)[-1].split()[3] == "t8"


async def test_the_log_keeps_the_newest_max_lines() -> None:
    app = LogApp()
    async with app.run_test(size=(60, 5)) as pilot:
        log = app.log_widget
        n = LongBlocksLog.MAX_LINES + 30
        log.arrived = Taken(tuple(blocks(0, n)), seen=n, lost=0, notices=())
        await pilot.pause()
        assert len(log.blocks) == LongBlocksLog.MAX_LINES and log.blocks[0].comm == "t30"
        log.focus()
        await pilot.press("home")
        assert log_lines(log)[0].split()[3] == "t30"


# --- the header -----------------------------------------------------------------------------

def test_problems_text_names_every_counted_error() -> None:
    assert problems_text(CaptureStats()).plain == ""
    text = problems_text(CaptureStats(drops={"start map full": 1}, truncated_stacks=2,
                                      symbol_errors={"bad ELF": 3})).plain
    assert "dropped start map full 1" in text and "2 truncated" in text
    assert "errors: bad ELF 3" in text


class HeaderApp(App[None]):
    def compose(self) -> ComposeResult:
        yield OfftopHeader()


async def test_the_header_keeps_three_lines_and_never_lays_the_screen_out_again(
        monkeypatch: pytest.MonkeyPatch) -> None:
    app = HeaderApp()
    snaps = synthetic_snapshots(3, tasks=10, stacks=20, seed=1)
    quiet = [dataclasses.replace(s, stats=CaptureStats(interval_s=1.0)) for s in snaps]
    async with app.run_test(size=(120, 5)) as pilot:
        header = app.query_one(OfftopHeader)
        layouts: list[bool] = []
        original = header.refresh

        def spy(*regions: object, **kwargs: bool) -> object:
            layouts.append(bool(kwargs.get("layout")))
            return original(*regions, **kwargs)

        monkeypatch.setattr(header, "refresh", spy)
        header.index = SnapshotIndex(quiet[0])
        header.index = SnapshotIndex(quiet[1])
        await pilot.pause()
        assert header.size.height == 3
        assert header.render().plain.split("\n")[2] == ""  # nothing to say
        header.index = SnapshotIndex(snaps[2])  # errors to say: on the third line
        await pilot.pause()
        assert "truncated" in header.render().plain.split("\n")[2]
        header.index = SnapshotIndex(quiet[2])
        await pilot.pause()
        assert not any(layouts) and header.size.height == 3


async def test_the_header_draws_again_only_the_lines_that_changed() -> None:
    """Each line is drawn from its own text, cut with an ellipsis to the width; a
    tick that leaves a line's text as it was reuses that line as drawn."""
    app = HeaderApp()
    snaps = synthetic_snapshots(3, tasks=10, stacks=20, seed=1)
    quiet = [dataclasses.replace(s, stats=CaptureStats(interval_s=1.0)) for s in snaps]
    async with app.run_test(size=(60, 5)) as pilot:
        header = app.query_one(OfftopHeader)
        header.index = SnapshotIndex(quiet[0])
        await pilot.pause()
        said = header.render().plain.split("\n")
        drawn = [header.render_line(y) for y in range(3)]
        width = header.size.width
        assert [s.cell_length for s in drawn] == [width] * 3
        for text, strip in zip(said, drawn, strict=True):  # cut to the width, or whole
            shown = strip.text.rstrip()
            assert shown == text.rstrip() or (shown.endswith("…")
                                              and text.startswith(shown[:-1])), (shown, text)
        header.index = SnapshotIndex(quiet[1])  # another time and seq: line 1 changes
        await pilot.pause()
        again = [header.render_line(y) for y in range(3)]
        assert again[0] is not drawn[0] and again[0].text != drawn[0].text
        assert again[2] is drawn[2]  # nothing new to say: drawn once


# --- the threshold pane, menus --------------------------------------------------------------

class ThresholdApp(App[None]):
    def __init__(self) -> None:
        super().__init__()
        self.asked: list[int] = []

    def compose(self) -> ComposeResult:
        yield ThresholdPane(500_000_000)

    def on_threshold_pane_changed(self, event: ThresholdPane.Changed) -> None:
        self.asked.append(event.value_ns)


async def test_the_threshold_pane_takes_typed_durations_and_slider_moves() -> None:
    app = ThresholdApp()
    async with app.run_test(size=(46, 6)) as pilot:
        box = app.query_one(ThresholdInput)
        assert box.value == "500ms"
        box.focus()
        await pilot.press(*"1.5", "enter")  # a bare number is ms
        assert app.asked == [1_500_000]
        box.focus()
        await pilot.press(*"oops", "escape")
        assert box.value == "500ms" and app.asked == [1_500_000]
        await pilot.press("right")  # Esc left the focus on the slider
        assert app.asked[-1] == 1_000_000_000
        app.query_one(ThresholdPane).value_ns = 42_000_000
        await pilot.pause()
        assert box.value == "42.0ms" and app.query_one(ThresholdSlider).value_ns == 42_000_000


class MenuApp(App[None]):
    def __init__(self) -> None:
        super().__init__()
        self.picked: list[str | None] = []

    def on_mount(self) -> None:
        self.push_screen(ChoiceScreen("Pick", [("a", "first"), ("b", "second")], current="b"),
                         self.picked.append)


async def test_a_choice_menu_returns_the_choice_or_none() -> None:
    app = MenuApp()
    async with app.run_test() as pilot:
        await pilot.press("enter")
        assert app.picked == ["b"]
        app.push_screen(ChoiceScreen("Pick", [("a", "first")]), app.picked.append)
        await pilot.pause()
        await pilot.press("escape")
        assert app.picked == ["b", None]


# --- the tables' own logic --------------------------------------------------------------

async def test_a_refresh_under_the_cursor_is_not_a_move() -> None:
    app = TableApp(NumberTable())
    async with app.run_test(size=(40, 10)) as pilot:
        table = app.table
        table.sync_rows([("a", ("a", 1)), ("b", ("b", 2))])
        await pilot.pause()
        table.sync_rows([("b", ("b", 2)), ("a", ("a", 1))])  # re-sorted: b under the cursor
        await pilot.pause()
        table.focus()
        await pilot.press("down")
        assert app.moved == [False, False, True]


async def test_blocked_now_rows_of_woken_threads_say_so() -> None:
    snap = synthetic_snapshots(1, tasks=20, stacks=40, seed=3)[0]
    table = BlockedNowTable()
    app = TableApp(table)
    async with app.run_test(size=(50, 20)) as pilot:
        table.index = SnapshotIndex(snap)
        await pilot.pause()
        first, *rest = table.tids
        table.refresh_waits({tid: 7_000_000_000 for tid in rest})
        assert "woke" in table.get_cell(first, "wait").plain
        assert all("7.00s" in table.get_cell(tid, "wait").plain for tid in rest)
        assert str(table.border_title) == f"Blocked now ({len(table.tids)}) · 1 woke since"


def test_written_views_never_overwrite_nor_follow_links(tmp_path: Path) -> None:
    snap = synthetic_snapshots(1, tasks=10, stacks=20, seed=4)[0]
    view = ViewData(snap.stacks, "all tasks", snap.time - 1, snap.time, True, False)
    first = write_view(view, "folded", tmp_path)
    second = write_view(view, "folded", tmp_path)
    assert first != second and first.read_bytes() == second.read_bytes()
    lines = first.read_text().splitlines()
    # comm, then the outermost kernel frame: no user frame in between.
    assert lines and {line.split(";")[1] for line in lines} <= {
        "entry_SYSCALL_64_after_hwframe", "asm_exc_page_fault"}
    assert not any(";main;" in line or ";start_thread;" in line for line in lines)  # user: off
    target = tmp_path / "target"
    target.write_text("precious")
    name = export_name(view, "pprof")
    (tmp_path / name).symlink_to(target)
    written = write_view(view, "pprof", tmp_path)
    assert written.name != name and target.read_text() == "precious"


# --- scopes: whose stacks, and their names --------------------------------------------------

def test_a_scope_keeps_an_idle_tasks_last_stacks_and_name() -> None:
    snaps = synthetic_snapshots(2, tasks=20, stacks=40, seed=5)
    first = SnapshotIndex(snaps[0])
    task = snaps[0].tasks[0]
    scopes = ScopeStacks()
    scope = Scope.task(task.key)
    scopes.seen(first, [task.key])
    stacks, stale = scopes.stacks(scope, first)
    assert stacks == list(snaps[0].stacks_of(task.tid)) and not stale
    idle = SnapshotIndex(dataclasses.replace(
        snaps[1], tasks=tuple(t for t in snaps[1].tasks if t.tid != task.tid),
        stacks=tuple(s for s in snaps[1].stacks if s.tid != task.tid)))
    assert scopes.stacks(scope, idle) == (stacks, True)
    assert scopes.title(scope, idle).plain == f"{task.comm} {task.pid}" + (
        "" if task.tid == task.pid else f"/{task.tid}")


def test_a_scope_never_seen_in_a_row_is_named_by_its_stacks() -> None:
    snap = synthetic_snapshots(1, tasks=20, stacks=40, seed=5)[0]
    s = snap.stacks[0]
    without_rows = SnapshotIndex(dataclasses.replace(snap, tasks=(), processes=()))
    assert ScopeStacks().title(Scope.task(RowKey.thread(s.tid)), without_rows).plain == (
        f"{s.comm} {s.pid}" + ("" if s.tid == s.pid else f"/{s.tid}"))
    assert ScopeStacks().title(Scope.task(RowKey.thread(99999)), without_rows).plain == \
        "thread 99999"


def test_scopes_of_a_command_a_block_and_all_tasks() -> None:
    snap = synthetic_snapshots(1, tasks=30, stacks=60, seed=6)[0]
    index, scopes = SnapshotIndex(snap), ScopeStacks()
    nginx, _ = scopes.stacks(Scope.command("nginx"), index)
    assert nginx == [s for s in snap.stacks if s.comm == "nginx"]
    assert scopes.title(Scope.command("ng[x]inx"), index).plain == "every ng[x]inx process"
    blocked = snap.blocked_now[0]
    stacks, _ = scopes.stacks(Scope.of_block(blocked), index)
    assert [(s.tid, s.offcpu_ns, s.kernel, s.before_start) for s in stacks] == [
        (blocked.tid, blocked.blocked_ns, blocked.kernel, blocked.before_start)]
    assert "blocked now" in scopes.title(Scope.of_block(blocked), index).plain
    everything, _ = scopes.stacks(ALL, index, text="TCP_RECVMSG")
    assert everything and all(any(f.name == "tcp_recvmsg" for f in s.kernel)
                              for s in everything)
    assert scopes.stacks(NOTHING, index) == ([], False)
    scopes.since = snap.stacks
    since, _ = scopes.stacks(Scope.command("nginx"), index, cumulative=True)
    assert since == nginx


def test_python_frames_are_a_kind_of_their_own_in_the_flame_graph() -> None:
    py = StackRow(pid=1, tid=1, comm="app", state="S", offcpu_ns=10, count=1, max_ns=10,
                  kernel=(Frame("schedule", "kernel", True),),
                  user=(Frame("read", "libc.so.6"), Frame("py:Queue.get (queue.py:171)", "q.py")))
    tree = FlameTree([py])
    kinds = {tree.name(n): tree.kind(n) for n in range(1, len(tree))}
    assert kinds == {"py:Queue.get (queue.py:171)": PYTHON, "read": USER, "schedule": KERNEL}


def test_a_style_pool_packs_segments_into_tuples_the_gc_lets_go() -> None:
    """A table's caches hold their lines packed: plain tuples, untracked by the
    cyclic GC once it has seen them, given back as the same segments."""
    import gc

    from rich.segment import ControlType, Segment
    from rich.style import Style

    pool = StylePool()
    red, bold = Style(color="red"), Style(bold=True)
    control = Segment("", None, [(ControlType.BELL,)])
    segments = [Segment("a", red), Segment(" b", None), Segment("c", red), Segment("[d]", bold)]
    packed = pool.pack(segments)
    gc.collect()  # untracks the (text, number) pairs; the next pass, what holds them
    gc.collect()
    assert not gc.is_tracked(packed) and not any(gc.is_tracked(p) for p in packed)
    assert pool.unpack(packed) == segments
    # A control segment is kept as it is (rare: cells are made printable).
    assert pool.unpack(pool.pack([control, *segments])) == [control, *segments]
    assert not pool.full
    many = StylePool(max_styles=3)
    many.pack([Segment(str(i), Style(color=f"color({i})")) for i in range(4)])
    assert many.full
    many.clear()
    assert not many.full and many.unpack(many.pack(segments)) == segments


def test_a_plain_lru_forgets_the_entry_used_least_lately() -> None:
    lru: PlainLru[str, int] = PlainLru(3)
    for i, key in enumerate("abc"):
        lru.set(key, i)
    assert lru.get("a") == 0  # now the most recent: "b" goes first
    lru.set("d", 3)
    assert (lru.get("b"), lru.get("c"), lru.get("a"), lru.get("d")) == (None, 2, 0, 3)
    lru.set("c", 20)  # a new value for a key kept: no room taken, and now the most recent
    lru.set("e", 4)
    assert len(lru) == 3 and lru.get("a") is None and lru.get("c") == 20
    lru.clear()
    assert len(lru) == 0 and lru.get("c") is None


def _tracked_in(container: object) -> list[object]:
    """What `container` refers to that the cyclic GC tracks."""
    import gc

    return [o for o in gc.get_referents(container)
            if gc.is_tracked(o) and o is not type(container)]


async def test_a_tables_caches_are_one_object_to_the_gc() -> None:
    """Drawn cells and lines are cached with nothing the GC must walk per entry
    (textual's LRUCache had a list per entry), so that a full pass walks a cache
    of cells as one object."""
    import gc

    app = TableApp(NumberTable())
    async with app.run_test(size=(40, 30)) as pilot:
        table = app.table
        table.sync_rows([(f"k{i}", (f"n{i}", i if i % 3 else i * 0.5)) for i in range(25)])
        await pilot.pause()
        assert len(screen_lines(table)) == 30
        cells, lines = table._cells, table._lines
        assert len(cells) >= 40 and len(lines) >= 25
        gc.collect()
        gc.collect()
        entries = cells._entries
        assert not [k for k in entries if gc.is_tracked(k)]
        assert not [v for v in entries.values() if gc.is_tracked(v)]
        # The cache holds its one dict; nothing per entry.
        assert _tracked_in(cells) == [entries]
        # A line's key holds its row's key and style (tracked): its value does not.
        assert not [v for v in lines._entries.values() if gc.is_tracked(v)]
