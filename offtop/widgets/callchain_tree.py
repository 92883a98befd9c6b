"""A task's stacks merged into a callchain tree, outermost frame first.

Each node is one frame on the way from `main` (or `start_thread`) down into
the kernel, labelled with the off-CPU time spent below it and its share of
the task's total. The tree is diffed by path on every refresh: labels change
in place, vanished paths are removed, new ones inserted by rank, so what the
user expanded stays expanded and the cursor stays on the same frame.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass
from itertools import chain
from typing import ClassVar

from rich.text import Text
from textual.binding import Binding, BindingType
from textual.widgets import Tree
from textual.widgets.tree import TreeNode

from offtop.model import Frame, StackRow
from offtop.units import format_ns
from offtop.widgets.render import frame_text, outer_to_inner

#: A node's identity: the frames from the outermost one down to it.
Path = tuple[str, ...]


@dataclass(slots=True)
class CallNode:
    """What one tree node stands for."""

    path: Path
    frame: Frame | None
    ns: int = 0
    count: int = 0


def _step(frame: Frame) -> str:
    return ("k:" if frame.kernel else "u:") + frame.name


def merge_stacks(
    stacks: Iterable[StackRow], *, show_kernel: bool = True, show_user: bool = True
) -> dict[Path, CallNode]:
    """Merge callchains into a prefix tree, keyed by path (the root is `()`)."""
    nodes: dict[Path, CallNode] = {(): CallNode((), None)}
    for s in stacks:
        root = nodes[()]
        root.ns += s.offcpu_ns
        root.count += s.count
        path: Path = ()
        for frame in outer_to_inner(s.kernel, s.user, show_kernel=show_kernel,
                                    show_user=show_user):
            path = (*path, _step(frame))
            node = nodes.get(path)
            if node is None:
                node = nodes[path] = CallNode(path, frame)
            node.ns += s.offcpu_ns
            node.count += s.count
    return nodes


def stack_path(stack: StackRow, *, show_kernel: bool = True, show_user: bool = True) -> Path:
    """The tree path of one stack's innermost frame."""
    return tuple(
        _step(f)
        for f in outer_to_inner(stack.kernel, stack.user, show_kernel=show_kernel,
                                show_user=show_user)
    )


def passes_through(stack: StackRow, path: Path, *, show_kernel: bool = True,
                   show_user: bool = True) -> bool:
    """True if `stack`'s tree path begins with `path` (the stack is below that node).

    Compares frame by frame from the outermost, and stops at the first that
    differs: most stacks of a scope part from a path within a few frames.
    """
    frames = chain(reversed(stack.user) if show_user else (),
                   reversed(stack.kernel) if show_kernel else ())
    steps = iter(path)
    # Frames first: when they run out, no step is taken from the path unseen.
    for frame, step in zip(frames, steps, strict=False):
        if _step(frame) != step:
            return False
    return next(steps, None) is None  # a path longer than the stack is not passed through


