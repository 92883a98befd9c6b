"""A one-line footer of the keys that apply where the focus is.

Textual's `Footer` mounts a widget per key and recomposes them on every focus
change, which costs tens of milliseconds with offtop's screen; this draws the
same hints as one line of text. Clicking a hint presses its key.
"""

from __future__ import annotations

from rich.text import Text
from textual import events
from textual.screen import Screen
from textual.widget import Widget


class KeyBar(Widget):
    """The bindings with `show=True` active now, as `key description` hints."""

    DEFAULT_CSS = """
    KeyBar {
        dock: bottom;
        height: 1;
        background: $panel;
        color: $foreground;
        text-wrap: nowrap;
        text-overflow: ellipsis;
    }
    """

    def __init__(self, *, id: str | None = None, classes: str | None = None) -> None:
        super().__init__(id=id, classes=classes)
        self._spans: list[tuple[int, int, str]] = []
        self._text = Text()

    def on_mount(self) -> None:
        self.screen.bindings_updated_signal.subscribe(self, self._bindings_changed)
        self._update()

    def on_unmount(self) -> None:
        self.screen.bindings_updated_signal.unsubscribe(self)

    def _bindings_changed(self, screen: Screen[object]) -> None:
        if self.is_attached and screen is self.screen:
            self._update()

    def _update(self) -> None:
        text = Text(no_wrap=True, overflow="ellipsis", end="")
        spans: list[tuple[int, int, str]] = []
        seen: set[str] = set()
        palette = None
        for _, binding, enabled, _tooltip in self.screen.active_bindings.values():
            if binding.action == "command_palette":
                palette = binding
                continue
            if not binding.show or binding.action in seen:
                continue
            seen.add(binding.action)
            start = len(text)
            text.append(f" {self.app.get_key_display(binding)} ",
                        style="bold #f0a35e" if enabled else "dim")
            text.append(f"{binding.description} ", style="" if enabled else "dim")
            spans.append((start, len(text), binding.key))
        if palette is not None:
            hint = f" {self.app.get_key_display(palette)} Commands "
            pad = max(1, self.size.width - len(text) - len(hint))
            text.append(" " * pad)
            start = len(text)
            text.append(hint, style="dim")
            spans.append((start, len(text), palette.key))
        self._text, self._spans = text, spans
        self.refresh()

    def on_resize(self, _: events.Resize) -> None:
        self._update()

    def render(self) -> Text:
        return self._text

    def on_click(self, event: events.Click) -> None:
        """A click on a hint presses its key."""
        for start, end, key in self._spans:
            if start <= event.x < end:
                self.app.simulate_key(key)
                return
