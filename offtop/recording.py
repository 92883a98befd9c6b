"""Recordings: what `--record FILE` writes and `--replay FILE` reads.

Format (version 1)
------------------
A recording is a gzip file of JSON lines, UTF-8, one JSON object a line:

- line 1, the header::

      {"offtop_recording": 1, "offtop_version": "0.1.0", "host": "db-1",
       "kernel": "6.1.0-27-amd64", "scope": "pid 123", "stacks": "kernel+user",
       "states": "SDI", "threshold_ns": 500000000, "interval_s": 1.0,
       "started": 1700000000.25}

  `offtop_recording` is the format version (a reader refuses a newer one);
  `scope` and `stacks` are as the header of the TUI shows them, `started`
  is the unix time the capture began.
- every further line: one interval, exactly as `offtop --batch --format json`
  prints it (`offtop.snapshot_json.snapshot_to_json`) but always complete:
  `--limit` never applies to recordings.

Each line is a gzip member of its own (a gzip file may hold any number of
members; `zcat FILE` reads them as one stream, so `zcat FILE | jq` works).
That costs little (each interval's JSON is kilobytes to megabytes, larger
than deflate's 32 KiB window) and buys two things: a recording cut short by
a crash, a full disk or SIGKILL keeps every interval written before (a
reader stops at the last whole member), and replay keeps each interval
compressed in memory and inflates only the ones shown, so time travel over a
long recording costs its compressed size, not its JSON size.

`--replay` also reads what `--batch --format json` printed (plain JSON lines
without a header), and either form gzipped as a single stream. zstd is
recognized and refused with the command to decompress it.

Reading is bounded: only a regular file, at most `MAX_FILE_BYTES` of it, at
most `MAX_LINE_BYTES` a line once inflated and `MAX_INFLATED_BYTES` in all
(a "zip bomb" stops there), and every field of every line type-checked at
load (`offtop.snapshot_json`), so a bad line is refused before anything is
shown. Anything else is a `RecordingError` whose message is one line.
"""

from __future__ import annotations

import collections
import gzip
import json
import os
import queue
import stat
import threading
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import overload

from offtop import __version__
from offtop.model import Snapshot
from offtop.snapshot_json import (
    FrameTable,
    JsonObject,
    SnapshotJsonError,
    parse_json,
    snapshot_from_json,
    snapshot_json_line,
)

#: The version this offtop writes, and the newest it reads.
FORMAT_VERSION = 1
#: The header's marker key (its value is the format version).
HEADER_KEY = "offtop_recording"

#: The largest file `--replay` reads: replay keeps it in memory (compressed).
MAX_FILE_BYTES = 256 << 20
#: The longest line (one interval) once inflated: ~1 MB for 2,000 tasks, ~20 MB for
#: a busy server (the aggregator keeps at most 20,000 stacks an interval).
MAX_LINE_BYTES = 64 << 20
#: All lines together, inflated: bounds the time a load takes (and a zip bomb).
MAX_INFLATED_BYTES = 2 << 30
#: Lines kept uncompressed (plain files, single-stream gzip) are held in
#: memory as they are: at most this much of them.
MAX_PLAIN_BYTES = 512 << 20

_GZIP_MAGIC = b"\x1f\x8b"
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
_CHUNK = 1 << 20


class RecordingError(ValueError):
    """A file that is not an offtop recording; the message is one line for users."""


# --- the header --------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RecordingHeader:
    """What a recording says about the capture it holds (its first line)."""

    host: str
    kernel: str
    scope: str
    stacks: str
    threshold_ns: int
    interval_s: float
    started: float
    states: str = ""
    offtop_version: str = __version__
    format_version: int = FORMAT_VERSION

    def to_json(self) -> dict[str, object]:
        """The header line's object."""
        return {HEADER_KEY: self.format_version, "offtop_version": self.offtop_version,
                "host": self.host, "kernel": self.kernel, "scope": self.scope,
                "stacks": self.stacks, "states": self.states,
                "threshold_ns": self.threshold_ns, "interval_s": self.interval_s,
                "started": self.started}

    @classmethod
    def from_json(cls, obj: object) -> RecordingHeader:
        """The header from its object, every field checked (`SnapshotJsonError`)."""
        o = JsonObject(obj, "header")
        version = o.count(HEADER_KEY)
        if version > FORMAT_VERSION:
            raise SnapshotJsonError(
                f"recording format {version} is newer than this offtop reads "
                f"({FORMAT_VERSION}): replay it with a newer offtop")
        return cls(host=o.text("host"), kernel=o.text("kernel"), scope=o.text("scope"),
                   stacks=o.text("stacks"), threshold_ns=o.count("threshold_ns"),
                   interval_s=o.seconds("interval_s"), started=o.seconds("started"),
                   states=o.text("states", ""), offtop_version=o.text("offtop_version", ""),
                   format_version=version)


