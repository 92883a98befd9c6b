"""An icicle flame graph of off-CPU time, drawn with Textual's Line API.

The root (the scope: all tasks, a process, a task) is the top line; below
it, frame by frame from the outermost (`_start`, `start_thread`) into the
kernel, each frame is a bar as wide as the off-CPU time spent below it.
Siblings are ordered hottest first, so the hot path runs down the left.
Kernel frames are warm, user frames cool, Python functions green (as everywhere
in offtop).

Two layers:

- `FlameTree`: the stacks merged into a prefix tree, pure data with no
  widget in sight, so it can be built off the event loop (a worker) and
  unit-tested; it also answers searches and exports the stacks under a node.
- `FlameGraph`: a `ScrollView` that lays the tree out for its width (only
  bars at least one cell wide: a walk that is bounded by the screen, not by
  the number of stacks) and draws one line per depth from a cached `Strip`.
  Moving the cursor redraws two lines; zooming or resizing re-lays out.

Keys: arrows move between frames (← → siblings and neighbours on the line,
↑ the caller, ↓ the hottest callee), Enter or + zooms into the frame under
the cursor, Esc or - zooms back out one level (at the top, Esc is left to
the app), Home shows the whole graph again. `search(text)` highlights the
frames whose name contains `text`.

Names are untrusted: they go through `offtop.safe_text.printable` and are
drawn as plain segments; titles are `Text`, never markup.
"""

from __future__ import annotations

import zlib
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import ClassVar, Literal

from rich.cells import cell_len, set_cell_size
from rich.segment import Segment
from rich.style import Style
from rich.text import Text
from textual import events
from textual.actions import SkipAction
from textual.binding import Binding, BindingType
from textual.color import Color
from textual.geometry import Region, Size
from textual.scroll_view import ScrollView
from textual.strip import Strip

from offtop.model import Frame, StackRow
from offtop.report import fold_name
from offtop.safe_text import printable
from offtop.units import format_ns
from offtop.widgets.render import KERNEL_STYLE, PYTHON_STYLE, USER_STYLE

GroupBy = Literal["none", "process", "thread"]
"""The level under the root: none, one bar per process, or one per thread."""

#: Node kinds (what colour a bar gets).
ROOT, GROUP, KERNEL, USER, UNKNOWN, PYTHON = range(6)
_KIND_NAMES = {ROOT: "scope", GROUP: "task", KERNEL: "kernel", USER: "user", UNKNOWN: "unresolved",
               PYTHON: "python"}

#: A node's identity below its parent: (kind, name). The kernel/user split
#: keeps a user `read` apart from a kernel `read`.
NodeKey = tuple[int, str]
#: A node's place in the tree: the keys from the root down to it.
NodePath = tuple[NodeKey, ...]


@dataclass(frozen=True, slots=True)
class SearchResult:
    """What a search found within the current view."""

    text: str
    frames: int
    """Bars whose name contains the text."""
    ns: int
    """Off-CPU time below them, each nanosecond counted once."""
    fraction: float
    """`ns` as a share of the view."""


