"""The header: what is captured, how, how healthy the capture is, and what it costs.

Line 1 names the capture (host, scope, time, kernel, stacks); line 2 says how
it runs (interval, threshold, events, lost events, the probe's cost and
offtop's own); line 3 (blank when there is nothing to say) lists
every error the capture counted (STYLE.md rule 8: errors are data), flood
control, what happened to the scope ("pid 123 exited") and, once nothing is
left to watch, that the run is over.
"""

from __future__ import annotations

from collections.abc import Mapping

from rich.segment import Segment
from rich.style import Style
from rich.text import Text
from textual.geometry import Region
from textual.reactive import reactive
from textual.strip import Strip
from textual.widget import Widget

from offtop.model import CaptureStats, SnapshotIndex
from offtop.source import SourceInfo
from offtop.symbols import NO_SYMBOL
from offtop.units import format_ns
from offtop.widgets.render import clock_time, untrusted_text

ERROR_STYLE = "bold #ff6b6b"
WARN_STYLE = "#e0c050"


def _field(t: Text, label: str, value: str | Text, style: str = "") -> None:
    t.append(f"{label} ", style="dim")
    if isinstance(value, Text):
        t.append_text(value)
    else:
        t.append(value, style=style)
    t.append("  ")


def _causes(counts: Mapping[str, int]) -> str:
    return ", ".join(f"{cause} {n:,}" for cause, n in sorted(counts.items()) if n)


def health_text(stats: CaptureStats) -> Text:
    """Events/s, lost events, stack errors, the probe's cost and offtop's own."""
    t = Text(no_wrap=True, end="")
    _field(t, "events", f"{stats.events_per_s:,.0f}/s")
    _field(t, "lost", f"{stats.lost:,}", ERROR_STYLE if stats.lost else "")
    errors = stats.stack_errors_total
    _field(t, "stack errors", f"{errors:,}", WARN_STYLE if errors else "")
    if stats.offtop_rss_bytes:
        _field(t, "offtop", f"{stats.offtop_cpu_pct:.1f}% CPU "
                            f"{stats.offtop_rss_bytes / 2**20:,.0f} MB")
    if stats.probe_runs:
        _field(t, "probe", f"{stats.probe_ns_per_switch:.0f}ns/switch "
                           f"({stats.switches_per_s:,.0f} sw/s, {stats.probe_cpu_pct:.2f}% CPU)")
    return t


def problems_text(stats: CaptureStats) -> Text:
    """Every counted error and adjustment of the capture, by cause ("" if none)."""
    t = Text(no_wrap=True, end="")
    if stats.flood_threshold_ns:
        t.append(f"threshold raised to {format_ns(stats.flood_threshold_ns)} by flood control  ",
                 style=WARN_STYLE)
    if stats.drops:
        _field(t, "dropped", _causes(stats.drops), ERROR_STYLE)
    if stats.lost_total:
        _field(t, "events lost", f"{stats.lost_total:,} in all", ERROR_STYLE)
    if stats.stack_errors:
        _field(t, "stack ids failed", _causes(stats.stack_errors), WARN_STYLE)
    cut = [(n, what) for n, what in ((stats.truncated_stacks, "truncated"),
                                     (stats.depth_limited_stacks, "at the depth limit"),
                                     (stats.user_stacks_lost, "user stacks lost"),
                                     (stats.behind_rows, "not resolved, offtop behind")) if n]
    if cut:
        _field(t, "stacks", ", ".join(f"{n:,} {what}" for n, what in cut), WARN_STYLE)
    if stats.stacks_capacity and stats.stacks_used * 2 >= stats.stacks_capacity:
        _field(t, "stack map", f"{stats.stacks_used:,}/{stats.stacks_capacity:,} used",
               WARN_STYLE)
    symbols = [(n, what) for n, what in ((stats.symbol_misses, "unresolved"),
                                         (stats.symbol_deadline_misses, "left for later"))
               if n]
    # An address with no symbol (a stripped binary) is counted as unresolved already.
    errors = {why: n for why, n in stats.symbol_errors.items() if why != NO_SYMBOL}
    if symbols or errors:
        text = ", ".join(f"{n:,} {what}" for n, what in symbols)
        if errors:
            text += ("; " if text else "") + "errors: " + _causes(errors)
        _field(t, "symbols", text, WARN_STYLE)
    if stats.python_failures:
        _field(t, "python stacks", "not read: " + _causes(stats.python_failures), WARN_STYLE)
    return t


