"""The help screen, built from the bindings themselves (so it cannot go stale)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import ClassVar

from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Static

#: A section of the help: a title, a note, and the bindings it documents.
HelpSection = tuple[str, str, Sequence[BindingType]]


def help_sections(app_bindings: Sequence[BindingType]) -> list[HelpSection]:
    """The help screen's sections: the app's keys, then each pane's own."""
    # Imported here: the panes import nothing of the help, and the help
    # needs every pane's bindings.
    from offtop.widgets.blocked_now import BlockedNowTable
    from offtop.widgets.callchain_tree import CallchainTree
    from offtop.widgets.flame_graph import FlameGraph
    from offtop.widgets.line_table import LineTable
    from offtop.widgets.long_blocks_log import LongBlocksLog
    from offtop.widgets.stack_table import StackTable
    from offtop.widgets.task_table import TaskTable
    from offtop.widgets.threshold_slider import ThresholdSlider
    from offtop.widgets.waker_tree import WakerTree

    # A replay's keys (ids `replay.*`, given only in a replay) get their own section.
    replay = [b for b in app_bindings
              if isinstance(b, Binding) and (b.id or "").startswith("replay.")]
    everywhere = [b for b in app_bindings if b not in replay]
    return [
        ("Everywhere", "htop's F-keys work too; + and - always move the threshold",
         everywhere),
        *([("Replay", "as in mpv; steps pause; click the time cursor to go there", replay)]
          if replay else []),
        ("Tables", "arrows, PgUp/PgDn, Home/End; click a header to sort by it; Enter opens "
                   "a task's or stack's tree, a blocked task's stack",
         [*LineTable.BINDINGS, *TaskTable.BINDINGS, *StackTable.BINDINGS,
          *BlockedNowTable.BINDINGS]),
        ("Callchain tree", "Enter/space expand or collapse; Esc goes back",
         CallchainTree.BINDINGS),
        ("Who woke it", "under the callchain tree (Tab): who woke the blocks below its "
                        "cursor, each waker's stack innermost first (Enter on a stack in "
                        "the stacks table: that stack's)",
         WakerTree.BINDINGS),
        # The graph's own +/- zoom keys are left out: in offtop they move the
        # threshold everywhere (one meaning per key).
        ("Flame graph", "←↑↓→ move; the filter (/) highlights frames",
         [b for b in FlameGraph.BINDINGS
          if not (isinstance(b, Binding) and b.key in ("plus", "minus"))]),
        ("Threshold", "type a duration (30s, 250ms) in its box, or click/drag the bar",
         ThresholdSlider.BINDINGS),
        ("Long blocks", "End follows the newest again", LongBlocksLog.BINDINGS),
    ]


def merged_bindings(bindings: Iterable[BindingType]) -> list[tuple[list[Binding], str]]:
    """Bindings with an id, grouped by action (or by their `group`, for keys that do
    the same by different actions): `[(bindings, description)]`.

    A primary binding and its secondary keys (same action, `show=False`) make
    one line, e.g. `p / space  Pause`.
    """
    out: dict[str, tuple[list[Binding], str]] = {}
    for b in bindings:
        if not isinstance(b, Binding) or b.id is None:
            continue
        line = f"group:{b.group.description}" if b.group is not None else b.action
        keys, desc = out.get(line, ([], ""))
        keys.append(b)
        out[line] = (keys, desc or b.tooltip or b.description)
    return list(out.values())


class HelpScreen(ModalScreen[None]):
    """Every key, section by section, from the bindings of each part of the UI."""

    DEFAULT_CSS = """
    HelpScreen {
        align: center middle;
    }
    HelpScreen > VerticalScroll {
        width: 120;
        max-width: 100%;
        height: auto;
        max-height: 100%;
        border: round $accent;
        background: $surface;
        padding: 0 1;
    }
    HelpScreen Horizontal {
        height: auto;
    }
    HelpScreen Vertical {
        width: 1fr;
        height: auto;
        padding-right: 2;
    }
    HelpScreen Static {
        width: 100%;
    }
    """

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape", "dismiss", "Close", id="help.close"),
        Binding("question_mark", "dismiss", "Close", show=False, id="help.close2"),
        Binding("q", "dismiss", "Close", show=False, id="help.close3"),
    ]

    def __init__(self, sections: Sequence[HelpSection]) -> None:
        super().__init__()
        self.sections = sections
        #: `(keys, description)` of every line shown, in order.
        self.lines: list[tuple[str, str]] = []

    def key_display(self, binding: Binding) -> str:
        """How a key reads: `space`, `ctrl+c`, `/`, `?`, `F1`."""
        if binding.key_display:
            return binding.key_display
        if binding.key in ("enter", "escape"):
            return "enter" if binding.key == "enter" else "esc"
        if binding.key.startswith("f") and binding.key[1:].isdigit():
            return binding.key.upper()
        return self.app.get_key_display(binding)

    def _section(self, title: str, note: str, bindings: Sequence[BindingType]) -> ComposeResult:
        table = Table.grid(padding=(0, 2))
        table.add_column(width=14, no_wrap=True)
        table.add_column()
        for keys, desc in merged_bindings(bindings):
            shown = " / ".join(dict.fromkeys(self.key_display(b) for b in keys))
            table.add_row(Text(shown, style="bold #5fafd7"), Text(desc))
            self.lines.append((shown, desc))
        head = Text()
        head.append(title, style="bold underline")
        if note:
            head.append(f"\n{note}", style="dim italic")
        yield Static(head, classes="help-title")
        yield Static(table, classes="help-keys")
        yield Static("")

    def compose(self) -> ComposeResult:
        first, *rest = self.sections
        with VerticalScroll() as scroll:
            scroll.border_title = "offtop keys"
            scroll.border_subtitle = "Esc closes"
            with Horizontal():
                with Vertical():
                    yield from self._section(*first)
                with Vertical():
                    for section in rest:
                        yield from self._section(*section)
            yield Static(Text(
                "Off-CPU time: how long threads were switched out (sleeping, waiting on locks, "
                "pipes, I/O) in the last interval. S = interruptible sleep, D = uninterruptible "
                "(often I/O). Kernel frames are orange (k), user frames blue (u), Python "
                "functions green (py). A ~ before a time: the block began before offtop "
                "started (estimated).",
                style="dim"))
