"""Snapshots as JSON objects, and back: the codec of `--format json` and of recordings.

`snapshot_to_json` writes one object per interval (the README's "Headless
output" contract); `snapshot_from_json` reads one back, checking every field
it reads as it reads it. There is no separate list of checks to keep in step
with the reader: each field is read through a typed getter (`JsonObject.count`,
`.text`, `.texts`, ...), so a field added to the reader is checked by the
line that adds it. Anything else is a `SnapshotJsonError` whose message names
the field (`tasks[3].pid: expected a whole number from 0 to 2^64, found a
string`). Unknown fields are left alone, so newer files still play.

`limit` bounds what one object holds (the top tasks, processes and stacks,
which are sorted by off-CPU time, and the longest long blocks); `omitted`
says how many were left out, so nothing is dropped silently. Recordings are
written without a limit.
"""

from __future__ import annotations

import heapq
import json
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

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
from offtop.recent import Recent


class SnapshotJsonError(ValueError):
    """JSON that is not a snapshot as `snapshot_to_json` writes it; one line for users."""


# --- writing ---------------------------------------------------------------------


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
        "behind_rows": s.behind_rows,
        "python_failures": dict(s.python_failures),
        "offtop_cpu_pct": round(s.offtop_cpu_pct, 2),
        "offtop_rss_bytes": s.offtop_rss_bytes,
    }


_Row = TypeVar("_Row")


def _top(rows: tuple[_Row, ...], limit: int) -> tuple[_Row, ...]:
    return rows if limit <= 0 else rows[:limit]


def _longest(blocks: tuple[LongBlock, ...], limit: int) -> list[LongBlock]:
    """The `limit` longest of `blocks` (all if `limit` <= 0), in their order (by time)."""
    if limit <= 0 or len(blocks) <= limit:
        return list(blocks)
    keep = heapq.nlargest(limit, range(len(blocks)), key=lambda i: blocks[i].duration_ns)
    return [blocks[i] for i in sorted(keep)]


