"""A log of long blocks (≥ threshold), newest at the bottom, as they arrive.

Drawn with the Line API and never resized by what it holds: a block arriving
costs an append and a repaint of the lines in view, never a layout pass (a
`RichLog` lays the screen out again at every write, which under a flood of
events kept the app busy for seconds). It keeps the newest `MAX_LINES`
blocks and counts every block that arrived, listed or not, and the events
the kernel's ring lost ("N seen").

Each line names who woke the block (`← wl-writer 1234/1235`, `← [timer
interrupt]`) after the task: at a width that cannot hold that much, the
callchain goes, with the waker's ids and the clock's milliseconds, and the
waker's name is cut short with an ellipsis if it must.

It follows the newest block until the user moves up (keys, wheel, click);
End follows again. Enter (or a second click) on a block posts `Chosen`, and
the app opens that block's stack.
"""

from __future__ import annotations

from collections import deque
from typing import ClassVar

from rich.segment import Segment
from rich.style import Style
from rich.text import Text
from textual import events
from textual.binding import Binding, BindingType
from textual.cache import LRUCache
from textual.geometry import Region
from textual.message import Message
from textual.reactive import var
from textual.strip import Strip

from offtop.model import LongBlock
from offtop.safe_text import printable
from offtop.units import format_ns
from offtop.widgets.arrivals import Taken
from offtop.widgets.render import (
    TitledPane,
    chain_summary,
    clock_time,
    set_titles,
    severity_style,
    state_text,
    task_label,
    waker_label,
)


def long_block_line(block: LongBlock, *, show_kernel: bool = True, show_user: bool = True,
                    width: int | None = None) -> Text:
    """`12:00:01.250 D 1.23s postgres 1052/1053 ← kworker/2:1 88/88  k io_schedule ← u pread64`.

    A block that began before offtop started has an estimated length, marked
    `~`. Within `width` cells the waker stays in view (see module docstring).
    """
    chain = chain_summary(block.kernel, block.user, show_kernel=show_kernel,
                          show_user=show_user, max_kernel=1, max_user=2)
    head = _head(block, millis=True)
    if block.waker is None:
        return Text.assemble(head, "  ", chain, no_wrap=True, end="")
    woke = Text.assemble((WOKEN_BY, "dim"), waker_label(block.waker))
    if width is None or head.cell_len + woke.cell_len <= width:
        return Text.assemble(head, woke, "  ", chain, no_wrap=True, end="")
    # Too narrow: no callchain, no waker ids, no milliseconds (on every such
    # line, so the columns stay put), and the waker's name cut short.
    head = _head(block, millis=False)
    woke = Text.assemble((WOKEN_BY, "dim"), waker_label(block.waker, ids=False))
    woke.truncate(max(0, width - head.cell_len), overflow="ellipsis")
    return Text.assemble(head, woke, no_wrap=True, end="")


#: Between a blocked task and the waker that ended its block.
WOKEN_BY = " ← "


def _head(block: LongBlock, *, millis: bool) -> Text:
    """`12:00:01.250 D  1.23s postgres 1052/1053`: when, state, how long, who."""
    t = Text(no_wrap=True, end="")
    t.append(clock_time(block.time, millis=millis), style="dim")
    t.append(" ")
    t.append_text(state_text(block.state))
    duration = ("~" if block.before_start else "") + format_ns(block.duration_ns)
    t.append(f" {duration:>6} ", style=severity_style(block.duration_ns))
    t.append_text(task_label(printable(block.comm), block.pid, block.tid))
    return t


