"""The filter line (`/` or F3, as htop's search): tasks and stacks whose
name, pid or frames contain the text; the flame graph highlights it.

Shown while a filter is open. Enter keeps the filter and goes back to the
tasks; Esc clears it. The text is typed by the user and shown literally
(the task table's subtitle quotes it as `Text`, never markup).
"""

from __future__ import annotations

from typing import ClassVar

from textual.binding import Binding, BindingType
from textual.message import Message
from textual.widgets import Input


class FilterInput(Input):
    """The filter line (see module docstring)."""

    DEFAULT_CSS = """
    FilterInput {
        display: none;
        height: 1;
        margin: 0 1;
        &.-open {
            display: block;
        }
    }
    """

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape", "clear_filter", "Clear filter", show=False, id="filter.clear"),
    ]

    class Done(Message):
        """Enter or Esc: the user is done with the filter line."""

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(placeholder="filter: name, pid or frame text · Enter keeps · Esc clears",
                         id=id, compact=True)

    @property
    def is_open(self) -> bool:
        """A filter is shown (typed, or being typed)."""
        return self.has_class("-open")

    def open(self) -> None:
        """Show the line and take the keys."""
        self.add_class("-open")
        self.focus()

    def close(self) -> None:
        """No filter: clear and hide the line."""
        self.value = ""
        self.remove_class("-open")

    def action_clear_filter(self) -> None:
        """Esc: no filter."""
        self.close()
        self.post_message(self.Done())

    def on_input_submitted(self, event: Input.Submitted) -> None:
        """Enter: keep the filter (an empty one closes the line)."""
        event.stop()
        if not self.value:
            self.close()
        self.post_message(self.Done())
