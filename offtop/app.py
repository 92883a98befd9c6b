"""The offtop TUI: a live, top-like view of off-CPU time.

Data flows one way. A thread worker owns the `SnapshotSource`: it starts it
(compiling BPF can take a second; the screen shows at once, loading), then
asks it for one snapshot per interval, indexes it (stacks by thread and by
process, off the event loop) and posts it as a single `SnapshotReady`
message. A backlog of those collapses to the newest (`can_replace`); the
long blocks of every snapshot are queued separately so none is lost. The
app shows a snapshot inside `batch_update()` and each widget diffs it in.
The thread never touches widgets; the UI never blocks on the source, except
for `set_threshold`, a single map write.
"""

from __future__ import annotations

import asyncio
import gc
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import ClassVar

from rich.text import Text
from textual import events, on, work
from textual.app import App, ComposeResult, SystemCommand
from textual.binding import Binding, BindingType
from textual.containers import Horizontal, Vertical
from textual.css.query import NoMatches
from textual.message import Message
from textual.reactive import var
from textual.screen import Screen
from textual.widgets import ContentSwitcher, Input, Static
from textual.worker import get_current_worker

from offtop.model import LongBlock, ProcessRow, Snapshot, StackRow, TaskRow
from offtop.safe_text import printable_lines
from offtop.source import SnapshotSource
from offtop.units import format_ns
from offtop.widgets.blocked_now import BlockedNowTable
from offtop.widgets.callchain_tree import CallchainTree, Path, stack_path
from offtop.widgets.header import OfftopHeader
from offtop.widgets.help_screen import HelpScreen, HelpSection
from offtop.widgets.key_bar import KeyBar
from offtop.widgets.line_table import LineTable
from offtop.widgets.long_blocks_log import LongBlocksLog
from offtop.widgets.render import task_label, untrusted_text
from offtop.widgets.stack_table import StackTable
from offtop.widgets.task_table import COLUMN_TITLES, SORT_CYCLE, TaskTable
from offtop.widgets.threshold_slider import ThresholdSlider

#: Threshold presets offered by the command palette.
THRESHOLD_PRESETS_NS: tuple[int, ...] = (
    0, 100_000, 1_000_000, 10_000_000, 100_000_000, 500_000_000, 1_000_000_000,
    10_000_000_000,
)


@dataclass(frozen=True, slots=True)
class SnapshotIndex:
    """Per-snapshot lookups, built once per snapshot (in the worker thread)."""

    by_tid: Mapping[int, tuple[StackRow, ...]]
    by_pid: Mapping[int, tuple[StackRow, ...]]
    rows: Mapping[str, TaskRow | ProcessRow]

    @classmethod
    def build(cls, snap: Snapshot) -> SnapshotIndex:
        """Group the stacks by thread and by process, keeping their rank order."""
        by_tid: dict[int, list[StackRow]] = {}
        by_pid: dict[int, list[StackRow]] = {}
        for s in snap.stacks:
            by_tid.setdefault(s.tid, []).append(s)
            by_pid.setdefault(s.pid, []).append(s)
        rows: dict[str, TaskRow | ProcessRow] = {t.key: t for t in snap.tasks}
        rows.update((p.key, p) for p in snap.processes)
        return cls(
            by_tid={k: tuple(v) for k, v in by_tid.items()},
            by_pid={k: tuple(v) for k, v in by_pid.items()},
            rows=rows,
        )

    def stacks_of_key(self, key: str) -> tuple[StackRow, ...]:
        """The stacks of a task-table row key (`t<tid>` or `p<pid>`)."""
        kind, num = key[:1], key[1:]
        if not num.isdigit():
            return ()
        table = self.by_tid if kind == "t" else self.by_pid
        return table.get(int(num), ())


class SnapshotReady(Message):
    """A new snapshot from the source; a newer one still queued replaces it."""

    def __init__(self, snapshot: Snapshot, index: SnapshotIndex) -> None:
        super().__init__()
        self.snapshot = snapshot
        self.index = index

    def can_replace(self, message: Message) -> bool:
        """Only the newest snapshot matters (long blocks are queued apart)."""
        return isinstance(message, SnapshotReady)


class SourceStarted(Message):
    """`source.start()` returned: the capture is running."""


