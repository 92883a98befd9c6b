"""Decoding CPython objects out of another process: str, bytes and code objects.

Every object is checked against the address of its type object (`ob_type`
must be &PyUnicode_Type, &PyBytes_Type, &PyCode_Type of that very
interpreter), every length is capped before anything is read, and text is
decoded with replacement. Code objects are cached by address and
re-validated on each use (their type and the pointers to their name,
file and line table must not have changed), so a code object freed and
another allocated at its address is read afresh, not misnamed.
"""

from __future__ import annotations

import struct
from collections import OrderedDict
from dataclasses import dataclass

from offtop.pystacks.linetable import line_from_linetable310, line_from_lnotab, line_from_locations
from offtop.pystacks.memory import ProcessMemory, ReadError, plausible_pointer
from offtop.pystacks.offsets import Layout

#: Characters kept of a name or a file name; longer ones end in "…".
MAX_CHARS = 512
#: Bytes of a line table read; lines of code past them show as 0 (unknown).
MAX_LINETABLE = 64 << 10
#: Code objects remembered per process.
MAX_CODES = 8192
#: (code object, instruction) -> line results remembered per process.
MAX_LINES = 32768
#: A first line number beyond this is not a line number.
_MAX_LINE = 1 << 24

_OB_TYPE = 8
_U64 = struct.Struct("<Q")
_I64 = struct.Struct("<q")
_U32 = struct.Struct("<I")
_I32 = struct.Struct("<i")


class Inconsistent(ValueError):
    """Memory that is not what the layout says it is (garbage, a stale pointer, a wrong table)."""


def u64(raw: bytes, off: int) -> int:
    """An unsigned 64-bit field of a struct read from the target."""
    return int(_U64.unpack_from(raw, off)[0])


def i32(raw: bytes, off: int) -> int:
    """A signed 32-bit field (an `int`) of a struct read from the target."""
    return int(_I32.unpack_from(raw, off)[0])


@dataclass(frozen=True, slots=True)
class TypeAddresses:
    """Run-time addresses of the type objects that tell real objects from garbage."""

    code: int
    unicode: int
    bytes: int
    frame: int


@dataclass(frozen=True, slots=True)
class CodeInfo:
    """What a stack needs of one code object."""

    identity: tuple[int, ...]
    """The fields re-checked on each use: type, name/file/table pointers, first line."""
    function: str
    filename: str
    firstlineno: int
    linetable: bytes
    bytecode: int
    """Address of the first code unit (3.11+), for instruction pointer -> offset."""


