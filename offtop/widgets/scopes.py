"""Whose stacks the stacks pane shows (`Scope`), which they are, and its name.

`ScopeStacks` answers, for a scope and a snapshot: the stacks (of the last
interval, or since offtop started), without idle waits or with only the
frames searched for when asked, and whether they are the last ones seen of
a task idle this interval; and how the scope is named in titles. It keeps
what it needs for that across snapshots: the last stacks and rows of the
tasks shown. No widget in sight, so it is tested alone.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import ClassVar, Literal, TypeVar

from rich.text import Text

from offtop.model import (
    BlockedNow,
    LongBlock,
    ProcessRow,
    RowKey,
    SnapshotIndex,
    StackRow,
    TaskRow,
    WakerRow,
)
from offtop.widgets.render import clock_time, task_label, untrusted_text


@dataclass(frozen=True, slots=True)
class Scope:
    """Whose stacks the pane shows."""

    kind: Literal["none", "all", "task", "command", "block"]
    """Nothing (no task selected), all tasks, a thread or process (`key`),
    every process named `comm`, or one block on its own (`block`)."""
    key: RowKey | None = None
    comm: str = ""
    block: StackRow | None = None
    label: str = ""
    """What `block` is ("blocked now", "long block that ended at …")."""

    def holds(self, stack: StackRow) -> bool:
        """True if `stack` is one of this scope's (of any snapshot)."""
        return self.holds_task(stack.pid, stack.tid, stack.comm)

    def holds_task(self, pid: int, tid: int, comm: str) -> bool:
        """True if the stacks of this task are this scope's."""
        if self.key is not None:
            return (pid if self.key.is_process else tid) == self.key.id
        if self.kind == "command":
            return comm == self.comm
        return self.kind == "all"

    @classmethod
    def task(cls, key: RowKey | None) -> Scope:
        """A thread or a process (nothing if `key` is None)."""
        return cls("task", key=key) if key is not None else NOTHING

    @classmethod
    def command(cls, comm: str) -> Scope:
        """Every process named `comm`."""
        return cls("command", comm=comm)

    @classmethod
    def of_block(cls, block: BlockedNow | LongBlock) -> Scope:
        """A block on its own: a task blocked now (so far), or a long block."""
        ns = block.blocked_ns if isinstance(block, BlockedNow) else block.duration_ns
        # A long block carries its waker (the waker tree names it); a task
        # blocked now has none yet.
        waker = block.waker if isinstance(block, LongBlock) else None
        row = StackRow(pid=block.pid, tid=block.tid, comm=block.comm, state=block.state,
                       offcpu_ns=ns, count=1, max_ns=ns, kernel=block.kernel, user=block.user,
                       before_start=block.before_start,
                       waker_rows=(WakerRow(waker, ns, 1),) if waker is not None else ())
        label = ("blocked now" if isinstance(block, BlockedNow)
                 else f"long block that ended at {clock_time(block.time, millis=True)}")
        return cls("block", block=row, label=label)


ALL = Scope("all")
NOTHING = Scope("none")


class ScopeStacks:
    """A scope's stacks and name in a snapshot (see module docstring)."""

    #: Tasks whose last stacks and rows are kept.
    REMEMBERED: ClassVar[int] = 16

    def __init__(self) -> None:
        #: The since-start ranking last worked out (None: none yet).
        self.since: tuple[StackRow, ...] | None = None
        self._last: dict[RowKey, tuple[StackRow, ...]] = {}
        self._rows: dict[RowKey, TaskRow | ProcessRow] = {}

    def seen(self, index: SnapshotIndex, keys: Iterable[RowKey | None]) -> None:
        """Remember the rows of these tasks (their names outlive an idle interval)."""
        for key in keys:
            row = index.rows.get(key) if key is not None else None
            if row is not None:
                _keep(self._rows, row.key, row, self.REMEMBERED)

    def stacks(self, scope: Scope, index: SnapshotIndex, *, cumulative: bool = False,
               hide_idle: bool = False, text: str = "") -> tuple[list[StackRow], bool]:
        """The scope's stacks, most time first, and whether they are the last
        seen (the task was idle this interval). `text` keeps the stacks whose
        task (name, pid, tid) or frames contain it."""
        if scope.block is not None:
            return [scope.block], False
        stale = False
        source: Sequence[StackRow] = ()
        if scope.kind == "none":
            pass
        elif cumulative:
            source = [s for s in self.since or () if scope.holds(s)]
        elif scope.key is not None:
            source = index.stacks_of(scope.key)
            if source:
                _keep(self._last, scope.key, tuple(source), self.REMEMBERED)
            else:
                source = self._last.get(scope.key, ())
                stale = bool(source)
        elif scope.kind == "command":
            source = [s for s in index.snapshot.stacks if s.comm == scope.comm]
        else:
            source = index.snapshot.stacks
        stacks = index.view(source, hide_idle=hide_idle)
        if text:
            needle = text.casefold()
            stacks = [s for s in stacks
                      if _task_matches(s, needle) or needle in index.catalog.text(s)]
        return stacks, stale

    def title(self, scope: Scope, index: SnapshotIndex) -> Text:
        """How the scope is named: `postgres 1052/1053`, `every nginx process`…"""
        if scope.block is not None:
            b = scope.block
            t = task_label(b.comm, b.pid, b.tid)
            t.append(f", {scope.label}", style="italic")
            if b.before_start:
                t.append(" (began before offtop started: estimated)", style="italic dim")
            return t
        if scope.kind == "none":
            return Text("no task selected", style="dim", end="")
        if scope.kind == "command":
            t = Text("every ", style="dim", end="")
            t.append_text(untrusted_text(scope.comm, "bold"))
            t.append(" process", style="dim")
            return t
        if scope.key is None:
            return Text("all tasks", end="")
        return self._task_title(scope.key, index)

    def _task_title(self, key: RowKey, index: SnapshotIndex) -> Text:
        row = index.rows.get(key) or self._rows.get(key)
        if row is None:
            # Not in this snapshot, nor seen before: its stacks still name it.
            stacks = index.stacks_of(key) or self._last.get(key, ())
            if not stacks:
                return Text(str(key), end="")
            s = stacks[0]
            return task_label(s.comm, s.pid, None if key.is_process else s.tid)
        if isinstance(row, TaskRow):
            return task_label(row.comm, row.pid, row.tid)
        t = task_label(row.comm, row.pid)
        t.append(f" ({row.threads} threads)", style="dim")
        if row.user:
            t.append(" ")
            t.append_text(untrusted_text(row.user, "italic"))
        if row.cmdline:
            cmd = row.cmdline if len(row.cmdline) <= 60 else row.cmdline[:59] + "…"
            t.append(" ")
            t.append_text(untrusted_text(cmd, "dim"))
        return t


K = TypeVar("K")
V = TypeVar("V")


def _keep(memory: dict[K, V], key: K, value: V, limit: int) -> None:
    """Remember `value` as the newest entry, forgetting the oldest past `limit`."""
    memory.pop(key, None)
    memory[key] = value
    while len(memory) > limit:
        del memory[next(iter(memory))]


def _task_matches(s: StackRow, needle: str) -> bool:
    return needle in s.comm.casefold() or needle in str(s.pid) or needle in str(s.tid)
