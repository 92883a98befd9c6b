"""A last resort for the TUI: once asked to stop, the process ends, whatever hangs.

Textual's shutdown can block for good. One way, seen under an event flood: a
SIGCONT that follows no SIGTSTP (the kernel sends SIGHUP and SIGCONT when a
terminal hangs up) makes its Linux driver start a second writer thread; with
the terminal gone that thread dies on EIO, its 30-slot queue fills, and
`App.run()` never returns, with the BPF probe still attached to every context
switch of the machine.

`ExitGuard` watches for the stop request (the event the app hands its source)
and for the terminal hanging up. If the process is still there `grace_s`
later, it puts the terminal back as well as it can and calls `os._exit()`,
which closes every fd, and so detaches the probe. A normal exit cancels it.
"""

from __future__ import annotations

import contextlib
import os
import termios
import threading
from collections.abc import Callable
from types import TracebackType
from typing import Any

from offtop.model import Snapshot
from offtop.source import SnapshotSource, SourceInfo

#: Leave the alternate screen, show the cursor, stop mouse, focus and paste
#: reporting and the kitty keyboard protocol: what a TUI may have turned on.
RESET_SEQUENCE = (
    "\x1b[?1000l\x1b[?1002l\x1b[?1003l\x1b[?1006l\x1b[?1015l"
    "\x1b[?1004l\x1b[?2004l\x1b[<u\x1b[?1049l\x1b[?25h"
)


class _WatchedSource:
    """The app's source, passed through; notes the stop event the app hands it."""

    def __init__(self, source: SnapshotSource, guard: ExitGuard) -> None:
        self._source = source
        self._guard = guard

    @property
    def info(self) -> SourceInfo:
        return self._source.info

    @property
    def threshold_ns(self) -> int:
        return self._source.threshold_ns

    def start(self) -> None:
        self._source.start()

    def next_snapshot(self, interval_s: float, stop: threading.Event) -> Snapshot | None:
        self._guard.watch(stop)
        return self._source.next_snapshot(interval_s, stop)

    def set_threshold(self, ns: int) -> None:
        self._source.set_threshold(ns)

    def close(self) -> None:
        self._source.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._source, name)


class ExitGuard:
    """Ends the process `grace_s` after a stop request or a hang-up, if it is still running."""

    def __init__(
        self,
        source: SnapshotSource,
        *,
        grace_s: float = 0.5,
        tty_fd: int | None = None,
        hard_exit: Callable[[int], None] = os._exit,
        poll_s: float = 0.25,
    ) -> None:
        # `poll_s`: how often the terminal is looked at (a stop request wakes the
        # thread at once). 20 looks a second were a twentieth of an idle TUI's CPU.
        self.source: SnapshotSource = _WatchedSource(source, self)
        self.stop_event: threading.Event | None = None
        self.fired = False
        self._grace = grace_s
        self._poll = poll_s
        self._fd = tty_fd
        self._exit = hard_exit
        self._done = threading.Event()
        self._handed = threading.Event()  # set once a stop event is handed over, or at the end
        self._saved: list[Any] | None = None
        self._thread = threading.Thread(target=self._watch, name="offtop-exit-guard",
                                        daemon=True)

    def __enter__(self) -> ExitGuard:
        if self._fd is not None:
            with contextlib.suppress(termios.error, OSError):
                self._saved = termios.tcgetattr(self._fd)
        self._thread.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._done.set()
        self._handed.set()
        self._thread.join(timeout=1.0)

    def watch(self, stop: threading.Event) -> None:
        """The event that says the app was asked to stop (the app's source is handed it)."""
        if self.stop_event is not stop:
            self.stop_event = stop
            self._handed.set()

    def _stop_requested(self) -> bool:
        ev = self.stop_event
        return ev is not None and ev.is_set()

    def _hung_up(self) -> bool:
        if self._fd is None or self._saved is None:
            return False
        try:
            termios.tcgetattr(self._fd)
        except termios.error:
            return True  # EIO: the terminal is gone
        return False

    def _watch(self) -> None:
        grace = self._grace
        while True:
            # On the stop event once the app handed it over: a stop is seen at once.
            event = self.stop_event
            (self._handed if event is None else event).wait(self._poll)
            if self._done.is_set():
                return
            if self._hung_up():
                grace = min(grace, 0.2)  # no terminal to put back: little to wait for
                break
            if self._stop_requested():
                break
        if self._done.wait(grace):
            return
        self.fired = True
        self._restore_terminal()
        self._exit(0)

    def _restore_terminal(self) -> None:
        """Best effort, never blocking: the terminal may be gone or not reading."""
        if self._fd is None or self._saved is None:
            return
        with contextlib.suppress(OSError):
            fd = os.open("/dev/tty", os.O_WRONLY | os.O_NONBLOCK | os.O_NOCTTY)
            try:
                with contextlib.suppress(OSError):
                    os.write(fd, RESET_SEQUENCE.encode())
            finally:
                os.close(fd)
        with contextlib.suppress(termios.error, OSError):
            termios.tcsetattr(self._fd, termios.TCSANOW, self._saved)
