"""Tasks off the CPU right now, and for how long so far: "why is it stuck?".

Each snapshot lists the tasks blocked when it was taken. Between snapshots
the table reads the true waits from the source four times a second, when
the source can (`BlockedWaits`; the live one reads the probe's per-thread
records): a wait shown is never a guess, and a task that ran meanwhile is
shown as woken, its last wait kept, until the next snapshot. A source that
cannot shows the waits as of the snapshot.
A block that began before offtop started has an estimated wait, marked `~`.
"""

from __future__ import annotations

import time
from collections.abc import Hashable, Mapping
from typing import ClassVar

from rich.text import Text
from textual.binding import Binding, BindingType
from textual.message import Message
from textual.reactive import var

from offtop.model import BlockedNow, SnapshotIndex
from offtop.safe_text import printable
from offtop.source import BlockedWaits
from offtop.units import format_ns
from offtop.widgets.line_table import Column, LineTable
from offtop.widgets.render import (
    TitledPane,
    bar,
    chain_summary,
    log_fraction,
    set_titles,
    severity_style,
    state_text,
    task_label,
)

#: Marks a wait that began before offtop started (its length is estimated).
ESTIMATED = "~"


class BlockedNowTable(LineTable[int], TitledPane):
    """Blocked tasks, longest wait first: wait and a log bar, state, task, where.

    Each row is two lines: the task, then the innermost frames it waits in.
    `Enter` (or a second click) posts `Chosen`: the app opens that block's stack.
    """

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("enter", "select_cursor", "Open stack",
                tooltip="Open the callchain this task is blocked in", id="blocked.open"),
    ]

    ROW_HEIGHT: ClassVar[int] = 2
    SHOW_HEADER: ClassVar[bool] = False
    #: Rows come and go under the cursor: it is drawn only while focused.
    CURSOR_FOCUS_ONLY: ClassVar[bool] = True
    #: Rows shown at most.
    MAX_ROWS: ClassVar[int] = 100

    # `var`s, not `reactive`s: a change redraws what its watcher says changed
    # (a reactive would also repaint the whole pane, at every tick).
    index: var[SnapshotIndex] = var(SnapshotIndex.empty, init=False)
    """The snapshot whose blocked tasks are shown."""
    show_kernel: var[bool] = var(True, init=False)
    """Kernel frames are shown."""
    show_user: var[bool] = var(True, init=False)
    """User frames are shown."""
    hide_idle: var[bool] = var(False, init=False)
    """Tasks in idle waits (`model.is_idle_wait`) are left out."""
    paused: var[bool] = var(False, init=False)
    """The display is frozen: waits are not read."""

    #: How old the waits shown may grow (seconds) before they are read from the
    #: source between snapshots. Each read that changes a wait shown redraws
    #: the screen, and a redraw is most of what the TUI costs on a quiet
    #: machine: at the default 1 s interval the snapshots' own waits are never
    #: older than this, so waits are read only at longer intervals (or when
    #: snapshots are late), as often as the numbers beside them change.
    READ_EVERY_S: ClassVar[float] = 1.0

    class Chosen(Message):
        """Enter on a blocked task."""

        def __init__(self, table: BlockedNowTable, blocked: BlockedNow) -> None:
            super().__init__()
            self.table = table
            self.blocked = blocked

    def __init__(self, waits: BlockedWaits | None = None, *, id: str | None = None,
                 classes: str | None = None) -> None:
        super().__init__(id=id, classes=classes)
        #: Where waits are read between snapshots (None: only the snapshots' waits).
        self.waits = waits
        self._blocked: dict[int, BlockedNow] = {}
        self._waits: dict[int, int] = {}
        self._woke: set[int] = set()
        self._indexed_at = 0.0  # time.monotonic() of the waits shown (a snapshot or a read)

    def on_mount(self) -> None:
        self.set_columns([Column("wait", "WAIT", 7), Column("s", "S", 1),
                          Column("where", "TASK / WHERE", 16, flex=True)])
        self._sync()
        if self.waits is not None:
            self.set_interval(self.READ_EVERY_S / 2, self.read_waits)

    def read_waits(self) -> None:
        """Read the shown threads' waits from the source, if those shown are
        READ_EVERY_S old (from a snapshot or a read)."""
        now = time.monotonic()
        if now - self._indexed_at < self.READ_EVERY_S:
            return
        if self.waits is not None and self._blocked and not self.paused:
            self._indexed_at = now
            self.refresh_waits(self.waits.blocked_waits(self.tids))

    def watch_index(self, index: SnapshotIndex) -> None:
        facts = index.catalog.info
        blocked: dict[int, BlockedNow] = {}
        for b in index.snapshot.blocked_now:
            if len(blocked) >= self.MAX_ROWS:
                break
            if b.tid not in blocked and not (self.hide_idle and facts(b.kernel, b.user).idle):
                blocked[b.tid] = b
        self._blocked = blocked
        self._waits = {tid: b.blocked_ns for tid, b in blocked.items()}
        self._woke = set()
        self._indexed_at = time.monotonic()
        self._sync()

    def watch_hide_idle(self) -> None:
        self.watch_index(self.index)

    def watch_show_kernel(self) -> None:
        self._sync()

    def watch_show_user(self) -> None:
        self._sync()

    @property
    def tids(self) -> list[int]:
        """The threads shown, blocked or woken since."""
        return list(self._blocked)

    def refresh_waits(self, waits: Mapping[int, int]) -> None:
        """The waits read just now (`BlockedWaits.blocked_waits` of `tids`):
        a thread missing from `waits` ran meanwhile and is shown as woken."""
        for tid in self._blocked:
            if tid in self._woke:
                continue
            wait = waits.get(tid)
            if wait is None:
                self._woke.add(tid)
            else:
                self._waits[tid] = wait
        self._sync()

    def _sync(self) -> None:
        view = (self.show_kernel, self.show_user)
        rows = []
        for tid, b in self._blocked.items():
            wait = self._waits[tid]
            woke = tid in self._woke
            rows.append((tid, ((format_ns(wait), round(log_fraction(wait) * 48),
                                severity_style(wait), b.before_start, woke),
                               b.state, (b.comm, b.pid, b.tid, b.kernel, b.user, view, woke))))
        self.sync_rows(rows)
        self._update_titles()

    def _update_titles(self) -> None:
        title = f"Blocked now ({len(self._blocked)})"
        if self._woke:
            title += f" · {len(self._woke)} woke since"
        estimated = any(b.before_start for b in self._blocked.values())
        set_titles(self, title, f"{ESTIMATED} blocked before offtop started (estimated)"
                   if estimated else "")

    def on_line_table_row_selected(self, event: LineTable.RowSelected) -> None:
        """Enter: ask the app to open this block's stack."""
        event.stop()
        blocked = self._blocked.get(event.key) if isinstance(event.key, int) else None
        if blocked is not None:
            self.post_message(self.Chosen(self, blocked))

    def render_cell(self, column: str, value: Hashable) -> Text:
        """Two lines a cell: wait over its bar; the task over where it waits."""
        if column == "wait":
            assert isinstance(value, tuple)
            text, eighths, style, estimated, woke = value
            if woke:
                t = Text(f"{text:>7}\n", style="dim", end="")
                t.append("  woke", style="dim italic")
                return t
            mark = ESTIMATED if estimated else ""
            t = Text(f"{mark + text:>7}\n", style=style, end="")
            t.append(" " + bar(eighths / 48, 6), style=style or "#5fafd7")
            return t
        if column == "s":
            return state_text(str(value))
        assert isinstance(value, tuple)
        comm, pid, tid, kernel, user, (show_kernel, show_user), woke = value
        t = task_label(printable(comm), pid, tid)
        t.append("\n")
        t.append_text(chain_summary(kernel, user, show_kernel=show_kernel, show_user=show_user,
                                    max_kernel=1, max_user=3))
        if woke:
            t.stylize("dim")
        t.no_wrap, t.overflow = True, "ellipsis"
        return t