def snapshot_to_json(snap: Snapshot, *, limit: int = 0) -> dict[str, Any]:
    """One JSON object for one interval (see README, 'Headless output').

    `limit` > 0 keeps the top `limit` tasks, processes and stacks (each list
    is sorted by off-CPU time, descending) and the `limit` longest long blocks
    (a pool of 5,000 threads waking once a second past the threshold made
    lines of ~0.9 MB); `omitted` counts the rest.
    """
    tasks = _top(snap.tasks, limit)
    processes = _top(snap.processes, limit)
    stacks = _top(snap.stacks, limit)
    long_blocks = _longest(snap.long_blocks, limit)
    return {
        "time": round(snap.time, 6),
        "seq": snap.seq,
        "interval_s": round(snap.interval_s, 6),
        "threshold_ns": snap.threshold_ns,
        "notices": list(snap.notices),
        "finished": snap.finished,
        "omitted": {"tasks": len(snap.tasks) - len(tasks),
                    "processes": len(snap.processes) - len(processes),
                    "stacks": len(snap.stacks) - len(stacks) + snap.omitted_stacks,
                    "long_blocks": len(snap.long_blocks) - len(long_blocks)},
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
            for t in tasks
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
            for p in processes
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
            for s in stacks
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
            for b in long_blocks
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


def snapshot_json_line(snap: Snapshot, *, limit: int = 0) -> str:
    """`snapshot_to_json` as one compact line, newline included."""
    return json.dumps(snapshot_to_json(snap, limit=limit), separators=(",", ":")) + "\n"


# --- reading: every field checked by the getter that reads it ---------------------


@dataclass(frozen=True, slots=True)
class _Kind:
    """What a JSON value must be, and how to say so."""

    what: str
    test: Callable[[object], bool]


def _is_count(v: object) -> bool:
    # Counters, ids and nanoseconds: what the kernel hands out fits in a u64.
    return type(v) is int and 0 <= v < 1 << 64


def _is_seconds(v: object) -> bool:
    # A year-5000 bound keeps time.localtime() and the formatters defined.
    return isinstance(v, int | float) and not isinstance(v, bool) and 0 <= v < 1e11


def _is_number(v: object) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and 0 <= v < 1 << 64


def _is_text(v: object) -> bool:
    return type(v) is str


def _is_flag(v: object) -> bool:
    return type(v) is bool


def _is_text_list(v: object) -> bool:
    return type(v) is list and all(type(x) is str for x in v)


def _is_counts(v: object) -> bool:
    return type(v) is dict and all(type(k) is str and _is_count(x) for k, x in v.items())


_COUNT = _Kind("a whole number from 0 to 2^64", _is_count)
_SECONDS = _Kind("a number of seconds", _is_seconds)
_NUMBER = _Kind("a number from 0 to 2^64", _is_number)
_TEXT = _Kind("a string", _is_text)
_FLAG = _Kind("true or false", _is_flag)
_TEXTS = _Kind("a list of strings", _is_text_list)
_COUNTS = _Kind("an object of whole numbers", _is_counts)


def json_type(v: object) -> str:
    """How a JSON value is named in a message: its kind, or a short number."""
    if type(v) in (int, float):
        text = repr(v)
        return text if len(text) <= 24 else f"{text[:20]}...{text[-3:]}"
    names = {dict: "an object", list: "a list", str: "a string", bool: "true/false",
             type(None): "null"}
    return names.get(type(v), type(v).__name__)


_T = TypeVar("_T")


class JsonObject:
    """One JSON object being read; each getter checks the type of what it returns.

    A getter without a default reads a required field; with one, the field
    may be absent (and then the default is returned). `where` names the
    object in messages (`tasks[3]`). Recordings read their header with it too.
    """

    __slots__ = ("_d", "_where")

    def __init__(self, d: object, where: str) -> None:
        if type(d) is not dict:
            raise SnapshotJsonError(f"{where}: expected an object, found {json_type(d)}")
        self._d: dict[str, object] = d
        self._where = where

    def _get(self, name: str, kind: _Kind, default: object) -> Any:
        v = self._d.get(name, _ABSENT)
        if v is _ABSENT:
            if default is None:
                raise SnapshotJsonError(f"{self._where}: {name} is missing")
            return default
        if not kind.test(v):
            raise SnapshotJsonError(
                f"{self._where}.{name}: expected {kind.what}, found {json_type(v)}")
        return v

    def count(self, name: str, default: int | None = None) -> int:
        """A whole number from 0 to 2^64."""
        v: int = self._get(name, _COUNT, default)
        return v

    def seconds(self, name: str, default: float | None = None) -> float:
        """Seconds (a time of day or a duration) up to the year 5000."""
        return float(self._get(name, _SECONDS, default))

    def number(self, name: str, default: float | None = None) -> float:
        """Any non-negative number."""
        return float(self._get(name, _NUMBER, default))

    def text(self, name: str, default: str | None = None) -> str:
        """A string."""
        v: str = self._get(name, _TEXT, default)
        return v

    def flag(self, name: str, default: bool | None = None) -> bool:
        """true or false."""
        v: bool = self._get(name, _FLAG, default)
        return v

    def texts(self, name: str, default: list[str] | None = None) -> list[str]:
        """A list of strings."""
        v: list[str] = self._get(name, _TEXTS, default)
        return v

    def counts(self, name: str, default: dict[str, int] | None = None) -> dict[str, int]:
        """An object of whole numbers (counts by cause, nanoseconds by state)."""
        v: dict[str, int] = self._get(name, _COUNTS, default)
        return v

    def _inner(self, name: str) -> str:
        # Rows and objects of a snapshot are named from the top: `tasks[3]`, `stats`.
        return name if self._where == "snapshot" else f"{self._where}.{name}"

    def obj(self, name: str) -> JsonObject | None:
        """An optional object (absent or null: None)."""
        v = self._d.get(name)
        return None if v is None else JsonObject(v, self._inner(name))

    def rows(self, name: str) -> Iterator[JsonObject]:
        """The objects of an optional list, each named `name[i]`."""
        v = self._d.get(name, _EMPTY)
        prefix = self._inner(name)
        if type(v) is not list:
            raise SnapshotJsonError(f"{prefix}: expected a list, found {json_type(v)}")
        for i, row in enumerate(v):
            yield JsonObject(row, f"{prefix}[{i}]")


_ABSENT = object()
_EMPTY: list[object] = []


class FrameTable:
    """Decoded stacks, shared: each distinct stack one tuple of shared `Frame`s.

    A busy server's snapshot names the same few hundred functions in some
    300,000 frames (each row's stacks and each of its wakers'). Decoded
    apart, the 16 snapshots a replay keeps decoded (`recording.Timeline`)
    held 4.8 million `Frame`s, 1.5 GB, and each of the TUI's full GC passes
    walked them all (2.7 s). A table shared by a recording's snapshots keeps
    one of each. Bounded: emptied past `max_stacks` stacks (what was decoded
    keeps its tuples). Equal frames compare equal either way: sharing
    changes memory and speed, not what a snapshot says.
    """

    def __init__(self, max_stacks: int = 100_000) -> None:
        # Bounded as `Recent` is (emptied when full); never rotated: a recording
        # is one run, its stacks may come back at any interval.
        self._stacks: Recent[tuple[bool, tuple[str, ...], tuple[str, ...]],
                             tuple[Frame, ...]] = Recent(max_stacks)
        self._frames: Recent[tuple[str, str, bool], Frame] = Recent(max_stacks)

    def stack(self, names: Sequence[str], modules: Sequence[str], kernel: bool
              ) -> tuple[Frame, ...]:
        """The frames named `names` (user ones in `modules`, by position)."""
        key = (kernel, tuple(names), () if kernel else tuple(modules))
        got = self._stacks.get(key)
        if got is None:
            frame = self._frame
            if kernel:
                got = tuple(frame(n, "kernel", True) for n in names)
            else:
                got = tuple(frame(n, modules[i] if i < len(modules) else "", False)
                            for i, n in enumerate(names))
            self._stacks.put(key, got)
        return got

    def _frame(self, name: str, module: str, kernel: bool) -> Frame:
        key = (name, module, kernel)
        f = self._frames.get(key)
        if f is None:
            f = Frame(name=name, module=module, kernel=kernel)
            self._frames.put(key, f)
        return f


def _frames(o: JsonObject, kernel: bool, table: FrameTable, *, required: bool = True
            ) -> tuple[Frame, ...]:
    """The `kernel` or `user` frames of an object (user ones with their modules)."""
    absent = None if required else _NO_NAMES
    if kernel:
        return table.stack(o.texts("kernel", absent), _NO_NAMES, True)
    return table.stack(o.texts("user", absent), o.texts("user_modules", _NO_NAMES), False)


_NO_NAMES: list[str] = []


def _drop_zero_states(m: Mapping[str, int]) -> dict[str, int]:
    return {k: v for k, v in m.items() if v}


def _waker(o: JsonObject, table: FrameTable) -> Waker:
    return Waker(pid=o.count("pid"), tid=o.count("tid"), comm=o.text("comm"),
                 kind=o.text("kind", "task"), kernel=_frames(o, True, table, required=False),
                 user=_frames(o, False, table, required=False))


def waker_from_json(d: object) -> Waker | None:
    """The inverse of `waker_to_json` (None and {} are "no waker")."""
    if d is None or d == {}:
        return None
    return _waker(JsonObject(d, "waker"), FrameTable())


def _stats(o: JsonObject | None, interval_s: float) -> CaptureStats:
    if o is None:
        return CaptureStats(interval_s=interval_s)
    return CaptureStats(
        events=o.count("events", 0),
        lost=o.count("lost", 0),
        events_total=o.count("events_total", 0),
        lost_total=o.count("lost_total", 0),
        stack_errors=o.counts("stack_errors_by_cause", {}),
        drops=o.counts("drops", {}),
        truncated_stacks=o.count("truncated_stacks", 0),
        symbol_misses=o.count("symbol_misses", 0),
        agg_entries=o.count("agg_entries", 0),
        stacks_used=o.count("stacks_used", 0),
        stacks_capacity=o.count("stacks_capacity", 0),
        stacks_reclaimed=o.count("stacks_reclaimed", 0),
        probe_run_ns=o.count("probe_run_ns", 0),
        probe_runs=o.count("probe_runs", 0),
        interval_s=interval_s,
        flood_threshold_ns=o.count("flood_threshold_ns", 0),
        symbol_deadline_misses=o.count("symbol_deadline_misses", 0),
        symbol_errors=o.counts("symbol_errors", {}),
        depth_limited_stacks=o.count("depth_limited_stacks", 0),
        user_stacks_lost=o.count("user_stacks_lost", 0),
        behind_rows=o.count("behind_rows", 0),
        python_failures=o.counts("python_failures", {}),
        offtop_cpu_pct=o.number("offtop_cpu_pct", 0.0),
        offtop_rss_bytes=o.count("offtop_rss_bytes", 0),
    )


def _task(t: JsonObject) -> TaskRow:
    offcpu = t.count("offcpu_ns")
    return TaskRow(pid=t.count("pid"), tid=t.count("tid"), comm=t.text("comm"),
                   offcpu_ns=offcpu, count=t.count("count"), max_ns=t.count("max_ns"),
                   state_ns=_drop_zero_states(t.counts("state_ns")),
                   total_ns=t.count("total_ns", offcpu), events=t.count("events", 0))


def _process(p: JsonObject) -> ProcessRow:
    offcpu = p.count("offcpu_ns")
    return ProcessRow(pid=p.count("pid"), comm=p.text("comm"), threads=p.count("threads"),
                      offcpu_ns=offcpu, count=p.count("count"), max_ns=p.count("max_ns"),
                      state_ns=_drop_zero_states(p.counts("state_ns")),
                      total_ns=p.count("total_ns", offcpu), events=p.count("events", 0),
                      user=p.text("user", ""), cmdline=p.text("cmdline", ""))


def _waker_row(w: JsonObject, table: FrameTable) -> WakerRow:
    return WakerRow(_waker(w, table), w.count("offcpu_ns"), w.count("count"))


def _stack(s: JsonObject, table: FrameTable) -> StackRow:
    return StackRow(pid=s.count("pid"), tid=s.count("tid"), comm=s.text("comm"),
                    state=s.text("state"), offcpu_ns=s.count("offcpu_ns"),
                    count=s.count("count"), max_ns=s.count("max_ns", 0),
                    before_start=s.flag("before_start", False),
                    waker_rows=tuple(_waker_row(w, table) for w in s.rows("wakers")),
                    kernel=_frames(s, True, table), user=_frames(s, False, table))


def _long_block(b: JsonObject, table: FrameTable) -> LongBlock:
    waker = b.obj("waker")
    return LongBlock(time=b.seconds("time"), pid=b.count("pid"), tid=b.count("tid"),
                     comm=b.text("comm"), state=b.text("state"),
                     duration_ns=b.count("duration_ns"),
                     kernel=_frames(b, True, table), user=_frames(b, False, table),
                     cgroup_id=b.count("cgroup_id", 0),
                     before_start=b.flag("before_start", False),
                     waker=_waker(waker, table) if waker is not None else None)


def _blocked(b: JsonObject, table: FrameTable) -> BlockedNow:
    return BlockedNow(pid=b.count("pid"), tid=b.count("tid"), comm=b.text("comm"),
                      state=b.text("state"), blocked_ns=b.count("blocked_ns"),
                      before_start=b.flag("before_start", False),
                      kernel=_frames(b, True, table), user=_frames(b, False, table))


def snapshot_from_json(d: object, frames: FrameTable | None = None) -> Snapshot:
    """Rebuild a snapshot from `snapshot_to_json` output; `SnapshotJsonError` if it is not one.

    Its stacks are shared with those of every snapshot decoded with the same
    `frames` table (by default, within this one only)."""
    table = frames if frames is not None else FrameTable()
    if type(d) is not dict:
        raise SnapshotJsonError(
            f"expected one JSON object per line (a snapshot), found {json_type(d)}")
    o = JsonObject(d, "snapshot")
    interval_s = o.seconds("interval_s")
    return Snapshot(
        seq=o.count("seq", 0),
        time=o.seconds("time"),
        interval_s=interval_s,
        threshold_ns=o.count("threshold_ns"),
        tasks=tuple(_task(t) for t in o.rows("tasks")),
        processes=tuple(_process(p) for p in o.rows("processes")),
        stacks=tuple(_stack(s, table) for s in o.rows("stacks")),
        long_blocks=tuple(_long_block(b, table) for b in o.rows("long_blocks")),
        blocked_now=tuple(_blocked(b, table) for b in o.rows("blocked_now")),
        stats=_stats(o.obj("stats"), interval_s),
        notices=tuple(o.texts("notices", [])),
        finished=o.text("finished", ""),
        omitted_stacks=_omitted_stacks(o),
    )


def _omitted_stacks(o: JsonObject) -> int:
    omitted = o.obj("omitted")
    return omitted.count("stacks", 0) if omitted is not None else 0


def _refuse_constant(name: str) -> float:
    raise SnapshotJsonError(f"{name} is not a number offtop writes")


def parse_json(line: str | bytes) -> object:
    """One line of JSON, or a `SnapshotJsonError` saying why not (one line).

    NaN and Infinity are refused (offtop never writes them, and they would
    make every sum they reach meaningless); so are texts that are not UTF-8,
    nesting deeper than the parser's recursion allows and numbers of
    thousands of digits.
    """
    if isinstance(line, bytes):
        try:
            line = line.decode("utf-8")
        except UnicodeDecodeError:
            raise SnapshotJsonError("not UTF-8 text (not an offtop JSON recording)") from None
    try:
        return json.loads(line, parse_constant=_refuse_constant)
    except json.JSONDecodeError as e:
        raise SnapshotJsonError(f"not JSON ({e.msg} at column {e.colno})") from None
    except RecursionError:
        raise SnapshotJsonError("JSON nested too deeply") from None
    except SnapshotJsonError:  # from _refuse_constant
        raise
    except ValueError as e:  # e.g. an integer of more than 4,300 digits
        raise SnapshotJsonError(f"not JSON ({e})") from None