class SourceFailed(Message):
    """The source raised: in `start()` (`started=False`) or later."""

    def __init__(self, error: BaseException, *, started: bool) -> None:
        super().__init__()
        self.error = error
        self.started = started


class SourceEnded(Message):
    """The source has no more snapshots (a replay ran out, or we are stopping)."""


class OfftopApp(App[int]):
    """Where threads spend their time off the CPU, live.

    Tasks ranked by off-CPU time on the left, the selected task's stacks (or
    its callchain tree) below them; on the right what is blocked right now,
    the long-block threshold slider and the log of long blocks.
    """

    CSS_PATH = "app.tcss"
    TITLE = "offtop"
    AUTO_FOCUS = "#tasks"
    HORIZONTAL_BREAKPOINTS = [(0, "-narrow"), (100, "-wide")]
    VERTICAL_BREAKPOINTS = [(0, "-short"), (24, "-tall")]

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("q", "quit", "Quit", tooltip="Quit (the terminal is restored)", id="app.quit"),
        Binding("ctrl+c", "quit", "Quit", show=False, priority=True, id="app.quit_ctrl_c"),
        Binding("question_mark", "help", "Help", key_display="?", tooltip="This help",
                id="app.help"),
        Binding("p", "toggle_pause", "Pause",
                tooltip="Pause / resume the display (data keeps accumulating)", id="app.pause"),
        Binding("space", "toggle_pause", "Pause", show=False, id="app.pause_space"),
        Binding("s", "cycle_sort", "Sort", tooltip="Sort the task table by the next column",
                id="app.sort"),
        Binding("t", "toggle_processes", "Threads/procs", tooltip="Rank threads or processes",
                id="app.processes"),
        Binding("slash", "filter", "Filter", key_display="/",
                tooltip="Filter tasks by comm or pid substring", id="app.filter"),
        Binding("a", "toggle_all_stacks", "All stacks",
                tooltip="Stacks pane: the selected task's stacks, or all tasks' stacks",
                id="app.all_stacks"),
        Binding("plus", "threshold_up", "Threshold", key_display="+",
                tooltip="Raise the long-block threshold one step", id="app.threshold_up"),
        Binding("equals_sign", "threshold_up", "Threshold up", show=False, key_display="=",
                id="app.threshold_up_eq"),
        Binding("minus", "threshold_down", "Threshold down", show=False, key_display="-",
                tooltip="Lower the long-block threshold one step", id="app.threshold_down"),
        Binding("K", "toggle_kernel", "Kernel frames", show=False,
                tooltip="Show / hide kernel frames", id="app.kernel"),
        Binding("U", "toggle_user", "User frames", show=False,
                tooltip="Show / hide user frames", id="app.user"),
        Binding("escape", "go_back", "Back", show=False,
                tooltip="Close the filter, leave the tree, back to the task table",
                id="app.back"),
        Binding("tab", "focus_next", "Next pane", show=False, tooltip="Next pane",
                id="app.next_pane"),
        Binding("shift+tab", "focus_previous", "Previous pane", show=False,
                tooltip="Previous pane", id="app.previous_pane"),
        Binding("ctrl+p", "command_palette", "Commands", show=False,
                tooltip="Command palette (sort by, threshold presets, ...)", id="app.palette"),
    ]

    paused: var[bool] = var(False, init=False)
    """The display is frozen (data keeps accumulating in the source)."""
    processes: var[bool] = var(False, init=False)
    """Rank processes instead of threads."""
    all_stacks: var[bool] = var(False, init=False)
    """The stacks pane ranks the stacks of all tasks, not the selected one's."""
    drilled: var[bool] = var(False, init=False)
    """The stacks pane shows a callchain tree."""
    show_kernel: var[bool] = var(True, init=False)
    """Kernel frames are shown."""
    show_user: var[bool] = var(True, init=False)
    """User frames are shown."""
    threshold_ns: var[int] = var(0, init=False)
    """The long-block threshold in force in the source."""
    status: var[str] = var("starting", init=False)
    """`starting`, `running`, `ended` or `failed`."""

    def __init__(
        self,
        source: SnapshotSource,
        *,
        interval_s: float = 1.0,
        clock: Callable[[], float] | None = None,
        freeze_gc: bool = False,
    ) -> None:
        super().__init__()
        #: Once the first snapshot is on screen, move everything alive then
        #: (widgets, styles, caches) out of the cyclic GC's full passes, which
        #: otherwise stall the UI every few seconds. For the process that owns
        #: the app (run_app), not for tests that share a process.
        self.freeze_gc = freeze_gc
        self.source = source
        self.interval_s = interval_s
        self.clock = clock or time.monotonic
        #: The exception that stopped the source, for `run_app` and the CLI.
        self.source_error: BaseException | None = None
        #: Snapshots received from the source (shown or not).
        self.received = 0
        self.snapshot: Snapshot | None = None
        self.index = SnapshotIndex({}, {}, {})
        self._stop = threading.Event()
        self._held: SnapshotReady | None = None
        self._pending_blocks: deque[LongBlock] = deque(maxlen=LongBlocksLog.MAX_LINES)
        self._arrived = 0.0
        self._selected: str | None = None
        self._tree_owner: str | None = None
        self._last_stacks: dict[str, tuple[StackRow, ...]] = {}
        self._signals: list[int] = []

    # --- layout -----------------------------------------------------------

    def compose(self) -> ComposeResult:
        yield OfftopHeader(id="header")
        with Horizontal(id="main"):
            with Vertical(id="left"):
                with Vertical(id="tasks-pane", classes="pane"):
                    yield Input(placeholder="filter: comm or pid substring, Enter keeps, "
                                "Esc clears", id="filter", compact=True)
                    yield TaskTable(id="tasks")
                with ContentSwitcher(id="stacks-pane", classes="pane", initial="stacks"):
                    yield StackTable(id="stacks")
                    yield CallchainTree(id="tree")
            with Vertical(id="right"):
                yield BlockedNowTable(id="blocked", classes="pane")
                yield ThresholdSlider(self.source.threshold_ns, id="slider", classes="pane")
                yield LongBlocksLog(id="long-blocks", classes="pane")
        yield Static(id="error")
        yield KeyBar(id="keys")

    def on_mount(self) -> None:
        header = self.query_one(OfftopHeader)
        header.info = self.source.info
        header.interval_s = self.interval_s
        self.set_reactive(OfftopApp.threshold_ns, self.source.threshold_ns)
        header.threshold_ns = self.source.threshold_ns
        self.add_class("-loading")
        tasks = self.query_one(TaskTable)
        tasks.loading = True
        tasks.focus()
        self.query_one("#tasks-pane").border_title = "Tasks"
        self.query_one("#stacks-pane").border_title = "Stacks"
        self.query_one(BlockedNowTable).border_title = "Blocked now"
        self.query_one(ThresholdSlider).border_title = "Long-block threshold"
        self.query_one(LongBlocksLog).border_title = "Long blocks"
        self._install_signal_handlers()
        self.set_interval(0.25, self._advance_blocked)
        self._run_source()

    def on_unmount(self) -> None:
        self._stop.set()
        self._remove_signal_handlers()

    def on_resize(self, event: events.Resize) -> None:
        """Narrow terminals get fewer, narrower task columns."""
        self.query_one(TaskTable).set_compact(event.size.width < 94)

    # --- signals and exit ---------------------------------------------------

    def _install_signal_handlers(self) -> None:
        try:
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGTERM, signal.SIGHUP):
                loop.add_signal_handler(sig, self.exit)
                self._signals.append(sig)
        except (NotImplementedError, RuntimeError, ValueError):
            pass  # not the main thread, or no signals on this platform

    def _remove_signal_handlers(self) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        for sig in self._signals:
            loop.remove_signal_handler(sig)
        self._signals.clear()

    def exit(
        self, result: int | None = None, return_code: int = 0, message: object = None
    ) -> None:
        """Stop the source thread, then exit as usual."""
        self._stop.set()
        super().exit(result, return_code, message)  # type: ignore[arg-type]

    # --- the source thread ----------------------------------------------

    @work(thread=True, exclusive=True, name="source", group="source", exit_on_error=False)
    def _run_source(self) -> None:
        """Own the source: start it, then post one snapshot per interval."""
        stop = self._stop
        worker = get_current_worker()
        try:
            self.source.start()
        except Exception as error:
            self.post_message(SourceFailed(error, started=False))
            return
        self.post_message(SourceStarted())
        while not stop.is_set() and not worker.is_cancelled:
            try:
                snap = self.source.next_snapshot(self.interval_s, stop)
            except Exception as error:
                self.post_message(SourceFailed(error, started=True))
                return
            if snap is None:
                break
            self.publish(snap)
        self.post_message(SourceEnded())

    def publish(self, snap: Snapshot) -> None:
        """Hand a snapshot to the UI (from any thread): index it, queue its
        long blocks, post one message. Tests and the bench call it too."""
        index = SnapshotIndex.build(snap)
        self._pending_blocks.extend(snap.long_blocks)
        self.post_message(SnapshotReady(snap, index))

    # --- source messages ----------------------------------------------------

    def on_source_started(self, _: SourceStarted) -> None:
        self.query_one(OfftopHeader).info = self.source.info
        if self.status == "starting":
            self.query_one(OfftopHeader).status = "running"

    def on_source_failed(self, message: SourceFailed) -> None:
        self.source_error = message.error
        self.status = "failed"
        text = Text()
        if message.started:
            text.append("The capture stopped:\n\n", style="bold")
        else:
            text.append("offtop could not start the capture:\n\n", style="bold")
        # An error may quote what a process controls (a path, a name): escaped.
        error = printable_lines(str(message.error))
        text.append(f"{type(message.error).__name__}: {error}", style="#ff6b6b")
        text.append("\n\nPress q to quit.", style="dim")
        if self.snapshot is None:
            self.query_one("#error", Static).update(text)
            self.add_class("-failed")
        else:
            self.notify(error, title="capture stopped", severity="error",
                        timeout=3600, markup=False)

    def on_source_ended(self, _: SourceEnded) -> None:
        if self.status != "failed":
            self.status = "ended" if not self._stop.is_set() else self.status

    def on_snapshot_ready(self, message: SnapshotReady) -> None:
        if self._stop.is_set():
            return  # quitting: the widgets may already be gone
        self.received += 1
        if self.status == "starting":
            self.status = "running"
        try:
            if self.paused:
                self._held = message
                self.query_one(OfftopHeader).behind += 1
                return
            self._show(message)
        except NoMatches:
            pass  # shutting down: the widgets are gone

    def _show(self, message: SnapshotReady) -> None:
        self._held = None
        snap = self.snapshot = message.snapshot
        self.index = message.index
        self._arrived = self.clock()
        blocks: list[LongBlock] = []
        while self._pending_blocks:
            blocks.append(self._pending_blocks.popleft())
        with self.batch_update():
            if self.has_class("-loading"):
                self.remove_class("-loading")
                tasks = self.query_one(TaskTable)
                tasks.loading = False
                if self.screen.focused is None:
                    tasks.focus()
                if self.freeze_gc:
                    self.call_after_refresh(_freeze_gc)
            header = self.query_one(OfftopHeader)
            header.snapshot = snap
            header.behind = 0
            self._refresh_tasks()
            self._refresh_stacks()
            blocked = self.query_one(BlockedNowTable)
            blocked.show(snap.blocked_now, show_kernel=self.show_kernel,
                         show_user=self.show_user)
            blocked.border_title = f"Blocked now ({len(snap.blocked_now)})"
            log = self.query_one(LongBlocksLog)
            log.add_blocks(blocks, show_kernel=self.show_kernel, show_user=self.show_user)
            log.border_title = f"Long blocks ≥ {format_ns(snap.threshold_ns)}"
            skipped = f", {log.skipped:,} not listed (flood)" if log.skipped else ""
            log.border_subtitle = f"{log.total:,} seen{skipped}"

    def _advance_blocked(self) -> None:
        """Let the blocked-now waits grow between snapshots."""
        if self.snapshot is None or self.paused or self._stop.is_set():
            return
        elapsed = max(0.0, self.clock() - self._arrived)
        for table in self.query(BlockedNowTable):
            table.advance(int(elapsed * 1e9))

    # --- refreshing panes ---------------------------------------------------

    def _refresh_tasks(self) -> None:
        snap = self.snapshot
        if snap is None:
            return
        table = self.query_one(TaskTable)
        rows: Sequence[TaskRow | ProcessRow] = snap.processes if self.processes else snap.tasks
        table.show(rows, snap.interval_s)
        self._selected = table.cursor_key
        self._update_tasks_title()

    def _update_tasks_title(self) -> None:
        table = self.query_one(TaskTable)
        what = "processes" if self.processes else "threads"
        pane = self.query_one("#tasks-pane")
        pane.border_title = f"{what.capitalize()} by off-CPU time"
        # A Text, not a string: Textual parses a string title as markup, and
        # the filter is typed text ("[/usr]" would raise MarkupError).
        sub = Text(f"{table.total_rows:,} {what}", end="")
        if table.filter_text:
            sub.append(f" · {table.matching_rows:,} match “")
            sub.append_text(untrusted_text(table.filter_text))
            sub.append("”")
        if table.hidden_rows:
            sub.append(f" · {table.hidden_rows:,} more")
        sub.append(f" · sort {table.sort_spec.label()}")
        pane.border_subtitle = sub

    def _stacks_for(self, key: str) -> tuple[tuple[StackRow, ...], bool]:
        """A task's stacks now, or the last ones seen if it is idle (and say so)."""
        stacks = self.index.stacks_of_key(key)
        if stacks:
            self._last_stacks.pop(key, None)
            self._last_stacks[key] = stacks
            while len(self._last_stacks) > 16:
                del self._last_stacks[next(iter(self._last_stacks))]
            return stacks, False
        last = self._last_stacks.get(key)
        return (last, True) if last else ((), False)

    def _task_title(self, key: str | None) -> Text:
        if key is None:
            return Text("no task selected", style="dim")
        row = self.index.rows.get(key) or self._row_in_table(key)
        if row is None:
            return Text(key)
        if isinstance(row, ProcessRow):
            t = task_label(row.comm, row.pid)
            t.append(f" ({row.threads} threads)", style="dim")
            if row.user:
                t.append(" ")
                t.append_text(untrusted_text(row.user, "italic"))
            if row.cmdline:
                cmd = row.cmdline if len(row.cmdline) <= 60 else row.cmdline[:59] + "…"
                t.append(" ")
                t.append_text(untrusted_text(cmd, "dim"))
        else:
            t = task_label(row.comm, row.pid, row.tid)
        return t

    def _row_in_table(self, key: str) -> TaskRow | ProcessRow | None:
        kind, num = key[:1], key[1:]
        if not num.isdigit():
            return None
        for s in self._last_stacks.get(key, ()):
            if kind == "t":
                return TaskRow(s.pid, s.tid, s.comm, 0, 0, 0, {}, 0)
            return ProcessRow(s.pid, s.comm, 0, 0, 0, 0, {}, 0)
        return None

    def _refresh_stacks(self, *, focus: Path | None = None) -> None:
        snap = self.snapshot
        if snap is None:
            return
        pane = self.query_one("#stacks-pane")
        table = self.query_one(StackTable)
        if self.all_stacks:
            table.show(snap.stacks, scope="all", show_kernel=self.show_kernel,
                       show_user=self.show_user, total_ns=snap.total_offcpu_ns)
            pane.border_title = "All stacks by off-CPU time"
            shown = min(len(snap.stacks), StackTable.MAX_ROWS_ALL)
            pane.border_subtitle = f"{shown:,} of {len(snap.stacks):,} stacks"
        else:
            key = self._selected
            stacks, stale = self._stacks_for(key) if key else ((), False)
            table.show(stacks, scope="task", show_kernel=self.show_kernel,
                       show_user=self.show_user)
            title = Text("Stacks of ", end="")
            title.append_text(self._task_title(key))
            pane.border_title = title
            count = f"{len(stacks):,} stacks"
            if len(stacks) > StackTable.MAX_ROWS:
                count = f"top {StackTable.MAX_ROWS} of {count}"
            pane.border_subtitle = (
                "idle this interval: last seen" if stale else count
            ) + " · Enter: callchain tree · a: all tasks"
        if self.drilled:
            self._refresh_tree(focus=focus)

    def _refresh_tree(self, *, focus: Path | None = None) -> None:
        snap = self.snapshot
        owner = self._tree_owner
        if snap is None or owner is None:
            return
        stacks, stale = self._stacks_for(owner)
        total = sum(s.offcpu_ns for s in stacks)
        title = self._task_title(owner)
        title.append(f"  {format_ns(total)} off-CPU", style="bold")
        if snap.interval_s > 0:
            title.append(f" ({100 * total / (snap.interval_s * 1e9):.0f}% of "
                         f"{snap.interval_s:g}s)", style="dim")
        states: dict[str, int] = {}
        for s in stacks:
            states[s.state] = states.get(s.state, 0) + s.offcpu_ns
        for state, ns in sorted(states.items(), key=lambda kv: -kv[1]):
            title.append(f"  {state} {format_ns(ns)}", style="dim")
        if stale:
            title.append("  (idle this interval: last seen)", style="italic #e0c050")
        tree = self.query_one(CallchainTree)
        tree.show(owner, title, stacks, show_kernel=self.show_kernel, show_user=self.show_user,
                  focus=focus)
        pane = self.query_one("#stacks-pane")
        pane.border_title = Text("Callchain of ", end="") + self._task_title(owner)
        pane.border_subtitle = "outermost frame first · k/u: kernel/user frames · Esc: back"

    # --- watchers -------------------------------------------------------------

    def watch_paused(self, paused: bool) -> None:
        self.set_class(paused, "-paused")
        self.query_one(OfftopHeader).paused = paused
        if not paused and self._held is not None:
            self._show(self._held)

    def watch_processes(self, processes: bool) -> None:
        table = self.query_one(TaskTable)
        old = table.cursor_key
        table.set_mode(processes=processes)
        self._refresh_tasks()
        if old is not None:
            target = self._map_key(old, processes)
            if target is not None:
                table.move_to_key(target)
        self._selected = table.cursor_key
        if self.drilled and not self.all_stacks:
            self._tree_owner = self._selected
        self._refresh_stacks()

    def _map_key(self, key: str, processes: bool) -> str | None:
        """The row of the other mode for the same task: thread ↔ its process."""
        if processes and key.startswith("t"):
            row = self.index.rows.get(key)
            return f"p{row.pid}" if row is not None else None
        if not processes and key.startswith("p"):
            main = f"t{key[1:]}"
            if main in self.index.rows:
                return main
            stacks = self.index.stacks_of_key(key)
            return f"t{stacks[0].tid}" if stacks else None
        return key

    def watch_all_stacks(self, all_stacks: bool) -> None:
        self.drilled = False
        self._refresh_stacks()

    def watch_drilled(self, drilled: bool) -> None:
        # On the screen, where the size breakpoints are: the short layout
        # swaps the task pane for the tree (see app.tcss).
        self.screen.set_class(drilled, "-drilled")
        switcher = self.query_one(ContentSwitcher)
        switcher.current = "tree" if drilled else "stacks"
        if not drilled:
            self._refresh_stacks()

    def watch_show_kernel(self, show: bool) -> None:
        if not (show or self.show_user):
            self.show_user = True  # hiding both would leave nothing: bring the other back
            return  # (its watcher refreshes)
        self._frames_changed()

    def watch_show_user(self, show: bool) -> None:
        if not (show or self.show_kernel):
            self.show_kernel = True
            return
        self._frames_changed()

    def _frames_changed(self) -> None:
        self._refresh_stacks()
        if self.snapshot is not None:
            self.query_one(BlockedNowTable).show(
                self.snapshot.blocked_now, show_kernel=self.show_kernel, show_user=self.show_user
            )
        shown = [n for n, on_ in (("kernel", self.show_kernel), ("user", self.show_user)) if on_]
        self.notify(f"showing {' + '.join(shown)} frames", timeout=2)

    def watch_threshold_ns(self, ns: int) -> None:
        self.query_one(OfftopHeader).threshold_ns = ns
        self.query_one(ThresholdSlider).value_ns = ns

    def watch_status(self, status: str) -> None:
        self.query_one(OfftopHeader).status = status
        if status in ("failed", "ended") and self.has_class("-loading"):
            self.remove_class("-loading")
            self.query_one(TaskTable).loading = False

    # --- widget messages ------------------------------------------------------

    @on(LineTable.RowHighlighted, "#tasks")
    def _task_highlighted(self, event: LineTable.RowHighlighted) -> None:
        key = event.key
        if key == self._selected or key != event.table.cursor_key:
            return  # already shown, or the cursor has moved on since
        self._selected = key
        if self.drilled and not self.all_stacks:
            self._tree_owner = key
        if not self.all_stacks:
            self._refresh_stacks()

    @on(LineTable.RowSelected, "#tasks")
    def _task_selected(self, event: LineTable.RowSelected) -> None:
        self._selected = event.key
        self._drill(self._selected)

    @on(LineTable.RowSelected, "#stacks")
    def _stack_selected(self, event: LineTable.RowSelected) -> None:
        stack = self.query_one(StackTable).stack_by_key(event.key)
        if stack is None:
            return
        owner = f"t{stack.tid}" if self.all_stacks or not self._selected else self._selected
        self._drill(owner, focus=stack_path(stack, show_kernel=self.show_kernel,
                                            show_user=self.show_user))

    @on(LineTable.RowSelected, "#blocked")
    def _blocked_selected(self, event: LineTable.RowSelected) -> None:
        b = self.query_one(BlockedNowTable).blocked_at_cursor()
        if b is None:
            return
        self.select_task(b.tid, b.pid)

    def select_task(self, tid: int, pid: int) -> bool:
        """Put the task-table cursor on a thread (or its process) and focus it."""
        key = f"p{pid}" if self.processes else f"t{tid}"
        table = self.query_one(TaskTable)
        if table.filter_text and not table.move_to_key(key):
            self._close_filter()
        if not table.move_to_key(key):
            self.notify(f"{key[1:]} had no off-CPU time in the last interval", timeout=3)
            return False
        table.focus()
        return True

    def _drill(self, owner: str | None, *, focus: Path | None = None) -> None:
        if owner is None or self.snapshot is None:
            return
        self._tree_owner = owner
        if self.drilled:
            self._refresh_tree(focus=focus)
        else:
            self.drilled = True
            self._refresh_tree(focus=focus)
        self.query_one(CallchainTree).focus()

    def on_threshold_slider_changed(self, event: ThresholdSlider.Changed) -> None:
        self.set_threshold(event.value_ns)

    def set_threshold(self, ns: int) -> None:
        """Write a new long-block threshold to the source, now."""
        ns = max(0, int(ns))
        try:
            self.source.set_threshold(ns)
        except Exception as error:  # a map write failing is shown, not swallowed
            self.notify(f"could not set the threshold: {error}", severity="error", markup=False)
            self.query_one(ThresholdSlider).value_ns = self.threshold_ns
            return
        self.threshold_ns = ns

    @on(TaskTable.SortChanged)
    def _sort_changed(self, _: TaskTable.SortChanged) -> None:
        self._update_tasks_title()

    @on(Input.Changed, "#filter")
    def _filter_changed(self, event: Input.Changed) -> None:
        self.query_one(TaskTable).set_filter(event.value)
        self._update_tasks_title()

    @on(Input.Submitted, "#filter")
    def _filter_submitted(self, event: Input.Submitted) -> None:
        if not event.value:
            self._close_filter()
        self.query_one(TaskTable).focus()

    def _close_filter(self) -> None:
        filt = self.query_one("#filter", Input)
        filt.value = ""
        self.remove_class("-filtering")
        self.query_one(TaskTable).set_filter("")
        self._update_tasks_title()

    # --- actions --------------------------------------------------------------

    async def action_quit(self) -> None:
        """Quit (q, Ctrl+C)."""
        self.exit()

    def action_toggle_pause(self) -> None:
        """Freeze or unfreeze the display."""
        self.paused = not self.paused

    def action_cycle_sort(self) -> None:
        """Sort the task table by the next column."""
        self.query_one(TaskTable).cycle_sort()

    def action_sort_by(self, column: str) -> None:
        """Sort the task table by a column."""
        self.query_one(TaskTable).sort_by(column)

    def action_toggle_processes(self) -> None:
        """Rank threads or processes."""
        self.processes = not self.processes

    def action_toggle_all_stacks(self) -> None:
        """Stacks of the selected task, or of all tasks."""
        self.all_stacks = not self.all_stacks

    def action_filter(self) -> None:
        """Open the filter input."""
        self.add_class("-filtering")
        self.query_one("#filter", Input).focus()

    def action_threshold_up(self) -> None:
        """Raise the long-block threshold one step."""
        self.query_one(ThresholdSlider).action_increase()

    def action_threshold_down(self) -> None:
        """Lower the long-block threshold one step."""
        self.query_one(ThresholdSlider).action_decrease()

    def action_set_threshold(self, ns: int) -> None:
        """Set the long-block threshold to a preset."""
        self.query_one(ThresholdSlider).move_to(ns)

    def action_toggle_kernel(self) -> None:
        """Show or hide kernel frames."""
        self.show_kernel = not self.show_kernel

    def action_toggle_user(self) -> None:
        """Show or hide user frames."""
        self.show_user = not self.show_user

    def action_go_back(self) -> None:
        """Esc: close the filter, leave the tree, or go back to the task table."""
        filt = self.query_one("#filter", Input)
        if filt.has_focus:
            self._close_filter()
            self.query_one(TaskTable).focus()
        elif self.drilled:
            self.drilled = False
            # Back where the drill started: the stacks of all tasks, or the task table.
            if self.all_stacks:
                self.query_one(StackTable).focus()
            else:
                self.query_one(TaskTable).focus()
        elif self.has_class("-filtering"):
            self._close_filter()
            self.query_one(TaskTable).focus()
        else:
            self.query_one(TaskTable).focus()

    def action_help(self) -> None:
        """Show every key (built from the bindings)."""
        if not isinstance(self.screen, HelpScreen):
            self.push_screen(HelpScreen(self.help_sections()))

    def help_sections(self) -> list[HelpSection]:
        """The help screen's sections, from each part's bindings."""
        return [
            ("Everywhere", "", self.BINDINGS),
            ("Task table", "arrows, PgUp/PgDn move too; click a header to sort by it",
             [*TaskTable.BINDINGS, *LineTable.BINDINGS]),
            ("Stacks pane", "here k/u toggle frames (K/U anywhere)", StackTable.BINDINGS),
            ("Callchain tree", "Enter/space expand or collapse; Esc goes back",
             CallchainTree.BINDINGS),
            ("Threshold slider", "or click/drag the bar", ThresholdSlider.BINDINGS),
            ("Blocked now", "", BlockedNowTable.BINDINGS),
        ]

    # --- command palette ------------------------------------------------------

    def get_system_commands(self, screen: Screen[object]) -> Iterable[SystemCommand]:
        """Textual's commands, plus offtop's."""
        yield from super().get_system_commands(screen)
        yield SystemCommand("Pause / resume", "Freeze the display (data keeps coming)",
                            self.action_toggle_pause)
        yield SystemCommand("Threads / processes", "Rank threads or whole processes",
                            self.action_toggle_processes)
        yield SystemCommand("All stacks / task stacks", "Rank the stacks of every task",
                            self.action_toggle_all_stacks)
        yield SystemCommand("Kernel frames: show / hide", "Toggle kernel frames",
                            self.action_toggle_kernel)
        yield SystemCommand("User frames: show / hide", "Toggle user frames",
                            self.action_toggle_user)
        for column, _ in SORT_CYCLE:
            title = COLUMN_TITLES[column].split()[0]
            yield SystemCommand(f"Sort by {title}", f"Sort the task table by {title}",
                                partial(self.action_sort_by, column))
        for ns in THRESHOLD_PRESETS_NS:
            label = format_ns(ns) if ns else "0 (every block)"
            yield SystemCommand(f"Threshold {label}", "Set the long-block threshold",
                                partial(self.action_set_threshold, ns))


def _freeze_gc() -> None:
    gc.collect()
    gc.freeze()


def run_app(
    source: SnapshotSource,
    *,
    interval_s: float = 1.0,
    on_error: Callable[[BaseException], None] | None = None,
) -> int:
    """Run the TUI until the user quits; returns the exit code.

    If the source failed, the terminal is restored first, then `on_error` is
    called with the exception (by default: one line on stderr) and the exit
    code is 1. The caller closes the source.
    """
    app = OfftopApp(source, interval_s=interval_s, freeze_gc=True)
    # What is loaded by now (Textual, Rich, bcc, ...) lives as long as the
    # process: keep it out of the cyclic GC's full collections, which would
    # otherwise scan it every time and stall the UI for tens of ms.
    _freeze_gc()
    app.run()
    if app.source_error is not None:
        if on_error is None:
            print(f"offtop: {app.source_error}", file=sys.stderr)
        else:
            on_error(app.source_error)
        return 1
    return app.return_code or 0
