"""Snapshots as text, JSON lines and folded stacks (the headless contract).

JSON is also the recording format: `snapshot_from_json` reads back what
`snapshot_to_json` wrote, which is how `ReplaySource` plays recordings.

Names (comms, frames, paths) are whatever a process chose. JSON carries them
exactly (the encoder escapes control characters itself); text and folded
output go to terminals and line-based tools, so there every control
character is shown as a visible escape (`offtop.safe_text.printable`).
"""

from __future__ import annotations

import time as _time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from offtop.model import (
    BlockedNow,
    CaptureStats,
    Frame,
    LongBlock,
    ProcessRow,
    Snapshot,
    StackRow,
    TaskRow,
    Waker,
    WakerRow,
)
from offtop.safe_text import printable
from offtop.units import format_ns

FORMATS = ("text", "json", "folded")


# --- JSON ---------------------------------------------------------------


def _state_ns(m: Mapping[str, int]) -> dict[str, int]:
    out = {"S": 0, "D": 0}
    out.update(m)
    return out


def _frames_json(frames: Sequence[Frame]) -> list[str]:
    return [f.name for f in frames]


def _modules_json(frames: Sequence[Frame]) -> list[str]:
    return [f.module for f in frames]


def waker_to_json(w: Waker | None) -> dict[str, Any] | None:
    """A waker as JSON: pid/tid 0 and `kind` other than "task" for an interrupt."""
    if w is None:
        return None
    return {"pid": w.pid, "tid": w.tid, "comm": w.comm, "kind": w.kind,
            "kernel": _frames_json(w.kernel), "user": _frames_json(w.user),
            "user_modules": _modules_json(w.user)}


def waker_from_json(d: Mapping[str, Any] | None) -> Waker | None:
    """The inverse of `waker_to_json`."""
    if not d:
        return None
    return Waker(pid=int(d["pid"]), tid=int(d["tid"]), comm=str(d["comm"]),
                 kind=str(d.get("kind", "task")),
                 kernel=_frames(d.get("kernel", ()), True),
                 user=_frames(d.get("user", ()), False, d.get("user_modules", ())))


def stats_to_json(s: CaptureStats) -> dict[str, Any]:
    """The `stats` object of a JSON snapshot."""
    return {
        "events": s.events,
        "lost": s.lost,
        "stack_errors": s.stack_errors_total,
        "stack_errors_by_cause": dict(s.stack_errors),
        "drops": dict(s.drops),
        "events_total": s.events_total,
        "lost_total": s.lost_total,
        "truncated_stacks": s.truncated_stacks,
        "symbol_misses": s.symbol_misses,
        "agg_entries": s.agg_entries,
        "stacks_used": s.stacks_used,
        "stacks_capacity": s.stacks_capacity,
        "stacks_reclaimed": s.stacks_reclaimed,
        "probe_run_ns": s.probe_run_ns,
        "probe_runs": s.probe_runs,
        "probe_ns_per_switch": round(s.probe_ns_per_switch, 1),
        "probe_cpu_pct": round(s.probe_cpu_pct, 3),
        "switches_per_s": round(s.switches_per_s, 1),
        "events_per_s": round(s.events_per_s, 1),
        "flood_threshold_ns": s.flood_threshold_ns,
        "symbol_deadline_misses": s.symbol_deadline_misses,
        "symbol_errors": dict(s.symbol_errors),
        "depth_limited_stacks": s.depth_limited_stacks,
        "user_stacks_lost": s.user_stacks_lost,
        "python_failures": dict(s.python_failures),
        "offtop_cpu_pct": round(s.offtop_cpu_pct, 2),
        "offtop_rss_bytes": s.offtop_rss_bytes,
    }