def _is_header(obj: object) -> bool:
    return type(obj) is dict and HEADER_KEY in obj


# --- writing -------------------------------------------------------------------------


class RecordingWriter:
    """Appends a recording to an open file: the header now, then one interval per `add`.

    Each line is compressed as a gzip member of its own and written as soon
    as it is (see the module docstring), so what was written is readable at
    any moment. Encoding and compressing an interval of a busy machine takes
    a tenth of a second or more; a thread of the writer's own does it (zlib
    lets go of the GIL, so it runs beside the capture on another CPU), at
    most `queue_max` intervals behind: past that, `add` waits, so nothing is
    ever dropped. An OS error (ENOSPC, EIO) is raised by the next `add` or by
    `close`; the caller says what failed. The writer owns `fd` and closes it.
    """

    def __init__(self, fd: int, header: RecordingHeader, *, level: int = 6,
                 queue_max: int = 4) -> None:
        self.fd = fd
        self.header = header
        self._level = level
        self.snapshots = 0
        """Intervals written so far."""
        self.bytes_written = 0
        """Compressed bytes written so far, header included."""
        self._write_line(json.dumps(header.to_json(), separators=(",", ":")) + "\n")
        self._queue: queue.Queue[Snapshot | None] = queue.Queue(queue_max)
        self._error: OSError | None = None
        self._thread: threading.Thread | None = None

    def add(self, snap: Snapshot) -> None:
        """Queue one interval, complete (no limit); waits while `queue_max` are queued."""
        self._raise_error()
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="offtop-record",
                                            daemon=True)
            self._thread.start()
        self._queue.put(snap)

    def close(self) -> None:
        """Write what is queued, then close the file (safe to call twice).

        Raises the OS error that stopped the writing, if one did.
        """
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None
        if self.fd >= 0:
            fd, self.fd = self.fd, -1
            os.close(fd)
        self._raise_error()

    def _run(self) -> None:
        while (snap := self._queue.get()) is not None:
            if self._error is not None:
                continue  # the file failed: drain, so `add` never waits for good
            try:
                self._write_line(snapshot_json_line(snap))
                self.snapshots += 1
            except OSError as e:
                self._error = e

    def _raise_error(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def _write_line(self, line: str) -> None:
        # mtime=0: the same recording compresses to the same bytes.
        data = memoryview(gzip.compress(line.encode("utf-8", "surrogatepass"),
                                        compresslevel=self._level, mtime=0))
        while data:
            n = os.write(self.fd, data)
            self.bytes_written += n
            data = data[n:]


# --- reading -------------------------------------------------------------------------


class Timeline(Sequence[Snapshot]):
    """A recording's intervals, decoded when asked for (a few kept decoded).

    Each entry is a line of JSON, compressed (a gzip member) or not; every one
    was checked when the recording was loaded. `times` are the intervals' end
    times, for seeking by time without decoding anything.
    """

    def __init__(self, entries: Sequence[bytes], times: Sequence[float], *,
                 compressed: Sequence[bool], cache: int = 4,
                 frames: FrameTable | None = None) -> None:
        if not len(entries) == len(times) == len(compressed):
            raise ValueError("entries, times and compressed must have the same length")
        self._entries = list(entries)
        self._compressed = list(compressed)
        self.times: tuple[float, ...] = tuple(times)
        self._cache: collections.OrderedDict[int, Snapshot] = collections.OrderedDict()
        self._cache_max = cache
        # The snapshots' stacks, shared (see FrameTable): those the load checked, too.
        self._frames = frames if frames is not None else FrameTable()

    def __len__(self) -> int:
        return len(self._entries)

    @overload
    def __getitem__(self, index: int) -> Snapshot: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[Snapshot]: ...

    def __getitem__(self, index: int | slice) -> Snapshot | Sequence[Snapshot]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(index)
        snap = self._cache.get(index)
        if snap is not None:
            self._cache.move_to_end(index)
            return snap
        raw = self._entries[index]
        line = gzip.decompress(raw) if self._compressed[index] else raw
        snap = snapshot_from_json(parse_json(line), self._frames)  # checked at load: cannot fail
        self._cache[index] = snap
        if len(self._cache) > self._cache_max:
            self._cache.popitem(last=False)
        return snap

    @property
    def stored_bytes(self) -> int:
        """What the entries take in memory."""
        return sum(len(e) for e in self._entries)


@dataclass(frozen=True, slots=True)
class Recording:
    """A loaded recording: its header (None for plain `--format json` output) and intervals.

    `cut_short` says the file ended inside an interval (the recording was not
    closed: a crash, SIGKILL, a full disk); what came before is all there.
    """

    header: RecordingHeader | None
    timeline: Timeline
    cut_short: bool = False


def _refuse_unless_regular(mode: int) -> None:
    if not stat.S_ISREG(mode):
        kinds = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
                 (stat.S_ISCHR, "a device"), (stat.S_ISBLK, "a device"),
                 (stat.S_ISSOCK, "a socket"))
        kind = next((name for test, name in kinds if test(mode)), "not a regular file")
        raise RecordingError(f"{kind}, not a file written by offtop --record or "
                             "--batch --format json")


