"""A compact unwind table for one ELF file: sorted pc -> rule.

Built from the file's .eh_frame (found through its section headers, or
through PT_GNU_EH_FRAME and .eh_frame_hdr when they are stripped) and from
.debug_frame, its own or that of a detached debug file under
/usr/lib/debug/.build-id. Where both describe a function, .eh_frame wins: it
is what the program's own unwinder (C++ exceptions, libgcc) relies on.

The table is two arrays, start pcs (8 bytes a row) and rule ids (4 bytes a
row), plus the few hundred distinct rules they point to: about 12 bytes a
row. A row holds from its pc up to the next row's pc; id 0 means "no rule"
(a gap between FDEs). This is the form a table takes to be handed to
another unwinder (an array map of a BPF program, as OpenTelemetry's and
Parca's profilers do); offtop's Python walk uses the lazy form in
`offtop.unwind.lazy`, which interprets only the FDEs it meets.
"""

from __future__ import annotations

import bisect
import os
import struct
import time
from array import array
from dataclasses import dataclass, field
from typing import Protocol

from offtop.unwind.cfi import (
    Bases,
    CfiError,
    CfiLimits,
    ParseStats,
    Rows,
    StateKey,
    fde_rows,
    iter_entries,
    read_encoded,
)
from offtop.unwind.elffile import SHF_COMPRESSED, SHT_NOBITS, ElfFile, ElfFormatError, LoadSegment
from offtop.unwind.rules import Rule

DEBUG_ROOT = "/usr/lib/debug"


@dataclass(slots=True)
class TableStats:
    """How a table was built: sizes, sources, what was skipped and why."""

    fdes: int = 0  #: FDEs that went into the table (interpreted, for a lazy table)
    rows: int = 0
    rules: int = 0  #: distinct rules
    sources: list[str] = field(default_factory=list)  #: e.g. [".eh_frame", "debug:.debug_frame"]
    hdr_fdes: int | None = None  #: FDEs .eh_frame_hdr claims (a cross-check)
    bad_entries: dict[str, int] = field(default_factory=dict)  #: "section:cause" -> count
    truncated: bool = False  #: a cap was reached: some functions have no rows
    build_s: float = 0.0
    nbytes: int = 0  #: memory held by the table


class FileTable(Protocol):
    """What the unwinder needs of one file's table, full or lazy."""

    build_id: bytes | None
    stats: TableStats

    def __len__(self) -> int: ...

    def rule_at(self, vaddr: int) -> Rule | None:
        """The rule for an instruction at `vaddr`, or None where no FDE covers it."""

    def vaddr_of(self, file_offset: int) -> int | None:
        """The virtual address a file offset is loaded at, if in a PT_LOAD segment."""

    @property
    def holds_file(self) -> bool:
        """Whether the table keeps its file open (to read it as walks need)."""

    @property
    def lookups(self) -> int:
        """Rules asked for so far (counted where the table holds its file)."""


def vaddr_in(segments: list[LoadSegment], file_offset: int) -> int | None:
    """The virtual address of `file_offset` in these PT_LOAD segments, if any."""
    for s in segments:
        if s.offset <= file_offset < s.offset + s.filesz:
            return file_offset - s.offset + s.vaddr
    return None


class UnwindTable:
    """Rules by pc, in the file's own virtual addresses (before load bias)."""

    def __init__(self, pcs: array[int], ids: array[int], rules: list[Rule | None],
                 segments: list[LoadSegment], build_id: bytes | None, stats: TableStats) -> None:
        self._pcs = pcs
        self._ids = ids
        self._rules = rules
        self.segments = segments
        self.build_id = build_id
        self.stats = stats

    def __len__(self) -> int:
        return len(self._pcs)

    def rule_at(self, vaddr: int) -> Rule | None:
        """The rule for an instruction at `vaddr`, or None where no FDE covers it."""
        i = bisect.bisect_right(self._pcs, vaddr) - 1
        if i < 0:
            return None
        return self._rules[self._ids[i]]

    def vaddr_of(self, file_offset: int) -> int | None:
        """The virtual address a file offset is loaded at, if in a PT_LOAD segment."""
        return vaddr_in(self.segments, file_offset)

    holds_file = False  #: the table is all in memory
    lookups = 0  #: not counted: only tables that hold their file are let go when idle

    def rows(self) -> list[tuple[int, Rule | None]]:
        """All rows (pc, rule), for tests and for exporting the table elsewhere."""
        return [(pc, self._rules[i]) for pc, i in zip(self._pcs, self._ids, strict=True)]


