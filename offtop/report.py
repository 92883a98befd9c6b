"""Snapshots as text, JSON lines and folded stacks (the headless contract).

The JSON codec lives in `offtop.snapshot_json` (it is also the recording
format: `snapshot_from_json` reads back what `snapshot_to_json` wrote, with
every field checked); it is re-exported here for the callers that format
snapshots.

Names (comms, frames, paths) are whatever a process chose. JSON carries them
exactly (the encoder escapes control characters itself); text and folded
output go to terminals and line-based tools, so there every control
character is shown as a visible escape (`offtop.safe_text.printable`).
"""

from __future__ import annotations

import time as _time
from collections.abc import Sequence

from offtop.model import Frame, Snapshot
from offtop.safe_text import printable
from offtop.snapshot_json import (
    SnapshotJsonError,
    snapshot_from_json,
    snapshot_json_line,
    snapshot_to_json,
    stats_to_json,
    waker_from_json,
    waker_to_json,
)
from offtop.units import format_ns

__all__ = [
    "FORMATS",
    "SnapshotJsonError",
    "fold_name",
    "folded_lines",
    "snapshot_from_json",
    "snapshot_json_line",
    "snapshot_to_json",
    "stats_to_json",
    "text_report",
    "waker_from_json",
    "waker_to_json",
]

#: The formats that print one report per interval.
FORMATS = ("text", "json", "folded")


# --- folded -------------------------------------------------------------


def fold_name(name: str) -> str:
    """A name as one frame of a folded line: escaped, no `;`, no whitespace."""
    # One line per stack: control characters escaped (a LF would split the
    # line), then flamegraph.pl's separators taken out: it splits frames on
    # ';' and the count off at the last whitespace (any, in its regex).
    name = printable(name).replace(";", ":")
    if not name.isascii() or " " in name:
        name = "".join("_" if c.isspace() else c for c in name)
    return name or "[unknown]"


def folded_lines(snap: Snapshot, *, wakers: bool = False) -> list[str]:
    """`comm;user outermost..innermost;kernel outermost..innermost value_us`.

    With `wakers`, as bcc's offwaketime folds them: one line per (stack,
    waker), the waker's kernel then user frames, innermost first, and its
    name appended after a `--` frame, so a flame graph stands the waker's
    stack upside down on top of the blocked one.
    """
    lines = []
    for s in snap.stacks:
        parts = [fold_name(s.comm)]
        parts += [fold_name(f.name) for f in reversed(s.user)]
        parts += [fold_name(f.name) for f in reversed(s.kernel)]
        if not wakers or not s.wakers:
            us = round(s.offcpu_ns / 1000)
            if us > 0:
                lines.append(f"{';'.join(parts)} {us}")
            continue
        rest = s.offcpu_ns
        for w in s.wakers:
            rest -= w.offcpu_ns
            us = round(w.offcpu_ns / 1000)
            if us <= 0:
                continue
            waker = [fold_name(f.name) for f in (*w.waker.kernel, *w.waker.user)]
            lines.append(f"{';'.join([*parts, '--', *waker, fold_name(w.waker.label)])} {us}")
        if round(rest / 1000) > 0:  # blocks whose waker was not seen
            lines.append(f"{';'.join([*parts, '--', fold_name('[unknown waker]')])} {round(rest / 1000)}")
    return lines


# --- text ---------------------------------------------------------------


def _pct(ns: int, interval_s: float) -> str:
    if interval_s <= 0:
        return "-"
    return f"{100.0 * ns / (interval_s * 1e9):5.1f}%"


def _chain(frames: Sequence[Frame]) -> str:
    return " <- ".join(printable(f.name) for f in frames[:8])


def _where(kernel: Sequence[Frame], user: Sequence[Frame]) -> str:
    """The innermost frame, user side first: where a task blocked."""
    top = user[0].name if user else (kernel[0].name if kernel else "?")
    return printable(top)


def text_report(snap: Snapshot, *, top_tasks: int = 20, top_stacks: int = 5) -> str:
    """A top-like report of one interval."""
    st = snap.stats
    when = _time.strftime("%H:%M:%S", _time.localtime(snap.time))
    out = [
        f"offtop {when}  interval {snap.interval_s:.2f}s  threshold {format_ns(snap.threshold_ns)}"
        f"  events {st.events} (lost {st.lost})  stack errors {st.stack_errors_total}"
        f"  probe {st.probe_ns_per_switch:.0f}ns/switch {st.switches_per_s:.0f} switches/s"
        f"  offtop {st.offtop_cpu_pct:.1f}% CPU {st.offtop_rss_bytes / 2**20:.0f} MB",
    ]
    if st.flood_threshold_ns:
        out.append(f"flood control: threshold raised to {format_ns(st.flood_threshold_ns)}"
                   " in the kernel (shorter blocks are summed there, not listed one by one)")
    out += [f"notice: {printable(n)}" for n in snap.notices]
    out.append(f"{'PID':>7} {'TID':>7} {'COMM':<16} {'OFF-CPU':>8} {'%INT':>6} {'S':>8} {'D':>8}"
               f" {'COUNT':>7} {'MAX':>8} {'TOTAL':>8}")
    for t in snap.tasks[:top_tasks]:
        out.append(
            f"{t.pid:>7} {t.tid:>7} {printable(t.comm[:16]):<16} {format_ns(t.offcpu_ns):>8}"
            f" {_pct(t.offcpu_ns, snap.interval_s):>6} {format_ns(t.state_ns.get('S', 0)):>8}"
            f" {format_ns(t.state_ns.get('D', 0)):>8} {t.count:>7} {format_ns(t.max_ns):>8}"
            f" {format_ns(t.total_ns):>8}"
        )
    if len(snap.tasks) > top_tasks:
        out.append(f"  ... {len(snap.tasks) - top_tasks} more tasks")
    if snap.stacks and top_stacks:
        out.append("top stacks:")
        for s in snap.stacks[:top_stacks]:
            out.append(
                f"  {format_ns(s.offcpu_ns):>8} {printable(s.comm)} ({s.pid}/{s.tid}) {s.state}"
                f" count {s.count} max {format_ns(s.max_ns)}"
            )
            if s.kernel:
                out.append("      kernel: " + _chain(s.kernel))
            if s.user:
                out.append("      user:   " + _chain(s.user))
    if snap.long_blocks:
        out.append(f"long blocks (>= {format_ns(snap.threshold_ns)}): {len(snap.long_blocks)}")
        for b in snap.long_blocks[-5:]:
            out.append(
                f"  {printable(b.comm)} ({b.pid}/{b.tid}) {b.state} {format_ns(b.duration_ns)}"
                f" in {_where(b.kernel, b.user)}"
            )
    if snap.blocked_now:
        out.append("blocked now:")
        for bn in snap.blocked_now[:5]:
            out.append(
                f"  {printable(bn.comm)} ({bn.pid}/{bn.tid}) {bn.state}"
                f" for {format_ns(bn.blocked_ns)} in {_where(bn.kernel, bn.user)}"
            )
    return "\n".join(out)