class CallchainTree(Tree[CallNode]):
    """A callchain tree of one scope's stacks (see module docstring).

    `Enter` or space expands and collapses; expanding a node with a single
    child expands down the chain; `e` expands the hottest path, `x` collapses
    everything.
    """

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("k", "cursor_up", "Up", show=False, id="tree.up"),
        Binding("j", "cursor_down", "Down", show=False, id="tree.down"),
        Binding("e", "expand_hot", "Expand hottest", tooltip="Expand the hottest path",
                id="tree.hot"),
        Binding("x", "collapse_all", "Collapse all", show=False,
                tooltip="Collapse every node", id="tree.collapse"),
    ]

    #: Expansion states remembered for this many tasks.
    MEMORY: ClassVar[int] = 64

    def __init__(self, *, id: str | None = None, classes: str | None = None) -> None:
        super().__init__(Text("no task selected", style="dim"), id=id, classes=classes)
        self.guide_depth = 2
        self.owner: Hashable | None = None
        self._view: tuple[bool, bool] = (True, True)
        self._paths: dict[Path, TreeNode[CallNode]] = {}
        self._memory: dict[tuple[Hashable, bool, bool], set[Path]] = {}
        self._last_total: int | None = None

    # --- public ---------------------------------------------------------

    def show(
        self,
        owner: Hashable,
        title: Text,
        stacks: Sequence[StackRow],
        *,
        show_kernel: bool = True,
        show_user: bool = True,
        focus: Path | None = None,
    ) -> None:
        """Show `stacks` (of `owner`, e.g. a task's `RowKey`), diffing against what is shown.

        A different owner or frame filter rebuilds the tree, restoring the
        expansion remembered for it (or expanding the hottest path). `focus`
        expands down to that path and puts the cursor on it.
        """
        view = (show_kernel, show_user)
        merged = merge_stacks(stacks, show_kernel=show_kernel, show_user=show_user)
        total = merged[()].ns
        self.root.set_label(title)
        if owner != self.owner or view != self._view or not self._paths:
            if self.owner is not None:
                self._remember()
            self.owner, self._view = owner, view
            self._rebuild(merged, total)
            remembered = self._memory.get((owner, *view))
            if remembered:
                for path in sorted(remembered, key=len):
                    node = self._paths.get(path)
                    if node is not None and node.allow_expand:
                        node.expand()
            elif focus is None:
                self.expand_hot()
            self._place_cursor(focus or ())
        else:
            cursor = self.cursor_node.data.path if self.cursor_node and self.cursor_node.data \
                else ()
            self._diff(merged, total)
            self._place_cursor(focus or cursor)
        if focus:
            for i in range(len(focus)):
                node = self._paths.get(focus[:i])
                if node is not None and not node.is_expanded:
                    node.expand()
            self._place_cursor(focus)

    def expanded_paths(self) -> set[Path]:
        """Paths of the expanded nodes."""
        return {p for p, n in self._paths.items() if n.is_expanded and n.children}

    def node_at(self, path: Path) -> TreeNode[CallNode] | None:
        """The node for a path, if shown."""
        return self._paths.get(path)

    def action_expand_hot(self) -> None:
        """Expand the hottest path from the root down."""
        self.expand_hot()

    def action_collapse_all(self) -> None:
        """Collapse everything below the root."""
        for child in self.root.children:
            child.collapse_all()
        self._place_cursor(())

    def expand_hot(self) -> None:
        """Expand the hottest path, from the root down to its leaf."""
        node = self.root
        node.expand()
        while node.children:
            node = max(node.children, key=lambda n: n.data.ns if n.data else 0)
            if node.children:
                node.expand()

    # --- internals ------------------------------------------------------

    def _remember(self) -> None:
        if self.owner is None:
            return
        key = (self.owner, *self._view)
        self._memory.pop(key, None)
        self._memory[key] = self.expanded_paths()
        while len(self._memory) > self.MEMORY:
            del self._memory[next(iter(self._memory))]

    def _label(self, node: CallNode, total: int) -> Text:
        pct = 100.0 * node.ns / total if total > 0 else 0.0
        t = Text(no_wrap=True, end="")
        t.append(f"{format_ns(node.ns):>7}", style="bold" if pct >= 10 else "")
        t.append(f" {pct:5.1f}%  ", style="dim" if pct < 1 else "")
        if node.frame is not None:
            t.append_text(frame_text(node.frame, module=True))
        return t

    def _children_of(self, merged: dict[Path, CallNode]) -> dict[Path, list[CallNode]]:
        children: dict[Path, list[CallNode]] = {}
        for path, node in merged.items():
            if path:
                children.setdefault(path[:-1], []).append(node)
        for kids in children.values():
            kids.sort(key=lambda n: (-n.ns, n.path[-1]))
        return children

    def _rebuild(self, merged: dict[Path, CallNode], total: int) -> None:
        self._last_total = total
        self.clear()
        self.root.data = merged[()]
        self.root.expand()
        self._paths = {(): self.root}
        children = self._children_of(merged)
        stack: list[Path] = [()]
        while stack:
            path = stack.pop()
            parent = self._paths[path]
            for kid in children.get(path, ()):
                self._paths[kid.path] = parent.add(
                    self._label(kid, total), kid, allow_expand=kid.path in children
                )
                stack.append(kid.path)

    def _diff(self, merged: dict[Path, CallNode], total: int) -> None:
        self.root.data = merged[()]
        # Vanished paths go, with everything below them.
        for path in sorted((p for p in self._paths if p not in merged), key=len):
            node = self._paths.get(path)
            if node is None:
                continue
            self._forget(node)
            node.remove()
        children = self._children_of(merged)
        for path in sorted(merged, key=len):
            if not path:
                continue
            new = merged[path]
            node = self._paths.get(path)
            has_kids = path in children
            if node is not None:
                old = node.data
                if old is None or (old.ns, old.count) != (new.ns, new.count) or \
                        self._stale_total(total):
                    node.data = new
                    node.set_label(self._label(new, total))
                if node.allow_expand != has_kids:
                    node.allow_expand = has_kids
                continue
            parent = self._paths[path[:-1]]
            before = next(
                (c for c in parent.children if c.data is not None and c.data.ns < new.ns), None
            )
            self._paths[path] = parent.add(
                self._label(new, total), new, before=before, allow_expand=has_kids
            )
        self._last_total = total

    def _stale_total(self, total: int) -> bool:
        # Percentages depend on the task total: relabel everything when it moves.
        return self._last_total != total

    def _forget(self, node: TreeNode[CallNode]) -> None:
        todo = [node]
        while todo:
            n = todo.pop()
            if n.data is not None:
                self._paths.pop(n.data.path, None)
            todo.extend(n.children)

    def _visible(self, path: Path) -> bool:
        for i in range(len(path)):
            parent = self._paths.get(path[:i])
            if parent is None or not parent.is_expanded:
                return False
        return path in self._paths

    def _place_cursor(self, path: Path) -> None:
        while path and not self._visible(path):
            path = path[:-1]
        node = self._paths.get(path)
        if node is None:
            return
        _ = self.last_line  # lays the lines out, so the node knows its line
        if self.cursor_node is not node:
            self.move_cursor(node)

    def on_tree_node_expanded(self, event: Tree.NodeExpanded[CallNode]) -> None:
        """Expanding a node with a single child expands down the chain."""
        node = event.node
        if len(node.children) == 1:
            child = node.children[0]
            if child.allow_expand and not child.is_expanded:
                child.expand()
