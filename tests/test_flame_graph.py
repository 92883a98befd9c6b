"""The flame graph: its tree and layout (pure), and the widget driven by keys
in a tiny app (Pilot): zoom, cursor, search, export, untrusted names, and its
speed at 20,000 stacks."""

from __future__ import annotations

import time
from typing import Any, ClassVar

import pytest
from textual.app import App, ComposeResult
from textual.binding import Binding, BindingType

from offtop.model import Frame, StackRow
from offtop.synthetic import synthetic_snapshots
from offtop.widgets.flame_graph import (
    GROUP,
    KERNEL,
    UNKNOWN,
    USER,
    FlameGraph,
    FlameTree,
    layout,
)

MS = 1_000_000


def k(*names: str) -> tuple[Frame, ...]:
    """Kernel frames, innermost first."""
    return tuple(Frame(n, "kernel", True) for n in names)


def u(*names: str) -> tuple[Frame, ...]:
    """User frames, innermost first."""
    return tuple(Frame(n, "app") for n in names)


def stack(tid: int, ns: int, kernel: tuple[Frame, ...], user: tuple[Frame, ...],
          comm: str = "app", pid: int = 10, state: str = "S") -> StackRow:
    return StackRow(pid=pid, tid=tid, comm=comm, state=state, offcpu_ns=ns, count=ns // MS,
                    max_ns=ns, kernel=kernel, user=user)


#: main → work → read → (kernel) vfs_read → schedule: 600 ms
#: main → work → poll → (kernel) do_poll → schedule: 300 ms (two threads)
#: main → idle → (kernel) schedule: 100 ms
STACKS = [
    stack(11, 600 * MS, k("schedule", "vfs_read"), u("read", "work", "main")),
    stack(11, 200 * MS, k("schedule", "do_poll"), u("poll", "work", "main")),
    stack(12, 100 * MS, k("schedule", "do_poll"), u("poll", "work", "main")),
    stack(13, 100 * MS, k("schedule"), u("idle", "main"), comm="other", pid=20),
]


def names_at(tree: FlameTree, node: int) -> list[str]:
    return [tree.name(c) for c in tree.children(node)]


def node_at(tree: FlameTree, *names: str) -> int:
    node = 0
    for name in names:
        node = next(c for c in tree.children(node) if tree.name(c) == name)
    return node


# --- the tree ------------------------------------------------------------------


def test_tree_merges_stacks_outermost_first_with_times_summed() -> None:
    tree = FlameTree(STACKS)
    assert tree.total_ns == 1000 * MS
    assert names_at(tree, 0) == ["main"]
    assert names_at(tree, node_at(tree, "main")) == ["work", "idle"]  # hottest first
    work = node_at(tree, "main", "work")
    assert tree.values[work] == 900 * MS and tree.counts[work] == 900
    assert names_at(tree, work) == ["read", "poll"]
    poll = node_at(tree, "main", "work", "poll", "do_poll", "schedule")
    assert tree.values[poll] == 300 * MS  # two threads merged
    assert tree.kind(poll) == KERNEL and tree.kind(work) == USER
    assert tree.depths[poll] == 5 and tree.max_depth == 5
    # Every node's time is its own stacks' plus its children's.
    for n in range(len(tree)):
        own = sum(s.offcpu_ns for s, e in zip(tree.stacks, tree.ends, strict=True) if e == n)
        assert tree.values[n] == own + sum(tree.values[c] for c in tree.children(n))


def test_tree_groups_by_process_or_thread_and_hides_frames() -> None:
    by_proc = FlameTree(STACKS, group_by="process")
    assert names_at(by_proc, 0) == ["app 10", "other 20"]
    assert by_proc.kind(by_proc.children(0)[0]) == GROUP
    by_thread = FlameTree(STACKS, group_by="thread")
    assert names_at(by_thread, 0) == ["app 10/11", "app 10/12", "other 20/13"]
    assert [by_thread.values[c] for c in by_thread.children(0)] == [800 * MS, 100 * MS, 100 * MS]
    user_only = FlameTree(STACKS, show_kernel=False)
    assert user_only.max_depth == 3 and names_at(user_only, node_at(user_only, "main", "work",
                                                                     "read")) == []
    kernel_only = FlameTree(STACKS, show_user=False)
    assert names_at(kernel_only, 0) == ["vfs_read", "do_poll", "schedule"]


