"""The stacks pane: whose callchains, and how they are shown.

Its scope is the task (or process) under the task table's cursor, all tasks
(`all_tasks`), every process of one command, or one block opened on its own
(a task blocked now, a long block). Its view is a ranked table of stacks, a
callchain tree with who woke those blocks under it (`WakerTree`: the wakers
of the stacks below the tree's cursor, of the last interval), or a flame
graph of the same scope. On top of the snapshot it can merge identical
stacks (across a process's threads, or across processes with one command),
hide idle waits, and sum stacks since offtop started instead of showing the
last interval.

The pane keeps what it needs to stay put while the data moves: the last
stacks of an idle task (shown as "last seen"), the callchain tree's owner,
and the flame graph's tree, which is built in a worker thread, only while
the flame graph is on screen, and for a big graph not at every tick (at
most a tenth of the time goes to building). A merge that meets thousands
of chains not seen before has them worked out in a worker thread first
(the table says "merging…" meanwhile). It sets its own title and subtitle.
"""

from __future__ import annotations

import time
from collections.abc import Hashable
from dataclasses import dataclass
from typing import ClassVar, Literal

from rich.text import Text
from textual import on, work
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.message import Message
from textual.reactive import var
from textual.widgets import ContentSwitcher

from offtop.gc_pacing import Parcel
from offtop.model import (
    MergeBy,
    MergedStack,
    RowKey,
    SinceStart,
    SnapshotIndex,
    StackRow,
    merge_identical,
)
from offtop.units import format_ns
from offtop.widgets.callchain_tree import CallchainTree, Path, passes_through, stack_path
from offtop.widgets.flame_graph import FlameGraph, FlameTree, GroupBy
from offtop.widgets.render import TitledPane, frame_text, set_titles
from offtop.widgets.scopes import ALL, Scope, ScopeStacks
from offtop.widgets.stack_table import StackKey, StackTable
from offtop.widgets.waker_tree import WakerTree

View = Literal["stacks", "tree", "flame"]
"""What the pane draws: the stacks table, the callchain tree or the flame graph."""

#: `m` cycles through these.
MERGE_CYCLE: tuple[MergeBy, ...] = ("none", "process", "command")


@dataclass(frozen=True, slots=True)
class ViewData:
    """The stacks of what the pane shows now, for an export."""

    stacks: tuple[StackRow, ...]
    title: str
    start: float
    end: float
    show_kernel: bool
    show_user: bool


