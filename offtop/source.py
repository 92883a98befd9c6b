"""Where snapshots come from.

The app and the batch printer take any `SnapshotSource`: the BPF engine
(`offtop.bpf.engine.BpfSource`) on a live kernel, or `ReplaySource`, which
plays back recorded snapshots (`offtop.recording`) with time travel, for
offline reading, UI tests and demos. Neither the app nor the widgets know
which one they have.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
import os
import platform
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from offtop.model import Snapshot
from offtop.recording import Timeline, load_recording


@dataclass(frozen=True, slots=True)
class SourceInfo:
    """What the header says about the capture."""

    host: str
    kernel: str
    scope: str = "all tasks"
    stacks: str = "kernel+user"
    kind: str = "bpf"


class SnapshotSource(Protocol):
    """The interface between data and screen (see module docstring)."""

    @property
    def info(self) -> SourceInfo:
        """Host, kernel, scope and stack mode, for the header."""
        ...

    @property
    def threshold_ns(self) -> int:
        """The current long-block threshold."""
        ...

    def start(self) -> None:
        """Get ready to produce snapshots (may be slow: compiles BPF)."""
        ...

    def next_snapshot(self, interval_s: float, stop: threading.Event) -> Snapshot | None:
        """Block for about `interval_s`, then return that interval's snapshot.

        Returns None when `stop` is set or the source is exhausted. Never
        blocks much longer than the interval, whatever the event rate.
        """
        ...

    def set_threshold(self, ns: int) -> None:
        """Route blocks of `ns` or longer to the event stream, from now on."""
        ...

    def close(self) -> None:
        """Detach and free everything; safe to call twice."""
        ...


@runtime_checkable
class BlockedWaits(Protocol):
    """What a source may offer besides `SnapshotSource`: the waits of blocked
    threads read at any moment, so the UI shows them true at every redraw."""

    def blocked_waits(self, tids: Iterable[int]) -> Mapping[int, int]:
        """How long each of `tids` has been blocked now, in ns; a thread that
        is absent runs again (or is not known). Cheap; callable from any thread."""
        ...


@runtime_checkable
class Hurry(Protocol):
    """What a source may offer besides `SnapshotSource`: a way to say "stopping"."""

    def hurry(self) -> None:
        """A stop is on its way: build what is left (the unfinished interval) without
        the slow work (new stacks are not resolved), so a signal ends offtop at once.
        Callable from a signal handler or any thread."""
        ...


@runtime_checkable
class TimeTravel(Protocol):
    """What a replay offers besides `SnapshotSource`: moving in its recording
    (`ReplaySource` has it; the CLI's wrappers pass it through, so this is
    checked by shape, not by class). Callable from any thread."""

    @property
    def time_travel(self) -> bool:
        """Steps and seeks reach the screen (the replay holds at its end or loops)."""
        ...

    @property
    def position(self) -> int:
        """The index of the interval returned last (-1 before the first)."""
        ...

    @property
    def length(self) -> int:
        """How many intervals the recording holds."""
        ...

    @property
    def times(self) -> Sequence[float]:
        """The end time (unix s) of every interval, in order."""
        ...

    @property
    def paused(self) -> bool:
        """Playback waits for a step, a seek or a resume."""
        ...

    @property
    def speed(self) -> float:
        """How many times faster than recorded it plays."""
        ...

    def time_at(self, index: int) -> float:
        """The end time (unix s) of interval `index`."""
        ...

    def toggle_pause(self) -> bool:
        """Pause or resume; returns whether paused now."""
        ...

    def step(self, delta: int = 1) -> int:
        """The interval `delta` away, at once, and pause there."""
        ...

    def seek(self, index: int) -> int:
        """Interval `index` at once, playing or paused as before."""
        ...

    def faster(self) -> float:
        """Double the speed; returns it."""
        ...

    def slower(self) -> float:
        """Halve the speed; returns it."""
        ...


def local_info(kind: str, scope: str = "all tasks", stacks: str = "kernel+user") -> SourceInfo:
    """A `SourceInfo` for this machine."""
    return SourceInfo(
        host=platform.node(), kernel=platform.release(), scope=scope, stacks=stacks, kind=kind
    )


#: How often a waiting replay looks at its stop event (it cannot wait on two).
_POLL_S = 0.05


class ReplaySource:
    """Plays back recorded snapshots, with time travel: for offline reading,
    UI tests and demos.

    Playback: `next_snapshot` returns the next interval; with `realtime` it
    waits `interval_s / speed` between them (the first comes at once),
    without it returns each at once (tests). At the end it returns None (the
    run is over), unless `loop` (start again) or `hold_at_end` (wait there,
    for a step back or a seek: what the TUI wants, so time travel never ends
    the run).

    Time travel, for the keys the TUI binds; callable from any thread, each
    takes effect at once (a waiting `next_snapshot` wakes up):

    - `position` (the interval shown last, -1 before the first), `length`,
      `at_end`, `times` / `time_at(i)` (end time of each interval, unix s);
    - `pause()`, `resume()`, `toggle_pause()`, `paused`: while paused,
      `next_snapshot` waits (it still returns None at once on `stop`);
    - `step(delta)`: the interval `delta` away from the one shown, at once,
      and pause there (frame by frame, as video players step);
    - `seek(index)`, `seek_time(unix_s)`: that interval at once; a playing
      replay goes on from there, a paused one stays paused;
    - `speed`, `set_speed(x)`, `faster()`, `slower()`: from 1/16x to 64x.

    Threshold changes are kept and stamped onto later snapshots, so the
    slider behaves as it would live; until one is made, each snapshot keeps
    the threshold it was recorded with. `notes` (e.g. "the recording was cut
    short") are added to the notices of the first interval.
    """

    MIN_SPEED = 1 / 16
    MAX_SPEED = 64.0

    def __init__(
        self,
        snapshots: Sequence[Snapshot],
        *,
        info: SourceInfo | None = None,
        realtime: bool = True,
        loop: bool = False,
        hold_at_end: bool = False,
        clock: Callable[[], float] = time.monotonic,
        notes: Sequence[str] = (),
    ) -> None:
        self._snapshots: Sequence[Snapshot] = (
            snapshots if isinstance(snapshots, Timeline) else list(snapshots))
        self._times: Sequence[float] = (
            snapshots.times if isinstance(snapshots, Timeline)
            else [s.time for s in self._snapshots])
        self._info = info or SourceInfo(
            host="replay", kernel=platform.release(), kind="replay"
        )
        self._realtime = realtime
        self._loop = loop
        self._hold_at_end = hold_at_end
        self._clock = clock
        self._notes = tuple(notes)
        self._cond = threading.Condition()
        self._position = -1
        self._jump: int | None = None
        self._paused = False
        self._speed = 1.0
        self._resumed_at = -math.inf
        self._first_threshold = self._snapshots[0].threshold_ns if self._snapshots else 500_000_000
        self._threshold_override: int | None = None
        self.threshold_writes: list[int] = []
        self.closed = False

    @classmethod
    def from_file(
        cls,
        path: str | os.PathLike[str],
        *,
        realtime: bool = True,
        loop: bool = False,
        hold_at_end: bool = False,
    ) -> ReplaySource:
        """Play a recording (`--record`) or `--batch --format json` output.

        The header of a recording gives `info` (the recorded host, kernel,
        scope: not this machine's); plain JSON output has none, and says so.
        Raises `RecordingError` (one line for users); see `load_recording`.
        """
        rec = load_recording(path)
        h = rec.header
        info = SourceInfo(host=h.host, kernel=h.kernel, scope=h.scope, stacks=h.stacks,
                          kind="replay") if h is not None else SourceInfo(
            host="(not recorded)", kernel="(not recorded)", scope="(not recorded)",
            stacks="(not recorded)", kind="replay")
        notes = ("the recording was cut short (not closed): its last interval is "
                 "incomplete and left out",) if rec.cut_short else ()
        return cls(rec.timeline, info=info, realtime=realtime, loop=loop,
                   hold_at_end=hold_at_end, notes=notes)

    # --- SnapshotSource --------------------------------------------------------

    @property
    def info(self) -> SourceInfo:
        return self._info

    @property
    def threshold_ns(self) -> int:
        if self._threshold_override is not None:
            return self._threshold_override
        pos = self._position
        return self._snapshots[pos].threshold_ns if pos >= 0 else self._first_threshold

    def start(self) -> None:
        with self._cond:
            self._position = -1
            self._jump = None

    def next_snapshot(self, interval_s: float, stop: threading.Event) -> Snapshot | None:
        began = self._clock()
        with self._cond:
            while True:
                if stop.is_set() or self.closed:
                    return None
                if self._jump is not None:
                    index, self._jump = self._jump, None
                    break
                wait = _POLL_S
                if not self._paused:
                    index = self._position + 1
                    if index >= len(self._snapshots):
                        if self._loop and self._snapshots:
                            index = 0
                        elif not self._hold_at_end:
                            return None
                    if index < len(self._snapshots):
                        if not self._realtime or self._position < 0:
                            break
                        since = max(began, self._resumed_at)
                        wait = since + interval_s / self._speed - self._clock()
                        if wait <= 0:
                            break
                self._cond.wait(min(wait, _POLL_S))
            self._position = index
        return self._stamp(index)

    def set_threshold(self, ns: int) -> None:
        self._threshold_override = ns
        self.threshold_writes.append(ns)

    def close(self) -> None:
        with self._cond:
            self.closed = True
            self._cond.notify_all()

    def blocked_waits(self, tids: Iterable[int]) -> Mapping[int, int]:
        """The waits as recorded in the snapshot last returned (see `BlockedWaits`)."""
        pos = self._position
        if pos < 0:
            return {}
        wanted = set(tids)
        return {b.tid: b.blocked_ns for b in self._snapshots[pos].blocked_now
                if b.tid in wanted}

    def _stamp(self, index: int) -> Snapshot:
        snap = self._snapshots[index]
        if self._threshold_override is not None:
            snap = dataclasses.replace(snap, threshold_ns=self._threshold_override)
        if index == 0 and self._notes:
            snap = dataclasses.replace(snap, notices=(*self._notes, *snap.notices))
        return snap

    # --- time travel -------------------------------------------------------------

    @property
    def position(self) -> int:
        """The index of the interval shown last (-1 before the first)."""
        return self._position

    @property
    def length(self) -> int:
        """How many intervals the recording holds."""
        return len(self._snapshots)

    @property
    def at_end(self) -> bool:
        """The last interval is the one shown."""
        return self._position == len(self._snapshots) - 1

    @property
    def times(self) -> Sequence[float]:
        """The end time (unix s) of every interval, in order."""
        return self._times

    def time_at(self, index: int) -> float:
        """The end time (unix s) of interval `index`."""
        return self._times[index]

    @property
    def time_travel(self) -> bool:
        """Steps and seeks reach a consumer that plays to the end: the replay
        holds there or loops instead of ending (the TUI binds its keys only then)."""
        return self._hold_at_end or self._loop

    @property
    def paused(self) -> bool:
        """Playback waits for a step, a seek or `resume()`."""
        return self._paused

    @property
    def speed(self) -> float:
        """How many times faster than recorded the replay plays."""
        return self._speed

    def pause(self) -> None:
        """Hold playback at the interval shown."""
        with self._cond:
            self._paused = True
            self._cond.notify_all()

    def resume(self) -> None:
        """Play on; the next interval comes a whole (scaled) interval from now."""
        with self._cond:
            if self._paused:
                self._paused = False
                self._resumed_at = self._clock()
            self._cond.notify_all()

    def toggle_pause(self) -> bool:
        """Pause or resume; returns whether paused now."""
        if self._paused:
            self.resume()
        else:
            self.pause()
        return self._paused

    def step(self, delta: int = 1) -> int:
        """Show the interval `delta` away at once (negative: back), and pause there.

        Steps add up until shown (two quick steps back go two intervals back).
        Returns the index that will be shown.
        """
        with self._cond:
            base = self._jump if self._jump is not None else self._position
            target = self._clamp(base + delta)
            self._jump = target
            self._paused = True
            self._cond.notify_all()
            return target

    def seek(self, index: int) -> int:
        """Show interval `index` at once (clamped to the recording); returns it."""
        with self._cond:
            target = self._clamp(index)
            self._jump = target
            self._resumed_at = self._clock()
            self._cond.notify_all()
            return target

    def seek_time(self, unix_s: float) -> int:
        """Show the first interval that ends at or after `unix_s`; returns its index."""
        return self.seek(bisect.bisect_left(self._times, unix_s))

    def set_speed(self, factor: float) -> float:
        """Play `factor` times as fast as recorded (1/16 to 64); returns the speed set."""
        if not math.isfinite(factor) or factor <= 0:
            raise ValueError(f"replay speed must be a positive number, not {factor!r}")
        with self._cond:
            self._speed = min(self.MAX_SPEED, max(self.MIN_SPEED, factor))
            self._cond.notify_all()
            return self._speed

    def faster(self) -> float:
        """Double the speed (at most 64x)."""
        return self.set_speed(self._speed * 2)

    def slower(self) -> float:
        """Halve the speed (at least 1/16x)."""
        return self.set_speed(self._speed / 2)

    def _clamp(self, index: int) -> int:
        return max(0, min(len(self._snapshots) - 1, index))
