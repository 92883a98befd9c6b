"""The replay bar: where a replay stands in its recording, and the controls to move it.

Shown only for a replay that can travel in time (`TimeTravel.time_travel`:
the TUI's `--replay`). One line: the state (playing, paused, at end), the
speed, the recorded wall time of the interval on screen and its number, and
a time cursor over the whole recording, the interval on screen marked; a
click on the cursor seeks there.

The bar is the replay's controller too: the app's replay keys call `run`,
which asks the source (thread-safe, at once: a waiting `next_snapshot` wakes
up). What is on screen still comes the one way, source → pump → app → panes:
a step asks the source for an interval and the pump brings it, so the bar,
which reads its position from the snapshot shown (`index`), moves when the
screen does, never before.
"""

from __future__ import annotations

import bisect

from rich.text import Text
from textual import events
from textual.reactive import reactive
from textual.widget import Widget

from offtop.model import SnapshotIndex
from offtop.source import SnapshotSource, TimeTravel
from offtop.widgets.render import clock_time

PLAYED_STYLE = "#5fafd7"
CURSOR_STYLE = "bold reverse #e0c050"
#: Below this width the cursor's ends are not labelled with their times.
_LABELLED_TRACK = 40


def time_travel(source: SnapshotSource) -> TimeTravel | None:
    """The replay to bind the keys and the bar to, or None (a live source, or
    a replay that ends at its last interval: steps would reach no one)."""
    return source if isinstance(source, TimeTravel) and source.time_travel else None


def speed_text(speed: float) -> str:
    """`1x`, `4x`, `1/2x`, `1/16x`."""
    if speed >= 1:
        return f"{speed:g}x"
    return f"1/{round(1 / speed)}x"


def track_cell(index: int, length: int, width: int) -> int:
    """The cell of the time cursor (`width` cells) that marks interval `index`."""
    if length <= 1 or width <= 1:
        return 0
    return round(index * (width - 1) / (length - 1))


def track_index(cell: int, length: int, width: int) -> int:
    """The interval a click on `cell` of the time cursor seeks to (`track_cell`'s inverse)."""
    if length <= 1 or width <= 1:
        return 0
    cell = max(0, min(width - 1, cell))
    return round(cell * (length - 1) / (width - 1))


class ReplayBar(Widget):
    """One line: state, speed, time and number of the interval shown, a time
    cursor over the recording (see module docstring)."""

    DEFAULT_CSS = """
    ReplayBar {
        height: 1;
        background: $panel;
        color: $foreground;
        padding: 0 1;
    }
    ReplayBar.-paused {
        background: $warning 30%;
    }
    """

    index: reactive[SnapshotIndex | None] = reactive(None)
    """The snapshot on screen (the app binds it): the bar's position."""
    paused: reactive[bool] = reactive(False)
    """The replay waits for a step, a seek or play (as the source last said)."""
    speed: reactive[float] = reactive(1.0)
    """How many times faster than recorded the replay plays."""

    def __init__(self, replay: TimeTravel, *, id: str | None = None,
                 classes: str | None = None) -> None:
        super().__init__(id=id, classes=classes)
        self.replay = replay
        #: The time cursor's first column and width, as last drawn (for clicks).
        self._track = (0, 0)
        self.set_reactive(ReplayBar.paused, replay.paused)
        self.set_reactive(ReplayBar.speed, replay.speed)
        self.set_class(replay.paused, "-paused")

    # --- what is shown ------------------------------------------------------------

    @property
    def position(self) -> int:
        """The number (from 0) of the interval on screen; -1 before the first.

        Found by the snapshot's time among the recording's, not read from
        the source, which may already be one interval further.
        """
        index = self.index
        if index is None or not index.snapshot.seq:
            return -1
        times = self.replay.times
        at = bisect.bisect_left(times, index.snapshot.time)
        if at < len(times) and times[at] == index.snapshot.time:
            return at
        return self.replay.position  # times out of order: the source's word

    @property
    def state(self) -> str:
        """`playing`, `paused` or `at end`."""
        if self.position >= 0 and self.position == self.replay.length - 1:
            return "at end"
        return "paused" if self.paused else "playing"

    def watch_paused(self, paused: bool) -> None:
        self.set_class(paused, "-paused")

    def watch_index(self) -> None:
        self._sync()

    def _sync(self) -> None:
        """Take the source's pause and speed (they change only through `run`,
        but a step pauses as a side effect)."""
        self.paused = self.replay.paused
        self.speed = self.replay.speed

    # --- control --------------------------------------------------------------------

    def run(self, command: str, amount: int = 0) -> None:
        """One of the replay keys: `pause` (toggle), `step` by `amount` intervals
        (and pause), `start`, `end`, `slower`, `faster`."""
        replay = self.replay
        if command == "pause":
            replay.toggle_pause()
        elif command == "step":
            replay.step(amount)
        elif command == "start":
            replay.seek(0)
        elif command == "end":
            replay.seek(replay.length - 1)
        elif command == "slower":
            replay.slower()
        elif command == "faster":
            replay.faster()
        else:
            raise ValueError(f"no replay command {command!r}")
        self._sync()
        self.refresh()

    def on_click(self, event: events.Click) -> None:
        """A click on the time cursor seeks to the interval under it."""
        start, width = self._track
        offset = event.get_content_offset(self)
        if offset is None or width <= 0 or not start <= offset.x < start + width:
            return
        event.stop()
        self.replay.seek(track_index(offset.x - start, self.replay.length, width))

    # --- drawing -----------------------------------------------------------------------

    def render(self) -> Text:
        replay, position, length = self.replay, self.position, self.replay.length
        line = Text(no_wrap=True, overflow="crop", end="")
        state = self.state
        mark = "▶" if state == "playing" else "■" if state == "at end" else "❚❚"
        line.append(f"{mark} {state:<7}", style="bold")
        line.append("  ")
        line.append(f"{speed_text(self.speed):>5}", style="bold")
        line.append("  ")
        if position >= 0:
            line.append(clock_time(replay.time_at(position)), style="bold")
            line.append(f"  {position + 1}/{length}", style="")
        else:
            line.append("--:--:--", style="dim")
            line.append(f"  -/{length}", style="dim")
        line.append("  ")
        self._draw_track(line, position, length)
        return line

    def _draw_track(self, line: Text, position: int, length: int) -> None:
        """The time cursor over what is left of the line, the recording's first
        and last times at its ends when there is room."""
        room = self.content_size.width - len(line)
        labelled = room - 2 * 9 >= _LABELLED_TRACK and length > 0
        if labelled:
            line.append(clock_time(self.replay.time_at(0)) + " ", style="dim")
            room -= 2 * 9
        width = max(0, room)
        self._track = (len(line), width)
        cell = track_cell(position, length, width) if position >= 0 else -1
        if cell > 0:
            line.append("━" * cell, style=PLAYED_STYLE)
        if cell >= 0 and width:
            line.append("●", style=CURSOR_STYLE)
        rest = width - max(cell, 0) - (1 if cell >= 0 and width else 0)
        line.append("─" * rest, style="dim")
        if labelled:
            line.append(" " + clock_time(self.replay.time_at(length - 1)), style="dim")
