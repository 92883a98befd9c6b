"""The long-block threshold pane: the value, typed or stepped, over its slider.

The top line is an input holding the threshold in force: type a duration
(`30s`, `250ms`, a bare number is ms) and Enter sets it; Esc puts back the
value in force. Under it the logarithmic slider (keys, click, drag). Either
way the pane posts one `Changed`; the app writes the source and hands the
value in force back through `value_ns`.
"""

from __future__ import annotations

from typing import ClassVar

from rich.text import Text
from textual import on
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal, Vertical
from textual.message import Message
from textual.reactive import reactive
from textual.widgets import Input, Static

from offtop.units import DurationError, format_ns, parse_duration_ns
from offtop.widgets.threshold_slider import HIGH_NS, ThresholdSlider


def threshold_label(ns: int) -> str:
    """How a threshold reads in the input."""
    return format_ns(ns) if ns else "0"


class ThresholdInput(Input):
    """The typed threshold (Esc puts back the value in force)."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape", "revert", "Revert", show=False, id="threshold.revert")]

    class Reverted(Message):
        """Esc: the typed text is dropped."""

    def action_revert(self) -> None:
        """Drop what was typed."""
        self.post_message(self.Reverted())


class ThresholdPane(Vertical):
    """The threshold, typed or on a slider (see module docstring)."""

    DEFAULT_CSS = """
    ThresholdPane {
        height: auto;
        padding: 0 1;
        & > Horizontal {
            height: 1;
        }
        & .threshold-prefix {
            width: 2;
        }
        & Input {
            width: 12;
            height: 1;
        }
        & .threshold-hint {
            width: 1fr;
            color: $text-muted;
        }
    }
    """

    value_ns: reactive[int] = reactive(0, init=False)
    """The threshold in force (the app binds it)."""

    class Changed(Message):
        """The user asked for a new threshold."""

        def __init__(self, pane: ThresholdPane, value_ns: int) -> None:
            super().__init__()
            self.pane = pane
            self.value_ns = value_ns

    def __init__(self, value_ns: int, *, id: str | None = None,
                 classes: str | None = None) -> None:
        super().__init__(id=id, classes=classes)
        self.set_reactive(ThresholdPane.value_ns, value_ns)

    def compose(self) -> ComposeResult:
        with Horizontal():
            yield Static("≥ ", classes="threshold-prefix")
            yield ThresholdInput(threshold_label(self.value_ns), compact=True,
                                 placeholder="e.g. 30s", id="threshold-input",
                                 select_on_focus=True)
            yield Static(Text(" type, ←/→ +/- or click", end=""), classes="threshold-hint")
        yield ThresholdSlider(self.value_ns, id="threshold-slider")

    def on_mount(self) -> None:
        self.border_title = "Long-block threshold"

    def watch_value_ns(self, ns: int) -> None:
        self.query_one(ThresholdSlider).value_ns = ns
        self.query_one(ThresholdInput).value = threshold_label(ns)

    @on(ThresholdSlider.Changed)
    def _slider_moved(self, event: ThresholdSlider.Changed) -> None:
        event.stop()
        self.post_message(self.Changed(self, event.value_ns))

    @on(Input.Submitted, "#threshold-input")
    def _typed(self, event: Input.Submitted) -> None:
        event.stop()
        try:
            ns = parse_duration_ns(event.value, max_ns=HIGH_NS)
        except DurationError as error:
            self.app.notify(str(error), title="threshold", severity="error", markup=False)
            return
        self.query_one(ThresholdSlider).focus()
        self.post_message(self.Changed(self, ns))

    @on(ThresholdInput.Reverted)
    def _reverted(self, event: ThresholdInput.Reverted) -> None:
        event.stop()
        self.query_one(ThresholdInput).value = threshold_label(self.value_ns)
        self.query_one(ThresholdSlider).focus()