def _read_regular(path: str | os.PathLike[str]) -> bytes:
    """The bytes of `path` if it is a regular file of at most MAX_FILE_BYTES; never blocks."""
    # stat() first: opening a FIFO waits for a writer, opening a device may act.
    _refuse_unless_regular(os.stat(path).st_mode)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)  # what was opened, in case the path changed since the stat()
        _refuse_unless_regular(st.st_mode)
        if st.st_size > MAX_FILE_BYTES:
            raise RecordingError(
                f"{st.st_size / (1 << 20):.0f} MiB, larger than the {MAX_FILE_BYTES >> 20} MiB "
                "offtop replays (keep a part: zcat FILE | sed -n '1p;2,3600p' | gzip > part.gz)")
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(MAX_FILE_BYTES + 1)
    finally:
        os.close(fd)
    if len(data) > MAX_FILE_BYTES:  # grew since the fstat()
        raise RecordingError(f"larger than {MAX_FILE_BYTES >> 20} MiB")
    return data


class _Lines:
    """Splits text into lines, with the line and total caps applied."""

    def __init__(self) -> None:
        self.inflated = 0
        self._pending = bytearray()

    def feed(self, data: bytes) -> Iterator[bytes]:
        """The whole lines that `data` completes (a line may span many calls)."""
        self.inflated += len(data)
        if self.inflated > MAX_INFLATED_BYTES:
            raise RecordingError(f"more than {MAX_INFLATED_BYTES >> 30} GiB of JSON")
        view = memoryview(data)
        start = 0
        while True:
            nl = data.find(b"\n", start)
            if nl < 0:
                break
            self._check(len(self._pending) + nl - start)
            if self._pending:
                line = bytes(self._pending + view[start:nl])
                self._pending.clear()
            else:
                line = bytes(view[start:nl])
            yield line
            start = nl + 1
        self._check(len(self._pending) + len(data) - start)
        self._pending += view[start:]

    def end(self) -> Iterator[bytes]:
        """The last line, if the text did not end with a newline."""
        if self._pending:
            line = bytes(self._pending)
            self._pending.clear()
            yield line

    def drop(self) -> None:
        """Forget a line that was cut short."""
        self._pending.clear()

    @staticmethod
    def _check(length: int) -> None:
        if length > MAX_LINE_BYTES:
            raise _LineTooLong


class _LineTooLong(Exception):
    """A line longer than MAX_LINE_BYTES (the caller knows its number)."""


