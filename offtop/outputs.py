"""Where a run's intervals go besides the screen or the batch report: a recording, a push.

`Outputs` feeds every interval to what `--record` and `--push` asked for, and
closes them together on every exit path. Batch mode calls `add` itself; the
TUI gets a `TeeSource`, which feeds them from the app's source thread as
snapshots come out of the source, so the app does not need to know (and
never waits for a disk or a network on its event loop).

Recording and pushing never lose data silently: a recording that cannot be
written ends the run with one line (`OutputError`, status 1); a push that
fails is retried and counted, and the counts are said at exit.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from offtop.cli_io import OutputError
from offtop.export import Pusher
from offtop.model import Snapshot
from offtop.recording import RecordingHeader, RecordingWriter
from offtop.source import SnapshotSource, SourceInfo

#: How long closing waits for queued profiles to be sent (after the probe is detached).
PUSH_CLOSE_S = 1.0


def recording_header(info: SourceInfo, *, threshold_ns: int, interval_s: float,
                     states: str = "", started: float | None = None) -> RecordingHeader:
    """The header of a recording of a capture described by `info`."""
    return RecordingHeader(host=info.host, kernel=info.kernel, scope=info.scope,
                           stacks=info.stacks, threshold_ns=threshold_ns,
                           interval_s=interval_s, states=states,
                           started=time.time() if started is None else started)


class RecordOutput:
    """--record FILE: each interval appended to the recording, whole."""

    def __init__(self, path: str, fd: int, header: RecordingHeader) -> None:
        self.path = path
        try:
            self.writer = RecordingWriter(fd, header)
        except OSError as e:
            raise self._error(e) from None

    def add(self, snap: Snapshot) -> None:
        """Append one interval; `OutputError` if the file refuses it."""
        try:
            self.writer.add(snap)
        except OSError as e:
            raise self._error(e) from None

    def close(self) -> None:
        """Write what is queued and close the file; `OutputError` if that fails."""
        try:
            self.writer.close()
        except OSError as e:
            raise self._error(e) from None

    def _error(self, e: OSError) -> OutputError:
        return OutputError(f"cannot write --record {self.path}: {e.strerror or e}")


class PushOutput:
    """--push URL: each interval queued for the `Pusher` (never waits for the network)."""

    def __init__(self, pusher: Pusher) -> None:
        self.pusher = pusher

    def start(self) -> None:
        """Start the sending thread."""
        self.pusher.start()

    def add(self, snap: Snapshot) -> None:
        """Queue one interval's profile (the oldest queued is dropped, and counted, if full)."""
        self.pusher.push(snap)

    def close(self, timeout: float = PUSH_CLOSE_S) -> str:
        """Send what is queued for at most about `timeout` s; the line that says how it went.

        `Pusher.close` may wait for a request in flight as long as the
        request's own timeout; offtop does not: what has not gone by then is
        counted as not sent.
        """
        closer = threading.Thread(target=self.pusher.close, args=(timeout,),
                                  name="offtop-push-close", daemon=True)
        closer.start()
        closer.join(timeout + 0.5)
        st = self.pusher.stats
        unsent = st.queued + (1 if closer.is_alive() else 0)
        line = (f"push: {st.sent} profile{'s' if st.sent != 1 else ''} sent to "
                f"{self.pusher.endpoint} ({st.failed} failed, {st.dropped + unsent} dropped, "
                f"{st.retries} retried)")
        if st.last_error:
            line += f"; last error: {st.last_error}"
        return line


class Outputs:
    """The outputs of a run, fed and closed together (either may be absent)."""

    def __init__(self, record: RecordOutput | None = None, push: PushOutput | None = None
                 ) -> None:
        self.record = record
        self.push = push
        self._closed = False

    def __bool__(self) -> bool:
        return self.record is not None or self.push is not None

    def start(self) -> None:
        """Called once the source has started (pushing starts then)."""
        if self.push is not None:
            self.push.start()

    def add(self, snap: Snapshot) -> None:
        """Feed one interval to every output; `OutputError` if the recording fails."""
        if self.push is not None:
            self.push.add(snap)
        if self.record is not None:
            self.record.add(snap)

    def close(self) -> list[str]:
        """Close everything (safe to call twice); the lines to say at exit.

        A recording whose last intervals could not be written is an
        `OutputError`, raised once the push is closed too.
        """
        if self._closed:
            return []
        self._closed = True
        lines = []
        error = None
        if self.record is not None:
            try:
                self.record.close()
            except OutputError as e:
                error = e
        if self.push is not None:
            lines.append(self.push.close())
        if error is not None:
            raise OutputError(f"{error}{''.join(f'; {line}' for line in lines)}")
        return lines


class TeeSource:
    """A source whose every snapshot also goes to `outputs`: how the TUI records and pushes.

    Everything else passes through, so the app sees its source's extras
    (blocked waits, a replay's time travel) as they are.
    """

    def __init__(self, source: SnapshotSource, outputs: Outputs) -> None:
        self.source = source
        self.outputs = outputs
        self._started = False

    @property
    def info(self) -> SourceInfo:
        return self.source.info

    @property
    def threshold_ns(self) -> int:
        return self.source.threshold_ns

    def start(self) -> None:
        self.source.start()
        self.outputs.start()
        self._started = True

    def finish(self) -> None:
        """The app has quit: the unfinished interval goes to the outputs too, as batch
        mode writes it on a signal, so that a recording holds what happened up to the
        quit (its screen is gone by then: nothing shows it). A replay has no
        unfinished interval (its next one is a whole other one)."""
        if not self._started or self.source.info.kind == "replay":
            return
        last = self.source.next_snapshot(0.0, threading.Event())
        if last is not None:
            self.outputs.add(last)

    def next_snapshot(self, interval_s: float, stop: threading.Event) -> Snapshot | None:
        snap = self.source.next_snapshot(interval_s, stop)
        if snap is not None:
            self.outputs.add(snap)
        return snap

    def set_threshold(self, ns: int) -> None:
        self.source.set_threshold(ns)

    def close(self) -> None:
        self.source.close()

    def __getattr__(self, name: str) -> Any:
        # Only what the class lacks: `blocked_waits` exists here exactly when
        # the source has it, so `isinstance(tee, BlockedWaits)` tells the truth.
        return getattr(self.source, name)