class TableBuilder:
    """Collects FDE rows of one file, sharing interned rules and program results."""

    def __init__(self, limits: CfiLimits) -> None:
        self.limits = limits
        self.intern: dict[StateKey, int] = {}
        self.stats = TableStats()
        self.fdes: list[tuple[int, int, Rows]] = []
        self._deadline = time.monotonic() + limits.max_build_s

    def add_section(self, data: bytes, bases: Bases, *, eh: bool, label: str) -> None:
        """Interpret every FDE of one section."""
        parse = ParseStats()
        # Identical programs under one CIE give identical relative rows: many
        # small functions share their CFA program byte for byte.
        programs: dict[tuple[int, bytes], Rows] = {}
        for fde, cie in iter_entries(data, bases, eh=eh, limits=self.limits, stats=parse):
            if len(self.fdes) & 1023 == 0 and time.monotonic() > self._deadline:
                parse.truncated = True  # the functions after this one get no rows
                break
            key = (fde.cie_offset, fde.program)
            rows = programs.get(key)
            if rows is None:
                try:
                    rows = fde_rows(fde, cie, self.limits, self.intern)
                except (CfiError, IndexError, struct.error) as e:
                    parse.bad("program" if isinstance(e, CfiError) else type(e).__name__)
                    continue
                if b"\x01" not in fde.program:  # DW_CFA_set_loc makes rows depend on the start
                    programs[key] = rows
            self.fdes.append((fde.start, fde.size, rows))
        self.stats.sources.append(label)
        self.stats.truncated |= parse.truncated
        for cause, n in parse.bad_entries.items():
            key_ = f"{label}:{cause}"
            self.stats.bad_entries[key_] = self.stats.bad_entries.get(key_, 0) + n

    def drop_covered(self, first: int) -> None:
        """Drop FDEs from index `first` on that overlap one before it."""
        if first == 0 or first == len(self.fdes):
            return
        older = sorted(self.fdes[:first])
        starts = [f[0] for f in older]
        kept = list(older)
        for f in self.fdes[first:]:
            i = bisect.bisect_right(starts, f[0]) - 1
            if i >= 0 and starts[i] + older[i][1] > f[0]:
                continue
            if i + 1 < len(starts) and starts[i + 1] < f[0] + f[1]:
                continue
            kept.append(f)
        self.fdes = kept

    def finish(self, segments: list[LoadSegment], build_id: bytes | None) -> UnwindTable:
        """Sort the FDEs into one table (gaps and overlaps resolved)."""
        pcs: array[int] = array("Q")
        ids: array[int] = array("I")
        self.fdes.sort(key=lambda f: f[0])
        used = 0
        for start, size, rows in self.fdes:
            while pcs and pcs[-1] > start:
                # Overlapping FDEs (a hostile or broken file): the later one wins.
                pcs.pop()
                ids.pop()
            for rel, rid in rows:
                if rel >= size:
                    break
                _append(pcs, ids, start + rel, rid)
            _append(pcs, ids, start + size, 0)
            used += 1
            if len(pcs) > self.limits.max_rows:
                self.stats.truncated = True
                break
        rules = rule_list(self.intern)
        st = self.stats
        st.fdes, st.rows, st.rules = used, len(pcs), len(self.intern)
        st.nbytes = pcs.itemsize * len(pcs) + ids.itemsize * len(ids) + 200 * len(rules)
        return UnwindTable(pcs, ids, rules, segments, build_id, st)


def rule_list(intern: dict[StateKey, int]) -> list[Rule | None]:
    """Rules indexed by interned id (id 0: no rule)."""
    rules: list[Rule | None] = [None] * (len(intern) + 1)
    for k, rid in intern.items():
        rules[rid] = Rule.from_key(k)
    return rules


def _append(pcs: array[int], ids: array[int], pc: int, rid: int) -> None:
    if pcs and pcs[-1] == pc:
        ids[-1] = rid
        if len(ids) > 1 and ids[-2] == rid:
            pcs.pop()
            ids.pop()
    elif not ids or ids[-1] != rid:
        pcs.append(pc)
        ids.append(rid)


@dataclass(frozen=True, slots=True)
class EhFrame:
    """A file's .eh_frame bytes and addresses, and its .eh_frame_hdr if any."""

    data: bytes  #: empty when left in the file (`in_file`)
    bases: Bases
    hdr: bytes | None  #: the whole .eh_frame_hdr section (binary search table included)
    hdr_vaddr: int
    #: (file offset, size) of an .eh_frame not read (`find_eh_frame`'s `read_below`)
    in_file: tuple[int, int] | None = None


def read_u64_at(elf: ElfFile, vaddr: int) -> int | None:
    """A pointer stored in the file at `vaddr` (for DW_EH_PE_indirect)."""
    off = elf.vaddr_to_offset(vaddr, 8)
    if off is None:
        return None
    try:
        return int(struct.unpack("<Q", elf.read(off, 8))[0])
    except (ElfFormatError, OSError):  # OSError: the file was closed since
        return None


