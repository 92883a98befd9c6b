"""An unwind table that interprets only the FDEs a walk meets.

.eh_frame_hdr holds a binary search table of every FDE by start address
(the linker writes it for libgcc's unwinder). With it, finding the rule of
one pc costs a bisect and one FDE's program, a few microseconds, instead of
interpreting every FDE of the file first (libLLVM has ~100,000). Results are
memoized per FDE; the memo is bounded. .debug_frame, which has no such
index, is built into a full table, consulted only where .eh_frame has no
FDE. A hostile index cannot produce a wrong rule: an FDE is used only if its
own range holds the pc.

A large .eh_frame is not held either: each FDE a walk meets (and its CIE) is
read from the file then, through a descriptor kept open with the table
(bounded preads: a file shrunk since is a counted error, never a SIGBUS as a
mapping would give). Held whole, libLLVM's and libclang-cpp's were 5.5 MB
each, for as long as their tables were cached.
"""

from __future__ import annotations

import bisect
import struct
import time
import weakref
from array import array

from offtop.unwind.cfi import Bases, CfiError, CfiLimits, Cie, Rows, StateKey, fde_read, fde_rows
from offtop.unwind.elffile import ElfFile, ElfFormatError, LoadSegment
from offtop.unwind.rules import Rule
from offtop.unwind.table import (
    DEBUG_ROOT,
    TableBuilder,
    TableStats,
    UnwindTable,
    build_table,
    debug_frames,
    find_eh_frame,
    hdr_fde_count,
    rule_list,
    vaddr_in,
)

#: The only table encoding indexed here: DW_EH_PE_datarel | DW_EH_PE_sdata4,
#: what GNU ld, gold, lld and mold all write on x86-64.
_TABLE_ENC = 0x3B
#: FDEs whose rows are kept; past this the memo starts over.
MAX_MEMO = 65536
#: An .eh_frame of this many bytes or more is read from its file as walks need
#: it (python3.11's is 0.4 MB, libc's 0.2: held; libLLVM's 5.5: read).
READ_IN_FILE_FROM = 1 << 20
#: What a descriptor kept open counts for in a table's bytes (`TableStats.nbytes`):
#: the cache's bound on bytes, 16 MB, so also keeps at most 64 files open.
OPEN_FILE_NBYTES = 256 << 10


class HeldSection:
    """An .eh_frame held in memory."""

    def __init__(self, data: bytes) -> None:
        self._data = data
        self.size = len(data)
        self.nbytes = len(data)

    def read(self, at: int, n: int) -> bytes:
        """`n` bytes at section offset `at` (fewer past the end)."""
        return self._data[at:at + n]

    def close(self) -> None:
        """Nothing is held open."""


class SectionInFile:
    """An .eh_frame read from its file on demand, through `elf`: kept open until
    `close`, or until nothing holds the section any more (a table evicted from the
    cache stays whole for a walk that still holds it). Reads are bounded by the
    section and checked (`ElfFile.read`)."""

    def __init__(self, elf: ElfFile, offset: int, size: int) -> None:
        self._elf = elf
        self._offset = offset
        self.size = size
        self.nbytes = OPEN_FILE_NBYTES
        self._closer = weakref.finalize(self, elf.close)

    def read(self, at: int, n: int) -> bytes:
        """`n` bytes at section offset `at` (fewer past the end); ElfFormatError or
        OSError when the file no longer has them, or once closed."""
        n = min(n, self.size - at)
        return self._elf.read(self._offset + at, n) if at >= 0 and n > 0 else b""

    @property
    def open(self) -> bool:
        """Whether the file is still held (not `close`d)."""
        return self._closer.alive

    def close(self) -> None:
        """Let the file go (idempotent); reads fail from then on."""
        self._closer()


