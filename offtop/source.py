"""Where snapshots come from.

The app and the batch printer take any `SnapshotSource`: the BPF engine
(`offtop.bpf.engine.BpfSource`) on a live kernel, or `ReplaySource`, which
plays back recorded snapshots for UI tests and demos. Neither the app nor
the widgets know which one they have.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import platform
import stat
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import BinaryIO, Protocol, runtime_checkable

from offtop.model import Snapshot
from offtop.report import snapshot_from_json


@dataclass(frozen=True, slots=True)
class SourceInfo:
    """What the header says about the capture."""

    host: str
    kernel: str
    scope: str = "all tasks"
    stacks: str = "kernel+user"
    kind: str = "bpf"


class SnapshotSource(Protocol):
    """The interface between data and screen (see module docstring)."""

    @property
    def info(self) -> SourceInfo:
        """Host, kernel, scope and stack mode, for the header."""
        ...

    @property
    def threshold_ns(self) -> int:
        """The current long-block threshold."""
        ...

    def start(self) -> None:
        """Get ready to produce snapshots (may be slow: compiles BPF)."""
        ...

    def next_snapshot(self, interval_s: float, stop: threading.Event) -> Snapshot | None:
        """Block for about `interval_s`, then return that interval's snapshot.

        Returns None when `stop` is set or the source is exhausted. Never
        blocks much longer than the interval, whatever the event rate.
        """
        ...

    def set_threshold(self, ns: int) -> None:
        """Route blocks of `ns` or longer to the event stream, from now on."""
        ...

    def close(self) -> None:
        """Detach and free everything; safe to call twice."""
        ...


@runtime_checkable
class BlockedWaits(Protocol):
    """What a source may offer besides `SnapshotSource`: the waits of blocked
    threads read at any moment, so the UI shows them true at every redraw."""

    def blocked_waits(self, tids: Iterable[int]) -> Mapping[int, int]:
        """How long each of `tids` has been blocked now, in ns; a thread that
        is absent runs again (or is not known). Cheap; callable from any thread."""
        ...


def local_info(kind: str, scope: str = "all tasks", stacks: str = "kernel+user") -> SourceInfo:
    """A `SourceInfo` for this machine."""
    return SourceInfo(
        host=platform.node(), kernel=platform.release(), scope=scope, stacks=stacks, kind=kind
    )


class ReplaySource:
    """Plays back recorded snapshots: for UI tests, demos and offline reading.

    `realtime=False` returns each snapshot at once (tests); otherwise it waits
    `interval_s` between them like a live source. Threshold changes are kept
    and stamped onto later snapshots, so the slider behaves as it would live.
    """

    def __init__(
        self,
        snapshots: Sequence[Snapshot],
        *,
        info: SourceInfo | None = None,
        realtime: bool = True,
        loop: bool = False,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._snapshots = list(snapshots)
        self._info = info or SourceInfo(
            host="replay", kernel=platform.release(), kind="replay"
        )
        self._realtime = realtime
        self._loop = loop
        self._clock = clock
        self._index = 0
        self._threshold_ns = self._snapshots[0].threshold_ns if self._snapshots else 500_000_000
        self.threshold_writes: list[int] = []
        self.closed = False

    @classmethod
    def from_jsonl(
        cls,
        path: str | os.PathLike[str],
        *,
        info: SourceInfo | None = None,
        realtime: bool = True,
        loop: bool = False,
    ) -> ReplaySource:
        """Load snapshots recorded with `offtop --batch --format json`.

        Raises `RecordingError` (one line for users) for anything that is not
        such a recording; see `load_recording`.
        """
        return cls(load_recording(path), info=info, realtime=realtime, loop=loop)

    @property
    def info(self) -> SourceInfo:
        return self._info

    @property
    def threshold_ns(self) -> int:
        return self._threshold_ns

    def start(self) -> None:
        self._index = 0

    def next_snapshot(self, interval_s: float, stop: threading.Event) -> Snapshot | None:
        if self._realtime and stop.wait(interval_s):
            return None
        if stop.is_set() or self.closed:
            return None
        if self._index >= len(self._snapshots):
            if not self._loop or not self._snapshots:
                return None
            self._index = 0
        snap = self._snapshots[self._index]
        self._index += 1
        return dataclasses.replace(snap, threshold_ns=self._threshold_ns)

    def set_threshold(self, ns: int) -> None:
        self._threshold_ns = ns
        self.threshold_writes.append(ns)

    def close(self) -> None:
        self.closed = True

    def blocked_waits(self, tids: Iterable[int]) -> Mapping[int, int]:
        """The waits as recorded in the snapshot last returned (see `BlockedWaits`)."""
        if not 0 < self._index <= len(self._snapshots):
            return {}
        wanted = set(tids)
        return {b.tid: b.blocked_ns for b in self._snapshots[self._index - 1].blocked_now
                if b.tid in wanted}


# --- recordings ------------------------------------------------------------------

#: The largest recording offtop loads. Every snapshot is kept in memory for
#: replay, at about five times its JSON size, so this bounds offtop to a few
#: hundred MB; a longer recording can be cut with `split -C 64m`.
MAX_RECORDING_BYTES = 64 << 20
#: The longest line (one snapshot); a real one is ~1 MB for 2,000 tasks.
MAX_LINE_BYTES = 16 << 20


class RecordingError(ValueError):
    """A file that is not an offtop recording; the message is one line for users."""


@dataclass(frozen=True, slots=True)
class _Kind:
    """What a recorded JSON value must be, and how to say so."""

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


def _is_text_list(v: object) -> bool:
    return type(v) is list and all(type(x) is str for x in v)


def _is_counts(v: object) -> bool:
    return type(v) is dict and all(type(k) is str and _is_count(x) for k, x in v.items())


_COUNT = _Kind("a whole number from 0 to 2^64", _is_count)
_SECONDS = _Kind("a number of seconds", _is_seconds)
_NUMBER = _Kind("a number from 0 to 2^64", _is_number)
_TEXT = _Kind("a string", _is_text)
_TEXTS = _Kind("a list of strings", _is_text_list)
_COUNTS = _Kind("an object of whole numbers", _is_counts)

#: The fields `report.snapshot_from_json` reads, by object: (kind, required).
#: Unknown fields are left alone, so newer recordings still play.
_Spec = dict[str, tuple[_Kind, bool]]
_ROW_BASE: _Spec = {"pid": (_COUNT, True), "comm": (_TEXT, True)}
_STACK_BASE: _Spec = {**_ROW_BASE, "tid": (_COUNT, True), "state": (_TEXT, True),
                      "kernel": (_TEXTS, True), "user": (_TEXTS, True),
                      "user_modules": (_TEXTS, False)}
_TOTALS: _Spec = {"offcpu_ns": (_COUNT, True), "count": (_COUNT, True),
                  "max_ns": (_COUNT, True), "state_ns": (_COUNTS, True),
                  "total_ns": (_COUNT, False), "events": (_COUNT, False)}
_ROWS: dict[str, _Spec] = {
    "tasks": {**_ROW_BASE, "tid": (_COUNT, True), **_TOTALS},
    "processes": {**_ROW_BASE, "threads": (_COUNT, True), **_TOTALS,
                  "user": (_TEXT, False), "cmdline": (_TEXT, False)},
    "stacks": {**_STACK_BASE, "offcpu_ns": (_COUNT, True), "count": (_COUNT, True),
               "max_ns": (_COUNT, False)},
    "long_blocks": {**_STACK_BASE, "time": (_SECONDS, True), "duration_ns": (_COUNT, True),
                    "cgroup_id": (_COUNT, False)},
    "blocked_now": {**_STACK_BASE, "blocked_ns": (_COUNT, True)},
}
_TOP: _Spec = {"time": (_SECONDS, True), "interval_s": (_SECONDS, True),
               "threshold_ns": (_COUNT, True), "seq": (_COUNT, False),
               "notices": (_TEXTS, False), "finished": (_TEXT, False)}
_STATS: _Spec = {
    "stack_errors_by_cause": (_COUNTS, False), "drops": (_COUNTS, False),
    "symbol_errors": (_COUNTS, False), "offtop_cpu_pct": (_NUMBER, False),
} | {
    name: (_COUNT, False)
    for name in ("events", "lost", "events_total", "lost_total", "truncated_stacks",
                 "symbol_misses", "agg_entries", "stacks_used", "stacks_capacity",
                 "stacks_reclaimed", "probe_run_ns", "probe_runs", "flood_threshold_ns",
                 "symbol_deadline_misses", "depth_limited_stacks", "user_stacks_lost",
                 "offtop_rss_bytes")
}


def _json_type(v: object) -> str:
    if type(v) in (int, float):
        text = repr(v)
        return text if len(text) <= 24 else f"{text[:20]}...{text[-3:]}"
    names = {dict: "an object", list: "a list", str: "a string", bool: "true/false",
             type(None): "null"}
    return names.get(type(v), type(v).__name__)


def _check_object(obj: object, spec: _Spec, where: str) -> dict[str, object]:
    if type(obj) is not dict:
        raise RecordingError(f"{where}: expected an object, found {_json_type(obj)}")
    for name, (kind, required) in spec.items():
        if name not in obj:
            if required:
                raise RecordingError(f"{where}: {name} is missing")
        elif not kind.test(obj[name]):
            raise RecordingError(
                f"{where}.{name}: expected {kind.what}, found {_json_type(obj[name])}")
    return obj


def _check_snapshot(obj: object) -> dict[str, object]:
    """The checks `snapshot_from_json` leaves out: every field it reads has its type."""
    if type(obj) is not dict:
        raise RecordingError(
            f"expected one JSON object per line (a snapshot), found {_json_type(obj)}")
    d = _check_object(obj, _TOP, "snapshot")
    if "stats" in d:
        _check_object(d["stats"], _STATS, "stats")
    for key, spec in _ROWS.items():
        rows = d.get(key, [])
        if type(rows) is not list:
            raise RecordingError(f"{key}: expected a list, found {_json_type(rows)}")
        for i, row in enumerate(rows):
            _check_object(row, spec, f"{key}[{i}]")
    return d


def _refuse_constant(name: str) -> float:
    raise RecordingError(f"{name} is not a number a recording can hold")


def parse_snapshot_line(line: str | bytes) -> Snapshot:
    """One recorded line as a snapshot, or a `RecordingError` saying what is wrong."""
    if isinstance(line, bytes):
        try:
            line = line.decode("utf-8")
        except UnicodeDecodeError:
            raise RecordingError("not UTF-8 text (not an offtop JSON recording)") from None
    try:
        obj = json.loads(line, parse_constant=_refuse_constant)
    except json.JSONDecodeError as e:
        raise RecordingError(f"not JSON ({e.msg} at column {e.colno})") from None
    except RecursionError:
        raise RecordingError("JSON nested too deeply") from None
    except RecordingError:  # from _refuse_constant
        raise
    except ValueError as e:  # e.g. an integer of more than 4,300 digits
        raise RecordingError(f"not JSON ({e})") from None
    d = _check_snapshot(obj)
    try:
        return snapshot_from_json(d)
    except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as e:
        # A field added to the codec since the checks above were written.
        raise RecordingError(f"not a snapshot ({type(e).__name__}: {e})") from None


def read_jsonl(lines: Iterable[str | bytes]) -> Iterator[Snapshot]:
    """Snapshots from JSON lines, skipping blank ones; `RecordingError` names the bad line."""
    for n, line in enumerate(lines, 1):
        if line.strip():
            try:
                yield parse_snapshot_line(line)
            except RecordingError as e:
                raise RecordingError(f"line {n}: {e}") from None


def _bounded_lines(f: BinaryIO) -> Iterator[bytes]:
    """The lines of `f`, refusing any longer than MAX_LINE_BYTES or a file that outgrows the cap."""
    total = 0
    for n in itertools.count(1):
        line = f.readline(MAX_LINE_BYTES + 1)
        if not line:
            return
        total += len(line)
        if len(line) > MAX_LINE_BYTES:
            raise RecordingError(f"line {n} is longer than {MAX_LINE_BYTES >> 20} MiB")
        if total > MAX_RECORDING_BYTES:
            raise RecordingError(f"larger than {MAX_RECORDING_BYTES >> 20} MiB")
        yield line


_FILE_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a device"),
               (stat.S_ISBLK, "a device"), (stat.S_ISSOCK, "a socket"))


def _refuse_unless_regular(mode: int) -> None:
    if not stat.S_ISREG(mode):
        kind = next((name for test, name in _FILE_KINDS if test(mode)), "not a regular file")
        raise RecordingError(f"{kind}, not a file written by offtop --batch --format json")


def _open_regular(path: str | os.PathLike[str]) -> BinaryIO:
    """`path` opened for reading if it is a regular file; never blocks, never opens a device."""
    # stat() first: opening a FIFO waits for a writer, opening a device may act.
    _refuse_unless_regular(os.stat(path).st_mode)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)  # what was opened, in case the path changed since the stat()
        _refuse_unless_regular(st.st_mode)
        if st.st_size > MAX_RECORDING_BYTES:
            raise RecordingError(
                f"{st.st_size / (1 << 20):.0f} MiB, larger than the {MAX_RECORDING_BYTES >> 20} MiB "
                f"offtop replays (cut it with split -C {MAX_RECORDING_BYTES >> 20}m)")
    except BaseException:
        os.close(fd)
        raise
    return os.fdopen(fd, "rb")


def load_recording(path: str | os.PathLike[str]) -> list[Snapshot]:
    """Every snapshot of a recording, in bounded time and memory.

    Only a regular file is read, at most MAX_RECORDING_BYTES of it, a line at
    a time of at most MAX_LINE_BYTES; each line must be a snapshot object with
    every field of the right type. Anything else is a `RecordingError` whose
    message says what and where; OS errors become one too.
    """
    try:
        with _open_regular(path) as f:
            snaps = list(read_jsonl(_bounded_lines(f)))
    except OSError as e:
        raise RecordingError(e.strerror or str(e)) from None
    if not snaps:
        raise RecordingError("holds no snapshots (empty, or blank lines only)")
    return snaps
