"""Who woke the blocks of what the callchain tree shows (issue 11, "who woke me").

Under the callchain tree, for its scope (a task, a process, a command, one
block) and the frame under its cursor: the wakers of the blocks below that
frame, summed across those stacks, most off-CPU time first. A waker is a
task (`comm pid/tid`) or an interrupt (`[timer interrupt]`, `[softirq
NET_RX]`, `[device interrupt]`). Each expands to the stacks it woke from,
kernel then user frames, innermost first (as bcc's offwaketime prints
them); a waker seen with one stack expands straight to its frames. Blocks
whose waker was not seen (they began before offtop started, or ended before
the probe saw their wake-up) are counted on a last line, never dropped.

`g` on a task waker posts `JumpTo`: the app puts the task table's cursor on
that task and opens its callchains. The summary is worked out only for what
is on screen (the scope's stacks below one frame), at each tick and each
move of the callchain tree's cursor; expansion and cursor are kept by path
across updates, and a tick that changes no figure rebuilds nothing.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import ClassVar

from rich.text import Text
from textual.binding import Binding, BindingType
from textual.message import Message
from textual.widgets import Tree
from textual.widgets.tree import TreeNode

from offtop.model import Frame, StackRow, Waker
from offtop.units import format_ns
from offtop.widgets.render import TitledPane, chain_summary, frame_text, set_titles, waker_label

#: A waker's identity: its kind, pid, tid and comm (its stacks told apart below it).
WakerId = tuple[str, int, int, str]
#: One stack a waker woke from: its kernel and user frames, innermost first.
WakerStack = tuple[tuple[Frame, ...], tuple[Frame, ...]]
#: A node's identity: the waker, then one of its stacks, then a frame's position.
NodePath = tuple[object, ...]


@dataclass(frozen=True, slots=True)
class WakerStackTotal:
    """The off-CPU time one waker ended while in one stack."""

    stack: WakerStack
    ns: int
    count: int


@dataclass(frozen=True, slots=True)
class WakerTotal:
    """One waker's part of the off-CPU time of some stacks, stack by stack."""

    waker: Waker
    """The waker (with its heaviest stack; identity is `ident`)."""
    ns: int
    count: int
    stacks: tuple[WakerStackTotal, ...]
    """Most time first; a stack `((), ())` was not taken (a short block)."""

    @property
    def ident(self) -> WakerId:
        """Who it is, whatever stack it woke from."""
        return waker_id(self.waker)


@dataclass(frozen=True, slots=True)
class WakerSummary:
    """Who woke the blocks of some stacks (see `sum_wakers`)."""

    wakers: tuple[WakerTotal, ...]
    """Most time first."""
    total_ns: int
    """The off-CPU time of the stacks summed."""
    unseen_ns: int
    """Of `total_ns`, the time of blocks whose waker was not seen."""
    unseen_count: int


def waker_id(waker: Waker) -> WakerId:
    """A waker's identity, its stacks aside."""
    return (waker.kind, waker.pid, waker.tid, waker.comm)


def sum_wakers(stacks: Iterable[StackRow]) -> WakerSummary:
    """The wakers of `stacks` summed by who they are, most off-CPU time first."""
    # Summed by `Waker` first (its hash is kept: no stack is hashed again
    # here), then grouped by who it is.
    by_waker: dict[Waker, list[int]] = {}
    total = unseen = unseen_count = 0
    for s in stacks:
        total += s.offcpu_ns
        rest, rest_count = s.offcpu_ns, s.count
        for w in s.wakers:
            rest -= w.offcpu_ns
            rest_count -= w.count
            acc = by_waker.get(w.waker)
            if acc is None:
                by_waker[w.waker] = [w.offcpu_ns, w.count]
            else:
                acc[0] += w.offcpu_ns
                acc[1] += w.count
        if rest > 0:
            unseen += rest
            unseen_count += max(0, rest_count)
    by_id: dict[WakerId, list[tuple[Waker, int, int]]] = {}
    for waker, (ns, n) in by_waker.items():
        by_id.setdefault(waker_id(waker), []).append((waker, ns, n))
    out = []
    for parts in by_id.values():
        parts.sort(key=lambda p: (-p[1], -p[2]))
        ranked = tuple(WakerStackTotal((w.kernel, w.user), ns, n) for w, ns, n in parts)
        out.append(WakerTotal(parts[0][0], sum(t.ns for t in ranked),
                              sum(t.count for t in ranked), ranked))
    out.sort(key=lambda t: (-t.ns, t.waker.kind != "task", t.waker.tid, t.waker.comm))
    return WakerSummary(tuple(out), total, unseen, unseen_count)


