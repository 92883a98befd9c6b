"""Small rendering helpers shared by the widgets (not a widget itself).

Everything here returns `rich.text.Text` built from plain strings with
explicit styles: process names and symbols are untrusted and may contain
`[`, so nothing is ever parsed as markup. They may hold terminal escape
sequences too (a comm of `ESC ] 0 ; ... BEL` retitles the terminal, `ESC [
2 J` clears it), and Rich passes ESC through: every untrusted string goes
through `offtop.safe_text.printable` here, so it shows as `\x1b`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Self

from rich.console import OverflowMethod
from rich.text import Text
from textual.content import Content
from textual.geometry import Region
from textual.widget import Widget

from offtop.model import SCHEDULER_FRAMES, Frame, Waker
from offtop.safe_text import printable

#: Kernel frames are warm, user frames cool, Python frames green: told apart
#: at a glance (and by their tags, `k`, `u`, `py`, without colour).
KERNEL_STYLE = "#f0a35e"
USER_STYLE = "#74b9e8"
PYTHON_STYLE = "#9ccc65"
UNKNOWN_STYLE = "dim italic"
#: Marks such as "[stack truncated]": what is known about where a stack ends.
MARK_STYLE = "italic #c090e0"
ARROW = " ← "

#: Colours for the task states of `offtop.model.STATE_NAMES`.
STATE_STYLES = {
    "S": "#8fbf7f",
    "D": "bold #ff6b6b",
    "I": "dim",
    "R": "#e0d070",
    "T": "#c090e0",
    "t": "#c090e0",
}


def untrusted_text(text: str, style: str = "", *, no_wrap: bool = True,
                   overflow: OverflowMethod | None = None) -> Text:
    """A string a process controls (a comm, a path, a symbol): literal, escaped, styled."""
    return Text(printable(text), style=style, no_wrap=no_wrap, overflow=overflow, end="")


def frame_kind(frame: Frame) -> str:
    """`k` (kernel), `py` (a Python function) or `u` (user): a frame's tag."""
    if frame.kernel:
        return "k"
    return "py" if frame.name.startswith("py:") else "u"


_KIND_STYLES = {"k": KERNEL_STYLE, "u": USER_STYLE, "py": PYTHON_STYLE}


def frame_style(frame: Frame) -> str:
    """The style of one frame: a mark, unresolved, kernel, user or Python."""
    if frame.name.startswith("["):
        return MARK_STYLE
    if frame.unknown:
        return UNKNOWN_STYLE
    return _KIND_STYLES[frame_kind(frame)]


def frame_text(frame: Frame, *, tag: bool = True, module: bool = False) -> Text:
    """One frame, with a `k`/`u`/`py` tag so it reads without colour too."""
    t = Text(no_wrap=True, end="")
    name = frame.name or "?"
    if tag:
        kind = frame_kind(frame)
        t.append(f"{kind} ", style="dim " + _KIND_STYLES[kind])
        if kind == "py":
            name = name[3:]  # the tag says it: "py Queue.get (queue.py:171)"
    t.append(printable(name), style=frame_style(frame))
    if module and frame.module and not frame.kernel:
        t.append(f"  {printable(frame.module)}", style="dim")
    return t


def innermost_frames(
    kernel: Sequence[Frame],
    user: Sequence[Frame],
    *,
    show_kernel: bool = True,
    show_user: bool = True,
    max_kernel: int = 2,
    max_user: int = 3,
) -> list[Frame]:
    """The frames that say where a task blocked: innermost kernel, then user."""
    out: list[Frame] = []
    if show_kernel:
        ks = [f for f in kernel if f.name not in SCHEDULER_FRAMES] or list(kernel[:1])
        out += ks[:max_kernel]
    if show_user:
        out += list(user[:max_user])
    return out


def chain_summary(
    kernel: Sequence[Frame],
    user: Sequence[Frame],
    *,
    show_kernel: bool = True,
    show_user: bool = True,
    max_kernel: int = 2,
    max_user: int = 3,
    tags: bool = True,
) -> Text:
    """`k do_nanosleep ← hrtimer_nanosleep ← u clock_nanosleep ← worker_loop`, coloured,
    tagged where the kind of frame changes (`tags`)."""
    frames = innermost_frames(kernel, user, show_kernel=show_kernel, show_user=show_user,
                              max_kernel=max_kernel, max_user=max_user)
    t = Text(no_wrap=True, overflow="ellipsis", end="")
    if not frames:
        t.append("(no frames)" if (kernel or user) else "(no stack)", style="dim")
        return t
    kind = ""
    for i, f in enumerate(frames):
        if i:
            t.append(ARROW, style="dim")
        if tags and frame_kind(f) != kind:
            # A tag where the kind changes: "k pipe_read ← u read ← py Queue.get".
            t.append_text(frame_text(f))
            kind = frame_kind(f)
        else:
            name = f.name[3:] if tags and kind == "py" else f.name
            t.append(printable(name or "?"), style=frame_style(f))
    return t


def outer_to_inner(
    kernel: Sequence[Frame], user: Sequence[Frame], *, show_kernel: bool, show_user: bool
) -> list[Frame]:
    """A callchain read from the outside in: user outermost first, then kernel."""
    out: list[Frame] = []
    if show_user:
        out += reversed(user)
    if show_kernel:
        out += reversed(kernel)
    return out


