"""A small menu over the screen: pick one of a few choices (htop's F6 sort menu).

Used for the sort column and for the export format. Returns the chosen id,
or None when dismissed with Esc.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from rich.text import Text
from textual import on
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.screen import ModalScreen
from textual.widgets import OptionList
from textual.widgets.option_list import Option


class ChoiceScreen(ModalScreen[str | None]):
    """A titled list of choices; Enter picks one, Esc picks none."""

    DEFAULT_CSS = """
    ChoiceScreen {
        align: center middle;
    }
    ChoiceScreen > OptionList {
        width: auto;
        min-width: 30;
        max-width: 90%;
        height: auto;
        max-height: 80%;
        border: round $accent;
        background: $surface;
    }
    """

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape", "dismiss(None)", "Close", id="choice.close"),
    ]

    def __init__(self, title: str, choices: Sequence[tuple[str, str | Text]], *,
                 current: str | None = None, subtitle: str = "Enter picks · Esc closes") -> None:
        super().__init__()
        self.title_text = title
        self.subtitle_text = subtitle
        self.choices = list(choices)
        self.current = current

    def compose(self) -> ComposeResult:
        options = OptionList(*(Option(label, id=choice) for choice, label in self.choices))
        options.border_title = self.title_text
        options.border_subtitle = self.subtitle_text
        yield options

    def on_mount(self) -> None:
        options = self.query_one(OptionList)
        ids = [choice for choice, _ in self.choices]
        if self.current in ids:
            options.highlighted = ids.index(self.current)
        options.focus()

    @on(OptionList.OptionSelected)
    def _picked(self, event: OptionList.OptionSelected) -> None:
        event.stop()
        self.dismiss(event.option.id)
