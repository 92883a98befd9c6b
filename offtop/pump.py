"""The source's side of the TUI: a worker thread that runs the `SnapshotSource`
and posts what it gives to the app, and the messages it posts.

Everything a snapshot costs before it can be shown happens in that thread,
off the event loop: its index (`SnapshotIndex`) and the queue of what it
brought (`Arrivals`). Its stacks are summed into the since-start totals
once it is on screen, in another thread (`fold_since_start`). A backlog of `SnapshotReady`
collapses to the newest; long blocks, counts and notices wait in `Arrivals`,
so none is lost.

A replay may jump (a step back, a seek, a loop to the start): the interval
it brings is then not the one after the last. The since-start totals and
the long-block log cover one unbroken stretch of intervals ending at the
one shown, so a jump starts them again at the interval jumped to (cheap, and
nothing is counted twice; replaying every interval from the recording's
start to rebuild them would cost the whole recording's decoding per step).
"""

from __future__ import annotations

import asyncio
import signal
import threading
from collections.abc import Callable
from typing import ClassVar

from rich.text import Text
from textual.app import App
from textual.message import Message
from textual.worker import get_current_worker

from offtop.model import ChainCatalog, SinceStart, Snapshot, SnapshotIndex
from offtop.safe_text import printable_lines
from offtop.source import Hurry, SnapshotSource, TimeTravel
from offtop.widgets.arrivals import Arrivals
from offtop.widgets.long_blocks_log import LongBlocksLog


class SnapshotReady(Message):
    """A new snapshot from the source, indexed; a newer one still queued replaces it."""

    def __init__(self, index: SnapshotIndex) -> None:
        super().__init__()
        self.index = index

    def can_replace(self, message: Message) -> bool:
        """Only the newest snapshot matters (what must not be lost is in `Arrivals`)."""
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
    """The source has no more snapshots (a replay ran out, a run is over, or we stop)."""


class SnapshotPump:
    """Runs the source in a worker thread and posts what it gives to the app.

    Everything a snapshot costs before it can be shown happens here, off the
    event loop: its index, the queue of what it brought; the since-start
    totals are summed once it is shown (`fold_since_start`). `stopping` ends
    the thread at its next wait.
    """

    #: Snapshots between two generations of the chain catalog: what no snapshot
    #: (nor a since-start ranking) asked for over 10-20 snapshots is forgotten.
    CATALOG_GENERATION: ClassVar[int] = 10

    def __init__(self, app: App[int], source: SnapshotSource, interval_s: float) -> None:
        self.app = app
        self.source = source
        self.interval_s = interval_s
        self.stopping = threading.Event()
        self.catalog = ChainCatalog()
        self._published = 0
        #: Idle waits are hidden: each index is given its idle pass here, not on the
        #: event loop at its first use (~20 ms at 20,000 stacks). Set by the app.
        self.idle_hidden = False
        self.since_start = SinceStart()
        self.arrivals = Arrivals(max_blocks=LongBlocksLog.MAX_LINES)
        #: The source's own number of the interval published last (replays only).
        self._position = -1

    def stop(self) -> None:
        """End the worker thread at its next wait; a sub-tick under way finishes without
        resolving new stacks (the source hurries), so quitting never waits for them."""
        self.stopping.set()
        if isinstance(self.source, Hurry):
            self.source.hurry()

    def start(self) -> None:
        """Start the worker thread."""
        self.app.run_worker(self._run, name="source", group="source", thread=True,
                            exclusive=True, exit_on_error=False)

    def _run(self) -> None:
        worker = get_current_worker()
        try:
            self.source.start()
        except Exception as error:
            self.app.post_message(SourceFailed(error, started=False))
            return
        self.app.post_message(SourceStarted())
        while not self.stopping.is_set() and not worker.is_cancelled:
            try:
                snap = self.source.next_snapshot(self.interval_s, self.stopping)
                if snap is None:
                    break
                self.publish(snap, restart=self._jumped())
            except Exception as error:
                # Said on screen, never a silent end of this thread (a stalled app).
                self.app.post_message(SourceFailed(error, started=True))
                return
        self.app.post_message(SourceEnded())

    def _jumped(self) -> bool:
        """The replay brought another interval than the next one (see module
        docstring). Called in this thread right after `next_snapshot`, the
        only place a replay's `position` moves."""
        if not isinstance(self.source, TimeTravel):
            return False
        last, self._position = self._position, self.source.position
        return self._position != last + 1

    def publish(self, snap: Snapshot, *, restart: bool = False) -> None:
        """Index a snapshot, queue what it brought and its stacks for the
        since-start totals, and post it.

        `restart`: a replay jumped, the totals and the log start again here.
        The stacks are queued before the post: a ranking asked for once the
        snapshot is shown sums them first (`SinceStart.ranked`), even if
        `fold_since_start` has not run yet.
        """
        self._published += 1
        if self._published % self.CATALOG_GENERATION == 0:
            self.catalog.next_generation()
        index = SnapshotIndex(snap, self.catalog)
        if self.idle_hidden:
            index.prepare_idle()
        if restart:
            self.since_start.clear()
            self.arrivals.restart()
        self.arrivals.put(snap)
        self.since_start.add(index)
        self.app.post_message(SnapshotReady(index))

    def fold_since_start(self) -> None:
        """Sum the queued stacks into the since-start totals in a thread (the
        app calls this once a snapshot is on screen: the sum never delays it)."""
        if self.since_start.pending and not self.stopping.is_set():
            self.app.run_worker(self.since_start.fold, name="since-start fold",
                                group="since-start-fold", thread=True, exit_on_error=False,
                                description="since-start fold")


class ExitSignals:
    """SIGTERM and SIGHUP end the app cleanly (terminal restored), as `q` does."""

    def __init__(self, on_signal: Callable[[], None]) -> None:
        self.on_signal = on_signal
        #: The signals handled now.
        self.installed: list[int] = []

    def install(self) -> None:
        """Handle the signals on the running loop (not possible off the main thread)."""
        try:
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGTERM, signal.SIGHUP):
                loop.add_signal_handler(sig, self.on_signal)
                self.installed.append(sig)
        except (NotImplementedError, RuntimeError, ValueError):
            pass  # not the main thread, or no signals on this platform

    def remove(self) -> None:
        """Give the signals back."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        for sig in self.installed:
            loop.remove_signal_handler(sig)
        self.installed.clear()


def failure_text(error: BaseException, *, started: bool) -> Text:
    """What the screen says when the capture could not start or stopped."""
    text = Text("The capture stopped:\n\n" if started
                else "offtop could not start the capture:\n\n", style="bold")
    # An error may quote what a process controls (a path, a name): escaped.
    text.append(f"{type(error).__name__}: {printable_lines(str(error))}", style="#ff6b6b")
    text.append("\n\nPress q to quit.", style="dim")
    return text
