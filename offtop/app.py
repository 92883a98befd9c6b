"""The offtop TUI: a live, top-like view of off-CPU time.

Data flows one way. `SnapshotPump` owns the `SnapshotSource` in a thread
worker: it starts it (compiling BPF can take a second; the screen shows at
once, loading), then asks it for one snapshot per interval, indexes it
(`SnapshotIndex`: stacks by thread and process, the facts of every
callchain), off the event loop, and posts it as one `SnapshotReady` message;
once it is on screen its stacks are summed into the since-start totals, in
a thread. A backlog of those collapses to the
newest (`can_replace`); the long blocks, counts and notices of every
snapshot wait in `Arrivals`, so none is lost.

The app assigns the newest index to a reactive inside `batch_update()`, and
data binding pushes it, with the display toggles, down to the panes; each
pane diffs it in and sets its own title. The app itself only wires keys to
actions and one pane's messages to another. The UI never blocks on the
source, except for `set_threshold` (a map write) and `blocked_waits` (reads
of a memory-mapped array), both meant to be called from here.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterable
from functools import partial
from pathlib import Path
from typing import ClassVar

from rich.console import RenderableType
from textual import events, on
from textual.actions import SkipAction, parse
from textual.app import App, ComposeResult, SystemCommand
from textual.binding import Binding, BindingType
from textual.containers import Horizontal, Vertical
from textual.reactive import var
from textual.screen import Screen
from textual.widgets import Input, Static

from offtop.app_keys import APP_BINDINGS, PALETTE, REPLAY_BINDINGS, THRESHOLD_PRESETS_NS
from offtop.gc_pacing import GcPacing, freeze_alive
from offtop.model import RowKey, Snapshot, SnapshotIndex
from offtop.pump import (
    ExitSignals,
    SnapshotPump,
    SnapshotReady,
    SourceEnded,
    SourceFailed,
    SourceStarted,
    failure_text,
)
from offtop.safe_text import printable, printable_lines
from offtop.source import BlockedWaits, SnapshotSource, SourceInfo
from offtop.units import format_ns
from offtop.widgets.arrivals import Taken
from offtop.widgets.blocked_now import BlockedNowTable
from offtop.widgets.export_screen import export_view
from offtop.widgets.filter_input import FilterInput
from offtop.widgets.header import OfftopHeader
from offtop.widgets.help_screen import HelpScreen, help_sections
from offtop.widgets.key_bar import KeyBar
from offtop.widgets.long_blocks_log import LongBlocksLog
from offtop.widgets.replay_bar import ReplayBar, time_travel
from offtop.widgets.scopes import Scope
from offtop.widgets.stacks_pane import StacksPane
from offtop.widgets.task_table import COLUMN_TITLES, SORT_CYCLE, TaskTable
from offtop.widgets.threshold_pane import ThresholdPane
from offtop.widgets.threshold_slider import step_down, step_up
from offtop.widgets.waker_tree import WakerTree


class OfftopApp(App[int]):
    """Where threads spend their time off the CPU, live.

    Tasks ranked by off-CPU time on the left, the stacks pane (stacks,
    callchain tree or flame graph) below them; on the right what is blocked
    right now, the long-block threshold and the log of long blocks.
    """

    CSS_PATH = "app.tcss"
    TITLE = "offtop"
    AUTO_FOCUS = "#tasks-pane"
    HORIZONTAL_BREAKPOINTS = [(0, "-narrow"), (100, "-normal"), (180, "-wide")]
    #: From this height the screen is "-tall"; below it "-short" (one pane at a time on the left).
    TALL_FROM = 24
    VERTICAL_BREAKPOINTS = [(0, "-short"), (TALL_FROM, "-tall")]
    BINDINGS: ClassVar[list[BindingType]] = [*APP_BINDINGS, *REPLAY_BINDINGS]
    # With `freeze_gc`, the cyclic GC's full passes are the app's
    # (offtop.gc_pacing), each once a snapshot is drawn: Python's own came
    # every few ticks (each interval's 20,000 stack rows outlive two
    # collections), at any moment, keys included: 65 ms each at 20,000
    # stacks, up to 300 ms.

    info: var[SourceInfo | None] = var(None, init=False)
    """What the source says it captures (bound to the header)."""
    loading: var[bool] = var(True, init=False)
    """No snapshot yet, and the source neither failed nor ended."""
    status: var[str] = var("starting", init=False)
    """`starting`, `running`, `ended` or `failed`."""
    index: var[SnapshotIndex] = var(SnapshotIndex.empty, init=False)
    """The snapshot on screen, with its lookups (bound to every pane)."""
    arrived: var[Taken | None] = var(None, init=False, always_update=True)
    """What arrived with the snapshots since the last one shown (bound to the log)."""
    notices: var[tuple[str, ...]] = var((), init=False)
    """The latest news about the capture's scope (bound to the header)."""
    stalled_s: var[float] = var(0.0, init=False)
    """How long a running source has been late with its snapshot (0: not late)."""
    paused: var[bool] = var(False, init=False)
    """The display is frozen (data keeps accumulating in the source)."""
    behind: var[int] = var(0, init=False)
    """Snapshots received while paused."""
    processes: var[bool] = var(False, init=False)
    """Rank processes instead of threads."""
    follow: var[bool] = var(False, init=False)
    """The task table's cursor follows its task (htop's F), not its row."""
    filter_text: var[str] = var("", init=False)
    """Tasks and stacks whose name, pid or frames contain this."""
    hide_idle: var[bool] = var(False, init=False)
    """Idle waits are left out (see `offtop.model.is_idle_wait`)."""
    show_kernel: var[bool] = var(True, init=False)
    """Kernel frames are shown (never both hidden)."""
    show_user: var[bool] = var(True, init=False)
    """User frames are shown (never both hidden)."""
    threshold_ns: var[int] = var(0, init=False)
    """The long-block threshold in force in the source."""

    def __init__(self, source: SnapshotSource, *, interval_s: float = 1.0,
                 clock: Callable[[], float] | None = None, freeze_gc: bool = False,
                 export_dir: Path | None = None) -> None:
        super().__init__()
        self.source = source
        #: The replay the time-travel keys and the replay bar drive (None: live).
        self.replay = time_travel(source)
        self.interval_s = interval_s
        self.pump = SnapshotPump(self, source, interval_s)
        #: Measures how late the source is (the header warns after 3 intervals).
        self.clock = clock or time.monotonic
        #: Own the process's cyclic GC (the process that runs the app): once
        #: the first snapshot is on screen, move everything alive then out of
        #: its full passes, and make those passes the app's (`gc_pacing`).
        self.freeze_gc = freeze_gc
        self._shown = 0
        self.gc_pacing = GcPacing()  #: its full GC passes, with `freeze_gc`
        #: Where `w` writes (the working directory by default).
        self.export_dir = export_dir or Path.cwd()
        #: The exception that stopped the source, for `run_app` and the CLI.
        self.source_error: BaseException | None = None
        #: Snapshots received from the source (shown or not).
        self.received = 0
        self.signals = ExitSignals(self.exit)
        self._arrived = self.clock()
        self._held: SnapshotIndex | None = None
        self.set_reactive(OfftopApp.threshold_ns, source.threshold_ns)
        self.set_reactive(OfftopApp.info, source.info)

    @property
    def stopping(self) -> threading.Event:
        """Set once the app stops: the source thread ends at its next wait."""
        return self.pump.stopping

    @property
    def snapshot(self) -> Snapshot | None:
        """The snapshot on screen (None before the first)."""
        return self.index.snapshot if self.index.snapshot.seq else None

    @property
    def drilled(self) -> bool:
        """The stacks pane shows a callchain tree."""
        return self.query_one(StacksPane).view == "tree"

    def compose(self) -> ComposeResult:
        waits = self.source if isinstance(self.source, BlockedWaits) else None
        app = OfftopApp
        yield OfftopHeader(self.interval_s, id="header").data_bind(
            app.info, app.index, app.paused, app.behind, app.status, app.threshold_ns,
            app.notices, app.stalled_s)
        with Horizontal(id="main"):
            with Vertical(id="left"):
                yield TaskTable(id="tasks-pane", classes="pane").data_bind(
                    app.index, app.processes, app.filter_text, app.hide_idle,
                    follow_task=app.follow)
                yield StacksPane(self.pump.since_start, id="stacks-pane", classes="pane"
                                 ).data_bind(app.index, app.show_kernel, app.show_user,
                                             app.hide_idle, app.filter_text)
            with Vertical(id="right"):
                yield BlockedNowTable(waits, id="blocked", classes="pane").data_bind(
                    app.index, app.show_kernel, app.show_user, app.hide_idle, app.paused)
                with Vertical(id="log-column"):
                    yield ThresholdPane(self.threshold_ns, id="threshold", classes="pane"
                                        ).data_bind(value_ns=app.threshold_ns)
                    yield LongBlocksLog(id="long-blocks", classes="pane").data_bind(
                        app.arrived, app.threshold_ns, app.show_kernel, app.show_user)
        if self.replay is not None:
            yield ReplayBar(self.replay, id="replay").data_bind(app.index)
        yield FilterInput(id="filter")
        yield Static(id="error")
        yield KeyBar(id="keys")

    def on_mount(self) -> None:
        self.set_class(self.loading, "-loading")
        self.signals.install()
        self.set_interval(1.0, self._each_second)
        self.pump.start()

    def on_unmount(self) -> None:
        self.pump.stop()
        self.signals.remove()
        self.gc_pacing.restore()

    def exit(self, result: int | None = None, return_code: int = 0,
             message: RenderableType | None = None) -> None:
        """Stop the source thread, then exit as usual."""
        self.pump.stop()
        super().exit(result, return_code, message)

    def publish(self, snap: Snapshot) -> None:
        """Hand a snapshot to the UI as the source thread does (tests, the benchmark)."""
        self.pump.publish(snap)

    # --- watchers -----------------------------------------------------------------

    def watch_paused(self, paused: bool) -> None:
        self.set_class(paused, "-paused")
        if not paused and self._held is not None:
            self._show(self._held)

    def watch_loading(self, loading: bool) -> None:
        self.set_class(loading, "-loading")

    def watch_status(self, status: str) -> None:
        if status in ("failed", "ended"):
            self.loading = False

    def watch_show_kernel(self, show: bool) -> None:
        self.show_user = self.show_user or not show  # never both hidden

    def watch_show_user(self, show: bool) -> None:
        self.show_kernel = self.show_kernel or not show

    # --- messages -------------------------------------------------------------------

    def on_source_started(self, _: SourceStarted) -> None:
        self.info = self.source.info
        self._arrived = self.clock()
        if self.status == "starting":
            self.status = "running"

    def on_source_failed(self, message: SourceFailed) -> None:
        self.source_error = message.error
        self.status = "failed"
        if self.snapshot is None:
            self.query_one("#error", Static).update(
                failure_text(message.error, started=message.started))
            self.add_class("-failed")
        else:
            self.notify(printable_lines(str(message.error)), title="capture stopped",
                        severity="error", timeout=3600, markup=False)

    def on_source_ended(self, _: SourceEnded) -> None:
        if self.status != "failed" and not self.stopping.is_set():
            self.status = "ended"

    def on_snapshot_ready(self, message: SnapshotReady) -> None:
        if self.stopping.is_set():
            return  # quitting: the widgets may already be gone
        self.received += 1
        if self.status == "starting":
            self.status = "running"
        if self.paused:
            self._held = message.index
            self.behind += 1
        else:
            self._show(message.index)

    def _show(self, index: SnapshotIndex) -> None:
        self._held = None
        self._arrived = self.clock()
        taken = self.pump.arrivals.take()
        self._shown += 1
        if self.freeze_gc and self.gc_pacing.snapshot_done():
            self.call_after_refresh(self.gc_pacing.full_pass)
        with self.batch_update():
            if self.loading:
                self.loading = False
            self.behind = self.stalled_s = 0
            table = self.query_one_optional(TaskTable)
            pane = self.query_one_optional(StacksPane)
            if table is not None and pane is not None:
                # The table first: a re-sort may bring another task under its
                # cursor, whose stacks the pane then shows in this same update,
                # not drawn once for the task before and again when the
                # table's message comes (two screen updates a second).
                table.index = index
                pane.preselect(table.cursor_key)
            self.index = index
            self.arrived = taken
            if taken.notices:
                self.notices = taken.notices[-3:]
        self.call_after_refresh(self.pump.fold_since_start)

    def watch_hide_idle(self, hide: bool) -> None:
        # Each snapshot's idle pass is then made with its index, off the event loop.
        self.pump.idle_hidden = hide

    def _each_second(self) -> None:
        self._check_stall()
        # Paused, or no data coming: the GC's full passes still come.
        if self.gc_pacing.overdue():
            self.gc_pacing.full_pass()

    def _check_stall(self) -> None:
        """A running source more than three intervals late is said to be."""
        late = self.clock() - self._arrived
        # A replay is never late: it waits for play, or holds at its end.
        running = self.status == "running" and not self.paused and self.replay is None
        self.stalled_s = late if running and late > 3 * self.interval_s else 0.0

    # A message from a child can arrive after the widgets are gone: at exit
    # they go first, and a table may have posted just before (a busy
    # server's refresh moving the cursor). Such a message is dropped.

    @on(TaskTable.TaskHighlighted)
    def _task_highlighted(self, event: TaskTable.TaskHighlighted) -> None:
        if pane := self.query_one_optional(StacksPane):
            pane.select(event.key, moved=event.moved)

    @on(TaskTable.TaskChosen)
    def _task_chosen(self, event: TaskTable.TaskChosen) -> None:
        if pane := self.query_one_optional(StacksPane):
            pane.open(Scope.task(event.key))

    @on(BlockedNowTable.Chosen)
    def _blocked_chosen(self, event: BlockedNowTable.Chosen) -> None:
        # Its stack, whether or not the task is in the table (a task blocked
        # since before offtop started has no off-CPU time counted yet).
        if pane := self.query_one_optional(StacksPane):
            pane.open(Scope.of_block(event.blocked))

    @on(LongBlocksLog.Chosen)
    def _long_block_chosen(self, event: LongBlocksLog.Chosen) -> None:
        if pane := self.query_one_optional(StacksPane):
            pane.open(Scope.of_block(event.block))

    @on(WakerTree.JumpTo)
    def _jump_to_waker(self, event: WakerTree.JumpTo) -> None:
        # Its row in the task table, and its callchains; a waker that spent no
        # time off the CPU (or is filtered out) has no row: said, not hidden.
        table, pane = self.query_one_optional(TaskTable), self.query_one_optional(StacksPane)
        if table is None or pane is None:
            return
        key = RowKey.process(event.pid) if self.processes else RowKey.thread(event.tid)
        if not table.move_to_key(key):
            who = f"{printable(event.waker.comm)} {event.pid}/{event.tid}"
            self.notify(f"{who} is not in the task table (no off-CPU time shown)",
                        title="go to waker", markup=False)
            if not self.index.stacks_of(key):
                return
        pane.open(Scope.task(key))

    @on(StacksPane.ViewChanged)
    def _view_changed(self) -> None:
        self._fit_left(self.size.height)

    def on_resize(self, event: events.Resize) -> None:
        self._fit_left(event.size.height)

    def _fit_left(self, height: int) -> None:
        """The short layout swaps the task table for the tree or flame graph
        (app.tcss: `-drilled` on the left column, which holds both). Set only
        on a short screen, where it shows: a class restyles the column's
        every widget (~15 ms of each Enter, Esc and f; on the screen, every
        widget's), and a tall screen has no use for it."""
        left, pane = self.query_one_optional("#left"), self.query_one_optional(StacksPane)
        if left is not None and pane is not None:
            left.set_class(pane.view != "stacks" and height < self.TALL_FROM, "-drilled")

    @on(ThresholdPane.Changed)
    def _threshold_asked(self, event: ThresholdPane.Changed) -> None:
        self.set_threshold(event.value_ns)

    def set_threshold(self, ns: int) -> None:
        """Write a new long-block threshold to the source, now."""
        ns = max(0, int(ns))
        try:
            self.source.set_threshold(ns)
        except Exception as error:  # a map write failing is shown, not swallowed
            self.notify(f"could not set the threshold: {error}", severity="error", markup=False)
            self.query_one(ThresholdPane).value_ns = self.threshold_ns
            return
        self.threshold_ns = ns

    @on(Input.Changed, "#filter")
    def _filter_changed(self, event: Input.Changed) -> None:
        self.filter_text = event.value

    @on(FilterInput.Done)
    def _filter_done(self) -> None:
        if table := self.query_one_optional(TaskTable):
            table.focus()

    # --- actions ----------------------------------------------------------------------

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        """The replay keys only in a replay, where p and space pause the replay
        instead of the display (hidden keys leave the key bar and the help)."""
        if action == "replay":
            return self.replay is not None
        if action == "toggle_pause":
            return self.replay is None
        return True

    def action_replay(self, command: str, amount: int = 0) -> None:
        """Time travel in a replay: pause, step, start, end, slower, faster."""
        self.query_one(ReplayBar).run(command, amount)

    def action_toggle_pause(self) -> None:
        """Freeze or unfreeze the display."""
        self.paused = not self.paused

    def action_stacks(self, name: str) -> None:
        """Flip one of the stacks pane's switches (all tasks, since start)."""
        pane = self.query_one(StacksPane)
        setattr(pane, name, not getattr(pane, name))

    def action_flame(self) -> None:
        """The flame graph of the stacks pane's scope, or back."""
        self.query_one(StacksPane).toggle_flame()

    def action_merge(self) -> None:
        """Merge identical stacks: off, across a process's threads, across a command."""
        self.query_one(StacksPane).cycle_merge()

    def action_export(self) -> None:
        """Write the stacks pane's view to a file (the format is asked first)."""
        export_view(self, self.query_one(StacksPane).view_data(), self.export_dir)

    def action_cycle_sort(self) -> None:
        """Sort the task table by the next column."""
        self.query_one(TaskTable).cycle_sort()

    def action_sort_by(self, column: str) -> None:
        """Sort the task table by a column."""
        self.query_one(TaskTable).sort_by(column)

    def action_sort_menu(self) -> None:
        """F6: choose the sort column from a menu."""
        table = self.query_one(TaskTable)
        self.push_screen(table.sort_menu(), lambda column: table.sort_by(column) if column else None)

    def action_quit_key(self) -> None:
        """q: quit, unless it is typed (the filter, the threshold) or a screen over the
        tasks has the keys (help, a menu, the command palette), which get it then."""
        if isinstance(self.focused, Input) or len(self.screen_stack) > 1:
            raise SkipAction()
        self.exit()

    def action_threshold(self, steps: int) -> None:
        """The long-block threshold one step up or down (typed text in an input)."""
        if isinstance(self.focused, Input):
            raise SkipAction()
        self.set_threshold((step_up if steps > 0 else step_down)(self.threshold_ns))

    def action_filter(self) -> None:
        """Open the filter line."""
        self.query_one(FilterInput).open()

    def action_go_back(self) -> None:
        """Esc: leave the tree or flame graph, else clear the filter; back to the tasks."""
        pane = self.query_one(StacksPane)
        if pane.back():
            if pane.all_tasks:  # back where the drill started: all tasks' stacks
                pane.visible_child().focus()
                return
        else:
            self.query_one(FilterInput).close()
        self.query_one(TaskTable).focus()

    def action_help(self) -> None:
        """Show every key (built from the bindings)."""
        if not isinstance(self.screen, HelpScreen):
            in_force = [b for b in self.BINDINGS if not isinstance(b, Binding)
                        or self.check_action(*parse(b.action)[1:]) is not False]
            self.push_screen(HelpScreen(help_sections(in_force)))

    def get_system_commands(self, screen: Screen[object]) -> Iterable[SystemCommand]:
        """Textual's commands, plus offtop's switches, sorts and threshold presets."""
        yield from super().get_system_commands(screen)
        for b in self.BINDINGS:
            if isinstance(b, Binding) and b.id in PALETTE:
                yield SystemCommand(b.description, b.tooltip, partial(self.run_action, b.action))
        for column, _ in SORT_CYCLE:
            title = COLUMN_TITLES[column].split()[0]
            yield SystemCommand(f"Sort by {title}", f"Sort the task table by {title}",
                                partial(self.action_sort_by, column))
        for ns in THRESHOLD_PRESETS_NS:
            label = format_ns(ns) if ns else "0 (every block)"
            yield SystemCommand(f"Threshold {label}", "Set the long-block threshold",
                                partial(self.set_threshold, ns))


def run_app(source: SnapshotSource, *, interval_s: float = 1.0,
            on_error: Callable[[BaseException], None] | None = None) -> int:
    """Run the TUI until the user quits; returns the exit code.

    If the source failed, the terminal is restored first, then `on_error` is
    called with the exception (by default: one line on stderr) and the exit
    code is 1. The caller closes the source.
    """
    app = OfftopApp(source, interval_s=interval_s, freeze_gc=True)
    # What is loaded by now (Textual, Rich, bcc, ...) lives as long as the
    # process: keep it out of the cyclic GC's full collections, which would
    # otherwise scan it every time and stall the UI for tens of ms.
    freeze_alive()
    app.run()
    if app.source_error is not None:
        if on_error is None:
            print(f"offtop: {app.source_error}", file=sys.stderr)
        else:
            on_error(app.source_error)
        return 1
    return app.return_code or 0