def test_tree_keeps_kernel_user_and_unresolved_frames_apart() -> None:
    tree = FlameTree([
        stack(1, 3 * MS, k("read"), u("read")),
        stack(1, 2 * MS, (Frame("0xffff1", "", True),), (Frame("0xffff1"),)),
    ])
    top = tree.children(0)
    assert [(tree.kind(c), tree.name(c)) for c in top] == [(USER, "read"), (UNKNOWN, "0xffff1")]
    assert [(tree.kind(c), tree.name(c)) for c in tree.children(top[0])] == [(KERNEL, "read")]
    assert [tree.key_of(c) for c in tree.children(top[1])] == [(UNKNOWN, "k:0xffff1")]


def test_paths_find_the_same_frames_in_a_new_tree() -> None:
    tree = FlameTree(STACKS)
    node = node_at(tree, "main", "work", "poll")
    path = tree.path_of(node)
    later = FlameTree(list(reversed(STACKS[1:])))  # other order, one stack gone
    assert later.path_of(later.find(path)) == path
    gone = node_at(tree, "main", "work", "read", "vfs_read")
    assert later.find(tree.path_of(gone)) == node_at(later, "main", "work")  # deepest left


def test_search_counts_each_nanosecond_once() -> None:
    recursive = [stack(1, 70 * MS, k("schedule"), u("f", "g", "f", "main")),
                 stack(1, 30 * MS, k("schedule"), u("h", "main"))]
    tree = FlameTree(recursive)
    hits, res = tree.search("F")  # case-insensitive
    assert {tree.name(n) for n in hits} == {"f"} and res.frames == 2
    assert res.ns == 70 * MS and res.fraction == pytest.approx(0.7)
    main = node_at(tree, "main")
    _, inside = tree.search("h", within=node_at(tree, "main", "h"))
    assert inside.ns == 30 * MS and inside.fraction == 1.0
    assert tree.search("", within=main)[1].frames == 0


def test_folded_lines_of_a_node_are_offtops_folded_format() -> None:
    evil = [stack(1, 5 * MS, k("sched;ule"), u("my\u3000func", "bad\nname"), comm="x [red]y")]
    tree = FlameTree(STACKS + evil)
    work = node_at(tree, "main", "work")
    assert tree.folded_lines(work) == [
        "app;main;work;read;vfs_read;schedule 600000",
        "app;main;work;poll;do_poll;schedule 300000",  # two threads, one line
    ]
    all_lines = tree.folded_lines(0, unit_ns=MS)
    assert "x_[red]y;bad\\x0aname;my_func;sched:ule 5" in all_lines
    assert all(len(line.split(" ")) == 2 for line in all_lines)


# --- the layout ------------------------------------------------------------------


def test_layout_widths_are_proportional_and_nest() -> None:
    tree = FlameTree(STACKS)
    lay = layout(tree, 0, 100)
    main = node_at(tree, "main")
    assert lay.rows[0] == ((0, 100, 0),) and lay.rows[1] == ((0, 100, main),)
    assert lay.rows[2] == ((0, 90, node_at(tree, "main", "work")),
                           (90, 100, node_at(tree, "main", "idle")))
    assert [(x0, x1) for x0, x1, _ in lay.rows[3]] == [(0, 60), (60, 90), (90, 100)]
    for r in range(1, len(lay.rows)):
        for x0, x1, n in lay.rows[r]:
            px0, px1, _ = lay.rows[r - 1][lay.where[tree.parents[n]][1]]
            assert px0 <= x0 < x1 <= px1


def test_layout_drops_bars_narrower_than_a_cell_and_zooms() -> None:
    many = [stack(1, 1000 * MS, k("schedule"), u("hot", "main"))] + [
        stack(1, MS, k("schedule"), u(f"cold{i}", "main")) for i in range(500)]
    tree = FlameTree(many)
    lay = layout(tree, 0, 80)
    # 500 bars of a 15th of a cell each are not drawn (nor looked at).
    assert [(x0, x1) for x0, x1, _ in lay.rows[2]] == [(0, 53)]
    cold = node_at(tree, "main", "cold7")
    zoomed = layout(tree, cold, 80)
    assert zoomed.rows[2] == ((0, 80, cold),)  # the zoomed frame is full width
    assert zoomed.rows[1] == ((0, 80, node_at(tree, "main")),)  # its callers above


# --- the widget, driven by keys -------------------------------------------------------


class FlameApp(App[None]):
    """A test app hosting only the widget; Esc at the top comes back here."""

    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape", "back", "Back")]

    def __init__(self, stacks: list[StackRow], **kw: Any) -> None:
        super().__init__()
        self.stacks = stacks
        self.kw = kw
        self.backs = 0

    def compose(self) -> ComposeResult:
        yield FlameGraph()

    def on_mount(self) -> None:
        graph = self.query_one(FlameGraph)
        graph.show(self.stacks, **self.kw)
        graph.focus()

    def action_back(self) -> None:
        self.backs += 1