class _Member:
    """One gzip member at the start of `data`, inflated a chunk at a time."""

    def __init__(self, data: memoryview) -> None:
        self._data = data
        self._d = zlib.decompressobj(wbits=31)
        self.size = 0
        """The member's length in `data`, once `chunks()` is exhausted."""

    def chunks(self) -> Iterator[bytes]:
        """The member's text; EOFError if the data ends inside it."""
        d = self._d
        rest = self._data
        while not d.eof:
            out = d.decompress(rest, _CHUNK)
            rest = memoryview(d.unconsumed_tail)
            if out:
                yield out
            elif not rest:
                raise EOFError  # no more input, no more output, no end: cut short
        self.size = len(self._data) - len(d.unused_data)


def _gzip_lines(data: bytes, lines: _Lines) -> Iterator[tuple[bytes, bytes | None]]:
    """(line, its gzip member if the member holds just that line, else None).

    A member of one line (what `RecordingWriter` writes) is kept compressed;
    the lines of a member holding more (a whole file gzipped at once) are
    handed out as they are inflated, so memory never holds the whole text.
    Raises EOFError after the last whole line when the data ends inside a
    member, or when what follows the last member is not one (a cut file).
    """
    view = memoryview(data)
    pos = 0
    while pos < len(view):
        m = _Member(view[pos:])
        held: list[bytes] = []  # the member's lines while it may still be a one-line member
        many = False
        try:
            for out in m.chunks():
                for line in lines.feed(out):
                    if many:
                        yield line, None
                        continue
                    held.append(line)
                    if sum(1 for h in held if h.strip()) > 1:
                        many = True
                        yield from ((h, None) for h in held)
                        held.clear()
        except zlib.error as e:
            if pos == 0:
                raise RecordingError(f"not a valid gzip file ({e})") from None
            lines.drop()
            raise EOFError from None
        except EOFError:
            lines.drop()
            raise
        held.extend(lines.end())
        member = bytes(view[pos:pos + m.size])
        one = not many and sum(1 for h in held if h.strip()) == 1
        yield from ((h, member if one and h.strip() else None) for h in held)
        pos += m.size


def _lines(data: bytes) -> Iterator[tuple[bytes, bytes | None]]:
    """(line, its own gzip member or None) for every line of the file."""
    if data[:4] == _ZSTD_MAGIC:
        raise RecordingError("zstd-compressed: offtop reads gzip or plain JSON lines; "
                             "decompress it first (unzstd FILE)")
    lines = _Lines()
    if data[:2] == _GZIP_MAGIC:
        yield from _gzip_lines(data, lines)
        return
    for line in lines.feed(data):
        yield line, None
    for line in lines.end():
        yield line, None


def load_recording(path: str | os.PathLike[str]) -> Recording:
    """A recording (or `--format json` output), every line checked, in bounded time and memory.

    See the module docstring for the caps. `RecordingError` says what is
    wrong and on which line; OS errors become one too.
    """
    try:
        data = _read_regular(path)
    except OSError as e:
        raise RecordingError(e.strerror or str(e)) from None
    header: RecordingHeader | None = None
    entries: list[bytes] = []
    compressed: list[bool] = []
    times: list[float] = []
    plain = 0
    cut_short = False
    n = 0
    frames = FrameTable()
    read = _lines(data)
    while True:
        try:
            line, member = next(read)
        except StopIteration:
            break
        except EOFError:
            cut_short = True
            break
        except _LineTooLong:
            raise RecordingError(f"line {n + 1} is longer than {MAX_LINE_BYTES >> 20} MiB"
                                 ) from None
        n += 1
        if not line.strip():
            continue
        try:
            obj = parse_json(line)
            if _is_header(obj):
                if entries or header is not None:
                    raise SnapshotJsonError("a recording header after the first line "
                                            "(two recordings in one file?)")
                header = RecordingHeader.from_json(obj)
                continue
            snap = snapshot_from_json(obj, frames)
        except SnapshotJsonError as e:
            raise RecordingError(f"line {n}: {e}") from None
        times.append(snap.time)
        if member is not None:
            entries.append(member)
            compressed.append(True)
        else:
            plain += len(line)
            if plain > MAX_PLAIN_BYTES:
                raise RecordingError(
                    f"more than {MAX_PLAIN_BYTES >> 20} MiB of uncompressed lines to hold "
                    "(a recording made with --record stays compressed in memory)")
            entries.append(line)
            compressed.append(False)
    if not entries:
        raise RecordingError("holds no snapshots (empty, or blank lines only)")
    return Recording(header, Timeline(entries, times, compressed=compressed, frames=frames),
                     cut_short)