class FlameTree:
    """Stacks merged into a prefix tree; node 0 is the root (see module docstring).

    Built for 20,000 stacks of 15 frames in well under a second: per-node
    data lives in parallel lists indexed by node id (no object per node),
    each distinct frame is interned once as a small integer *key id*, the
    stacks are merged in sorted order (see `_build`), and times are summed
    at the stacks' ends and then up the tree in one pass (a child's id is
    always above its parent's).
    """

    def __init__(
        self,
        stacks: Iterable[StackRow],
        *,
        title: str = "all tasks",
        group_by: GroupBy = "none",
        show_kernel: bool = True,
        show_user: bool = True,
    ) -> None:
        self.title = title
        self.group_by: GroupBy = group_by
        self.show_kernel = show_kernel
        self.show_user = show_user
        self.stacks: tuple[StackRow, ...] = tuple(stacks)
        # Interned node keys: key id -> (kind, name), its display name.
        self._key_ids: dict[NodeKey, int] = {(ROOT, title): 0}
        self.node_keys: list[NodeKey] = [(ROOT, title)]
        self.key_names: list[str] = [printable(title)]
        # Per node.
        self.keys: list[int] | array[int] = [0]
        self.parents: list[int] | array[int] = [-1]
        self.depths: list[int] | array[int] = [0]
        self.values: list[int] | array[int] = [0]
        self.counts: list[int] | array[int] = [0]
        #: The node each stack ends at (its innermost shown frame).
        self.ends: list[int] | array[int] = []
        self._build()
        # Children as linked lists of ints (first child, next sibling): a
        # list per node would be 85,000 containers for 20,000 stacks, and the
        # garbage collector's passes over them cost more than the build.
        # Sorted child lists are made on demand: the layout visits only the
        # bars wide enough to draw.
        n = len(self.keys)
        self._first_child: list[int] | array[int] = [-1] * n
        self._next_sibling: list[int] | array[int] = [-1] * n
        first, nxt, parents = self._first_child, self._next_sibling, self.parents
        for node in range(n - 1, 0, -1):
            p = parents[node]
            nxt[node] = first[p]
            first[p] = node
        self._children: dict[int, list[int]] = {}
        self.max_depth = max(self.depths)
        # Built in lists (appending to them is the fastest), kept as machine
        # integers: 8 bytes a node each, where a list holds a pointer and an
        # int object. A graph of 20,000 stacks grouped by process has ~275,000
        # nodes (41 MB in lists, 17 in arrays), and a live refresh holds the
        # graph shown while the next one is built. `keys` and `depths` too,
        # though their ints are shared: a list is walked element by element
        # by every full GC pass (two lists of 170,000 were half of what a pass
        # walked at 20,000 stacks), an array not at all.
        self.keys, self.depths = array("q", self.keys), array("q", self.depths)
        self.parents, self.values, self.counts, self.ends = (
            array("q", self.parents), array("q", self.values), array("q", self.counts),
            array("q", self.ends))
        self._first_child, self._next_sibling = (array("q", self._first_child),
                                                 array("q", self._next_sibling))

    def children(self, node: int) -> list[int]:
        """The children of `node`, hottest first (ties by name, so the order is stable)."""
        kids = self._children.get(node)
        if kids is None:
            kids = []
            c = self._first_child[node]
            while c >= 0:
                kids.append(c)
                c = self._next_sibling[c]
            kids.sort(key=lambda c: (-self.values[c], self.name(c)))
            if len(self._children) > 4096:
                self._children.clear()
            self._children[node] = kids
        return kids

    def _key_id(self, key: NodeKey) -> int:
        kid = self._key_ids.get(key)
        if kid is None:
            kid = self._key_ids[key] = len(self.node_keys)
            self.node_keys.append(key)
            self.key_names.append(printable(key[1]))
        return kid

    @staticmethod
    def frame_key(f: Frame) -> NodeKey:
        """A frame's node key: kernel, user or unresolved, and its name."""
        if f.unknown:
            # An unresolved kernel address is not an unresolved user one.
            return (UNKNOWN, "k:" + f.name if f.kernel else f.name)
        if f.kernel:
            return (KERNEL, f.name)
        return (PYTHON if f.name.startswith("py:") else USER, f.name)

    def _build(self) -> None:
        # Each stack becomes a tuple of key ids (comprehensions: the cheapest
        # per-frame work Python has); sorted, stacks that share a prefix are
        # neighbours, so each stack only adds the nodes past the prefix it
        # shares with the previous one. Twice as fast as a lookup per frame
        # step, and no child index is needed. Frames are interned by name,
        # kernel and user apart: whether one is unresolved follows from it.
        kernel_kids: dict[str, int] = {}
        user_kids: dict[str, int] = {}
        key_id, frame_key = self._key_id, self.frame_key

        def kid(f: Frame, kids: dict[str, int]) -> int:
            k = kids.get(f.name)
            if k is None:
                k = kids[f.name] = key_id(frame_key(f))
            return k

        paths: list[tuple[int, ...]] = []
        for s in self.stacks:
            path: list[int] = []
            if self.group_by != "none":
                label = (f"{s.comm} {s.pid}" if self.group_by == "process"
                         else f"{s.comm} {s.pid}/{s.tid}")
                path.append(key_id((GROUP, label)))
            if self.show_user:
                path += [user_kids.get(f.name) or kid(f, user_kids) for f in reversed(s.user)]
            if self.show_kernel:
                path += [kernel_kids.get(f.name) or kid(f, kernel_kids)
                         for f in reversed(s.kernel)]
            paths.append(tuple(path))
        keys, parents, depths = self.keys, self.parents, self.depths
        values, counts = self.values, self.counts
        ends = [0] * len(paths)
        prev: tuple[int, ...] = ()
        along = [0]  # the nodes of `prev`, root first
        for i in sorted(range(len(paths)), key=paths.__getitem__):
            cur = paths[i]
            n, m = 0, min(len(cur), len(prev))
            while n < m and cur[n] == prev[n]:
                n += 1
            del along[n + 1:]
            node = along[-1]
            for k in cur[n:]:
                child = len(keys)
                keys.append(k)
                parents.append(node)
                depths.append(len(along))
                values.append(0)
                counts.append(0)
                along.append(child)
                node = child
            s = self.stacks[i]
            values[node] += s.offcpu_ns
            counts[node] += s.count
            ends[i] = node
            prev = cur
        self.ends = ends
        for node in range(len(keys) - 1, 0, -1):
            values[parents[node]] += values[node]
            counts[parents[node]] += counts[node]

    def __len__(self) -> int:
        """The number of nodes (root included)."""
        return len(self.keys)

    @property
    def total_ns(self) -> int:
        """Off-CPU time of the whole tree."""
        return self.values[0]

    def name(self, node: int) -> str:
        """What a node's bar shows (printable)."""
        return self.key_names[self.keys[node]]

    def kind(self, node: int) -> int:
        """ROOT, GROUP, KERNEL, USER, PYTHON or UNKNOWN."""
        return self.node_keys[self.keys[node]][0]

    def key_of(self, node: int) -> NodeKey:
        """A node's key below its parent."""
        return self.node_keys[self.keys[node]]

    def path_of(self, node: int) -> NodePath:
        """The keys from the root down to `node` (the root's path is `()`)."""
        out: list[NodeKey] = []
        while node > 0:
            out.append(self.key_of(node))
            node = self.parents[node]
        return tuple(reversed(out))

    def child(self, node: int, key: NodeKey) -> int | None:
        """The child of `node` with `key`, if any."""
        kid = self._key_ids.get(key)
        if kid is None:
            return None
        c = self._first_child[node]
        while c >= 0 and self.keys[c] != kid:
            c = self._next_sibling[c]
        return c if c >= 0 else None

    def find(self, path: NodePath) -> int:
        """The node at `path`, or its deepest ancestor that exists here."""
        node = 0
        for key in path:
            child = self.child(node, key)
            if child is None:
                break
            node = child
        return node

    def is_under(self, node: int, ancestor: int) -> bool:
        """True if `node` is `ancestor` or below it."""
        depth = self.depths[ancestor]
        while self.depths[node] > depth:
            node = self.parents[node]
        return node == ancestor

    def ancestors(self, node: int) -> list[int]:
        """The nodes above `node`, root first."""
        out = []
        while self.parents[node] >= 0:
            node = self.parents[node]
            out.append(node)
        return out[::-1]

    def search(self, text: str, within: int = 0) -> tuple[frozenset[int], SearchResult]:
        """The nodes under `within` whose name contains `text` (case-insensitive)."""
        needle = text.casefold()
        if not needle:
            return frozenset(), SearchResult(text, 0, 0, 0.0)
        # Names repeat a lot (schedule, main...): test each distinct key once.
        hit_keys = {kid for kid, name in enumerate(self.key_names)
                    if kid and needle in name.casefold()}
        hits = frozenset(n for n, kid in enumerate(self.keys)
                         if kid in hit_keys and n and self.is_under(n, within))
        # Time under the matches, each nanosecond once: a match below a match
        # is already counted by the upper one.
        ns = 0
        for nid in hits:
            up = self.parents[nid]
            while up >= 0 and up not in hits:
                up = self.parents[up]
            if up < 0 or not self.is_under(up, within):
                ns += self.values[nid]
        total = self.values[within]
        return hits, SearchResult(text, len(hits), ns, ns / total if total else 0.0)

    def stacks_under(self, node: int) -> list[StackRow]:
        """The stacks that pass through `node` (all of them for the root)."""
        if node == 0:
            return list(self.stacks)
        return [s for s, end in zip(self.stacks, self.ends, strict=True) if self.is_under(end, node)]

    def folded_lines(self, node: int = 0, *, unit_ns: int = 1000) -> list[str]:
        """The stacks through `node` in offtop's folded format, heaviest first.

        `comm;outermost;...;innermost value` as `--format folded` writes
        them (values in microseconds by default), with the frames this tree
        shows (kernel and/or user); identical lines are merged.
        """
        merged: dict[str, int] = {}
        for s in self.stacks_under(node):
            parts = [fold_name(s.comm)]
            if self.show_user:
                parts += [fold_name(f.name) for f in reversed(s.user)]
            if self.show_kernel:
                parts += [fold_name(f.name) for f in reversed(s.kernel)]
            line = ";".join(parts)
            merged[line] = merged.get(line, 0) + s.offcpu_ns
        rows = sorted(merged.items(), key=lambda kv: (-kv[1], kv[0]))
        return [f"{line} {round(ns / unit_ns)}" for line, ns in rows if round(ns / unit_ns) > 0]