def state_text(state: str) -> Text:
    """A one-letter state, coloured."""
    return Text(state, style=STATE_STYLES.get(state, ""), end="")


def number_text(n: int, *, width: int = 0) -> Text:
    """A right-aligned integer, dim when zero."""
    return Text(str(n).rjust(width), style="dim" if n == 0 else "", end="")


def rate_parts(ns: int, interval_s: float) -> tuple[str, str]:
    """Off-CPU time as milliseconds per second of interval, and % of it."""
    if interval_s <= 0:
        return ("     -", "     ")
    ms_per_s = ns / interval_s / 1e6
    pct = 100.0 * ns / (interval_s * 1e9)
    ms = f"{ms_per_s:6.1f}" if ms_per_s < 1000 else f"{ms_per_s:6.0f}"
    return ms, f"{pct:5.0f}%"


def rate_text(parts: tuple[str, str]) -> Text:
    """`rate_parts` styled: the rate bold, zero dim."""
    ms, pct = parts
    zero = ms.strip() in ("0.0", "-")
    t = Text(ms, style="dim" if zero else "bold", end="")
    t.append(pct, style="dim" if zero else "")
    return t


def severity_style(ns: float) -> str:
    """How alarming a wait is: seconds are red, 100s of ms yellow."""
    if ns >= 1e9:
        return "bold #ff6b6b"
    if ns >= 100e6:
        return "#e0c050"
    return ""


_EIGHTHS = " ▏▎▍▌▋▊▉█"


def bar(fraction: float, width: int) -> str:
    """A horizontal bar of `width` cells filled to `fraction`, in eighths."""
    fraction = min(1.0, max(0.0, fraction))
    eighths = round(fraction * width * 8)
    full, part = divmod(eighths, 8)
    s = "█" * full
    if part and full < width:
        s += _EIGHTHS[part]
    return s.ljust(width)


def log_fraction(ns: float, lo: float = 1e6, hi: float = 10e9) -> float:
    """Where `ns` sits between `lo` and `hi` on a log scale, 0..1."""
    if ns <= lo:
        return 0.0
    return min(1.0, math.log10(ns / lo) / math.log10(hi / lo))


def clock_time(t: float, *, millis: bool = False) -> str:
    """A wall-clock time of day (local), from a snapshot's or event's timestamp."""
    s = time.strftime("%H:%M:%S", time.localtime(t))
    if millis:
        s += f".{int((t % 1) * 1000):03d}"
    return s


def task_label(comm: str, pid: int, tid: int | None = None) -> Text:
    """`comm pid/tid` with the comm literal (never markup) and escaped."""
    t = untrusted_text(comm, "bold")
    t.append(f" {pid}" if tid is None or tid == pid else f" {pid}/{tid}", style="dim")
    return t


#: How interrupt wakers read: not a task, so not bold like a comm.
INTERRUPT_STYLE = "italic #e0c050"


def waker_label(waker: Waker, *, ids: bool = True) -> Text:
    """A waker: `comm pid/tid` (literal, escaped; without ids `comm`), or what
    interrupted (`[timer interrupt]`, `[softirq NET_RX]`)."""
    if waker.kind != "task":
        return untrusted_text(waker.label, INTERRUPT_STYLE)
    return task_label(waker.comm, waker.pid, waker.tid) if ids \
        else untrusted_text(waker.comm, "bold")


class TitledPane(Widget):
    """A widget whose border title and subtitle, set by `set_titles`, redraw
    the border's top and bottom lines only.

    Textual redraws a whole widget when its title or subtitle is set: a pane
    whose counts change at every tick ("4 threads", "Blocked now (18)", the
    task under the cursor) was drawn whole at every tick, and at a quiet
    server those redraws were most of the TUI's work.
    """

    #: Set by `set_titles` while it sets a title (a whole refresh asked for then is the title's).
    titles_only = False

    def refresh(self, *regions: Region, repaint: bool = True, layout: bool = False,
                recompose: bool = False) -> Self:
        if self.titles_only and not regions and repaint and not (layout or recompose):
            regions = self._border_lines()
        return super().refresh(*regions, repaint=repaint, layout=layout, recompose=recompose)

    def _border_lines(self) -> tuple[Region, ...]:
        """The widget's top and bottom lines, in the content's coordinates (as `refresh`
        takes regions)."""
        x, y = self.content_offset
        width, height = self.outer_size
        return (Region(-x, -y, width, 1), Region(-x, height - 1 - y, width, 1))


def set_titles(widget: Widget, title: str | Text, subtitle: str | Text = "") -> None:
    """Set a pane's border title and subtitle, only those that changed.

    Textual repaints the whole widget at each set, changed or not: a pane
    setting its titles at every tick would be drawn again in full at every
    tick, when only a few of its cells changed. A `TitledPane` redraws its
    border lines only.
    """
    pane = widget if isinstance(widget, TitledPane) else None
    for name, value in (("border_title", title), ("border_subtitle", subtitle)):
        markup = Content.from_rich_text(value).markup if isinstance(value, Text) else value
        if getattr(widget, name) != (markup or None):
            if pane is not None:
                pane.titles_only = True
            try:
                setattr(widget, name, value)
            finally:
                if pane is not None:
                    pane.titles_only = False
