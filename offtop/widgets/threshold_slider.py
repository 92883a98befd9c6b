"""The long-block threshold, as a logarithmic slider from 0 to one hour.

Blocks at or above the threshold are sent one by one through the perf buffer
(and land in the long-blocks log); shorter ones are only aggregated. The
range is the one the command line accepts (`offtop.units.MAX_THRESHOLD_NS`),
so no key ever moves a threshold given on the command line the wrong way.
The slider never touches the source itself: it posts `Changed`, and the app
writes the value to the source at once.
"""

from __future__ import annotations

import math
from typing import ClassVar

from rich.text import Text
from textual import events
from textual.binding import Binding, BindingType
from textual.message import Message
from textual.reactive import reactive
from textual.widget import Widget

from offtop.units import MAX_THRESHOLD_NS

#: The lowest non-zero and the highest position of the scale.
LOW_NS = 10_000
HIGH_NS = MAX_THRESHOLD_NS
_DECADES = math.log10(HIGH_NS / LOW_NS)

_S = 1_000_000_000
#: Key steps: 0, then 1-2-5 from 10 µs to 10 s, then minutes up to the maximum.
STEPS: tuple[int, ...] = (
    0, *(m * 10**e for e in range(4, 10) for m in (1, 2, 5)),
    10 * _S, 30 * _S, 60 * _S, 2 * 60 * _S, 5 * 60 * _S, 10 * 60 * _S, 30 * 60 * _S, HIGH_NS,
)

_TICKS = ((10_000, "10µ"), (100_000, "100µ"), (1_000_000, "1ms"), (10_000_000, "10ms"),
          (100_000_000, "100ms"), (_S, "1s"), (10 * _S, "10s"), (60 * _S, "1m"),
          (HIGH_NS, "1h"))


def step_up(ns: int) -> int:
    """The next key step above `ns` (never below it)."""
    return next((s for s in STEPS if s > ns), max(ns, HIGH_NS))


def step_down(ns: int) -> int:
    """The next key step below `ns`."""
    return next((s for s in reversed(STEPS) if s < ns), 0)


def _two_digits(ns: float) -> int:
    """Round to two significant digits (37.4 ms → 37 ms)."""
    if ns <= 0:
        return 0
    e = 10 ** max(0, math.floor(math.log10(ns)) - 1)
    return int(round(ns / e) * e)


def value_at(cell: int, width: int) -> int:
    """The threshold at `cell` of a bar `width` cells wide (cell 0 is 0)."""
    if cell <= 0 or width < 3:
        return 0
    frac = min(1.0, (cell - 1) / (width - 2))
    return min(HIGH_NS, _two_digits(LOW_NS * 10 ** (_DECADES * frac)))


def cell_of(ns: int, width: int) -> int:
    """The bar cell showing `ns`."""
    if ns <= 0 or width < 3:
        return 0
    frac = math.log10(max(ns, LOW_NS) / LOW_NS) / _DECADES
    return 1 + round(min(1.0, frac) * (width - 2))


class ThresholdSlider(Widget, can_focus=True):
    """A log-scale slider for the long-block threshold (keys and mouse)."""

    DEFAULT_CSS = """
    ThresholdSlider {
        height: 2;
    }
    """

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("right", "increase", "Threshold up", show=False, id="slider.up"),
        Binding("left", "decrease", "Threshold down", show=False, id="slider.down"),
        Binding("home", "set(0)", "Threshold 0", show=False, id="slider.zero"),
        Binding("end", f"set({HIGH_NS})", "Threshold 1 h", show=False, id="slider.max"),
    ]

    value_ns: reactive[int] = reactive(0)
    """The threshold shown (ns)."""

    class Changed(Message):
        """The user moved the slider to `value_ns`."""

        def __init__(self, slider: ThresholdSlider, value_ns: int) -> None:
            super().__init__()
            self.slider = slider
            self.value_ns = value_ns

        @property
        def control(self) -> ThresholdSlider:
            """The slider that moved."""
            return self.slider

    def __init__(
        self, value_ns: int = 0, *, id: str | None = None, classes: str | None = None
    ) -> None:
        super().__init__(id=id, classes=classes)
        self.set_reactive(ThresholdSlider.value_ns, value_ns)
        self._dragging = False

    # --- moves ----------------------------------------------------------

    def move_to(self, ns: int) -> None:
        """Set the threshold as the user would (posts `Changed` if it moved)."""
        ns = max(0, min(HIGH_NS, int(ns)))
        if ns != self.value_ns:
            self.value_ns = ns
            self.post_message(self.Changed(self, ns))

    def action_increase(self) -> None:
        """One step up (see `STEPS`)."""
        self.move_to(step_up(self.value_ns))

    def action_decrease(self) -> None:
        """One step down."""
        self.move_to(step_down(self.value_ns))

    def action_set(self, ns: int) -> None:
        """Jump to a value."""
        self.move_to(ns)

    # --- mouse ----------------------------------------------------------

    @property
    def _bar_width(self) -> int:
        return max(3, self.content_size.width)

    def _move_to_x(self, x: int) -> None:
        self.move_to(value_at(x, self._bar_width))

    def on_mouse_down(self, event: events.MouseDown) -> None:
        """Click on the bar: jump there and start dragging."""
        self._dragging = True
        self.capture_mouse()
        self._move_to_x(event.x - self.gutter.left)

    def on_mouse_move(self, event: events.MouseMove) -> None:
        """Drag the knob."""
        if self._dragging:
            self._move_to_x(event.x - self.gutter.left)

    def on_mouse_up(self, event: events.MouseUp) -> None:
        """Stop dragging."""
        if self._dragging:
            self._dragging = False
            self.release_mouse()

    # --- drawing --------------------------------------------------------

    def render(self) -> Text:
        """The bar with its knob, and the scale's ticks under it."""
        width = self._bar_width
        knob = cell_of(self.value_ns, width)
        bar = Text(no_wrap=True, end="")
        bar.append("━" * knob, style="#5fafd7")
        bar.append("●", style="bold reverse #5fafd7" if self.has_focus else "bold #ffffff")
        bar.append("─" * max(0, width - knob - 1), style="dim")
        ticks = [" "] * width
        ticks[0] = "0"
        for ns, label in _TICKS:
            c = cell_of(ns, width)
            start = min(max(0, c - len(label) // 2), width - len(label))
            if all(ch == " " for ch in ticks[max(0, start - 1): start + len(label) + 1]):
                ticks[start: start + len(label)] = list(label)
        tick_text = Text("".join(ticks), style="dim", no_wrap=True, end="")
        return Text("\n", end="").join([bar, tick_text])

    def on_focus(self) -> None:
        self.refresh()

    def on_blur(self) -> None:
        self.refresh()
