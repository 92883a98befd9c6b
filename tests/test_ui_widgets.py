"""The widgets' own logic: keyed diffs, the slider's scale, callchain merging,
key hints, rendering of untrusted text, and the synthetic data behind the UI tests."""

from __future__ import annotations

import random
from collections.abc import Hashable
from typing import Any

import pytest
from rich.console import RenderableType
from rich.text import Text
from textual.app import App, ComposeResult

import offtop.widgets.keyed_table as keyed_table
from offtop.model import Frame, StackRow
from offtop.synthetic import synthetic_snapshots
from offtop.widgets.callchain_tree import merge_stacks, stack_path
from offtop.widgets.key_bar import KeyBar
from offtop.widgets.keyed_table import KeyedTable
from offtop.widgets.render import chain_summary, frame_text, task_label
from offtop.widgets.threshold_slider import (
    HIGH_NS,
    STEPS,
    cell_of,
    step_down,
    step_up,
    value_at,
)


class NumberTable(KeyedTable):
    """A keyed table of (name, value) rows."""

    def on_mount(self) -> None:
        self.set_columns([("name", "NAME", 8), ("value", "VALUE", 8)])

    def render_cell(self, column: str, value: Hashable) -> RenderableType:
        return Text(str(value), end="")


class TableApp(App[None]):
    def compose(self) -> ComposeResult:
        yield NumberTable()


def table_state(table: KeyedTable) -> list[tuple[str, str, str]]:
    """What the table holds, in display order, read through the public API."""
    out = []
    for i in range(table.row_count):
        key = table.coordinate_to_cell_key((i, 0)).row_key.value  # type: ignore[arg-type]
        assert key is not None
        out.append((key, *(str(c) for c in table.get_row(key))))
    return out


def random_rounds(seed: int, rounds: int = 12) -> list[list[tuple[str, tuple[Hashable, ...]]]]:
    rng = random.Random(seed)
    out = []
    for _ in range(rounds):
        keys = rng.sample(range(60), rng.randrange(0, 40))
        out.append([(f"k{k}", (f"n{k}", rng.randrange(5))) for k in keys])
    return out


@pytest.mark.parametrize("fallback", [False, True], ids=["batched", "public-api"])
async def test_keyed_table_matches_the_rows_it_is_given(
    fallback: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if fallback:
        # Make the private fast paths fail, as if DataTable's internals moved.
        def broken(*_: Any, **__: Any) -> Any:
            raise AttributeError("moved")

        monkeypatch.setattr(keyed_table, "TwoWayDict", broken)
        monkeypatch.setattr(keyed_table, "RowKey", broken)
    app = TableApp()
    async with app.run_test() as pilot:
        table = app.query_one(NumberTable)
        for rows in random_rounds(seed=7):
            cursor = table.cursor_key
            table.sync_rows(rows)
            await pilot.pause()
            assert table.row_keys_in_order == [k for k, _ in rows]
            assert table_state(table) == [(k, str(v[0]), str(v[1])) for k, v in rows]
            if cursor is not None and cursor in dict(rows):
                assert table.cursor_key == cursor


async def test_keyed_table_only_touches_changed_cells(monkeypatch: pytest.MonkeyPatch) -> None:
    app = TableApp()
    async with app.run_test() as pilot:
        table = app.query_one(NumberTable)
        table.sync_rows([("a", ("a", 1)), ("b", ("b", 2)), ("c", ("c", 3))])
        await pilot.pause()
        touched: list[tuple[str, str]] = []
        real = table.update_cells

        def spy(changes: Any) -> None:
            touched.extend((r, c) for r, c, _ in changes)
            real(changes)

        monkeypatch.setattr(table, "update_cells", spy)
        table.sync_rows([("c", ("c", 3)), ("a", ("a", 9)), ("b", ("b", 2))])
        assert touched == [("a", "value")]
        assert table.row_keys_in_order == ["c", "a", "b"]


def test_slider_scale() -> None:
    assert STEPS[0] == 0 and STEPS[-1] == HIGH_NS == 10_000_000_000
    assert list(STEPS) == sorted(set(STEPS))
    assert step_up(0) == 10_000 and step_up(100_000_000) == 200_000_000
    assert step_up(150_000_000) == 200_000_000 and step_up(HIGH_NS) == HIGH_NS
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
    assert chain.plain == "pipe_read ← handle[bold]request"


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