class StacksPane(ContentSwitcher, TitledPane):
    """Stacks, callchain tree or flame graph of a scope (see module docstring)."""

    #: After building a flame tree in `t` seconds, new data waits `t` times
    #: this before the next build (a big graph is not rebuilt every tick).
    FLAME_IDLE_FACTOR: ClassVar[float] = 9.0
    #: A merge meeting this many chains not seen before has them worked out in
    #: a worker thread first (each costs a few µs on the event loop otherwise).
    MERGE_ON_LOOP: ClassVar[int] = 2_000

    # `var`s, not `reactive`s: a change redraws what its watcher says changed
    # (a reactive would also repaint the whole pane, at every tick).
    index: var[SnapshotIndex] = var(SnapshotIndex.empty, init=False)
    """The snapshot shown (the app binds it)."""
    show_kernel: var[bool] = var(True, init=False)
    """Kernel frames are shown (bound)."""
    show_user: var[bool] = var(True, init=False)
    """User frames are shown (bound)."""
    hide_idle: var[bool] = var(False, init=False)
    """Idle waits are left out (bound)."""
    filter_text: var[str] = var("", init=False)
    """All tasks' stacks: only those of matching tasks or frames; the flame
    graph highlights matching frames (bound)."""
    all_tasks: var[bool] = var(False, init=False)
    """The stacks of every task, not the selected one's."""
    view: var[View] = var("stacks", init=False)
    """The table, the tree or the flame graph."""
    merge: var[MergeBy] = var("none", init=False)
    """How identical stacks are merged in the table."""
    cumulative: var[bool] = var(False, init=False)
    """Stacks summed since offtop started, not the last interval's."""

    class SinceStartReady(Message):
        """The since-start ranking of a scope, worked out in a thread."""

        def __init__(self, rows: tuple[StackRow, ...], seq: int,
                     wanted: tuple[Scope, int | None]) -> None:
            super().__init__()
            self.rows = rows
            #: The ranking's number (in the order asked).
            self.seq = seq
            self.wanted = wanted

    class ViewChanged(Message):
        """The pane shows another view (the app adapts the layout)."""

        def __init__(self, view: View) -> None:
            super().__init__()
            self.view = view

    class ChainsLearned(Message):
        """The chains of an index's stacks are known: a merge of them is quick now."""

        def __init__(self, index: SnapshotIndex) -> None:
            super().__init__()
            self.index = index

    class FlameReady(Message):
        """A flame graph's tree, built in a thread."""

        def __init__(self, tree: FlameTree, inputs: tuple[Hashable, ...],
                     build_s: float) -> None:
            super().__init__()
            self.tree = tree
            self.inputs = inputs
            self.build_s = build_s

    def __init__(self, since_start: SinceStart, *, id: str | None = None,
                 classes: str | None = None) -> None:
        super().__init__(id=id, classes=classes, initial="stacks")
        self.since_start = since_start
        #: The task under the task table's cursor.
        self.selected: RowKey | None = None
        #: The scope of the tree and flame graph (set when one is opened).
        self.opened: Scope = ALL
        self.scopes = ScopeStacks()
        self._focus_path: Path | None = None
        self._searched = ""
        #: Rankings asked for, and the number of the one shown: a replay's
        #: step back shows an older snapshot, so snapshot numbers cannot tell
        #: a stale ranking from a fresh one.
        self._since_asked = 0
        self._since_seq = -1
        self._since_for: tuple[Scope, int | None] | None = None
        self._flame_inputs: tuple[Hashable, ...] = ()
        self._flame_due = 0.0
        #: The index whose chains a worker thread is working out, if any.
        self._learning: SnapshotIndex | None = None
        #: What the merged rows in the table are (merge, scope and switches), if merged.
        self._merge_drawn: tuple[Hashable, ...] | None = None
        #: The tree's owner and the stacks whose wakers the waker tree sums.
        self._waker_owner: object = None
        self._waker_stacks: list[StackRow] = []

    def compose(self) -> ComposeResult:
        yield StackTable(id="stacks")
        with Vertical(id="tree"):
            yield CallchainTree(id="callchain")
            yield WakerTree(id="wakers")
        yield FlameGraph(id="flame")

    # --- what the app asks --------------------------------------------------

    def select(self, key: RowKey | None, *, moved: bool = True) -> None:
        """The task table's cursor is on `key`: show its stacks (unless all
        tasks'). An open tree or flame graph follows when the user `moved`
        the cursor, not when a refresh brought another task under it."""
        if key == self.selected:
            return
        self.selected = key
        if (moved and self.view != "stacks" and not self.all_tasks
                and self.opened.kind == "task"):
            self.opened = Scope.task(key)
        self._refresh()

    def preselect(self, key: RowKey | None) -> None:
        """`select(key, moved=False)` just before a new index, which draws the pane:
        it is drawn once, for the task selected (the task table's message that
        follows finds it selected already)."""
        self.selected = key

    def open(self, scope: Scope, *, view: View = "tree", focus: Path | None = None) -> None:
        """Open the tree (or the flame graph) of `scope`, the cursor on `focus`."""
        self.opened = scope
        if self.view == view:
            self._refresh(focus=focus)
        else:
            self._focus_path = focus
            self.view = view
        self.visible_child().focus()

    def back(self) -> bool:
        """Esc: from the tree or the flame graph back to the table (False: nothing to do)."""
        if self.view == "stacks":
            return False
        self.view = "stacks"
        return True

    def toggle_flame(self) -> None:
        """The flame graph of what is shown now, or back from it."""
        if self.view == "flame":
            self.view = "stacks"
            return
        if self.view == "stacks":
            self.opened = self._table_scope()
        self.open(self.opened, view="flame")

    def cycle_merge(self) -> None:
        """Merge stacks: not at all, within a process, across one command."""
        self.merge = MERGE_CYCLE[(MERGE_CYCLE.index(self.merge) + 1) % len(MERGE_CYCLE)]

    def visible_child(self) -> StackTable | CallchainTree | FlameGraph:
        """The widget drawn now."""
        if self.view == "tree":
            return self.query_one(CallchainTree)
        if self.view == "flame":
            return self.query_one(FlameGraph)
        return self.query_one(StackTable)

    def view_data(self) -> ViewData:
        """The stacks of the current view (a zoomed flame graph: what is in view)."""
        scope = self._table_scope() if self.view == "stacks" else self.opened
        stacks, _ = self._stacks_of(scope)
        if self.view == "flame":
            stacks = self.query_one(FlameGraph).view_stacks()
        snap = self.index.snapshot
        start = self.since_start.since if self.cumulative else snap.time - snap.interval_s
        return ViewData(tuple(stacks), self._scope_title(scope).plain, start, snap.time,
                        self.show_kernel, self.show_user)

    # --- watchers -------------------------------------------------------------

    def watch_index(self, index: SnapshotIndex) -> None:
        self.scopes.seen(index, (self.selected, self.opened.key))
        if self.cumulative:
            self._rank_since_start()
        self._refresh()

    def watch_view(self, view: View) -> None:
        self.current = view
        # The flame graph draws its own border and titles: the pane has none
        # meanwhile. Inline, not a class: a class restyles the pane's every
        # widget (~10 ms of each f).
        self.styles.border = "none" if view == "flame" else None
        focus, self._focus_path = self._focus_path, None
        self._refresh(focus=focus)
        self.post_message(self.ViewChanged(view))

    def watch_all_tasks(self) -> None:
        if self.view != "stacks":
            self.view = "stacks"
        else:
            self._refresh()

    def watch_cumulative(self, cumulative: bool) -> None:
        self.scopes.since, self._since_seq, self._since_for = None, -1, None
        self._refresh()

    def watch_merge(self) -> None:
        self._refresh()

    def watch_show_kernel(self) -> None:
        self._refresh()

    def watch_show_user(self) -> None:
        self._refresh()

    def watch_hide_idle(self) -> None:
        self._refresh()

    def watch_filter_text(self, text: str) -> None:
        if self.view == "flame":
            self._search()
        elif self.all_tasks:
            self._refresh()

    # --- scopes and their stacks ----------------------------------------------

    def _table_scope(self) -> Scope:
        return ALL if self.all_tasks else Scope.task(self.selected)

    def _stacks_of(self, scope: Scope) -> tuple[list[StackRow], bool]:
        """A scope's stacks as the pane's switches ask; whether they are the last seen."""
        # The filter narrows the table of all tasks; the flame graph highlights instead.
        text = self.filter_text.strip() if scope.kind == "all" and self.view == "stacks" else ""
        return self.scopes.stacks(scope, self.index, cumulative=self.cumulative,
                                  hide_idle=self.hide_idle, text=text)

    # --- refreshing -------------------------------------------------------------

    def _refresh(self, *, focus: Path | None = None) -> None:
        if not self.is_mounted:
            return
        if self.cumulative and self._since_for != self._since_wanted():
            self._rank_since_start()  # other totals are wanted: they come from a thread
        if self.view == "stacks":
            self._refresh_table()
        elif self.view == "tree":
            self._refresh_tree(focus)
        else:
            self._refresh_flame()

    def _refresh_table(self) -> None:
        scope = self._table_scope()
        stacks, stale = self._stacks_of(scope)
        everything = scope.kind == "all"
        limit = StackTable.MAX_ROWS_ALL if everything else StackTable.MAX_ROWS
        title = Text("All stacks by off-CPU time" if everything else "Stacks of ", end="")
        if not everything:
            title.append_text(self._scope_title(scope))
        drawn = (self.merge, scope, self.cumulative, self.hide_idle, self.filter_text)
        if self.merge != "none" and self._learn_first(stacks):
            # The rows shown stay until the chains are known (`_chains_learned`);
            # a new merge says so, new data for the merge shown waits silently.
            if drawn != self._merge_drawn:
                self._set_titles(title, Text(f"merging {len(stacks):,} stacks…",
                                             style="italic", end=""))
            return
        self._merge_drawn = drawn if self.merge != "none" else None
        merged, in_all = merge_identical(stacks, self.merge, self.index.facts_of, limit)
        rows = [(self._row_key(m), m) for m in merged]
        total = sum(s.offcpu_ns for s in stacks)
        self.query_one(StackTable).show(
            rows, scope="all" if everything else "task", merged=self.merge != "none",
            total_ns=total, show_kernel=self.show_kernel, show_user=self.show_user)
        self._set_titles(title, self._table_subtitle(len(stacks), in_all, len(rows), stale))

    def _learn_first(self, stacks: list[StackRow]) -> bool:
        """Whether a merge of `stacks` waits for a worker thread to work out
        their chains (started here unless already under way): so it does when
        `MERGE_ON_LOOP` chains or more are new. Each is a few µs; 20,000
        held the event loop for most of a tenth of a second."""
        index = self.index
        if len(stacks) < self.MERGE_ON_LOOP or \
                index.catalog.new_chains(stacks) < self.MERGE_ON_LOOP:
            return False
        if self._learning is not index:
            self._learning = index
            self._learn_chains(Parcel((stacks, index)))
        return True

    @work(thread=True, exclusive=True, group="chains", exit_on_error=False,
          description="chain numbers")
    def _learn_chains(self, parcel: Parcel[tuple[list[StackRow], SnapshotIndex]]) -> None:
        """Work out the chains of some stacks of an index off the event loop."""
        got = parcel.take()
        if got is None:
            return
        stacks, index = got
        index.facts_of(stacks)
        self.post_message(self.ChainsLearned(index))

    @on(ChainsLearned)
    def _chains_learned(self, message: ChainsLearned) -> None:
        if message.index is self._learning:
            self._learning = None
        if message.index is self.index and self.view == "stacks" and self.merge != "none":
            self._refresh()

    def _row_key(self, m: MergedStack) -> StackKey:
        s = m.row
        owner: Hashable = s.tid
        if self.merge == "process":
            owner = ("p", s.pid)
        elif self.merge == "command":
            owner = ("c", s.comm)
        return (owner, s.state, s.before_start, self.index.facts(s).chain)

    def _table_subtitle(self, stacks: int, rows: int, shown: int, stale: bool) -> Text:
        sub = Text(end="")
        if stale:
            sub.append("idle this interval: last seen", style="italic #e0c050")
        else:
            what = f"{stacks:,} stacks" if rows == stacks else f"{rows:,} rows of {stacks:,} stacks"
            sub.append(what if shown == rows else f"top {shown:,} of {what}")
        sub.append_text(self._mode_text())
        sub.append(" · Enter: tree · f: flame graph" + ("" if self.all_tasks
                                                       else " · a: all tasks"))
        return sub

    def _mode_text(self) -> Text:
        t = Text(end="")
        if self.merge != "none":
            t.append(f" · merged by {self.merge}", style="bold")
        if self.hide_idle:
            t.append(" · idle hidden", style="bold")
        if self.cumulative:
            since = "" if self.scopes.since is not None else " (summing…)"
            t.append(f" · since start{since}", style="bold")
            dropped = self.since_start.dropped_ns
            if dropped:  # the totals' bound: said, never silent
                t.append(f" · {format_ns(dropped)} in lighter stacks not kept (all tasks)",
                         style="italic #e0c050")
        return t

    def _refresh_tree(self, focus: Path | None) -> None:
        scope = self.opened
        stacks, stale = self._stacks_of(scope)
        total = sum(s.offcpu_ns for s in stacks)
        label = self._scope_title(scope)
        label.append(f"  {format_ns(total)} off-CPU", style="bold")
        interval_s = self.index.snapshot.interval_s
        if scope.block is None and not self.cumulative and interval_s > 0:
            label.append(f" ({100 * total / (interval_s * 1e9):.0f}% of {interval_s:g}s)",
                         style="dim")
        states: dict[str, int] = {}
        for s in stacks:
            states[s.state] = states.get(s.state, 0) + s.offcpu_ns
        for state, ns in sorted(states.items(), key=lambda kv: -kv[1]):
            label.append(f"  {state} {format_ns(ns)}", style="dim")
        if stale:
            label.append("  (idle this interval: last seen)", style="italic #e0c050")
        owner = (scope.kind, scope.key, scope.comm, scope.block)
        self.query_one(CallchainTree).show(owner, label, stacks, show_kernel=self.show_kernel,
                                           show_user=self.show_user, focus=focus)
        title = Text("Callchain of ", end="")
        title.append_text(self._scope_title(scope))
        sub = Text("outermost frame first", end="")
        sub.append_text(self._mode_text())
        # Wakers are not summed since start: the last interval's are shown.
        self._waker_owner = owner
        self._waker_stacks = (self.scopes.stacks(scope, self.index, hide_idle=self.hide_idle)[0]
                              if self.cumulative else stacks)
        woken = any(s.wakers for s in self._waker_stacks)
        sub.append(" · K/U: kernel/user frames" + (" · Tab: wakers" if woken else "")
                   + " · Esc: back")
        self._set_titles(title, sub)
        self._refresh_wakers()

    @on(CallchainTree.NodeHighlighted, "#callchain")
    def _refresh_wakers(self) -> None:
        """Who woke the blocks below the callchain tree's cursor (all at its root)."""
        if self.view != "tree":
            return
        node = self.query_one(CallchainTree).cursor_node
        call = node.data if node is not None else None
        stacks = self._waker_stacks
        title = self._scope_title(self.opened)
        if call is not None and call.frame is not None:
            kernel, user = self.show_kernel, self.show_user
            stacks = [s for s in stacks
                      if passes_through(s, call.path, show_kernel=kernel, show_user=user)]
            title.append(" below ", style="dim")
            title.append_text(frame_text(call.frame))
        if self.cumulative:
            title.append(" (last interval)", style="dim")
        self.query_one(WakerTree).show(self._waker_owner, title, stacks)

    def _refresh_flame(self) -> None:
        scope = self.opened
        stacks, _ = self._stacks_of(scope)
        group: GroupBy = ("process" if scope.kind in ("all", "command")
                          else "thread" if scope.key is not None and scope.key.is_process
                          else "none")
        what = (scope, self.cumulative, self.hide_idle, self.show_kernel, self.show_user)
        inputs = (what, self.index.snapshot.seq, self._since_seq)
        # New data for the same graph waits while the last build is recent:
        # the builds of a big graph take at most a tenth of the time.
        due = what != self._flame_inputs[:1] or time.monotonic() >= self._flame_due
        if inputs != self._flame_inputs and due:
            self._flame_inputs = inputs
            # Begun once the screen shows the rest: a big graph's build holds the
            # interpreter most of the time it runs (~0.2 s at 20,000 stacks), and
            # begun at once it made the redraw it came with wait its turns.
            self.call_after_refresh(self._build_flame, Parcel(stacks),
                                    self._scope_title(scope).plain, group, inputs,
                                    (self.show_kernel, self.show_user))
        if self._searched != self.filter_text.strip():
            self._search()

    def _search(self) -> None:
        """The flame graph highlights the frames that contain the filter text."""
        self._searched = self.filter_text.strip()
        self.query_one(FlameGraph).search(self._searched)

    # A description given: Textual would otherwise make one of the arguments' reprs,
    # on the event loop (20,000 stack rows: a quarter of a second).
    @work(thread=True, exclusive=True, group="flame", exit_on_error=False,
          description="flame graph")
    def _build_flame(self, parcel: Parcel[list[StackRow]], title: str, group: GroupBy,
                     inputs: tuple[Hashable, ...], frames: tuple[bool, bool]) -> None:
        """Merge the stacks into a flame tree off the event loop."""
        stacks = parcel.take()
        if stacks is None:
            return
        start = time.monotonic()
        tree = FlameTree(stacks, title=title, group_by=group, show_kernel=frames[0],
                         show_user=frames[1])
        self.post_message(self.FlameReady(tree, inputs, time.monotonic() - start))

    @on(FlameReady)
    def _flame_ready(self, message: FlameReady) -> None:
        self._flame_due = time.monotonic() + self.FLAME_IDLE_FACTOR * message.build_s
        if message.inputs == self._flame_inputs and self.view == "flame":
            self.query_one(FlameGraph).show_tree(message.tree)

    def _shown_scope(self) -> Scope:
        return self._table_scope() if self.view == "stacks" else self.opened

    def _since_wanted(self) -> tuple[Scope, int | None]:
        """The scope whose since-start totals are shown, and how many: the
        table shows the heaviest rows only, unless they are merged or
        filtered first; the tree and the flame graph need them all."""
        plain = (self.view == "stacks" and self.merge == "none" and not self.hide_idle
                 and not self.filter_text.strip())
        return self._shown_scope(), StackTable.MAX_ROWS_ALL if plain else None

    def _rank_since_start(self) -> None:
        wanted = self._since_wanted()
        if wanted[0].kind != "none":
            self._since_for = wanted
            self._since_asked += 1
            self._rank_worker(self._since_asked, wanted)

    @work(thread=True, exclusive=True, group="since-start", exit_on_error=False,
          description="since-start ranking")
    def _rank_worker(self, seq: int, wanted: tuple[Scope, int | None]) -> None:
        """Rank a scope's since-start totals off the event loop."""
        scope, limit = wanted
        rows = self.since_start.ranked(scope.holds_task, limit)
        self.post_message(self.SinceStartReady(rows, seq, wanted))

    @on(SinceStartReady)
    def _since_start_ready(self, message: SinceStartReady) -> None:
        # A ranking older than the one shown (a slow thread), or of a scope
        # no longer shown, is dropped.
        if (self.cumulative and message.seq >= self._since_seq
                and message.wanted == self._since_for):
            self.scopes.since, self._since_seq = message.rows, message.seq
            self._refresh()

    # --- titles -----------------------------------------------------------------

    def _set_titles(self, title: Text, subtitle: Text) -> None:
        if self.cumulative:
            title.append(" since start", style="bold")
        set_titles(self, title, subtitle)

    def _scope_title(self, scope: Scope) -> Text:
        return self.scopes.title(scope, self.index)

    # --- the table's rows -------------------------------------------------------

    @on(StackTable.StackChosen)
    def _stack_chosen(self, event: StackTable.StackChosen) -> None:
        """Enter on a stack: the tree of its owner, the cursor on it."""
        event.stop()
        s = event.merged.row
        scope = self._table_scope()
        if scope.kind == "all":
            scope = (Scope.task(RowKey.thread(s.tid)) if self.merge == "none"
                     else Scope.task(RowKey.process(s.pid)) if self.merge == "process"
                     else Scope.command(s.comm))
        self.open(scope, focus=stack_path(s, show_kernel=self.show_kernel,
                                          show_user=self.show_user))