def screen_lines(graph: FlameGraph) -> list[str]:
    return [graph.render_line(y).text for y in range(graph.scrollable_content_region.height)]


async def test_arrows_move_and_enter_zooms_and_escape_zooms_out() -> None:
    app = FlameApp(STACKS, title="app")
    async with app.run_test(size=(100, 12)) as pilot:
        graph = app.query_one(FlameGraph)
        tree = graph.flame_tree
        await pilot.press("down", "down", "down")  # root → main → work → read
        assert graph.cursor_node == node_at(tree, "main", "work", "read")
        await pilot.press("right")
        assert graph.cursor_node == node_at(tree, "main", "work", "poll")
        assert screen_lines(graph)[0].startswith("poll  user  300ms")
        await pilot.press("enter")
        assert graph.zoom_node == node_at(tree, "main", "work", "poll")
        lines = screen_lines(graph)
        assert lines[4].strip() == "poll"
        assert lines[5].startswith(" do_poll ") and len(lines[5]) == 100  # the full width
        assert graph.view_stacks() == STACKS[1:3]
        await pilot.press("up", "up", "enter")  # zoom out to an ancestor: main
        assert graph.zoom_node == node_at(tree, "main")
        await pilot.press("escape")
        assert graph.zoom_node == 0 and graph.cursor_node == node_at(tree, "main")
        assert app.backs == 0
        await pilot.press("escape")  # at the top: the app's Esc (back)
        assert app.backs == 1


async def test_plus_minus_and_home_zoom_too() -> None:
    app = FlameApp(STACKS)
    async with app.run_test(size=(100, 12)) as pilot:
        graph = app.query_one(FlameGraph)
        tree = graph.flame_tree
        await pilot.press("down", "down", "plus")
        assert graph.zoom_node == node_at(tree, "main", "work")
        await pilot.press("down", "plus")
        assert graph.zoom_node == node_at(tree, "main", "work", "read")
        await pilot.press("minus")
        assert graph.zoom_node == node_at(tree, "main", "work")
        await pilot.press("home")
        assert graph.zoom_node == 0


async def test_a_click_moves_the_cursor_and_a_second_one_zooms() -> None:
    app = FlameApp(STACKS)
    async with app.run_test(size=(100, 12)) as pilot:
        graph = app.query_one(FlameGraph)
        idle = node_at(graph.flame_tree, "main", "idle")
        await pilot.click(FlameGraph, offset=(95, 3))  # line 3: depth 2, cells 90..99
        assert graph.cursor_node == idle and graph.zoom_node == 0
        await pilot.click(FlameGraph, offset=(95, 3))
        assert graph.zoom_node == idle


async def test_search_highlights_matching_bars() -> None:
    app = FlameApp(STACKS)
    async with app.run_test(size=(100, 12)) as pilot:
        graph = app.query_one(FlameGraph)
        res = graph.search("poll")
        await pilot.pause()
        assert res is not None and res.frames == 2 and res.ns == 300 * MS
        assert "search poll: 2 frames, 30.0%" in screen_lines(graph)[0]
        hit_bg = FlameGraph.MATCH_STYLE.bgcolor

        def highlighted(row: int) -> list[str]:
            return [seg.text.strip() for seg in graph.render_line(row + 1)
                    if seg.style is not None and seg.style.bgcolor == hit_bg]

        assert highlighted(3) == ["poll"]
        assert highlighted(4) == ["do_poll"]
        assert highlighted(2) == []
        graph.search("")
        await pilot.pause()
        assert highlighted(3) == [] and graph.search_result is None


async def test_export_gives_the_current_views_stacks() -> None:
    app = FlameApp(STACKS, group_by="process")
    async with app.run_test(size=(100, 12)) as pilot:
        graph = app.query_one(FlameGraph)
        assert graph.folded_lines() == ["app;main;work;read;vfs_read;schedule 600000",
                                        "app;main;work;poll;do_poll;schedule 300000",
                                        "other;main;idle;schedule 100000"]
        await pilot.press("down", "right", "enter")  # into process "other 20"
        assert graph.folded_lines() == ["other;main;idle;schedule 100000"]
        assert graph.view_stacks() == [STACKS[3]]


