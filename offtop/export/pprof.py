"""Off-CPU profiles as gzipped pprof (`profile.proto` of google/pprof).

One sample per (thread, state, stack), two values per sample, named as
OpenTelemetry's eBPF profiler names its off-CPU profile:

- `count`/`count`: how many blocks ended at that stack;
- `off_cpu`/`nanoseconds`: how long they were off the CPU (the default).

String labels on every sample: `pid`, `tid`, `comm`, `state` (one letter,
see `offtop.model.STATE_NAMES`) and `cgroup` when known. They are strings,
not numeric labels, because Pyroscope-compatible backends keep only string
labels; `go tool pprof -tagfocus tid=1234` works on them all the same.

Frames become locations (innermost first, kernel frames then user frames),
each with one function; the module a frame comes from (`kernel`,
`libc.so.6`, the binary's name) becomes a mapping with `has_functions` set,
so pprof never tries to symbolize the (address-less) locations itself.

The encoder is a small hand-written protobuf writer rather than the
`protobuf` package: profile.proto needs only varints and length-delimited
fields, the whole writer is ~60 lines, and the `protobuf` runtime plus code
generated with a matching `protoc` would be a dependency (and a generated
file kept in step with it) for no gain. It is tested against the real
consumer, `go tool pprof`.
"""

from __future__ import annotations

import gzip
import re
from collections.abc import Iterable, Sequence

from offtop.export.accumulator import ProfileData, StackTotal
from offtop.model import Frame
from offtop.units import format_ns

#: The sample types, in order, as (type, unit).
SAMPLE_TYPES: tuple[tuple[str, str], ...] = (("count", "count"), ("off_cpu", "nanoseconds"))
DEFAULT_SAMPLE_TYPE = "off_cpu"


# --- protobuf wire format -------------------------------------------------

_VARINT, _LEN = 0, 2


def _varint(out: bytearray, n: int) -> None:
    if n < 0:  # int64 fields: two's complement in 64 bits, as protobuf does
        n += 1 << 64
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)


def _uvarint(n: int) -> bytes:
    """A non-negative varint on its own (the samples' fast path)."""
    if n < _SMALL_MAX:
        return _SMALL[n]
    out = bytearray()
    _varint(out, n)
    return bytes(out)


def _encode_small(n: int) -> bytes:
    out = bytearray()
    _varint(out, n)
    return bytes(out)


#: Varints below 2**14 (ids, string indices, lengths, counts) are looked up.
_SMALL_MAX = 1 << 14
_SMALL = [_encode_small(n) for n in range(_SMALL_MAX)]


class _Message:
    """One protobuf message being written (fields in any order, as allowed)."""

    __slots__ = ("buf",)

    def __init__(self) -> None:
        self.buf = bytearray()

    def varint(self, field: int, value: int) -> _Message:
        """A varint field; zero is the default and is left out."""
        if value:
            _varint(self.buf, field << 3 | _VARINT)
            _varint(self.buf, value)
        return self

    def blob(self, field: int, value: bytes | bytearray) -> _Message:
        """A length-delimited field (bytes, string or embedded message), always written."""
        _varint(self.buf, field << 3 | _LEN)
        _varint(self.buf, len(value))
        self.buf += value
        return self

    def message(self, field: int, msg: _Message) -> _Message:
        """An embedded message."""
        return self.blob(field, msg.buf)

    def packed(self, field: int, values: Iterable[int]) -> _Message:
        """A packed repeated varint field (proto3's default encoding)."""
        body = bytearray()
        for v in values:
            _varint(body, v)
        if body:
            self.blob(field, body)
        return self


class _Strings:
    """The profile's string table: index 0 is always ""."""

    def __init__(self) -> None:
        self.index: dict[str, int] = {"": 0}

    def __call__(self, s: str) -> int:
        i = self.index.get(s)
        if i is None:
            i = self.index[s] = len(self.index)
        return i

    def write(self, msg: _Message) -> None:
        for s in self.index:  # dicts keep insertion order: index order
            # Names are decoded with replacement, so this is exact UTF-8; a
            # lone surrogate (never produced by offtop) becomes "?" instead
            # of making the whole profile invalid UTF-8.
            msg.blob(6, s.encode("utf-8", errors="replace"))


# --- profile ----------------------------------------------------------------