class LazyTable:
    """Rules by pc through .eh_frame_hdr, with .debug_frame as a full fallback table."""

    def __init__(self, section: HeldSection | SectionInFile, bases: Bases, hdr_vaddr: int,
                 starts: array[int], fdes: array[int], segments: list[LoadSegment],
                 build_id: bytes | None, fallback: UnwindTable | None, limits: CfiLimits,
                 stats: TableStats) -> None:
        self._section = section
        self._bases = bases
        self._hdr_vaddr = hdr_vaddr
        self._starts = starts  #: FDE start - hdr vaddr, sorted
        self._fdes = fdes  #: FDE address - hdr vaddr
        self._cies: dict[int, Cie | None] = {}
        self._memo: dict[int, tuple[int, int, Rows] | None] = {}
        self._intern: dict[StateKey, int] = {}
        self._rules: list[Rule | None] = [None]
        self._fallback = fallback
        self._limits = limits
        self.segments = segments
        self.build_id = build_id
        self.stats = stats
        self.errors: dict[str, int] = {}  #: FDEs found unusable on lookup, by cause
        self.lookups = 0  #: rules asked for, by any holder (the cache tells idle tables by it)

    def __len__(self) -> int:
        # Rows held, for the cache's memory bound: the index counts as one row per FDE.
        return len(self._starts) + (len(self._fallback) if self._fallback is not None else 0)

    def vaddr_of(self, file_offset: int) -> int | None:
        """The virtual address a file offset is loaded at, if in a PT_LOAD segment."""
        return vaddr_in(self.segments, file_offset)

    @property
    def holds_file(self) -> bool:
        """Whether a descriptor of the file is kept open (a large .eh_frame)."""
        return isinstance(self._section, SectionInFile) and self._section.open

    def close(self) -> None:
        """Let go of the file a large .eh_frame is read from (idempotent). Rules
        looked up since are found only among the FDEs met before."""
        self._section.close()

    def rule_at(self, vaddr: int) -> Rule | None:
        """The rule for an instruction at `vaddr`, or None where no FDE covers it."""
        self.lookups += 1
        hv = self._hdr_vaddr
        i = bisect.bisect_right(self._starts, vaddr - hv) - 1
        if i >= 0:
            found = self._fde(self._fdes[i] + hv - self._bases.section_vaddr)
            if found is not None:
                start, size, rows = found
                if start <= vaddr < start + size:
                    return self._rule(rows, vaddr - start)
        return self._fallback.rule_at(vaddr) if self._fallback is not None else None

    def _fde(self, offset: int) -> tuple[int, int, Rows] | None:
        if offset in self._memo:
            return self._memo[offset]
        found: tuple[int, int, Rows] | None = None
        try:
            section = self._section
            fde = fde_read(section.read, section.size, offset, self._bases, self._cies)
            if fde is not None:
                cie = self._cies[fde.cie_offset]
                assert cie is not None
                found = (fde.start, fde.size, fde_rows(fde, cie, self._limits, self._intern))
                self.stats.fdes += 1
        except (CfiError, IndexError, struct.error, ElfFormatError, OSError) as e:
            cause = ("format" if isinstance(e, CfiError)
                     else "read" if isinstance(e, (ElfFormatError, OSError)) else type(e).__name__)
            self.errors[cause] = self.errors.get(cause, 0) + 1
        if len(self._memo) >= MAX_MEMO:
            self._memo.clear()
        self._memo[offset] = found
        return found

    def _rule(self, rows: Rows, rel: int) -> Rule | None:
        j = bisect.bisect_right(rows, (rel, 1 << 62)) - 1
        if j < 0:
            return None
        rid = rows[j][1]
        if rid >= len(self._rules):
            self._rules = rule_list(self._intern)
        return self._rules[rid]


def _index(hdr: bytes, hdr_vaddr: int) -> tuple[array[int], array[int]] | None:
    """The binary search table of an .eh_frame_hdr: (starts, FDE addresses), hdr-relative."""
    if len(hdr) < 12 or hdr[0] != 1 or hdr[3] != _TABLE_ENC:
        return None
    count = hdr_fde_count(hdr, hdr_vaddr)
    if count is None or count <= 0:
        return None
    table_at = 12 if hdr[1] & 0x0F == 0x0B and hdr[2] & 0x0F in (0x03, 0x0B) else None
    if table_at is None or table_at + 8 * count > len(hdr):
        return None
    pairs = array("i")
    pairs.frombytes(hdr[table_at:table_at + 8 * count])
    if pairs.itemsize != 4:
        return None
    return pairs[0::2], pairs[1::2]


def load_table(path: str, *, debug_root: str = DEBUG_ROOT, limits: CfiLimits | None = None,
               in_file_from: int = READ_IN_FILE_FROM) -> LazyTable | UnwindTable:
    """A lazy table when the file has a usable .eh_frame_hdr, else a full one. An
    .eh_frame of `in_file_from` bytes or more stays in the file (`SectionInFile`).

    ElfFormatError or OSError when the file is not readable ELF.
    """
    t0 = time.perf_counter()
    lim = limits or CfiLimits()
    elf = ElfFile(path)
    section: HeldSection | SectionInFile | None = None
    try:
        eh = find_eh_frame(elf, read_below=in_file_from)
        index = _index(eh.hdr, eh.hdr_vaddr) if eh is not None and eh.hdr is not None else None
        if eh is None or index is None:
            return build_table(path, debug_root=debug_root, limits=lim)
        build_id = elf.build_id()
        extra = debug_frames(elf, build_id, debug_root)
        segments = list(elf.segments)
        section = SectionInFile(elf, *eh.in_file) if eh.in_file else HeldSection(eh.data)
    finally:
        if not isinstance(section, SectionInFile):
            elf.close()
    stats = TableStats(sources=[".eh_frame (lazy)"], hdr_fdes=len(index[0]))
    fallback = None
    if extra:
        b = TableBuilder(lim)
        for label, data in extra:
            b.add_section(data, Bases(0), eh=False, label=label)
        fallback = b.finish(segments, build_id)
        stats.sources += fallback.stats.sources
        stats.bad_entries.update(fallback.stats.bad_entries)
    # The index is all a lazy table needs of .eh_frame_hdr (8 bytes an FDE:
    # 0.8 MB of libLLVM's): the section's bytes are not kept too.
    stats.nbytes = section.nbytes + 8 * len(index[0]) + (fallback.stats.nbytes if fallback else 0)
    stats.build_s = time.perf_counter() - t0
    return LazyTable(section, eh.bases, eh.hdr_vaddr, index[0], index[1], segments, build_id,
                     fallback, lim, stats)
