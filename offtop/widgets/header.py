"""The header: what is captured, how, and how healthy the capture is."""

from __future__ import annotations

from rich.text import Text
from textual.reactive import reactive
from textual.widget import Widget

from offtop.model import CaptureStats, Snapshot
from offtop.source import SourceInfo
from offtop.units import format_ns
from offtop.widgets.render import clock_time, untrusted_text


def _field(t: Text, label: str, value: str | Text, style: str = "") -> None:
    t.append(f"{label} ", style="dim")
    if isinstance(value, Text):
        t.append_text(value)
    else:
        t.append(value, style=style)
    t.append("  ")


def health_text(stats: CaptureStats) -> Text:
    """Events/s, lost events, stack-id failures and probe cost, errors in colour."""
    t = Text(no_wrap=True, end="")
    _field(t, "events", f"{stats.events_per_s:.0f}/s")
    _field(t, "lost", str(stats.lost), "bold #ff6b6b" if stats.lost else "")
    errors = stats.stack_errors_total
    _field(t, "stack errors", str(errors), "#e0c050" if errors else "")
    if stats.probe_runs:
        _field(t, "probe", f"{stats.probe_ns_per_switch:.0f}ns/switch "
                           f"({stats.switches_per_s:,.0f} sw/s, {stats.probe_cpu_pct:.2f}% CPU)")
    return t


class OfftopHeader(Widget):
    """Two lines: host, kernel, scope, time; interval, threshold, health, PAUSED."""

    DEFAULT_CSS = """
    OfftopHeader {
        height: 2;
        background: $panel;
        color: $foreground;
        padding: 0 1;
        text-wrap: nowrap;
        text-overflow: ellipsis;
    }
    OfftopHeader.-paused {
        background: $warning 30%;
    }
    """

    info: reactive[SourceInfo | None] = reactive(None)
    """The source's description."""
    snapshot: reactive[Snapshot | None] = reactive(None, always_update=True)
    """The snapshot on screen."""
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

    def watch_paused(self, paused: bool) -> None:
        self.set_class(paused, "-paused")

    def render(self) -> Text:
        info = self.info
        snap = self.snapshot
        line1 = Text(no_wrap=True, overflow="ellipsis", end="")
        line1.append("offtop ", style="bold #5fafd7")
        if self.paused:
            line1.append(" PAUSED ", style="bold reverse #e0c050")
            if self.behind:
                line1.append(f" +{self.behind}", style="#e0c050")
            line1.append("  ")
        # The source's description is escaped: the scope holds a cgroup path,
        # and a user may name the cgroups delegated to them as they like.
        if info is not None:
            _field(line1, "host", untrusted_text(info.host, "bold"))
            _field(line1, "scope", untrusted_text(info.scope, "bold"))
        if snap is not None:
            _field(line1, "at", f"{clock_time(snap.time)} #{snap.seq}")
        if info is not None:
            _field(line1, "kernel", untrusted_text(info.kernel))
            _field(line1, "stacks", untrusted_text(info.stacks))
            if info.kind != "bpf":
                _field(line1, "source", untrusted_text(info.kind, "italic"))
        line2 = Text(no_wrap=True, overflow="ellipsis", end="")
        _field(line2, "interval", f"{self.interval_s:g}s")
        _field(line2, "threshold", format_ns(self.threshold_ns) if self.threshold_ns else "0",
               "bold")
        if self.status == "starting":
            line2.append("starting capture (compiling the BPF program)…", style="italic #e0c050")
        elif self.status == "failed":
            line2.append("capture failed", style="bold #ff6b6b")
        elif snap is not None:
            _field(line2, "tasks", f"{len(snap.tasks):,}")
            line2.append_text(health_text(snap.stats))
            if self.status == "ended":
                line2.append("source ended", style="italic #e0c050")
        elif self.status == "ended":
            line2.append("source ended before the first snapshot", style="italic #e0c050")
        out = Text("\n", no_wrap=True, overflow="ellipsis", end="").join([line1, line2])
        out.no_wrap, out.overflow = True, "ellipsis"
        return out