#: One bar on screen: first cell, end cell (exclusive), node.
Span = tuple[int, int, int]


@dataclass(frozen=True, slots=True)
class _Layout:
    """The bars at one width and zoom: `rows[depth]` left to right."""

    width: int
    zoom: int
    rows: tuple[tuple[Span, ...], ...]
    where: dict[int, tuple[int, int]]  # node -> (row, index in row)


def layout(tree: FlameTree, zoom: int, width: int) -> _Layout:
    """Lay out the bars under `zoom` across `width` cells.

    A bar narrower than half a cell is not drawn, nor is anything below it;
    children are hottest first, so the walk stops at the first such child.
    The walk therefore visits at most a few bars per cell per line however
    many stacks there are. The zoomed node's ancestors are full-width bars.
    """
    rows: list[list[Span]] = [[] for _ in range(tree.max_depth + 1)]
    for a in tree.ancestors(zoom):
        rows[tree.depths[a]].append((0, width, a))
    total = tree.values[zoom]
    if total > 0 and width > 0:
        scale = width / total
        values, children, depths = tree.values, tree.children, tree.depths
        todo: list[tuple[int, float]] = [(zoom, 0.0)]
        while todo:
            node, x = todo.pop()
            w = values[node] * scale
            x0, x1 = round(x), round(x + w)
            if x1 <= x0:
                continue
            rows[depths[node]].append((x0, x1, node))
            nxt: list[tuple[int, float]] = []
            cx = x
            for c in children(node):
                cw = values[c] * scale
                if cw < 0.5:
                    break
                nxt.append((c, cx))
                cx += cw
            todo += reversed(nxt)  # depth first, left to right
    else:
        rows[tree.depths[zoom]].append((0, width, zoom))
    while len(rows) > 1 and not rows[-1]:
        rows.pop()
    where = {n: (r, i) for r, spans in enumerate(rows) for i, (_, _, n) in enumerate(spans)}
    return _Layout(width, zoom, tuple(tuple(r) for r in rows), where)