def snapshot_to_json(snap: Snapshot) -> dict[str, Any]:
    """One JSON object for one interval (see README, 'Headless output')."""
    return {
        "time": round(snap.time, 6),
        "seq": snap.seq,
        "interval_s": round(snap.interval_s, 6),
        "threshold_ns": snap.threshold_ns,
        "notices": list(snap.notices),
        "finished": snap.finished,
        "stats": stats_to_json(snap.stats),
        "tasks": [
            {
                "pid": t.pid,
                "tid": t.tid,
                "comm": t.comm,
                "offcpu_ns": t.offcpu_ns,
                "count": t.count,
                "max_ns": t.max_ns,
                "state_ns": _state_ns(t.state_ns),
                "total_ns": t.total_ns,
                "events": t.events,
            }
            for t in snap.tasks
        ],
        "processes": [
            {
                "pid": p.pid,
                "comm": p.comm,
                "threads": p.threads,
                "offcpu_ns": p.offcpu_ns,
                "count": p.count,
                "max_ns": p.max_ns,
                "state_ns": _state_ns(p.state_ns),
                "total_ns": p.total_ns,
                "events": p.events,
                "user": p.user,
                "cmdline": p.cmdline,
            }
            for p in snap.processes
        ],
        "stacks": [
            {
                "pid": s.pid,
                "tid": s.tid,
                "comm": s.comm,
                "state": s.state,
                "offcpu_ns": s.offcpu_ns,
                "count": s.count,
                "max_ns": s.max_ns,
                "kernel": _frames_json(s.kernel),
                "user": _frames_json(s.user),
                "user_modules": _modules_json(s.user),
                "before_start": s.before_start,
                "wakers": [{**(waker_to_json(w.waker) or {}), "offcpu_ns": w.offcpu_ns,
                            "count": w.count} for w in s.wakers],
            }
            for s in snap.stacks
        ],
        "long_blocks": [
            {
                "time": round(b.time, 6),
                "pid": b.pid,
                "tid": b.tid,
                "comm": b.comm,
                "state": b.state,
                "duration_ns": b.duration_ns,
                "cgroup_id": b.cgroup_id,
                "before_start": b.before_start,
                "waker": waker_to_json(b.waker),
                "kernel": _frames_json(b.kernel),
                "user": _frames_json(b.user),
                "user_modules": _modules_json(b.user),
            }
            for b in snap.long_blocks
        ],
        "blocked_now": [
            {
                "pid": b.pid,
                "tid": b.tid,
                "comm": b.comm,
                "state": b.state,
                "blocked_ns": b.blocked_ns,
                "before_start": b.before_start,
                "kernel": _frames_json(b.kernel),
                "user": _frames_json(b.user),
                "user_modules": _modules_json(b.user),
            }
            for b in snap.blocked_now
        ],
    }


def _frames(names: Iterable[str], kernel: bool, modules: Sequence[str] = ()) -> tuple[Frame, ...]:
    mods = list(modules)
    return tuple(
        Frame(name=n, module=mods[i] if i < len(mods) else ("kernel" if kernel else ""), kernel=kernel)
        for i, n in enumerate(names)
    )


def _drop_zero_states(m: Mapping[str, int]) -> dict[str, int]:
    return {k: int(v) for k, v in m.items() if v}