async def test_a_refresh_keeps_the_zoom_and_cursor_on_the_same_frames() -> None:
    app = FlameApp(STACKS)
    async with app.run_test(size=(100, 12)) as pilot:
        graph = app.query_one(FlameGraph)
        await pilot.press("down", "down", "enter", "down", "right")
        zoom, cursor = graph.zoom_path, graph.flame_tree.path_of(graph.cursor_node)
        graph.search("sched")
        more = [*STACKS, stack(14, 900 * MS, k("schedule", "futex_wait"), u("lock", "work", "main"))]
        graph.show(more)
        await pilot.pause()
        assert graph.zoom_path == zoom
        assert graph.flame_tree.path_of(graph.cursor_node) == cursor
        # The search is made again, in the zoomed view of the new tree.
        assert graph.search_result is not None and graph.search_result.frames == 3
        assert graph.search_result.ns == 1800 * MS
        # The new, hotter child comes first.
        work = graph.zoom_node
        assert graph.flame_tree.name(graph.flame_tree.children(work)[0]) == "lock"
        # Another scope starts from the whole graph.
        graph.show(more, title="another task")
        assert graph.zoom_node == 0 and graph.cursor_node == 0


async def test_untrusted_names_are_drawn_literally() -> None:
    evil = [stack(1, MS, k("schedule"), u("[bold]x\x1b[2J"), comm="[red]c\x07")]
    app = FlameApp(evil, title="[b]t", group_by="process")
    async with app.run_test(size=(80, 8)) as pilot:
        graph = app.query_one(FlameGraph)
        await pilot.press("down")
        lines = screen_lines(graph)
        assert lines[0].startswith("[red]c\\x07 10  task")
        assert lines[1].startswith(" [b]t")
        assert lines[3].startswith(" [bold]x\\x1b[2J")
        assert all(ch.isprintable() for line in lines for ch in line)
        # The title is text: its markup form escapes the bracket ("[b]" is not bold).
        assert graph.border_title is not None and "\\[b]t" in graph.border_title


async def test_speed_at_20000_stacks() -> None:
    """Generous bounds (noisy CI); the figures measured are in the report."""
    snap = synthetic_snapshots(1, tasks=400, stacks=20_000)[0]
    assert len(snap.stacks) >= 19_000
    app = FlameApp([])
    async with app.run_test(size=(200, 50)) as pilot:
        graph = app.query_one(FlameGraph)
        t0 = time.perf_counter()
        graph.show(snap.stacks, group_by="process")
        await pilot.pause()
        first = time.perf_counter() - t0
        assert len(graph.flame_tree) > 100_000
        assert first < 5.0, f"build + first paint took {first:.2f}s"
        await pilot.press("down", "down")
        drawn = graph.lines_rendered
        t0 = time.perf_counter()
        graph.action_cursor_down()
        graph.action_cursor_right()
        await pilot.pause()
        move = time.perf_counter() - t0
        assert move < 1.0, f"two cursor moves took {move:.2f}s"
        # A move redraws the lines it changed, not the graph.
        assert graph.lines_rendered - drawn <= 4
        t0 = time.perf_counter()
        await pilot.press("enter")
        zoom = time.perf_counter() - t0
        assert zoom < 1.0, f"zoom took {zoom:.2f}s"
        assert graph.zoom_node != 0


def test_a_big_tree_keeps_a_few_machine_words_per_node() -> None:
    """A live flame graph of a busy server's since-start stacks has ~275,000 nodes,
    and a refresh holds two trees: per-node numbers are kept as machine integers
    (~8 bytes each), not lists of int objects (~36 bytes each)."""
    import gc
    import tracemalloc

    shared = u(*[f"layer{i}" for i in range(29)])
    # Each stack apart from its outermost frame on: ~30 nodes of its own.
    stacks = [stack(1000 + i, (i + 1) * 1_000_003, k("schedule"),
                    (*shared, Frame(f"main{i}", "app"))) for i in range(3000)]
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        tree = FlameTree(stacks)
        kept = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert len(tree) > 90_000
    assert kept / len(tree) < 80, kept / len(tree)


def test_a_tree_holds_nothing_a_gc_pass_walks_per_node() -> None:
    """Every full GC pass walks each element of a list: two per-node lists of
    170,000 ints were half of what a pass walked at 20,000 stacks. Per-node
    data is kept in arrays, whose numbers the GC does not walk."""
    import gc

    tree = FlameTree(synthetic_snapshots(1, tasks=20, stacks=200, seed=5)[0].stacks)
    assert len(tree) > 200
    per_node = [tree.keys, tree.depths, tree.parents, tree.values, tree.counts, tree.ends]
    # An array refers to its type alone; a list to each of its numbers.
    assert [len(gc.get_referents(a)) for a in per_node] == [1] * len(per_node)
