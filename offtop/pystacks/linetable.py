"""Line numbers from a code object's line table, in the three formats of CPython 3.8-3.13.

Each function mirrors the interpreter's own lookup (`PyCode_Addr2Line`) for
its versions, on bytes read from an untrusted process: every loop is
bounded by the table's length, and a table that ends early or encodes
nonsense gives 0 ("line unknown") instead of an exception.

- 3.8-3.9, `co_lnotab` (Objects/lnotab_notes.txt): byte pairs (address
  increment, signed line increment).
- 3.10, `co_linetable` (PEP 626): byte pairs (address delta, signed line
  delta; -128 means "no line") covering [start, end) ranges.
- 3.11+, the location table (Objects/locations.md): entries that each cover
  1-8 code units; the first byte has bit 7 set, its bits 3-6 give the kind,
  bits 0-2 the length minus one; the line delta is 0 (short forms, 0-9),
  0-2 (one-line forms, 10-12), a signed varint (13, 14), or "no location" (15).
"""

from __future__ import annotations

#: At most this many bytes of a varint are read: 6 bits each, more than any line delta needs.
_MAX_VARINT_BYTES = 6


def line_from_lnotab(table: bytes, firstlineno: int, lasti: int) -> int:
    """3.8-3.9: the line of the byte offset `lasti` (as PyCode_Addr2Line of 3.8)."""
    line = firstlineno
    addr = 0
    for i in range(0, len(table) - 1, 2):
        addr += table[i]
        if addr > lasti:
            break
        delta = table[i + 1]
        line += delta - 256 if delta >= 128 else delta
    return max(line, 0)


def line_from_linetable310(table: bytes, firstlineno: int, addr: int) -> int:
    """3.10: the line of byte offset `addr` (f_lasti * 2), 0 where the table says none."""
    if addr < 0:
        return firstlineno
    line = firstlineno
    end = 0
    for i in range(0, len(table) - 1, 2):
        start = end
        end += table[i]
        delta = table[i + 1]
        has_line = delta != 0x80
        if has_line:
            line += delta - 256 if delta >= 128 else delta
        if start <= addr < end:
            return max(line, 0) if has_line else 0
    return 0


def _varint(table: bytes, i: int) -> tuple[int, int]:
    """An unsigned varint of the location table at `i`: (value, index after it)."""
    value = 0
    shift = 0
    for _ in range(_MAX_VARINT_BYTES):
        if i >= len(table):
            break
        b = table[i]
        i += 1
        value |= (b & 63) << shift
        shift += 6
        if not b & 64:
            break
    return value, i


def line_from_locations(table: bytes, firstlineno: int, addr: int) -> int:
    """3.11+: the line of byte offset `addr` into the bytecode, 0 where the table says none."""
    if addr < 0:
        return firstlineno
    line = firstlineno
    start = 0
    i = 0
    n = len(table)
    while i < n:
        first = table[i]
        if not first & 0x80:
            return 0  # not at the start of an entry: the table is not what it should be
        kind = (first >> 3) & 15
        end = start + ((first & 7) + 1) * 2
        has_line = kind != 15
        if kind in (13, 14):
            raw, _ = _varint(table, i + 1)
            line += -(raw >> 1) if raw & 1 else raw >> 1
        elif kind >= 10 and kind != 15:
            line += kind - 10
        if start <= addr < end:
            return max(line, 0) if has_line else 0
        start = end
        # The next entry starts at the next byte with bit 7 set (as the interpreter skips).
        i += 1
        while i < n and not table[i] & 0x80:
            i += 1
    return 0