def snapshot_from_json(d: Mapping[str, Any]) -> Snapshot:
    """Rebuild a snapshot from `snapshot_to_json` output."""
    st = d.get("stats", {})
    stats = CaptureStats(
        events=int(st.get("events", 0)),
        lost=int(st.get("lost", 0)),
        events_total=int(st.get("events_total", 0)),
        lost_total=int(st.get("lost_total", 0)),
        stack_errors=dict(st.get("stack_errors_by_cause", {})),
        drops=dict(st.get("drops", {})),
        truncated_stacks=int(st.get("truncated_stacks", 0)),
        symbol_misses=int(st.get("symbol_misses", 0)),
        agg_entries=int(st.get("agg_entries", 0)),
        stacks_used=int(st.get("stacks_used", 0)),
        stacks_capacity=int(st.get("stacks_capacity", 0)),
        stacks_reclaimed=int(st.get("stacks_reclaimed", 0)),
        probe_run_ns=int(st.get("probe_run_ns", 0)),
        probe_runs=int(st.get("probe_runs", 0)),
        interval_s=float(d.get("interval_s", 1.0)),
        flood_threshold_ns=int(st.get("flood_threshold_ns", 0)),
        symbol_deadline_misses=int(st.get("symbol_deadline_misses", 0)),
        symbol_errors={str(k): int(v) for k, v in dict(st.get("symbol_errors", {})).items()},
        depth_limited_stacks=int(st.get("depth_limited_stacks", 0)),
        user_stacks_lost=int(st.get("user_stacks_lost", 0)),
        python_failures={str(k): int(v)
                         for k, v in dict(st.get("python_failures", {})).items()},
        offtop_cpu_pct=float(st.get("offtop_cpu_pct", 0.0)),
        offtop_rss_bytes=int(st.get("offtop_rss_bytes", 0)),
    )
    return Snapshot(
        seq=int(d.get("seq", 0)),
        time=float(d["time"]),
        interval_s=float(d["interval_s"]),
        threshold_ns=int(d["threshold_ns"]),
        tasks=tuple(
            TaskRow(
                pid=t["pid"],
                tid=t["tid"],
                comm=t["comm"],
                offcpu_ns=t["offcpu_ns"],
                count=t["count"],
                max_ns=t["max_ns"],
                state_ns=_drop_zero_states(t["state_ns"]),
                total_ns=t.get("total_ns", t["offcpu_ns"]),
                events=t.get("events", 0),
            )
            for t in d.get("tasks", ())
        ),
        processes=tuple(
            ProcessRow(
                pid=p["pid"],
                comm=p["comm"],
                threads=p["threads"],
                offcpu_ns=p["offcpu_ns"],
                count=p["count"],
                max_ns=p["max_ns"],
                state_ns=_drop_zero_states(p["state_ns"]),
                total_ns=p.get("total_ns", p["offcpu_ns"]),
                events=p.get("events", 0),
                user=p.get("user", ""),
                cmdline=p.get("cmdline", ""),
            )
            for p in d.get("processes", ())
        ),
        stacks=tuple(
            StackRow(
                pid=s["pid"],
                tid=s["tid"],
                comm=s["comm"],
                state=s["state"],
                offcpu_ns=s["offcpu_ns"],
                count=s["count"],
                max_ns=s.get("max_ns", 0),
                before_start=bool(s.get("before_start", False)),
                wakers=tuple(WakerRow(waker_from_json(w) or Waker(0, 0, ""), int(w["offcpu_ns"]),
                                      int(w["count"])) for w in s.get("wakers", ())),
                kernel=_frames(s["kernel"], True),
                user=_frames(s["user"], False, s.get("user_modules", ())),
            )
            for s in d.get("stacks", ())
        ),
        long_blocks=tuple(
            LongBlock(
                time=b["time"],
                pid=b["pid"],
                tid=b["tid"],
                comm=b["comm"],
                state=b["state"],
                duration_ns=b["duration_ns"],
                kernel=_frames(b["kernel"], True),
                user=_frames(b["user"], False, b.get("user_modules", ())),
                cgroup_id=b.get("cgroup_id", 0),
                before_start=bool(b.get("before_start", False)),
                waker=waker_from_json(b.get("waker")),
            )
            for b in d.get("long_blocks", ())
        ),
        blocked_now=tuple(
            BlockedNow(
                pid=b["pid"],
                tid=b["tid"],
                comm=b["comm"],
                state=b["state"],
                blocked_ns=b["blocked_ns"],
                before_start=bool(b.get("before_start", False)),
                kernel=_frames(b["kernel"], True),
                user=_frames(b["user"], False, b.get("user_modules", ())),
            )
            for b in d.get("blocked_now", ())
        ),
        stats=stats,
        notices=tuple(str(n) for n in d.get("notices", ())),
        finished=str(d.get("finished", "")),
    )


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