class OfftopHeader(Widget):
    """Three lines: the capture, its health and cost, its errors and news.

    The height is fixed: a header that grew and shrank with its news would
    lay the whole screen out again each time, and a layout pass that lags the
    data on a busy machine would show a line cut off."""

    DEFAULT_CSS = """
    OfftopHeader {
        height: 3;
        background: $panel;
        color: $foreground;
        padding: 0 1;
        text-wrap: nowrap;
        text-overflow: ellipsis;
    }
    OfftopHeader.-paused {
        background: $warning 30%;
    }
    OfftopHeader.-finished {
        background: $primary 25%;
    }
    """

    info: reactive[SourceInfo | None] = reactive(None)
    """The source's description."""
    index: reactive[SnapshotIndex | None] = reactive(None)
    """The snapshot on screen (with its index)."""
    interval_s: reactive[float] = reactive(1.0)
    """The refresh interval."""
    threshold_ns: reactive[int] = reactive(0)
    """The long-block threshold now in force."""
    paused: reactive[bool] = reactive(False)
    """Whether the display is frozen."""
    status: reactive[str] = reactive("starting")
    """`starting`, `running`, `ended` or `failed`."""
    behind: reactive[int] = reactive(0)
    """Snapshots received while paused."""
    notices: reactive[tuple[str, ...]] = reactive(())
    """The latest news about the capture's scope ("pid 123 exited")."""
    stalled_s: reactive[float] = reactive(0.0)
    """How long the source has been late with a snapshot (0: it is not)."""

    def __init__(self, interval_s: float = 1.0, *, id: str | None = None,
                 classes: str | None = None) -> None:
        super().__init__(id=id, classes=classes)
        self.set_reactive(OfftopHeader.interval_s, interval_s)
        #: The lines and style of the render pass under way (`render_lines`).
        self._pass: tuple[tuple[Text, Text, Text], Style] | None = None
        #: Each line's last strip, with what it was drawn from.
        self._strips: dict[int, tuple[tuple[object, ...], Strip]] = {}

    def watch_paused(self, paused: bool) -> None:
        self.set_class(paused, "-paused")

    def watch_index(self, index: SnapshotIndex | None) -> None:
        self.set_class(index is not None and bool(index.snapshot.finished), "-finished")

    def render(self) -> Text:
        """What the header says, its three lines in one text (it is drawn line by
        line: `render_line`)."""
        return Text("\n", no_wrap=True, overflow="ellipsis", end="").join(self._lines())

    def render_lines(self, crop: Region) -> list[Strip]:
        """The three lines are made once a pass, with the header's style."""
        self._pass = self._lines(), self.rich_style
        try:
            return super().render_lines(crop)
        finally:
            self._pass = None

    def render_line(self, y: int) -> Strip:
        """Line `y`, cut with an ellipsis to the width. Drawn from the line's text
        only when that changed: a tick changes the first two lines, and drawing
        the three through a renderable (Rich text to Textual content to strips)
        cost ~0.7 ms a line, the most of any widget at the pacer."""
        texts, base = self._pass or (self._lines(), self.rich_style)
        width = self.size.width
        if not 0 <= y < len(texts) or width <= 0:
            return Strip.blank(max(width, 0), base)
        text = texts[y]
        key = (text.plain, tuple(text.spans), width, base)
        cached = self._strips.get(y)
        if cached is not None and cached[0] == key:
            return cached[1]
        line = text.copy()
        line.truncate(width, overflow="ellipsis")
        segments = Segment.apply_style(line.render(self.app.console), base)
        strip = Strip(segments).crop_extend(0, width, base)
        self._strips[y] = (key, strip)
        return strip

    def _lines(self) -> tuple[Text, Text, Text]:
        return self._capture_line(), self._health_line(), self._news_line()

    def _capture_line(self) -> Text:
        info, index = self.info, self.index
        line = Text(no_wrap=True, overflow="ellipsis", end="")
        line.append("offtop ", style="bold #5fafd7")
        if self.paused:
            line.append(" PAUSED ", style="bold reverse #e0c050")
            if self.behind:
                line.append(f" +{self.behind}", style=WARN_STYLE)
            line.append("  ")
        # The source's description is escaped: the scope holds a cgroup path,
        # and a user may name the cgroups delegated to them as they like.
        if info is not None:
            _field(line, "host", untrusted_text(info.host, "bold"))
            _field(line, "scope", untrusted_text(info.scope, "bold"))
        if index is not None and index.snapshot.seq:
            snap = index.snapshot
            _field(line, "at", f"{clock_time(snap.time)} #{snap.seq}")
        if info is not None:
            _field(line, "kernel", untrusted_text(info.kernel))
            _field(line, "stacks", untrusted_text(info.stacks))
            if info.kind != "bpf":
                _field(line, "source", untrusted_text(info.kind, "italic"))
        return line

    def _health_line(self) -> Text:
        line = Text(no_wrap=True, overflow="ellipsis", end="")
        _field(line, "interval", f"{self.interval_s:g}s")
        _field(line, "threshold", format_ns(self.threshold_ns) if self.threshold_ns else "0",
               "bold")
        snap = self.index.snapshot if self.index is not None and self.index.snapshot.seq else None
        if self.status == "starting":
            line.append("starting capture (loading the BPF program)…", style="italic " + WARN_STYLE)
        elif self.status == "failed":
            line.append("capture failed", style=ERROR_STYLE)
        elif snap is not None:
            _field(line, "tasks", f"{len(snap.tasks):,}")
            line.append_text(health_text(snap.stats))
        elif self.status == "ended":
            line.append("source ended before the first snapshot", style="italic " + WARN_STYLE)
        return line

    def _news_line(self) -> Text:
        line = Text(no_wrap=True, overflow="ellipsis", end="")
        snap = self.index.snapshot if self.index is not None and self.index.snapshot.seq else None
        if snap is not None and snap.finished:
            line.append(" RUN OVER ", style="bold reverse #5fafd7")
            line.append(" ")
            line.append_text(untrusted_text(snap.finished, "bold"))
            line.append(" — the last data stays on screen; q quits  ", style="dim")
        elif self.status == "ended" and snap is not None:
            line.append(" SOURCE ENDED ", style="bold reverse " + WARN_STYLE)
            line.append(" the last data stays on screen; q quits  ", style="dim")
        if self.stalled_s:
            line.append(f"no data for {self.stalled_s:.0f}s  ", style=ERROR_STYLE)
        if snap is not None:
            line.append_text(problems_text(snap.stats))
        for notice in self.notices:
            line.append_text(untrusted_text(notice, "italic"))
            line.append("  ")
        return line