def find_eh_frame(elf: ElfFile, *, read_below: int | None = None) -> EhFrame | None:
    """.eh_frame and .eh_frame_hdr, from section headers or else PT_GNU_EH_FRAME.

    With `read_below`, an .eh_frame stored plainly (not compressed) of that many
    bytes or more is not read: its place in the file is given (`EhFrame.in_file`).
    """
    got = elf.sections.get(".got")
    hdr_vaddr = elf.eh_frame_hdr_vaddr
    hdr: bytes | None = None
    if hdr_vaddr is not None:
        off = elf.vaddr_to_offset(hdr_vaddr, 12)
        seg_end = elf.segment_end_at(hdr_vaddr)
        sec = elf.sections.get(".eh_frame_hdr")
        size = sec.size if sec is not None and sec.addr == hdr_vaddr else (seg_end or 0) - hdr_vaddr
        if off is not None and size >= 12:
            try:
                hdr = elf.read(off, size)
            except ElfFormatError:
                hdr = None
    sec = elf.sections.get(".eh_frame")
    if sec is not None and sec.type != SHT_NOBITS:
        vaddr, at, size = sec.addr, sec.offset, sec.size
        plain = not sec.flags & SHF_COMPRESSED
    else:
        # No section headers: .eh_frame starts where the header points and
        # runs to its terminator, inside the segment that holds it.
        vaddr_ = _hdr_eh_frame_ptr(hdr, hdr_vaddr) if hdr is not None and hdr_vaddr is not None else None
        if vaddr_ is None:
            return None
        off = elf.vaddr_to_offset(vaddr_, 4)
        seg_end = elf.segment_end_at(vaddr_)
        if off is None or seg_end is None:
            return None
        vaddr, at, size, plain = vaddr_, off, seg_end - vaddr_, True
    in_file: tuple[int, int] | None = None
    if not plain:
        data = elf.section_data(".eh_frame") or b""
    elif read_below is not None and size >= read_below and 0 <= at <= elf.size - size:
        data, in_file = b"", (at, size)
    else:
        data = elf.read(at, size) if size else b""
    if not data and in_file is None:
        return None
    bases = Bases(vaddr, data=got.addr if got else None, read_u64=lambda v: read_u64_at(elf, v))
    return EhFrame(data, bases, hdr, hdr_vaddr or 0, in_file)


def _hdr_eh_frame_ptr(hdr: bytes, hdr_vaddr: int) -> int | None:
    if hdr[0] != 1:
        return None
    try:
        v, _ = read_encoded(hdr, 4, hdr[1], Bases(hdr_vaddr, data=hdr_vaddr))
    except (CfiError, IndexError, struct.error):
        return None
    return v


def hdr_fde_count(hdr: bytes, hdr_vaddr: int) -> int | None:
    """The FDE count an .eh_frame_hdr claims (None when it has none or is malformed)."""
    if len(hdr) < 4 or hdr[0] != 1 or hdr[2] == 0xFF:
        return None
    try:
        b = Bases(hdr_vaddr, data=hdr_vaddr)
        _, pos = read_encoded(hdr, 4, hdr[1], b)
        count, _ = read_encoded(hdr, pos, hdr[2], b)
    except (CfiError, IndexError, struct.error):
        return None
    return count


def debug_file_path(build_id: bytes, debug_root: str = DEBUG_ROOT) -> str:
    """Where Debian's -dbg/-dbgsym packages put the detached debug file of a build-id."""
    h = build_id.hex()
    return os.path.join(debug_root, ".build-id", h[:2], h[2:] + ".debug")


def debug_frames(elf: ElfFile, build_id: bytes | None, debug_root: str) -> list[tuple[str, bytes]]:
    """.debug_frame sections: the file's own, then its detached debug file's."""
    out: list[tuple[str, bytes]] = []
    own = elf.section_data(".debug_frame")
    if own:
        out.append((".debug_frame", own))
    if build_id is not None:
        try:
            with ElfFile(debug_file_path(build_id, debug_root)) as dbg:
                if dbg.build_id() in (None, build_id):
                    data = dbg.section_data(".debug_frame")
                    if data:
                        out.append(("debug:.debug_frame", data))
        except (OSError, ElfFormatError):
            pass
    return out


def build_table(path: str, *, debug_root: str = DEBUG_ROOT, limits: CfiLimits | None = None) -> UnwindTable:
    """The full table of the ELF file at `path` (ElfFormatError/OSError if unreadable)."""
    t0 = time.perf_counter()
    b = TableBuilder(limits or CfiLimits())
    with ElfFile(path) as elf:
        build_id = elf.build_id()
        eh = find_eh_frame(elf)
        if eh is not None:
            if eh.hdr is not None:
                b.stats.hdr_fdes = hdr_fde_count(eh.hdr, eh.hdr_vaddr)
            b.add_section(eh.data, eh.bases, eh=True, label=".eh_frame")
        eh_count = len(b.fdes)
        for label, data in debug_frames(elf, build_id, debug_root):
            b.add_section(data, Bases(0), eh=False, label=label)
        segments = list(elf.segments)
    b.drop_covered(eh_count)
    table = b.finish(segments, build_id)
    table.stats.build_s = time.perf_counter() - t0
    return table