class _Builder:
    """Dedupes mappings, functions and locations while samples are added."""

    def __init__(self) -> None:
        self.strings = _Strings()
        self.mappings: dict[str, int] = {}
        self.locations: dict[tuple[str, str, bool], tuple[int, int]] = {}  # -> (id, mapping)
        self.labels: dict[tuple[str, str], bytes] = {}
        self.samples = bytearray()

    def mapping_of(self, module: str) -> int:
        if not module:
            return 0
        mid = self.mappings.get(module)
        if mid is None:
            mid = self.mappings[module] = len(self.mappings) + 1
        return mid

    def new_location(self, f: Frame) -> tuple[int, int]:
        """A location (and its mapping) for a frame not seen before: (id, mapping id)."""
        loc = self.locations[(f.name, f.module, f.kernel)] = (
            len(self.locations) + 1, self.mapping_of(f.module))
        return loc

    def label(self, key: str, value: str) -> bytes:
        """A sample's label field (3), encoded once per distinct (key, value)."""
        field = self.labels.get((key, value))
        if field is None:
            msg = _Message().varint(1, self.strings(key)).varint(2, self.strings(value)).buf
            field = self.labels[(key, value)] = b"\x1a" + _uvarint(len(msg)) + msg
        return field

    def sample(self, st: StackTotal) -> None:
        """One sample (field 2): location ids leaf first, [count, ns], labels.

        Written field by field from cached pieces: this runs once per stack,
        20,000 times for a busy interval.
        """
        locs = self.locations
        ids = [(locs.get((f.name, f.module, f.kernel)) or self.new_location(f))[0]
               for f in st.frames]
        packed = b"".join([_SMALL[i] if i < _SMALL_MAX else _uvarint(i) for i in ids])
        values = _uvarint(st.count) + _uvarint(st.offcpu_ns)
        label = self.label
        body = b"".join([
            b"\x0a", _uvarint(len(packed)), packed,
            b"\x12", _uvarint(len(values)), values,
            label("pid", str(st.pid)), label("tid", str(st.tid)), label("comm", st.comm),
            label("state", st.state), label("cgroup", st.cgroup) if st.cgroup else b"",
        ])
        self.samples += b"\x12" + _uvarint(len(body)) + body

    def finish(self, data: ProfileData, comments: Sequence[str]) -> bytes:
        s = self.strings
        out = _Message()
        for typ, unit in SAMPLE_TYPES:
            out.message(1, _Message().varint(1, s(typ)).varint(2, s(unit)))
        out.buf += self.samples  # field 2
        for module, mid in self.mappings.items():
            out.message(3, _Message().varint(1, mid).varint(5, s(module)).varint(7, 1))
        for (name, _module, _kernel), (lid, mid) in self.locations.items():
            # Location id == function id: one function per location.
            shown, file, line = _function_parts(name)
            out.message(4, _Message().varint(1, lid).varint(2, mid)
                        .message(4, _Message().varint(1, lid).varint(2, line)))
            fn = _Message().varint(1, lid).varint(2, s(shown)).varint(3, s(name))
            if file:
                fn.varint(4, s(file))
            out.message(5, fn)
        start_ns = round(data.start * 1e9)
        out.varint(9, start_ns)
        out.varint(10, round(data.duration_s * 1e9))
        # Every block is measured whole (nothing is sampled): one nanosecond
        # of off-CPU time per unit.
        out.message(11, _Message().varint(1, s("off_cpu")).varint(2, s("nanoseconds")))
        out.varint(12, 1)
        out.packed(13, [s(c) for c in comments])
        out.varint(14, s(DEFAULT_SAMPLE_TYPE))
        s.write(out)
        return bytes(out.buf)


#: A Python frame as offtop names it: "py:FUNC (FILE:LINE)".
_PY_FRAME = re.compile(r"(py:.*) \((.+):(\d+)\)")


def _function_parts(name: str) -> tuple[str, str, int]:
    """(function name, file, line) of a frame, for pprof's Function and Line.

    A Python frame's file and line go in their own fields. CPython's
    `<module>`, `<lambda>`, `<listcomp>` are written `[module]`...: pprof
    drops anything in angle brackets as C++ template arguments, which left
    "py:" alone on the screen. The full name stays the system name.
    """
    m = _PY_FRAME.fullmatch(name)
    if m is None:
        return name, "", 0
    func = m.group(1).replace("<", "[").replace(">", "]")
    return func, m.group(2), min(int(m.group(3)), 1 << 31)


def default_comments(data: ProfileData) -> list[str]:
    """What a reader of the profile should know about how it was made."""
    out = ["offtop off-CPU profile: whole blocks measured at sched_switch, not sampled"]
    if data.threshold_ns:
        out.append(f"long-block threshold {format_ns(data.threshold_ns)}")
    if data.folded_stacks:
        out.append(f"{data.folded_stacks} smallest stacks ({format_ns(data.folded_ns)}) "
                   "folded into [other stacks] to bound memory")
    return out


def pprof_bytes(data: ProfileData, *, compress: bool = True) -> bytes:
    """`data` as a pprof profile, gzipped unless `compress` is false."""
    b = _Builder()
    stacks = [st for st in data.stacks if st.offcpu_ns > 0 or st.count > 0]
    if stacks:
        # The heaviest stack's user modules come first, so that mapping[0],
        # which pprof calls the main binary, is a program, not the kernel.
        for f in reversed(stacks[0].user):
            b.mapping_of(f.module)
    for st in stacks:
        b.sample(st)
    raw = b.finish(data, [*default_comments(data), *data.comments])
    # mtime=0: the same profile gives the same bytes (tests, dedup in backends).
    return gzip.compress(raw, compresslevel=6, mtime=0) if compress else raw