@dataclass(frozen=True, slots=True)
class WakerNode:
    """What one node of the waker tree stands for."""

    path: NodePath
    waker: Waker | None
    """The waker the node is (or is below); None for the "not seen" line."""


class WakerTree(Tree[WakerNode], TitledPane):
    """Who woke the blocks the callchain tree shows (see module docstring)."""

    DEFAULT_CSS = """
    WakerTree {
        height: auto;
        max-height: 45%;
        border-top: solid $panel-lighten-2;
        border-title-color: $text-muted;
        border-title-style: bold;
        scrollbar-size-vertical: 1;
        &.-empty {
            display: none;
        }
        &:focus {
            border-top: solid $accent;
            border-title-color: $accent;
        }
    }
    """

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("k", "cursor_up", "Up", show=False),
        Binding("j", "cursor_down", "Down", show=False),
        Binding("g", "jump", "Go to waker", id="wakers.jump",
                tooltip="Go to the waking task: its row in the task table, its callchains"),
    ]

    #: Wakers listed at most; the rest are summed on one line.
    MAX_WAKERS: ClassVar[int] = 40

    class JumpTo(Message):
        """`g` on a task waker: go to that task."""

        def __init__(self, waker: Waker) -> None:
            super().__init__()
            self.waker = waker

        @property
        def pid(self) -> int:
            """The waker's process."""
            return self.waker.pid

        @property
        def tid(self) -> int:
            """The waker's thread."""
            return self.waker.tid

    def __init__(self, *, id: str | None = None, classes: str | None = None) -> None:
        super().__init__(Text("wakers"), id=id, classes=classes)
        self.show_root = False
        self.guide_depth = 2
        #: Whose wakers are shown (a new owner resets the expansion).
        self.owner: object = None
        #: The summary shown.
        self.summary = WakerSummary((), 0, 0, 0)
        self._paths: dict[NodePath, TreeNode[WakerNode]] = {}
        self._shape: list[NodePath] = []
        self._labels: dict[NodePath, Text] = {}

    # --- public ---------------------------------------------------------

    def show(self, owner: object, title: Text, stacks: Iterable[StackRow]) -> None:
        """Show who woke `stacks` (of `owner`), keeping expansion and cursor by path."""
        summary = sum_wakers(stacks)
        self.summary = summary
        self.set_class(not summary.wakers, "-empty")
        set_titles(self, self._title(title, summary))  # only if changed: no repaint
        items = self._items(summary)
        shape = [path for path, _, _, _ in items]
        new_owner = owner != self.owner
        if not new_owner and shape == self._shape:
            for path, _, label, _ in items:
                if self._labels.get(path) != label:
                    self._labels[path] = label
                    self._paths[path].set_label(label)
            return
        expanded = set() if new_owner else {
            p for p, n in self._paths.items() if n.is_expanded}
        cursor = None if new_owner else self._cursor_path()
        self.owner = owner
        self._rebuild(items)
        if new_owner and summary.wakers and (summary.wakers[0].waker.kernel
                                             or summary.wakers[0].waker.user):
            expanded = {(summary.wakers[0].ident,)}  # the top waker's stack, at once
        for path in sorted(expanded, key=len):
            node = self._paths.get(path)
            if node is not None and node.allow_expand:
                node.expand()
        self._place_cursor(cursor)

    def node_at(self, path: NodePath) -> TreeNode[WakerNode] | None:
        """The node of a path, if shown."""
        return self._paths.get(path)

    def action_jump(self) -> None:
        """Go to the task under the cursor (or above it), if a task woke."""
        node = self.cursor_node
        waker = node.data.waker if node is not None and node.data is not None else None
        if waker is None:
            return
        if waker.kind != "task":
            self.notify(f"{waker.label} is an interrupt, not a task", markup=False)
            return
        self.post_message(self.JumpTo(waker))

    # --- building -------------------------------------------------------

    def _title(self, scope: Text, summary: WakerSummary) -> Text:
        t = Text("Who woke ", end="")
        t.append_text(scope)
        n = len(summary.wakers)
        t.append(f"  {n} waker{'s' if n != 1 else ''}", style="dim")
        if summary.unseen_ns and summary.total_ns:
            seen = 100 * (summary.total_ns - summary.unseen_ns) / summary.total_ns
            t.append(f", {seen:.0f}% of the time seen", style="dim")
        t.append(" · g: go to waker", style="dim")
        return t

    def _items(self, summary: WakerSummary) -> list[tuple[NodePath, NodePath, Text, bool]]:
        """Every node in order: (path, parent path, label, expandable)."""
        total = summary.total_ns
        items: list[tuple[NodePath, NodePath, Text, bool]] = []
        shown = summary.wakers[: self.MAX_WAKERS]
        for w in shown:
            top: NodePath = (w.ident,)
            taken = [s for s in w.stacks if s.stack != ((), ())]
            label = _figures(w.ns, w.count, total)
            label.append_text(waker_label(w.waker))
            if not taken:
                label.append("  (stack not taken: short blocks)", style="dim italic")
            items.append((top, (), label, bool(taken)))
            if len(w.stacks) == 1 and taken:
                items += _frame_items(top, taken[0].stack)
                continue
            for s in w.stacks:
                path = (*top, s.stack)
                label = _figures(s.ns, s.count, total)
                if s.stack == ((), ()):
                    label.append("(stack not taken: short blocks)", style="dim italic")
                    items.append((path, top, label, False))
                    continue
                label.append_text(chain_summary(*s.stack, max_kernel=3, max_user=2))
                items.append((path, top, label, True))
                items += _frame_items(path, s.stack)
        rest = summary.wakers[self.MAX_WAKERS:]
        if rest:
            label = _figures(sum(w.ns for w in rest), sum(w.count for w in rest), total)
            label.append(f"{len(rest)} more wakers", style="dim italic")
            items.append((("more",), (), label, False))
        if summary.unseen_ns:
            label = _figures(summary.unseen_ns, summary.unseen_count, total)
            label.append("[waker not seen]", style="dim italic")
            items.append((("unseen",), (), label, False))
        return items

    def _rebuild(self, items: list[tuple[NodePath, NodePath, Text, bool]]) -> None:
        self.clear()
        self._paths = {(): self.root}
        self._labels = {}
        self._shape = []
        wakers = {w.ident: w.waker for w in self.summary.wakers}
        for path, parent, label, expandable in items:
            ident = path[0]
            waker = wakers.get(ident) if isinstance(ident, tuple) else None
            self._paths[path] = self._paths[parent].add(
                label, WakerNode(path, waker), allow_expand=expandable)
            self._labels[path] = label
            self._shape.append(path)

    def _cursor_path(self) -> NodePath | None:
        node = self.cursor_node
        return node.data.path if node is not None and node.data is not None else None

    def _place_cursor(self, path: NodePath | None) -> None:
        """The cursor on `path`, or its nearest shown ancestor, or the first line."""
        node = self.root.children[0] if self.root.children else None
        while path:
            found = self._paths.get(path)
            if found is not None and all(self._paths[path[:i]].is_expanded
                                         for i in range(1, len(path))):
                node = found
                break
            path = path[:-1]
        if node is not None:
            _ = self.last_line  # lays the lines out, so the node knows its line
            self.move_cursor(node)


def _figures(ns: int, count: int, total: int) -> Text:
    """`   52ms  96.2%     12  `: time, share of the shown stacks' time, blocks."""
    pct = 100.0 * ns / total if total > 0 else 0.0
    t = Text(no_wrap=True, end="")
    t.append(f"{format_ns(ns):>7}", style="bold" if pct >= 10 else "")
    t.append(f" {pct:5.1f}%", style="dim" if pct < 1 else "")
    t.append(f" {count:>6,}  ", style="dim")
    return t


def _frame_items(parent: NodePath, stack: WakerStack) -> list[tuple[NodePath, NodePath,
                                                                    Text, bool]]:
    """A waker's frames as leaves: kernel then user, innermost first."""
    kernel, user = stack
    out: list[tuple[NodePath, NodePath, Text, bool]] = []
    for i, frame in enumerate((*kernel, *user)):
        label = frame_text(frame, module=True)
        out.append(((*parent, i), parent, label, False))
    return out