class LongBlocksLog(TitledPane, can_focus=True):
    """The newest `MAX_LINES` long blocks, one line each (see module docstring)."""

    DEFAULT_CSS = """
    LongBlocksLog {
        background: $surface;
        color: $foreground;
        &:focus {
            background-tint: $foreground 5%;
        }
        & > .long-blocks--cursor {
            background: $block-cursor-background;
            color: $block-cursor-foreground;
        }
    }
    """

    COMPONENT_CLASSES: ClassVar[set[str]] = {"long-blocks--cursor"}

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("up,k", "move(-1)", "Up", show=False),
        Binding("down,j", "move(1)", "Down", show=False),
        Binding("pageup", "page(-1)", "Page up", show=False),
        Binding("pagedown", "page(1)", "Page down", show=False),
        Binding("home", "oldest", "Oldest", show=False, id="log.oldest"),
        Binding("end", "newest", "Newest (follow)", show=False, id="log.newest"),
        Binding("enter", "choose", "Open stack",
                tooltip="Open the callchain of this long block", id="log.open"),
    ]

    #: Blocks kept (and listed).
    MAX_LINES: ClassVar[int] = 500

    # `var`s, not `reactive`s: a change redraws what its watcher says changed
    # (a reactive would also repaint the whole pane, at every tick).
    arrived: var[Taken | None] = var(None, always_update=True, init=False)
    """What arrived with the snapshot just shown (the app binds it)."""
    threshold_ns: var[int] = var(0, init=False)
    """The threshold in force (for the title)."""
    show_kernel: var[bool] = var(True, init=False)
    """Kernel frames are shown."""
    show_user: var[bool] = var(True, init=False)
    """User frames are shown."""

    class Chosen(Message):
        """Enter on a long block."""

        def __init__(self, log: LongBlocksLog, block: LongBlock) -> None:
            super().__init__()
            self.log = log
            self.block = block

    def __init__(self, *, id: str | None = None, classes: str | None = None) -> None:
        super().__init__(id=id, classes=classes)
        self._blocks: deque[LongBlock] = deque(maxlen=self.MAX_LINES)
        #: The number of the oldest block kept (blocks are numbered as they come).
        self._first = 0
        #: The number of the block on the top line, or None to follow the newest.
        self._top: int | None = None
        #: The number of the block under the cursor, or None for the newest.
        self._cursor: int | None = None
        self._strips: LRUCache[tuple[object, ...], Strip] = LRUCache(256)
        self._base: Style | None = None  # the style of the render pass under way
        #: Long blocks that arrived (listed or not), and events the ring lost.
        self.seen = 0
        self.lost = 0

    # --- data -----------------------------------------------------------

    @property
    def total(self) -> int:
        """Long blocks seen since the start (the same as `seen`)."""
        return self.seen

    @property
    def blocks(self) -> list[LongBlock]:
        """The blocks kept, oldest first."""
        return list(self._blocks)

    @property
    def lines(self) -> list[Strip]:
        """Every kept block's line as drawn (unstyled by the cursor), oldest first."""
        return [Strip(list(self._line_text(b).render(self.app.console))) for b in self._blocks]

    def watch_arrived(self, taken: Taken | None) -> None:
        if taken is None:
            return
        if taken.restarted:  # a replay jumped: the blocks listed are of another time
            self._blocks.clear()
            self._first, self._top, self._cursor = 0, None, None
            self.seen = self.lost = 0
            self._strips.clear()
        self.seen += taken.seen
        self.lost += taken.lost
        top, old_end = self._view_top(), self._end
        end = old_end
        for block in taken.blocks:
            self._blocks.append(block)
            end += 1
        self._first = end - len(self._blocks)
        if self._top is not None and self._top < self._first:
            self._top = self._first  # the lines in view were dropped: show the oldest kept
        if self._cursor is not None and self._cursor < self._first:
            self._cursor = self._first
        self._update_titles()
        if not (taken.blocks or taken.restarted):
            return
        if taken.restarted or self._view_top() != top:
            self.refresh()  # the lines in view moved (or are of another time)
            return
        # The view stayed: only the new lines change, and the newest one before
        # them, which a following cursor leaves (the rest is drawn already: a
        # whole refresh drew every line again, at every tick with blocks).
        y = max(old_end - 1, top) - top
        self.refresh(Region(0, y, self.size.width, self._end - top - y))

    @property
    def _end(self) -> int:
        return self._first + len(self._blocks)

    def watch_threshold_ns(self) -> None:
        self._update_titles()

    def watch_show_kernel(self) -> None:
        self._strips.clear()
        self.refresh()

    def watch_show_user(self) -> None:
        self._strips.clear()
        self.refresh()

    def on_mount(self) -> None:
        self._update_titles()

    def _update_titles(self) -> None:
        title = f"Long blocks ≥ {format_ns(self.threshold_ns)}"
        sub = f"{self.seen:,} seen"
        if self.seen > len(self._blocks):
            sub += f" · newest {len(self._blocks):,} listed"
        if self.lost:
            sub += f" · {self.lost:,} lost"
        if self._top is not None:
            sub += " · End: follow"
        set_titles(self, title, sub)

    # --- moving -------------------------------------------------------------

    def _view_top(self) -> int:
        """The number of the block on the top line."""
        if self._top is not None:
            return self._top
        return max(self._first, self._end - self.size.height)

    def _cursor_at(self) -> int | None:
        if not self._blocks:
            return None
        return self._cursor if self._cursor is not None else self._end - 1

    def _set_cursor(self, number: int) -> None:
        number = max(self._first, min(number, self._end - 1))
        height = max(1, self.size.height)
        top = self._view_top()
        if number < top:
            top = number
        elif number >= top + height:
            top = number - height + 1
        following = number == self._end - 1 and top + height >= self._end
        self._cursor = None if following else number
        self._top = None if following else top
        self._update_titles()
        self.refresh()

    def action_move(self, step: int) -> None:
        """The cursor up or down a line."""
        at = self._cursor_at()
        if at is not None:
            self._set_cursor(at + step)

    def action_page(self, pages: int) -> None:
        """The cursor up or down a screenful."""
        at = self._cursor_at()
        if at is not None:
            self._set_cursor(at + pages * max(1, self.size.height - 1))

    def action_oldest(self) -> None:
        """The oldest block kept."""
        if self._blocks:
            self._set_cursor(self._first)

    def action_newest(self) -> None:
        """The newest block, and follow new ones."""
        if self._blocks:
            self._set_cursor(self._end - 1)

    def action_choose(self) -> None:
        """Post `Chosen` for the block under the cursor."""
        at = self._cursor_at()
        if at is not None:
            self.post_message(self.Chosen(self, self._blocks[at - self._first]))

    def on_mouse_scroll_up(self, event: events.MouseScrollUp) -> None:
        """The wheel moves the view three lines."""
        event.stop()
        self.action_move(-3)

    def on_mouse_scroll_down(self, event: events.MouseScrollDown) -> None:
        """See `on_mouse_scroll_up`."""
        event.stop()
        self.action_move(3)

    def on_click(self, event: events.Click) -> None:
        """A click puts the cursor on a block; a click on the cursor's block opens it."""
        offset = event.get_content_offset(self)
        if offset is None:
            return
        number = self._view_top() + offset.y
        if not self._first <= number < self._end:
            return
        event.stop()
        if number == self._cursor_at() and self.has_focus:
            self.action_choose()
        else:
            self._set_cursor(number)

    def on_focus(self) -> None:
        """The cursor is drawn only while focused."""
        self.refresh()

    def on_blur(self) -> None:
        """See `on_focus`."""
        self.refresh()

    # --- drawing --------------------------------------------------------------

    def _line_text(self, block: LongBlock, width: int | None = None) -> Text:
        return long_block_line(block, show_kernel=self.show_kernel, show_user=self.show_user,
                               width=width)

    def render_lines(self, crop: Region) -> list[Strip]:
        """Read the style once for the lines of this pass (`rich_style` walks every
        ancestor: per line, it was most of the log's drawing)."""
        self._base = self.rich_style
        try:
            return super().render_lines(crop)
        finally:
            self._base = None

    def render_line(self, y: int) -> Strip:
        """Line `y`: the block at that place in view, from a cached strip."""
        width = self.size.width
        base = self._base if self._base is not None else self.rich_style
        number = self._view_top() + y
        if not self._first <= number < self._end:
            return Strip.blank(width, base)
        cursor = self.has_focus and number == self._cursor_at()
        style = base + self.get_component_rich_style("long-blocks--cursor") if cursor else base
        key = (number, width, cursor, style, self.show_kernel, self.show_user)
        strip = self._strips.get(key)
        if strip is None:
            block = self._blocks[number - self._first]
            segments = self._line_text(block, width).render(self.app.console)
            strip = Strip(Segment.apply_style(segments, style), None).crop_extend(
                0, width, style if cursor else base)
            self._strips.set(key, strip)
        return strip

    def notify_style_update(self) -> None:
        """Styles changed (focus, theme): cached lines are stale."""
        super().notify_style_update()
        self._strips.clear()