class ObjectReader:
    """Reads str, bytes and code objects of one process, with a code-object cache."""

    def __init__(self, mem: ProcessMemory, layout: Layout, types: TypeAddresses) -> None:
        self.mem = mem
        self.layout = layout
        self.types = types
        self._codes: OrderedDict[int, CodeInfo] = OrderedDict()
        # A blocked thread sits at the same instruction read after read, and a
        # location table is decoded from its start: remember the answers.
        self._lines: dict[tuple[tuple[int, ...], int], int] = {}

    def string(self, addr: int) -> str:
        """A str object's text (compact strings, as all names and file names are)."""
        lay = self.layout
        if not plausible_pointer(addr):
            raise Inconsistent(f"str pointer {addr:#x}")
        head = lay.unicode_compact_size
        try:
            raw = self.mem.read(addr, head + 128, min_size=lay.unicode_ascii_size)
        except ReadError as e:
            raise Inconsistent(f"str at {addr:#x}: {e}") from e
        if u64(raw, _OB_TYPE) != self.types.unicode:
            raise Inconsistent(f"not a str at {addr:#x}")
        length = int(_I64.unpack_from(raw, lay.unicode_length)[0])
        state = int(_U32.unpack_from(raw, lay.unicode_state)[0])
        # PyASCIIObject.state bit-fields (3.8-3.13): interned:2, kind:3, compact:1, ascii:1.
        kind, compact, ascii_ = (state >> 2) & 7, (state >> 5) & 1, (state >> 6) & 1
        if length < 0 or not compact or kind not in (1, 2, 4) or (ascii_ and kind != 1):
            raise Inconsistent(f"str at {addr:#x}: length {length}, state {state:#x}")
        start = lay.unicode_ascii_size if ascii_ else lay.unicode_compact_size
        nbytes = min(length, MAX_CHARS) * kind
        data = raw[start:start + nbytes]
        if len(data) < nbytes:
            try:
                data = self.mem.read(addr + start, nbytes)
            except ReadError as e:
                raise Inconsistent(f"str data at {addr:#x}: {e}") from e
        encoding = {1: "ascii" if ascii_ else "latin-1", 2: "utf-16-le", 4: "utf-32-le"}[kind]
        text = data.decode(encoding, errors="replace")
        return text + "…" if length > MAX_CHARS else text

    def bytes_object(self, addr: int, cap: int) -> bytes:
        """The first `cap` bytes of a bytes object."""
        lay = self.layout
        if not plausible_pointer(addr):
            raise Inconsistent(f"bytes pointer {addr:#x}")
        try:
            raw = self.mem.read(addr, lay.bytes_sval + 256, min_size=lay.bytes_sval)
        except ReadError as e:
            raise Inconsistent(f"bytes at {addr:#x}: {e}") from e
        size = int(_I64.unpack_from(raw, lay.bytes_size)[0])
        if u64(raw, _OB_TYPE) != self.types.bytes or size < 0:
            raise Inconsistent(f"not a bytes object at {addr:#x}")
        n = min(size, cap)
        data = raw[lay.bytes_sval:lay.bytes_sval + n]
        if len(data) < n:
            try:
                data = self.mem.read(addr + lay.bytes_sval, n)
            except ReadError as e:
                raise Inconsistent(f"bytes data at {addr:#x}: {e}") from e
        return data

    def _identity(self, raw: bytes) -> tuple[int, ...]:
        lay = self.layout
        fields = [u64(raw, _OB_TYPE), u64(raw, lay.code_filename), u64(raw, lay.code_name),
                  u64(raw, lay.code_linetable), i32(raw, lay.code_firstlineno)]
        if lay.code_qualname is not None:
            fields.append(u64(raw, lay.code_qualname))
        return tuple(fields)

    def is_code(self, raw: bytes) -> bool:
        """True when a header read from the target is that of a code object."""
        return len(raw) >= self.layout.code_read and u64(raw, _OB_TYPE) == self.types.code

    def code_headers(self, addrs: list[int]) -> dict[int, bytes]:
        """The headers of several code objects in one batched read (unreadable ones left out)."""
        size = self.layout.code_read
        ok = [a for a in addrs if plausible_pointer(a)]
        got = self.mem.read_many([(a, size) for a in ok])
        return {a: raw for a, raw in zip(ok, got, strict=True) if raw is not None}

    def code(self, addr: int, raw: bytes) -> CodeInfo:
        """The code object at `addr` whose header is `raw`: from the cache if it is unchanged."""
        if not self.is_code(raw):
            raise Inconsistent(f"not a code object at {addr:#x}")
        identity = self._identity(raw)
        cached = self._codes.get(addr)
        if cached is not None and cached.identity == identity:
            self._codes.move_to_end(addr)
            return cached
        lay = self.layout
        firstlineno = identity[4]
        if not 0 <= firstlineno < _MAX_LINE:
            raise Inconsistent(f"code at {addr:#x}: first line {firstlineno}")
        qual = u64(raw, lay.code_qualname) if lay.code_qualname is not None else u64(raw, lay.code_name)
        info = CodeInfo(
            identity=identity,
            function=self.string(qual),
            filename=self.string(u64(raw, lay.code_filename)),
            firstlineno=firstlineno,
            linetable=self.bytes_object(u64(raw, lay.code_linetable), MAX_LINETABLE),
            bytecode=addr + lay.code_adaptive if lay.code_adaptive is not None else 0,
        )
        self._codes[addr] = info
        if len(self._codes) > MAX_CODES:
            self._codes.popitem(last=False)
        return info

    def line(self, code: CodeInfo, position: int) -> int:
        """The line of a frame: `position` is f_lasti (3.8-3.10) or the instruction pointer (3.11+)."""
        key = (code.identity, position)
        line = self._lines.get(key)
        if line is None:
            if len(self._lines) >= MAX_LINES:
                self._lines.clear()
            line = self._lines[key] = self._decode_line(code, position)
        return line

    def _decode_line(self, code: CodeInfo, position: int) -> int:
        fmt = self.layout.line_format
        if fmt == "lnotab":
            return line_from_lnotab(code.linetable, code.firstlineno, position)
        if fmt == "linetable310":
            # f_lasti counts 2-byte code units in 3.10; -1 before the first instruction.
            return line_from_linetable310(code.linetable, code.firstlineno, position * 2)
        return line_from_locations(code.linetable, code.firstlineno, position - code.bytecode)
