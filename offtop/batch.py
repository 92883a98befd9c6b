"""Batch mode: one report per interval, or one profile for the whole run.

The run lasts until `--count` intervals, a signal (SIGINT, SIGTERM, SIGHUP),
the end of a replay, or the source saying nothing is left to watch
(`Snapshot.finished`): then that last interval is printed, the reason goes
to stderr as one line and the status is 3. On a signal, the unfinished
interval is printed too (it holds what happened since the last report).

Formats: `text`, `json` (at most `limit` tasks, processes and stacks a line)
and `folded` print each interval as it ends; `pprof` and `speedscope` sum
every interval, the unfinished last one included, and are written once, at
the end, after the probe is detached. Notices ("pid 123 exited") are part
of a text report; with the other formats they go to stderr.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import Protocol

from offtop.cli_args import EXIT_NOTHING_LEFT, EXIT_OK, PROFILE_FORMATS
from offtop.cli_io import ReportWriter, exit_at_once_on_signal, signal_handlers
from offtop.export import ProfileAccumulator, pprof_bytes, speedscope_json
from offtop.gc_pacing import GcPacing
from offtop.model import Snapshot
from offtop.outputs import Outputs
from offtop.report import folded_lines, snapshot_json_line, text_report
from offtop.source import Hurry, SnapshotSource


class Output(Protocol):
    """Where batch mode writes (a `ReportWriter`)."""

    #: A stop found the output not being read: nothing more is written.
    stalled: bool

    def write(self, text: str | bytes) -> None:
        """Write all of `text` (or, once stalled, nothing)."""
        ...


class BatchFormat(Protocol):
    """What batch mode writes: something per interval, something at the end."""

    #: Notices go to stderr (they are not part of the format's own output).
    notices_to_stderr: bool

    def interval(self, snap: Snapshot) -> str:
        """The report of one interval ("" for none)."""
        ...

    def end(self) -> bytes:
        """What is written once the run is over (b"" for nothing)."""
        ...


#: Stacks a text report shows per interval.
TEXT_TOP_STACKS = 5


class IntervalReports:
    """text, json or folded: one report per interval, nothing at the end."""

    def __init__(self, fmt: str, *, limit: int = 0, wakers: bool = False) -> None:
        self.fmt = fmt
        self.limit = limit
        self.wakers = wakers  # folded: offwaketime-style merged stacks
        self.notices_to_stderr = fmt != "text"

    @property
    def stacks_shown(self) -> int:
        """How many top stacks an interval's report shows (0: all of them)."""
        if self.fmt == "json":
            return self.limit
        return TEXT_TOP_STACKS if self.fmt == "text" else 0

    def interval(self, snap: Snapshot) -> str:
        if self.fmt == "json":
            return snapshot_json_line(snap, limit=self.limit)
        if self.fmt == "folded":
            lines = folded_lines(snap, wakers=self.wakers)
            return "\n".join(lines) + "\n" if lines else ""
        return text_report(snap, top_stacks=TEXT_TOP_STACKS) + "\n\n"

    def end(self) -> bytes:
        return b""


class WholeRunProfile:
    """pprof or speedscope: every interval summed, written once at the end."""

    notices_to_stderr = True

    def __init__(self, fmt: str, *, accumulator: ProfileAccumulator | None = None) -> None:
        if fmt not in PROFILE_FORMATS:
            raise ValueError(f"not a whole-run format: {fmt}")
        self.fmt = fmt
        self.accumulator = accumulator or ProfileAccumulator()

    def interval(self, snap: Snapshot) -> str:
        self.accumulator.add(snap)
        return ""

    def end(self) -> bytes:
        data = self.accumulator.profile()
        if self.fmt == "pprof":
            return pprof_bytes(data)
        return (speedscope_json(data) + "\n").encode()