def _shades(hex_colour: str) -> tuple[Style, ...]:
    """A few close shades of one colour, so that neighbouring bars stand apart."""
    base = Color.parse(hex_colour)
    colours = (base, base.darken(0.08), base.lighten(0.06), base.darken(0.16))
    return tuple(Style(color="#1a1a1a", bgcolor=c.hex) for c in colours)


class FlameGraph(ScrollView, can_focus=True):
    """An icicle graph of stacks (see module docstring)."""

    DEFAULT_CSS = """
    FlameGraph {
        background: $surface;
        color: $foreground;
        overflow-x: hidden;
        scrollbar-size-vertical: 1;
    }
    """

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("enter", "zoom_in", "Zoom in", tooltip="Zoom into the frame under the cursor",
                id="flame.zoom_in"),
        Binding("plus", "zoom_in", "Zoom in", show=False, key_display="+",
                id="flame.zoom_in_plus"),
        Binding("escape", "zoom_out", "Zoom out", tooltip="Zoom out one level",
                id="flame.zoom_out"),
        Binding("minus", "zoom_out", "Zoom out", show=False, key_display="-",
                id="flame.zoom_out_minus"),
        Binding("home", "reset_zoom", "Whole graph", show=False, id="flame.reset"),
        Binding("left", "cursor_left", "Left", show=False),
        Binding("right", "cursor_right", "Right", show=False),
        Binding("up", "cursor_up", "Caller", show=False),
        Binding("down", "cursor_down", "Callee", show=False),
        Binding("k", "cursor_up", "Caller", show=False, id="flame.up"),
        Binding("j", "cursor_down", "Callee", show=False, id="flame.down"),
    ]

    #: Bar colours: kernel warm, user cool, Python green (render.py's), unresolved grey.
    KIND_STYLES: ClassVar[dict[int, tuple[Style, ...]]] = {
        KERNEL: _shades(KERNEL_STYLE),
        USER: _shades(USER_STYLE),
        PYTHON: _shades(PYTHON_STYLE),
        UNKNOWN: (Style(color="#1a1a1a", bgcolor="#9a9a9a", italic=True),),
        GROUP: _shades("#b8a1e3"),
        ROOT: (Style(color="#f0f0f0", bgcolor="#4a4f5a", bold=True),),
    }
    #: Search hits: flamegraph.pl's magenta.
    MATCH_STYLE: ClassVar[Style] = Style(color="#1a1a1a", bgcolor="#e35fd4", bold=True)
    #: The cursor: the bar's colours swapped, bold.
    CURSOR_STYLE: ClassVar[Style] = Style(reverse=True, bold=True)
    #: The border's subtitle: the keys.
    HINTS: ClassVar[Text] = Text("←↑↓→ move · Enter zoom in · Esc out · Home: all", end="")
    #: Ancestors of the zoomed frame: shown, but faint.
    ABOVE_STYLE: ClassVar[Style] = Style(dim=True)

    def __init__(self, *, id: str | None = None, classes: str | None = None) -> None:
        super().__init__(id=id, classes=classes)
        self.flame_tree = FlameTree(())
        self._zoom = 0
        self._cursor = 0
        self._search = ""
        self._matches: frozenset[int] = frozenset()
        self.search_result: SearchResult | None = None
        """The last search's result in the current view (None without a search)."""
        self._layout: _Layout | None = None
        self._strips: dict[int, Strip] = {}
        self._base: Style | None = None
        self._info: Strip | None = None
        #: Lines drawn (cache misses) since the widget was made, for tests and benchmarks.
        self.lines_rendered = 0

    # --- data ---------------------------------------------------------------

    def show(
        self,
        stacks: Sequence[StackRow],
        *,
        title: str = "all tasks",
        group_by: GroupBy = "none",
        show_kernel: bool = True,
        show_user: bool = True,
    ) -> None:
        """Show `stacks` (building the tree here; see `show_tree` to build it elsewhere)."""
        self.show_tree(FlameTree(stacks, title=title, group_by=group_by,
                                 show_kernel=show_kernel, show_user=show_user))

    def show_tree(self, tree: FlameTree) -> None:
        """Show a tree built elsewhere (e.g. in a worker thread).

        A refresh of the same scope (same title and grouping) keeps the zoom
        and the cursor on the same frames (by path) where they still exist,
        so a live update does not lose the user's place; another scope starts
        from the whole graph. The search is applied again either way.
        """
        old = self.flame_tree
        same_scope = (old.title, old.group_by) == (tree.title, tree.group_by)
        zoom_path = old.path_of(self._zoom) if same_scope else ()
        cursor_path = old.path_of(self._cursor) if same_scope else ()
        self.flame_tree = tree
        self._zoom = tree.find(zoom_path)
        self._cursor = tree.find(cursor_path)
        if not tree.is_under(self._cursor, self._zoom) and self._cursor not in tree.ancestors(
                self._zoom):
            self._cursor = self._zoom
        self._apply_search()
        self._relayout()

    def search(self, text: str) -> SearchResult | None:
        """Highlight the frames whose name contains `text` ("" clears)."""
        self._search = text
        self._apply_search()
        self._strips.clear()
        self._update_titles()
        self.refresh()
        return self.search_result

    def _apply_search(self) -> None:
        if self._search:
            self._matches, self.search_result = self.flame_tree.search(self._search, self._zoom)
        else:
            self._matches, self.search_result = frozenset(), None

    @property
    def zoom_node(self) -> int:
        """The node the view is zoomed into (0: the whole graph)."""
        return self._zoom

    @property
    def cursor_node(self) -> int:
        """The node under the cursor."""
        return self._cursor

    @property
    def zoom_path(self) -> NodePath:
        """The frames from the root down to the zoomed one."""
        return self.flame_tree.path_of(self._zoom)

    def view_stacks(self) -> list[StackRow]:
        """The stacks of the current view (all of them when not zoomed)."""
        return self.flame_tree.stacks_under(self._zoom)

    def folded_lines(self, *, unit_ns: int = 1000) -> list[str]:
        """The current view's stacks in offtop's folded format (see `FlameTree.folded_lines`)."""
        return self.flame_tree.folded_lines(self._zoom, unit_ns=unit_ns)

    # --- layout and titles ------------------------------------------------------

    def _width(self) -> int:
        return max(1, self.scrollable_content_region.width)

    def _current_layout(self) -> _Layout:
        width = self._width()
        lay = self._layout
        if lay is None or lay.width != width or lay.zoom != self._zoom:
            lay = self._layout = layout(self.flame_tree, self._zoom, width)
            self._strips.clear()
            if self._cursor not in lay.where:
                self._cursor = self._zoom
                self._info = None
        return lay

    def _relayout(self) -> None:
        self._layout = None
        self._strips.clear()
        lay = self._current_layout()
        self.virtual_size = Size(lay.width, len(lay.rows) + 1)
        self._update_titles()
        self._scroll_to_cursor()
        self.refresh()

    def _update_titles(self) -> None:
        tree = self.flame_tree
        title = Text("Flame graph of ", end="")
        title.append(printable(tree.title), style="bold")
        if self._zoom:
            title.append("  zoomed into ", style="dim")
            title.append(tree.name(self._zoom))
        self.border_title = title
        self.border_subtitle = self.HINTS
        self._refresh_info()

    def _refresh_info(self) -> None:
        """The info line changed: redraw it alone (a border change repaints everything)."""
        self._info = None
        self.refresh(Region(0, 0, self.size.width, 1))

    def _info_text(self) -> Text:
        tree = self.flame_tree
        n = self._cursor
        t = Text(no_wrap=True, end="")
        if tree.total_ns <= 0:
            t.append("no off-CPU time in this scope", style="dim")
            return t
        t.append(tree.name(n), style="bold")
        t.append(f"  {_KIND_NAMES[tree.kind(n)]}  {format_ns(tree.values[n])}", style="")
        view = tree.values[self._zoom]
        if view and self._zoom:
            t.append(f"  {100 * tree.values[n] / view:.1f}% of view")
        t.append(f"  {100 * tree.values[n] / tree.total_ns:.1f}% of all  {tree.counts[n]:,} blocks")
        res = self.search_result
        if res is not None:
            t.append("  search ", style="dim")
            t.append(printable(res.text), style="bold")
            t.append(f": {res.frames:,} frames, {100 * res.fraction:.1f}%")
        return t

    # --- the cursor ---------------------------------------------------------------

    def _move_cursor(self, node: int) -> None:
        lay = self._current_layout()
        if node == self._cursor or node not in lay.where:
            return
        old = lay.where.get(self._cursor)
        self._cursor = node
        for pos in (old, lay.where[node]):
            if pos is not None:
                self._strips.pop(pos[0], None)
                self.refresh_line(pos[0] + 1)
        self._refresh_info()
        self._scroll_to_cursor()

    def _scroll_to_cursor(self) -> None:
        lay = self._current_layout()
        pos = lay.where.get(self._cursor)
        body = self.scrollable_content_region.height - 1
        if pos is None or body <= 0:
            return
        row, y = pos[0], self.scroll_offset.y
        if row < y:
            y = row
        elif row >= y + body:
            y = row - body + 1
        if y != self.scroll_offset.y:
            self.scroll_to(y=y, animate=False, force=True, immediate=True)

    def action_cursor_left(self) -> None:
        """The bar to the left on the same line."""
        lay = self._current_layout()
        row, i = lay.where.get(self._cursor, (0, 0))
        if i > 0:
            self._move_cursor(lay.rows[row][i - 1][2])

    def action_cursor_right(self) -> None:
        """The bar to the right on the same line."""
        lay = self._current_layout()
        row, i = lay.where.get(self._cursor, (0, 0))
        if i + 1 < len(lay.rows[row]):
            self._move_cursor(lay.rows[row][i + 1][2])

    def action_cursor_up(self) -> None:
        """The caller (the bar above)."""
        parent = self.flame_tree.parents[self._cursor]
        if parent >= 0:
            self._move_cursor(parent)

    def action_cursor_down(self) -> None:
        """The hottest callee that is drawn."""
        lay = self._current_layout()
        for c in self.flame_tree.children(self._cursor):
            if c in lay.where:
                self._move_cursor(c)
                return

    # --- zoom -------------------------------------------------------------------------

    def zoom_to(self, node: int) -> None:
        """Zoom into `node` (0: the whole graph); the cursor goes there too."""
        if not 0 <= node < len(self.flame_tree):
            raise IndexError(node)
        self._zoom = self._cursor = node
        self._apply_search()
        self._relayout()

    def action_zoom_in(self) -> None:
        """Zoom into the frame under the cursor (or out to it, above the zoom)."""
        if self._cursor != self._zoom and self.flame_tree.values[self._cursor] > 0:
            self.zoom_to(self._cursor)

    def action_zoom_out(self) -> None:
        """One level out; at the top, the key goes on to the app (Esc: back)."""
        if self._zoom == 0:
            raise SkipAction()
        previous = self._zoom
        self.zoom_to(self.flame_tree.parents[previous])
        self._move_cursor(previous)

    def action_reset_zoom(self) -> None:
        """The whole graph."""
        self.zoom_to(0)

    # --- mouse ---------------------------------------------------------------------------

    def on_click(self, event: events.Click) -> None:
        """A click puts the cursor on a bar; a click on the cursor's bar zooms into it."""
        offset = event.get_content_offset(self)
        if offset is None:
            return
        lay = self._current_layout()
        row = offset.y - 1 + self.scroll_offset.y
        if offset.y < 1 or not 0 <= row < len(lay.rows):
            return
        for x0, x1, node in lay.rows[row]:
            if x0 <= offset.x < x1:
                event.stop()
                if node == self._cursor:
                    self.action_zoom_in()
                else:
                    self._move_cursor(node)
                return

    def on_resize(self, _: events.Resize) -> None:
        """Bars are laid out for the new width."""
        self._relayout()

    def on_focus(self) -> None:
        """The cursor is drawn only while focused."""
        self._redraw_cursor()

    def on_blur(self) -> None:
        """See `on_focus`."""
        self._redraw_cursor()

    def _redraw_cursor(self) -> None:
        lay = self._current_layout()
        pos = lay.where.get(self._cursor)
        if pos is not None:
            self._strips.pop(pos[0], None)
            self.refresh_line(pos[0] + 1)

    # --- drawing ---------------------------------------------------------------------------

    def render_lines(self, crop: Region) -> list[Strip]:
        """Read the base style once per pass (it is costly to compute per line)."""
        self._base = self.rich_style
        try:
            return super().render_lines(crop)
        finally:
            self._base = None

    def render_line(self, y: int) -> Strip:
        """Screen line `y`: the info line, or the bars at depth `y - 1 + scroll` (cached)."""
        lay = self._current_layout()
        width = self.size.width
        base = self._base if self._base is not None else self.rich_style
        if y == 0:
            if self._info is None or self._info.cell_length != width:
                self._info = Strip(self._info_text().render(self.app.console), None)
                self._info = self._info.crop_extend(0, width, base)
            return self._info
        row = y - 1 + self.scroll_offset.y
        if not 0 <= row < len(lay.rows):
            return Strip.blank(width, base)
        strip = self._strips.get(row)
        if strip is None or strip.cell_length != width:
            self.lines_rendered += 1
            strip = self._draw_row(lay, row, base).crop_extend(0, width, base)
            self._strips[row] = strip
        return strip

    def _bar_style(self, node: int, above: bool, cursor: bool) -> Style:
        tree = self.flame_tree
        if node in self._matches:
            style = self.MATCH_STYLE
        else:
            shades = self.KIND_STYLES[tree.kind(node)]
            # The shade follows the name (a stable hash, not Python's salted
            # one), so a frame keeps its colour across refreshes and runs.
            style = shades[zlib.crc32(tree.name(node).encode("utf-8", "replace")) % len(shades)]
        if above:
            style += self.ABOVE_STYLE
        if cursor:
            style += self.CURSOR_STYLE
        return style

    def _draw_row(self, lay: _Layout, row: int, base: Style) -> Strip:
        tree = self.flame_tree
        zoom_depth = tree.depths[self._zoom]
        cursor = self._cursor if self.has_focus else -1
        segments: list[Segment] = []
        pos = 0
        for x0, x1, node in lay.rows[row]:
            if x0 > pos:
                segments.append(Segment(" " * (x0 - pos), base))
            style = self._bar_style(node, row < zoom_depth, node == cursor)
            w = x1 - x0
            if w == 1:
                segments.append(Segment(" ", style))
            else:
                # The last cell is left blank: it separates neighbouring bars.
                label = " " + tree.name(node)
                if cell_len(label) > w - 1 and w > 4:
                    label = set_cell_size(label, w - 2) + "…"
                segments.append(Segment(set_cell_size(label, w - 1), style))
                segments.append(Segment(" ", base))
            pos = x1
        return Strip(segments, pos)