def make_format(fmt: str, *, limit: int = 0, wakers: bool = False,
                cgroup_name: Callable[[int], str | None] | None = None) -> BatchFormat:
    """The `BatchFormat` for `--format fmt`."""
    if fmt in PROFILE_FORMATS:
        return WholeRunProfile(fmt, accumulator=ProfileAccumulator(cgroup_name=cgroup_name))
    return IntervalReports(fmt, limit=limit, wakers=wakers)


def stderr_notices(snap: Snapshot) -> list[str]:
    """The notices to say on stderr after this interval (the finish reason is said apart)."""
    return [n for n in snap.notices if not (snap.finished and n in snap.finished)]


def run_batch(source: SnapshotSource, fmt: BatchFormat, interval_s: float, count: int | None,
              *, fd: int, name: str | None = None, outputs: Outputs | None = None,
              say: Callable[[str], None] = lambda line: None) -> int:
    """Run batch mode, writing to `fd`, until `count`, a signal or the end; the exit status.

    `say` gets the lines for stderr: notices, why the run ended, and a stop
    that left the last report unwritten (the output not being read).
    """
    stop = threading.Event()
    with ReportWriter(fd, name=name) as writer:

        def on_signal(signum: int, frame: FrameType | None) -> None:
            stop.set()
            writer.stop_requested()
            if isinstance(source, Hurry):  # the last interval without slow work
                source.hurry()

        sigs = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
        with signal_handlers(dict.fromkeys(sigs, on_signal)):
            status = batch_loop(source, fmt, interval_s, count, stop, writer,
                                outputs=outputs or Outputs(), say=say)
    if writer.stalled:
        say(f"{writer.name} is not being read: stopped with the last report unwritten")
    return status


def batch_loop(source: SnapshotSource, fmt: BatchFormat, interval_s: float, count: int | None,
               stop: threading.Event, out: Output, *,
               outputs: Outputs, say: Callable[[str], None]) -> int:
    """The run itself (see module docstring); `out` takes the output, `say` stderr lines."""
    if stop.is_set():  # a signal before the start (early_signal): nothing to start
        return EXIT_OK
    with exit_at_once_on_signal():
        source.start()
    if stop.is_set():
        return EXIT_OK
    outputs.start()

    def deliver(snap: Snapshot, *, partial: bool = False) -> None:
        outputs.add(snap)  # recordings and pushes get every interval, whole
        # An unfinished interval where nothing happened makes no empty report.
        if not partial or snap.tasks or snap.long_blocks or snap.notices:
            text = fmt.interval(snap)
            if text:
                out.write(text)
        if fmt.notices_to_stderr:
            for notice in stderr_notices(snap):
                say(notice)

    n = 0
    finished = ""
    # Python's GC passes: full ones between intervals, no others (offtop.gc_pacing).
    pacing = GcPacing(young=False)
    try:
        while not stop.is_set():
            snap = source.next_snapshot(interval_s, stop)
            if snap is None:
                break
            deliver(snap)
            n += 1
            if snap.finished:
                finished = snap.finished
                break
            if count is not None and n >= count:
                break
            if pacing.snapshot_done() or pacing.overdue():
                pacing.full_pass()
    finally:
        pacing.restore()
    if stop.is_set() and source.info.kind != "replay" and (outputs or not out.stalled):
        # Stopped by a signal: what the unfinished interval holds. (A replay
        # has no unfinished interval: its next one is a whole other one; an
        # output nobody reads would not take it: then only a recording or a
        # push is worth the time it takes to build.)
        last = source.next_snapshot(0.0, threading.Event())
        if last is not None:
            deliver(last, partial=True)
            finished = last.finished
    source.close()  # the probe is detached before a whole-run profile is encoded
    end = fmt.end()
    if end:
        out.write(end)
    if finished:
        say(finished)
        # A replay of such a run ended as replays do; only a live run ends so.
        return EXIT_NOTHING_LEFT if source.info.kind != "replay" else EXIT_OK
    return EXIT_OK
