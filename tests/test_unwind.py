"""Tests of offtop.unwind: call-frame information, tables, the stack walk.

Three layers: the CFA interpreter and section parser on hand-made bytes
(every opcode the unwinder claims, and hostile entries); whole tables
against binutils' readelf and against each other (full and lazy) on
Debian's libc and python3.11, plus mutated files; real blocked processes
(a program built -O2 -fomit-frame-pointer, Debian's sleep, gzip, dd, tar
and python3) unwound and compared frame by frame with gdb's backtrace.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import gc
import os
import random
import re
import shutil
import struct
import subprocess
import sys
import threading
import time
import tracemalloc
from collections.abc import Iterator
from pathlib import Path

import pytest

from offtop.unwind import StopReason, TableCache, Unwinder, UnwindLimits, build_table, read_syscall_regs
from offtop.unwind.cfi import (
    Bases,
    CfiError,
    CfiLimits,
    Cie,
    ParseStats,
    State,
    StateKey,
    iter_entries,
    read_encoded,
    run_program,
    sleb,
    uleb,
)
from offtop.unwind.elffile import ElfFile, ElfFormatError
from offtop.unwind.lazy import OPEN_FILE_NBYTES, LazyTable, SectionInFile, load_table
from offtop.unwind.maps import ExecMapping, parse_maps, read_exec_maps
from offtop.unwind.memory import PAGE, StackReader
from offtop.unwind.regs import parse_syscall
from offtop.unwind.rules import CfaKind, RegKind, Rule
from offtop.unwind.table import FileTable, TableStats, find_eh_frame

ROOT = Path(__file__).resolve().parent.parent
NOFP_SRC = ROOT / "tests" / "workloads" / "unwind_nofp.c"
LIBC = "/lib/x86_64-linux-gnu/libc.so.6"
PYTHON = "/usr/bin/python3.11"
#: GCC's x86-64 CIE: DW_CFA_def_cfa rsp 8; DW_CFA_offset r16 (return address) at cfa-8.
GCC_CIE = b"\x0c\x07\x08\x90\x01"


# --- the CFA interpreter -----------------------------------------------------

def _cie(initial: bytes = GCC_CIE, *, fde_enc: int = 0x1B, ra_reg: int = 16) -> Cie:
    return Cie(code_align=1, data_align=-8, ra_reg=ra_reg, fde_enc=fde_enc, has_aug_data=True,
               signal_frame=False, initial=initial)


def _rows(program: bytes, *, initial: bytes = GCC_CIE,
          limits: CfiLimits | None = None) -> list[tuple[int, str]]:
    """(pc offset, readable rule) rows of one FDE program under GCC's CIE."""
    cie = _cie(initial)
    lim = limits or CfiLimits()
    intern: dict[StateKey, int] = {}
    start: State = ((CfaKind.NONE, 0, 0, 0), (RegKind.SAME, 0, 0), (RegKind.SAME, 0, 0))
    _, init = run_program(cie.initial, cie, start, start, 0, lim, intern)
    rows, _ = run_program(program, cie, init, init, 0x1000, lim, intern)
    by_id = {rid: Rule.from_key(k) for k, rid in intern.items()}
    return [(loc, by_id[rid].describe()) for loc, rid in rows]


def test_leb128_and_pointer_encodings() -> None:
    assert uleb(b"\xe5\x8e\x26", 0) == (624485, 3)
    assert sleb(b"\xc0\xbb\x78", 0) == (-123456, 3)
    assert sleb(b"\x7f", 0) == (-1, 1)
    with pytest.raises(CfiError):
        uleb(b"\xff" * 12, 0)
    data = struct.pack("<iIqQ", -16, 0x1234, -8, 0xAAAA)
    b = Bases(section_vaddr=0x5000, data=0x9000, read_u64=lambda a: 0xFEED if a == 0x5000 - 16 else None)
    assert read_encoded(data, 0, 0x1B, b) == (0x5000 - 16, 4)  # pcrel sdata4: relative to the field
    assert read_encoded(data, 4, 0x03, b) == (0x1234, 8)  # udata4, absolute
    assert read_encoded(data, 8, 0x3C, b) == (0x9000 - 8, 16)  # datarel sdata8
    assert read_encoded(data, 16, 0x04, b) == (0xAAAA, 24)  # udata8
    assert read_encoded(data, 0, 0x9B, b) == (0xFEED, 4)  # indirect pcrel sdata4: the pointer there
    with pytest.raises(CfiError):
        read_encoded(data, 0, 0x3B, Bases(0))  # datarel with no base
    with pytest.raises(CfiError):
        read_encoded(data, 0, 0x9B, Bases(0x5000))  # indirect with nothing to read it


def test_prologue_epilogue_with_frame_pointer() -> None:
    prog = (b"\x41\x0e\x10\x86\x02"  # advance 1; def_cfa_offset 16; offset rbp at cfa-16
            b"\x43\x0d\x06"  # advance 3; def_cfa_register rbp
            b"\x60\x0c\x07\x08")  # advance 32; def_cfa rsp 8
    assert _rows(prog) == [
        (0, "cfa=rsp+8 ra=c-8 rbp=same"),
        (1, "cfa=rsp+16 ra=c-8 rbp=c-16"),
        (4, "cfa=rbp+16 ra=c-8 rbp=c-16"),
        (36, "cfa=rsp+8 ra=c-8 rbp=c-16"),
    ]


def test_remember_restore_state_and_restore() -> None:
    prog = (b"\x41\x0e\x10\x86\x02"  # 1: push rbp
            b"\x42\x0a\x0e\x08\xc6"  # 3: remember; epilogue: cfa rsp+8, restore rbp
            b"\x41\x0b")  # 4: restore_state: back to the body's rules
    assert _rows(prog) == [
        (0, "cfa=rsp+8 ra=c-8 rbp=same"),
        (1, "cfa=rsp+16 ra=c-8 rbp=c-16"),
        (3, "cfa=rsp+8 ra=c-8 rbp=same"),
        (4, "cfa=rsp+16 ra=c-8 rbp=c-16"),
    ]
    # restore_extended, same_value, undefined, and the advance_loc forms
    prog = (b"\x05\x06\x02"  # offset_extended rbp cfa-16
            b"\x02\x10\x06\x06"  # advance_loc1 16; restore_extended rbp
            b"\x03\x00\x01\x08\x06"  # advance_loc2 256; same_value rbp
            b"\x04\x00\x00\x01\x00\x07\x10")  # advance_loc4 65536; undefined ra
    assert _rows(prog) == [
        (0, "cfa=rsp+8 ra=c-8 rbp=c-16"),
        (16, "cfa=rsp+8 ra=c-8 rbp=same"),
        (16 + 256 + 65536, "cfa=rsp+8 ra=undefined rbp=same"),
    ]


def test_signed_and_gnu_forms() -> None:
    prog = (b"\x11\x06\x7e"  # offset_extended_sf rbp: -2 * -8 = cfa+16
            b"\x41\x12\x07\x7e"  # def_cfa_sf rsp, -2 * -8 = 16
            b"\x41\x13\x7d"  # def_cfa_offset_sf -3 * -8 = 24
            b"\x41\x2e\x10"  # GNU_args_size 16: no change to any rule
            b"\x41\x2f\x06\x03"  # GNU_negative_offset_extended rbp: -(3 * -8) ... = cfa+24
            b"\x41\x14\x06\x01")  # val_offset rbp: value cfa-8
    assert _rows(prog) == [
        (0, "cfa=rsp+8 ra=c-8 rbp=c+16"),
        (1, "cfa=rsp+16 ra=c-8 rbp=c+16"),
        (2, "cfa=rsp+24 ra=c-8 rbp=c+16"),
        (4, "cfa=rsp+24 ra=c-8 rbp=c+24"),
        (5, "cfa=rsp+24 ra=c-8 rbp==c-8"),
    ]


def test_register_and_expression_rules() -> None:
    # __vfork: the return address is popped into rdi (r5) around the syscall.
    assert _rows(b"\x41\x0e\x00\x09\x10\x05")[-1] == (1, "cfa=rsp+0 ra=r5 rbp=same")
    plt = b"\x0f\x0b\x77\x08\x80\x00\x3f\x1a\x3b\x2a\x33\x24\x22"  # ld's PLT expression
    assert _rows(plt) == [(0, "cfa=plt(rsp+8,11) ra=c-8 rbp=same")]
    drap = (b"\x0f\x03\x76\x78\x06"  # cfa = *(rbp - 8)
            b"\x10\x06\x02\x76\x00")  # rbp saved at rbp + 0
    assert _rows(drap) == [(0, "cfa=*(r6+-8)+0 ra=c-8 rbp=[r6+0]")]
    assert _rows(b"\x0f\x01\x9c") == [(0, "cfa=expr ra=c-8 rbp=same")]  # DW_OP_call_frame_cfa: no
    assert _rows(b"\x0c\x0a\x00") == [(0, "cfa=r10+0 ra=c-8 rbp=same")]  # first-frame-only register
    assert _rows(b"\x16\x10\x01\x9c") == [(0, "cfa=rsp+8 ra=unsupported rbp=same")]  # val_expression


@pytest.mark.parametrize("program, limits", [
    (b"\x1c", None),  # DW_CFA_lo_user: unknown
    (b"\x0b", None),  # restore_state with nothing remembered
    (b"\x0a" * 65, None),  # remember_state nested past the cap
    (b"\x00" * 30, CfiLimits(max_ops_per_program=20)),  # a program longer than the cap
    (b"\x0f\x40\x77", None),  # an expression longer than the program
])
def test_bad_programs_raise(program: bytes, limits: CfiLimits | None) -> None:
    with pytest.raises(CfiError):
        _rows(program, limits=limits)


def test_truncated_operand_raises_index_error() -> None:
    with pytest.raises(IndexError):
        _rows(b"\x0c\x07")


# --- sections ----------------------------------------------------------------

def _eh_cie(instr: bytes = GCC_CIE, aug: bytes = b"zR", enc: int = 0x1B) -> bytes:
    aug_data = bytes([enc]) if aug == b"zR" else b""
    body = (b"\x00\x00\x00\x00\x01" + aug + b"\x00\x01\x78\x10"
            + (bytes([len(aug_data)]) + aug_data if aug.startswith(b"z") else b"") + instr)
    return struct.pack("<I", len(body)) + body


def _eh_fde(at: int, cie_at: int, start: int, size: int, instr: bytes, vaddr: int) -> bytes:
    pc = start - (vaddr + at + 8)  # pcrel sdata4, relative to the pc field at at+8
    body = struct.pack("<Iii", at + 4 - cie_at, pc, size) + b"\x00" + instr
    return struct.pack("<I", len(body)) + body


def _section(*fdes: tuple[int, int, bytes], vaddr: int = 0x2000) -> bytes:
    data = _eh_cie()
    for start, size, instr in fdes:
        data += _eh_fde(len(data), 0, start, size, instr, vaddr)
    return data + b"\x00\x00\x00\x00"


def _entries(data: bytes, *, eh: bool = True, limits: CfiLimits | None = None,
             vaddr: int = 0x2000) -> tuple[list[tuple[int, int]], ParseStats]:
    stats = ParseStats()
    found = [(f.start, f.size) for f, _ in iter_entries(data, Bases(vaddr), eh=eh,
                                                         limits=limits or CfiLimits(), stats=stats)]
    return found, stats


def test_eh_frame_entries_with_pcrel_addresses() -> None:
    found, stats = _entries(_section((0x1000, 0x20, b""), (0x1020, 0x10, b"\x41\x0e\x10")))
    assert found == [(0x1000, 0x20), (0x1020, 0x10)]
    assert (stats.cies, stats.fdes, stats.bad_entries) == (1, 2, {})


def test_hostile_sections_are_bounded() -> None:
    good = _section((0x1000, 0x20, b""))
    # A length running past the section ends the walk, counted.
    bad_len = good[:-4] + struct.pack("<I", 0x7FFFFFF0) + b"\x00" * 8
    found, stats = _entries(bad_len)
    assert found == [(0x1000, 0x20)] and stats.bad_entries == {"length": 1}
    # A 64-bit length claiming exabytes.
    found, stats = _entries(good[:-4] + b"\xff\xff\xff\xff" + struct.pack("<Q", 1 << 60) + b"\x00" * 8)
    assert stats.bad_entries == {"length": 1}
    # An FDE whose CIE pointer points at itself (an FDE), then one pointing outside the section.
    cie = _eh_cie()
    self_ptr = struct.pack("<I", 13) + struct.pack("<I", 4) + struct.pack("<ii", 0, 0x10) + b"\x00"
    outside = struct.pack("<I", 13) + struct.pack("<I", 0x7FFFFFFF) + struct.pack("<ii", 0, 0x10) + b"\x00"
    found, stats = _entries(cie + self_ptr + outside)
    assert found == [] and sum(stats.bad_entries.values()) == 2
    # A CIE with an unknown augmentation, and an FDE of it.
    weird = _eh_cie(aug=b"eh")
    found, stats = _entries(weird + _eh_fde(len(weird), 0, 0x1000, 0x10, b"", 0x2000))
    assert found == [] and stats.bad_entries == {"format": 1, "fde_of_bad_cie": 1}


def test_entry_cap_stops_a_huge_section_quickly() -> None:
    data = _section(*[(0x1000 + 16 * i, 16, b"") for i in range(5000)])
    t0 = time.perf_counter()
    found, stats = _entries(data, limits=CfiLimits(max_entries=100))
    assert len(found) == 99 and stats.truncated
    assert time.perf_counter() - t0 < 1.0


def test_debug_frame_absolute_addresses_and_late_cie() -> None:
    # .debug_frame: CIE id 0xffffffff, version 4 (address and segment sizes),
    # FDE CIE pointers are section offsets, and a CIE may follow its FDEs.
    cie_body = b"\xff\xff\xff\xff\x04\x00\x08\x00\x01\x78\x10" + GCC_CIE
    fde_body = struct.pack("<IQQ", 28, 0x401000, 0x40) + b"\x41\x0e\x10\x00"  # nop: 28 bytes in all
    fde = struct.pack("<I", len(fde_body)) + fde_body
    data = fde + struct.pack("<I", len(cie_body)) + cie_body
    found, stats = _entries(data, eh=False)
    assert found == [(0x401000, 0x40)] and stats.bad_entries == {}


# --- files and tables --------------------------------------------------------

def _readelf_rows(path: str) -> Iterator[tuple[int, str, str, str]]:
    """(pc, cfa, rbp, ra) of every row readelf's interpreter prints."""
    # readelf exits 1 over an unrelated complaint (no program interpreter): read its output.
    out = subprocess.run(["readelf", "--debug-dump=frames-interp", path], capture_output=True,
                         text=True).stdout
    cols: list[str] = []
    in_fde = False
    for line in out.splitlines():
        parts = line.split()
        if len(parts) > 3 and parts[3] in ("FDE", "CIE"):
            in_fde = parts[3] == "FDE"  # a CIE's own rows are at pc 0
        elif parts[:2] == ["LOC", "CFA"] and in_fde:
            cols = parts
        elif cols and len(parts) == len(cols) and re.fullmatch(r"[0-9a-f]{16}", parts[0]):
            row = dict(zip(cols, parts, strict=True))
            yield int(parts[0], 16), row["CFA"], row.get("rbp", "u"), row.get("ra", "u")
        elif not line.strip():
            cols = []


REG_NAMES = ["rax", "rdx", "rcx", "rbx", "rsi", "rdi", "rbp", "rsp", *[f"r{i}" for i in range(8, 16)], "rip"]


def _as_readelf(rule: Rule | None) -> tuple[str, str, str]:
    """A rule as readelf prints it: CFA, rbp and ra columns ("u": no rule or undefined)."""
    assert rule is not None
    cfa = (f"{REG_NAMES[rule.cfa_reg]}+{rule.cfa_off}"
           if rule.cfa in (CfaKind.RSP, CfaKind.RBP, CfaKind.REG) else "exp")

    def reg(kind: RegKind, r: int, off: int) -> str:
        if kind == RegKind.REGISTER:
            return REG_NAMES[r]
        return {RegKind.OFFSET: f"c{off:+d}", RegKind.VAL_OFFSET: f"v{off:+d}", RegKind.SAME: "u",
                RegKind.UNDEFINED: "u", RegKind.AT_REG: "exp"}.get(kind, "?")
    return cfa, reg(rule.bp, rule.bp_reg, rule.bp_off), reg(rule.ra, rule.ra_reg, rule.ra_off)


@pytest.mark.skipif(shutil.which("readelf") is None, reason="binutils' readelf is not installed")
def test_libc_table_matches_readelf_row_for_row() -> None:
    table = build_table(LIBC)
    n = 0
    for pc, cfa, rbp, ra in _readelf_rows(LIBC):
        got = _as_readelf(table.rule_at(pc))
        want = (cfa, "u" if rbp == "s" else rbp, ra)
        assert got == want, f"{pc:#x}: {got} != readelf's {want}"
        n += 1
    assert n > 20000 and table.stats.fdes == table.stats.hdr_fdes and not table.stats.bad_entries


@pytest.mark.parametrize("path", [LIBC, PYTHON])
@pytest.mark.parametrize("in_file", [False, True], ids=["held", "read-from-file"])
def test_lazy_table_agrees_with_the_full_table(path: str, in_file: bool) -> None:
    full = build_table(path)
    lazy = load_table(path, in_file_from=0 if in_file else 1 << 30)
    assert isinstance(lazy, LazyTable) and lazy.holds_file == in_file
    try:
        for pc, _ in full.rows():
            for probe in (pc, pc + 1):
                assert lazy.rule_at(probe) == full.rule_at(probe), f"{path} at {probe:#x}"
        assert lazy.rule_at(0) is None and not lazy.errors
    finally:
        lazy.close()
    assert not lazy.holds_file


def test_a_table_whose_file_shrinks_counts_reads_that_fail(tmp_path: Path) -> None:
    copy = tmp_path / "python3"
    shutil.copy(PYTHON, copy)
    full = build_table(str(copy))
    pcs = [pc for pc, rule in full.rows() if rule is not None]
    early, late = pcs[: len(pcs) // 10], pcs[-len(pcs) // 10:]
    table = load_table(str(copy), in_file_from=0)
    assert isinstance(table, LazyTable) and table.holds_file
    try:
        met = {pc: table.rule_at(pc) for pc in early}
        with open(copy, "r+b") as f:  # the file's owner cuts it short under offtop
            f.truncate(os.path.getsize(copy) // 2)
        assert [table.rule_at(pc) for pc in early] == list(met.values())  # met before: kept
        assert all(table.rule_at(pc) is None for pc in late)  # .eh_frame is past the cut
        assert table.errors.get("read", 0) > 0
    finally:
        table.close()
    assert all(table.rule_at(pc) is None for pc in late[:50])  # closed: failures, no reads


def test_a_table_reading_its_file_reads_only_the_fdes_it_meets(
        monkeypatch: pytest.MonkeyPatch) -> None:
    path = os.path.realpath(sys.executable)
    reads: list[int] = []
    inner = SectionInFile.read

    def counted(self: SectionInFile, at: int, n: int) -> bytes:
        reads.append(n)
        return inner(self, at, n)

    monkeypatch.setattr(SectionInFile, "read", counted)
    table = load_table(path, in_file_from=0)
    assert isinstance(table, LazyTable) and not reads
    try:
        full = build_table(path)
        pcs = [pc for pc, rule in full.rows() if rule is not None][::997]
        assert all(table.rule_at(pc) == full.rule_at(pc) for pc in pcs)
    finally:
        table.close()
    # An FDE's header, then the FDE; its CIE's the same way, once: a few hundred
    # bytes per FDE met, never the section.
    assert 0 < len(reads) <= 4 * len(pcs) + 8 and max(reads) < 4096, (len(reads), max(reads))


def test_file_without_section_headers_is_found_through_pt_gnu_eh_frame(tmp_path: Path) -> None:
    data = bytearray(Path("/usr/bin/sleep").read_bytes())
    struct.pack_into("<Q", data, 0x28, 0)  # e_shoff
    struct.pack_into("<HH", data, 0x3C, 0, 0)  # e_shnum, e_shstrndx
    bare = tmp_path / "bare"
    bare.write_bytes(bytes(data))
    orig = build_table("/usr/bin/sleep")
    for table in (build_table(str(bare)), load_table(str(bare))):
        assert table.stats.hdr_fdes == orig.stats.hdr_fdes
        for pc, rule in orig.rows():
            assert table.rule_at(pc) == rule, hex(pc)


def _mutated_copies(src: str, tmp: Path, count: int, seed: int) -> Iterator[Path]:
    data = Path(src).read_bytes()
    out = subprocess.run(["readelf", "-SW", src], capture_output=True, text=True).stdout
    spans = []
    for m in re.finditer(r"\.(eh_frame(?:_hdr)?)\s+\S+\s+[0-9a-f]+\s+([0-9a-f]+)\s+([0-9a-f]+)", out):
        spans.append((int(m.group(2), 16), int(m.group(3), 16)))
    spans.append((0, 64 + 56 * 13))  # the ELF and program headers
    rng = random.Random(seed)
    for i in range(count):
        buf = bytearray(data)
        for _ in range(rng.choice((1, 4, 32))):
            off, size = rng.choice(spans)
            buf[off + rng.randrange(size)] = rng.choice((0, 0xFF, 0x7F, 0x80, rng.randrange(256)))
        if i % 10 == 9:
            buf = buf[: rng.randrange(len(buf))]
        p = tmp / f"m{i}"
        p.write_bytes(bytes(buf))
        yield p


@pytest.mark.skipif(shutil.which("readelf") is None, reason="binutils' readelf is not installed")
def test_mutated_files_never_crash_or_hang(tmp_path: Path) -> None:
    t0 = time.perf_counter()
    loaded = 0
    read_from_file = functools.partial(load_table, in_file_from=0)
    for p in _mutated_copies("/usr/bin/sleep", tmp_path, 150, seed=13):
        for load in (build_table, load_table, read_from_file):
            try:
                table = load(str(p))
            except (ElfFormatError, OSError):
                continue
            loaded += 1
            for vaddr in range(0x2000, 0x8000, 0x40):
                table.rule_at(vaddr)
    assert loaded > 100  # most mutations leave a readable file: the parser did run on them
    assert time.perf_counter() - t0 < 60


def test_a_fifo_or_device_mapped_by_a_process_is_refused_without_blocking(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)  # opened for reading, a FIFO waits for a writer: forever
    results: list[object] = []

    def attempt() -> None:
        for path in (str(fifo), "/dev/null"):
            try:
                ElfFile(path)
            except OSError as e:
                results.append(e)
        results.append(TableCache().get(str(fifo)))

    worker = threading.Thread(target=attempt, daemon=True)
    worker.start()
    worker.join(10)
    if worker.is_alive():
        with open(fifo, "wb"):  # let the blocked open return, so the test ends
            pass
        pytest.fail("opening a FIFO as an ELF file blocked")
    assert [type(r) for r in results] == [OSError, OSError, type(None)]
    assert all("not a regular file" in str(e) for e in results[:2])


def test_table_cache_shares_by_build_id_and_remembers_failures(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    shutil.copy("/usr/bin/sleep", a)
    shutil.copy("/usr/bin/sleep", b)
    (tmp_path / "junk").write_bytes(b"not an ELF file at all")
    cache = TableCache()
    ta, tb = cache.get(str(a)), cache.get(str(b))
    assert ta is not None and ta is tb and cache.builds == 1
    assert cache.get(str(tmp_path / "junk")) is None and cache.get(str(tmp_path / "junk")) is None
    assert cache.failures == {"not_elf": 1}
    small = TableCache(max_files=1)
    small.get(str(a))
    small.get(str(tmp_path / "junk"))
    assert len(small) == 1


def test_table_cache_is_bounded_by_the_bytes_its_tables_hold(tmp_path: Path) -> None:
    paths = []
    for name in ("sleep", "true", "env"):  # three build-ids: no table shared
        paths.append(str(tmp_path / name))
        shutil.copy(f"/usr/bin/{name}", paths[-1])

    class Sized:
        def __init__(self, path: str, nbytes: int) -> None:
            with ElfFile(path) as elf:
                self.build_id = elf.build_id()  # as a real table's
            self.stats = TableStats(nbytes=nbytes)

        holds_file = False
        lookups = 0

        def __len__(self) -> int:
            return 1  # a row: as few as can be, so only the bytes can bound the cache

    sizes = {paths[0]: 6 << 20, paths[1]: 6 << 20, paths[2]: 20 << 20}
    cache = TableCache(max_bytes=16 << 20, builder=lambda path, **_: Sized(path, sizes[path]))
    a, b = cache.get(paths[0]), cache.get(paths[1])
    assert len(cache) == 2 and cache.nbytes == 12 << 20
    assert cache.get(paths[0]) is a  # used again: b is now the least recently used
    c = cache.get(paths[2])  # over the bound alone: kept, being the newest; the rest go
    assert c is not None and len(cache) == 1 and cache.nbytes == 20 << 20
    assert cache.get(paths[2]) is c and cache.builds == 3
    assert cache.get(paths[1]) is not b and cache.builds == 4


def _open_fds() -> set[str]:
    return {os.readlink(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd")
            if os.path.exists(f"/proc/self/fd/{fd}")}


def test_table_cache_lets_files_go_when_evicted_or_idle(tmp_path: Path) -> None:
    paths = []
    for name in ("sleep", "true", "env"):  # three build-ids: no table shared
        paths.append(str(tmp_path / name))
        shutil.copy(f"/usr/bin/{name}", paths[-1])
    now = [1000.0]
    cache = TableCache(builder=functools.partial(load_table, in_file_from=0),
                       max_bytes=2 * OPEN_FILE_NBYTES + (64 << 10), clock=lambda: now[0])
    a = cache.get(paths[0])
    b = cache.get(paths[1])
    assert a is not None and b is not None and a.holds_file and b.holds_file
    assert {paths[0], paths[1]} <= _open_fds()
    now[0] += 20
    c = cache.get(paths[2])  # over the bound: the least recently used goes
    assert c is not None and len(cache) == 2
    assert a.holds_file and a.rule_at(0x4000) is not None  # whole for whoever still holds it
    del a
    gc.collect()
    assert paths[0] not in _open_fds()  # closed once nothing holds it
    now[0] += 15  # b unused for 35 s, c for 15
    assert cache.forget_idle(30) == 1 and len(cache) == 1
    del b
    gc.collect()
    assert paths[1] not in _open_fds() and paths[2] in _open_fds()
    for _ in range(3):  # c in use through a holder (a walk), never through the cache
        now[0] += 20
        c.rule_at(0x4000)
        assert cache.forget_idle(30) == 0
    now[0] += 31
    assert cache.forget_idle(30) == 1 and len(cache) == 0
    del c
    gc.collect()
    assert not _open_fds() & set(paths)


@pytest.mark.parametrize("in_file", [False, True], ids=["held", "read-from-file"])
def test_a_lazy_table_holds_what_it_counts_and_its_index_once(in_file: bool) -> None:
    path = os.path.realpath(sys.executable)  # python3.11: ~10,000 FDEs
    with ElfFile(path) as elf:
        eh = find_eh_frame(elf)
    assert eh is not None and eh.hdr is not None
    gc.collect()
    tracemalloc.start()
    try:
        table = load_table(path, in_file_from=0 if in_file else 1 << 30)
        held = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert isinstance(table, LazyTable) and table.holds_file == in_file
    table.close()
    # The cache's bound (TableCache) is only as good as this count.
    assert held <= table.stats.nbytes * 1.1 + (64 << 10), (held, table.stats.nbytes)
    # .eh_frame_hdr's search table is kept as the index alone, not also as bytes.
    assert table.stats.nbytes < len(eh.data) + len(eh.hdr), (table.stats.nbytes, len(eh.data))
    if in_file:
        # The index (8 bytes an FDE), not .eh_frame: python3.11's is 80 kB, its
        # .eh_frame 400 kB (libLLVM's 0.8 and 5.5 MB).
        assert held <= len(eh.hdr) + (64 << 10), (held, len(eh.hdr))
        assert held < len(eh.data) / 3, (held, len(eh.data))


def test_maps_handles_have_no_leading_zeros(tmp_path: Path) -> None:
    text = ("00400000-0041f000 r--p 00000000 fe:00 1 /usr/bin/python3.11\n"
            "0041f000-006d2000 r-xp 0001f000 fe:00 1 /usr/bin/python3.11\n"
            "7f00000-7f01000 r-xp 00000000 00:00 0 [vdso]\n"
            "7f10000-7f11000 r-xp 00002000 fe:00 13 /tmp/gone (deleted)\n"
            "garbage line\n")
    maps = parse_maps(text, 77, proc="/p")
    assert [(m.start, m.offset, m.path) for m in maps] == [
        (0x41F000, 0x1F000, "/usr/bin/python3.11"), (0x7F10000, 0x2000, "/tmp/gone (deleted)")]
    assert maps[0].handle == "/p/77/map_files/41f000-6d2000"


def test_syscall_file_formats() -> None:
    r = parse_syscall("230 0x0 0x0 0x7ffc4 0x0 0x0 0x64 0x7ffc0 0x7f1234\n")
    assert r is not None and (r.nr, r.sp, r.pc) == (230, 0x7FFC0, 0x7F1234)
    assert r.leaf_registers() == {5: 0, 4: 0, 1: 0x7FFC4, 10: 0, 8: 0, 9: 0x64}
    blocked = parse_syscall("-1 0x7ffd 0x4005")
    assert blocked is not None
    assert (blocked.nr, blocked.args, blocked.sp, blocked.pc) == (-1, (), 0x7FFD, 0x4005)
    assert parse_syscall("running\n") is None
    assert parse_syscall("1 2 3") is None and parse_syscall("x " * 9) is None


def test_stack_reader_reads_words_across_pages_and_counts_failures() -> None:
    buf = ctypes.create_string_buffer(3 * PAGE)
    base = ctypes.addressof(buf)
    straddle = (base + PAGE) & ~(PAGE - 1)
    struct.pack_into("<Q", buf, straddle - base - 4, 0x1122334455667788)
    # Clear of the straddling word: at offset 8, it overlapped it whenever the
    # buffer began 16 bytes before a page boundary (1 run in ~256 failed).
    plain = straddle - base + 64
    struct.pack_into("<Q", buf, plain, 0xDEADBEEF)
    r = StackReader(os.getpid(), max_pages=8)
    assert r.u64(base + plain) == 0xDEADBEEF
    assert r.u64(straddle - 4) == 0x1122334455667788
    assert r.u64(8) is None and r.failures == {"EFAULT": 1}
    tiny = StackReader(os.getpid(), max_pages=1)
    tiny.u64(base)
    assert tiny.u64(base + 2 * PAGE) is None and tiny.failures == {"page_budget": 1}


# --- the walk, on a fake process ---------------------------------------------

def _rule(cfa: CfaKind = CfaKind.RSP, off: int = 16, *, ra: RegKind = RegKind.OFFSET, ra_reg: int = 0,
          bp: RegKind = RegKind.SAME, bp_off: int = 0, reg: int = 7, arg: int = 0) -> Rule:
    return Rule(cfa, reg, off, arg, ra, ra_reg, -8, bp, 0, bp_off)


class FakeTable:
    """Rules by [start, end) of ELF vaddr; the file is mapped with vaddr == address."""

    def __init__(self, spans: list[tuple[int, int, Rule]]) -> None:
        self.spans = spans
        self.build_id: bytes | None = None
        self.stats = TableStats()

    def __len__(self) -> int:
        return len(self.spans)

    def rule_at(self, vaddr: int) -> Rule | None:
        return next((r for s, e, r in self.spans if s <= vaddr < e), None)

    def vaddr_of(self, file_offset: int) -> int | None:
        return file_offset + 0x400000

    holds_file = False
    lookups = 0


class FakeTables:
    def __init__(self, table: FileTable | None) -> None:
        self.table = table

    def get(self, path: str, expect: tuple[int, int] | None = None) -> FileTable | None:
        return self.table


class FakeMemory:
    def __init__(self, words: dict[int, int]) -> None:
        self.words = words
        self.failures: dict[str, int] = {}

    def u64(self, addr: int) -> int | None:
        return self.words.get(addr)


MAPS = [ExecMapping(0x400000, 0x500000, 0, "/bin/fake", "fake")]
END = _rule(ra=RegKind.UNDEFINED)  # _start: the outermost frame


def _walker(spans: list[tuple[int, int, Rule]], words: dict[int, int], **kw: object) -> Unwinder:
    return Unwinder(FakeTables(FakeTable(spans)), maps=lambda pid: MAPS,
                    memory=lambda pid, lim: FakeMemory(words), **kw)  # type: ignore[arg-type]


def _counting_rules(looked: list[str]) -> Unwinder:
    """An unwinder with one rule at 0x401000-0x401100 whose table lookups (a stat()
    of the file each) are appended to `looked`."""
    table = FakeTable([(0x401000, 0x401100, _rule(off=16))])

    class Counting(FakeTables):
        def get(self, path: str, expect: tuple[int, int] | None = None) -> FileTable | None:
            looked.append(path)
            return super().get(path)

    return Unwinder(Counting(table))  # type: ignore[arg-type]


def test_rule_lookups_find_a_files_table_once_per_mapping_while_the_mappings_hold() -> None:
    """The repair asks a rule for every new pc of a process; each table lookup stats
    the file. With the same mappings passed (the symbolizer's list), once per
    mapping; new mappings (read again, or another process) look again."""
    looked: list[str] = []
    u = _counting_rules(looked)
    maps = list(MAPS)
    for pc in (0x401010, 0x401020, 0x401030):
        assert u.rule_for(1, pc, exact=True, maps=maps) == _rule(off=16)
    assert looked == ["fake"]
    u.rule_for(2, 0x401010, exact=True, maps=maps)  # another process
    u.rule_for(1, 0x401010, exact=True, maps=list(MAPS))  # process 1's mappings read again
    assert looked == ["fake"] * 3


def test_rule_walks_of_processes_gone_are_dropped() -> None:
    """One rule walk per process (with its mappings) was bounded by a count alone:
    under churn it held mostly processes gone. `forget_gone` drops those."""
    looked: list[str] = []
    u = _counting_rules(looked)
    maps = list(MAPS)
    for pid in (1, 2):
        assert u.rule_for(pid, 0x401010, exact=True, maps=maps) == _rule(off=16)
    alive = {1: 100}
    assert u.forget_gone(alive.get) == 1 and u.forget_gone(alive.get) == 0
    u.rule_for(1, 0x401020, exact=True, maps=maps)  # kept: no lookup again
    assert looked == ["fake", "fake"]
    u.rule_for(2, 0x401020, exact=True, maps=maps)  # dropped: looked up afresh
    assert looked == ["fake"] * 3


def test_walk_to_the_outermost_frame_looking_callers_up_at_ra_minus_1() -> None:
    # The caller's return address 0x402010 is the first byte of the next
    # function (a call to a noreturn function ends the caller): looked up at
    # ra - 1 it is the caller's rule, not END's.
    spans = [(0x401000, 0x401100, _rule(off=16)), (0x402000, 0x402010, _rule(off=32)),
             (0x402010, 0x402100, END), (0x403000, 0x403100, END)]
    words = {0x7000 + 8: 0x402010, 0x7000 + 16 + 24: 0x403005}
    u = _walker(spans, words)
    r = u.unwind(1, 1, pc=0x401050, sp=0x7000)
    assert r.addresses == (0x401050, 0x402010, 0x403005) and r.stop_reason == StopReason.OUTERMOST
    assert r.complete and u.stops == {"outermost": 1} and u.frames == 3


def test_rbp_based_frames_need_a_known_rbp() -> None:
    spans = [(0x401000, 0x401100, _rule(off=16)), (0x402000, 0x402100, _rule(CfaKind.RBP, 16, reg=6)),
             (0x403000, 0x403100, END)]
    words = {0x7008: 0x402005, 0x9000: 0x403005}  # rbp 0x8ff8: cfa 0x9008, ra at cfa - 8
    r = _walker(spans, words).unwind(1, 1, pc=0x401050, sp=0x7000)
    assert r.addresses == (0x401050, 0x402005) and r.stop_reason == StopReason.RBP_UNKNOWN
    r = _walker(spans, words).unwind(1, 1, pc=0x401050, sp=0x7000, bp=0x8FF8)
    assert r.addresses == (0x401050, 0x402005, 0x403005) and r.complete
    # rbp recovered from where the first frame saved it (cfa - 16)
    spans[0] = (0x401000, 0x401100, _rule(off=16, bp=RegKind.OFFSET, bp_off=-16))
    words[0x7000] = 0x8FF8
    r = _walker(spans, words).unwind(1, 1, pc=0x401050, sp=0x7000)
    assert r.addresses == (0x401050, 0x402005, 0x403005) and r.complete


@pytest.mark.parametrize("spans, words, reason, addrs", [
    ([(0x401000, 0x401100, _rule())], {0x7008: 0x900000}, StopReason.RA_UNMAPPED, (0x401050,)),
    ([(0x401000, 0x401100, _rule())], {}, StopReason.STACK_READ, (0x401050,)),
    ([(0x401000, 0x401100, _rule(off=0))], {}, StopReason.SP_NOT_GROWING, (0x401050,)),
    ([], {}, StopReason.NO_CFI, (0x401050,)),
    ([(0x401000, 0x401100, _rule(CfaKind.UNSUPPORTED))], {}, StopReason.UNSUPPORTED_RULE, (0x401050,)),
    ([(0x401000, 0x401100, _rule(CfaKind.REG, reg=10))], {}, StopReason.REGISTER_UNKNOWN, (0x401050,)),
    ([(0x401000, 0x401100, _rule(ra=RegKind.SAME))], {}, StopReason.UNSUPPORTED_RULE, (0x401050,)),
    ([(0x401000, 0x401100, _rule(ra=RegKind.REGISTER, ra_reg=5))], {}, StopReason.REGISTER_UNKNOWN,
     (0x401050,)),
])
def test_untrusted_steps_stop_the_walk_with_their_reason(
        spans: list[tuple[int, int, Rule]], words: dict[int, int], reason: StopReason,
        addrs: tuple[int, ...]) -> None:
    u = _walker(spans, words)
    r = u.unwind(1, 1, pc=0x401050, sp=0x7000)
    assert (r.addresses, r.stop_reason) == (addrs, reason) and not r.complete
    assert u.stops == {reason: 1}


def test_first_frame_registers_plt_and_deref_rules() -> None:
    # __vfork: the return address is in rdi (DWARF 5), which the syscall file gives.
    vfork = [(0x401000, 0x401100, _rule(off=8, ra=RegKind.REGISTER, ra_reg=5)), (0x402000, 0x402100, END)]
    r = _walker(vfork, {}).unwind(1, 1, pc=0x401050, sp=0x7000, regs={5: 0x402005})
    assert r.addresses == (0x401050, 0x402005) and r.complete
    # PLT: past the push (pc & 15 >= 11) the CFA is 8 further.
    plt = [(0x401000, 0x401100, _rule(CfaKind.PLT, 8, arg=11)), (0x402000, 0x402100, END)]
    r = _walker(plt, {0x7000: 0x402005}).unwind(1, 1, pc=0x40100B, sp=0x7000 - 8)
    assert r.addresses == (0x40100B, 0x402005) and r.complete
    # A realigned frame: CFA = *(rsp + 16).
    deref = [(0x401000, 0x401100, _rule(CfaKind.DEREF, 16, reg=7)), (0x402000, 0x402100, END)]
    r = _walker(deref, {0x7010: 0x7100, 0x70F8: 0x402005}).unwind(1, 1, pc=0x401050, sp=0x7000)
    assert r.addresses == (0x401050, 0x402005) and r.complete


def test_first_pc_outside_mappings_gives_nothing() -> None:
    r = _walker([], {}).unwind(1, 1, pc=0x10, sp=0x7000)
    assert r.addresses == () and r.stop_reason == StopReason.PC_UNMAPPED


def test_frame_and_time_limits() -> None:
    loop = [(0x401000, 0x401100, _rule(off=16))]
    words = {0x7000 + 16 * i + 8: 0x401005 for i in range(1000)}
    r = _walker(loop, words, limits=UnwindLimits(max_frames=10)).unwind(1, 1, pc=0x401005, sp=0x7000)
    assert len(r.addresses) == 10 and r.stop_reason == StopReason.MAX_FRAMES
    ticks = iter(range(0, 10**6, 1))
    r = _walker(loop, words, limits=UnwindLimits(time_budget_s=3.5),
                clock=lambda: float(next(ticks))).unwind(1, 1, pc=0x401005, sp=0x7000)
    assert r.stop_reason == StopReason.TIME_BUDGET and len(r.addresses) < 10


# --- real blocked processes --------------------------------------------------

BLOCKING = {0, 7, 23, 35, 61, 202, 230, 232, 270, 271}  # read poll select nanosleep wait4 futex ...


def _state(pid: int, tid: int) -> str:
    try:
        with open(f"/proc/{pid}/task/{tid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "?"


@contextlib.contextmanager
def blocked(cmd: list[str], *, ready_line: bool = False,
            stdin: int | None = None) -> Iterator[tuple[int, int]]:
    """Run `cmd` and yield (pid, tid) once that thread sleeps in a blocking system call."""
    p = subprocess.Popen(cmd, stdin=stdin, stdout=subprocess.PIPE if ready_line else subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL, text=True)
    try:
        pid = tid = p.pid
        if ready_line:
            assert p.stdout is not None
            m = re.search(r"pid=(\d+) tid=(\d+)", p.stdout.readline())
            assert m, "the workload did not start"
            pid, tid = int(m.group(1)), int(m.group(2))
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            r = read_syscall_regs(pid, tid)
            if r is not None and r.nr in BLOCKING and _state(pid, tid) == "S":
                break
            time.sleep(0.02)
        else:
            pytest.fail(f"{cmd[0]} never blocked")
        time.sleep(0.05)
        yield pid, tid
    finally:
        p.kill()
        p.wait()


@pytest.fixture(scope="module")
def nofp_bin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """unwind_nofp built -O2 -fomit-frame-pointer (symbols kept, for the names)."""
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        pytest.fail("no C compiler: run the README's test command (it installs gcc)")
    out = tmp_path_factory.mktemp("unwind") / "unwind_nofp"
    subprocess.run([cc, "-O2", "-fomit-frame-pointer", "-g", "-pthread", "-o", str(out), str(NOFP_SRC)],
                   check=True)
    return out


def _names(pid: int, addrs: tuple[int, ...]) -> list[str]:
    """Function names of a walked stack, callers looked up at return address - 1."""
    from offtop.elf import load_elf

    maps = read_exec_maps(pid)
    files: dict[str, object] = {}
    out = []
    for i, a in enumerate(addrs):
        q = a - 1 if i else a
        m = next((m for m in maps if m.start <= q < m.end), None)
        assert m is not None
        syms = files.get(m.path) or files.setdefault(m.path, load_elf(m.handle))
        vaddr = syms.vaddr_of(q - m.start + m.offset)  # type: ignore[attr-defined]
        name = syms.lookup(vaddr) if vaddr is not None else None  # type: ignore[attr-defined]
        out.append(name or f"{os.path.basename(m.path)}+{q - m.start + m.offset:#x}")
    return out


def _libc_has_symtab() -> bool:
    from offtop.unwind.elffile import ElfFile
    from offtop.unwind.table import debug_file_path

    with ElfFile(LIBC) as elf:
        bid = elf.build_id()
    return bid is not None and os.path.exists(debug_file_path(bid))


@pytest.mark.parametrize("mode, chain", [
    ("read", ["read", "unwind_f3", "unwind_f2", "unwind_f1", "main"]),
    ("sleep", ["clock_nanosleep", "nanosleep", "unwind_f3", "unwind_f2", "unwind_f1", "main"]),
    ("deref", ["read", "unwind_f3", "unwind_f2", "unwind_f1", "unwind_deref", "main"]),
    ("vla", ["read", "unwind_f3", "unwind_f2", "unwind_f1", "unwind_vla", "main"]),
    ("thread", ["read", "unwind_f3", "unwind_f2", "unwind_f1", "thread_main"]),
])
def test_no_frame_pointer_program_unwinds_three_calls_deep(nofp_bin: Path, mode: str,
                                                           chain: list[str]) -> None:
    with blocked([str(nofp_bin), mode], ready_line=True) as (pid, tid):
        u = Unwinder()
        r = u.unwind_blocked(pid, tid)
        names = _names(pid, r.addresses)
    assert r.complete, (r.stop_reason, names)
    assert names[:len(chain)] == chain, names
    libc_frames = names[len(chain):]
    if _libc_has_symtab():  # libc6-dbg: libc's own local names
        start = ["start_thread", "clone3"] if mode == "thread" else [
            "__libc_start_call_main", "__libc_start_main", "_start"]
        assert libc_frames == start, names
    else:
        assert len(libc_frames) == (2 if mode == "thread" else 3), names
    assert u.stops == {"outermost": 1} and not u.read_failures


def _gdb_rbp(pid: int) -> int:
    out = subprocess.run(["gdb", "-p", str(pid), "-batch", "-nx", "-ex", "p/x $rbp"], capture_output=True,
                         text=True, timeout=120).stdout
    m = re.search(r"= (0x[0-9a-f]+)", out)
    assert m, out
    return int(m.group(1), 16)


@pytest.mark.skipif(shutil.which("gdb") is None, reason="gdb is not installed (Debian's gdb)")
@pytest.mark.skipif(os.geteuid() != 0, reason="gdb must attach to a process that is not its child: root")
def test_frame_pointer_code_stops_without_rbp_and_completes_with_it(tmp_path: Path) -> None:
    # With frame pointers, unwind_f3's CFA is rbp + 16; libc's read wrapper
    # does not save rbp, so the walk cannot know it: it must stop there, not guess.
    exe = tmp_path / "fp"
    subprocess.run(["gcc", "-O2", "-fno-omit-frame-pointer", "-g", "-pthread", "-o", str(exe), str(NOFP_SRC)],
                   check=True)
    with blocked([str(exe), "read"], ready_line=True) as (pid, tid):
        u = Unwinder()
        without = u.unwind_blocked(pid, tid)
        rbp = _gdb_rbp(pid)  # the thread's rbp (the BPF program can read it from pt_regs)
        deadline = time.monotonic() + 10
        while _state(pid, tid) != "S" and time.monotonic() < deadline:  # back in read() after gdb
            time.sleep(0.02)
        with_bp = u.unwind_blocked(pid, tid, bp=rbp)
        names = _names(pid, with_bp.addresses)
    assert without.stop_reason == StopReason.RBP_UNKNOWN and len(without.addresses) == 2
    assert with_bp.complete and with_bp.addresses[:2] == without.addresses
    assert names[:5] == ["read", "unwind_f3", "unwind_f2", "unwind_f1", "main"], names
    assert u.counters()["stop:rbp_unknown"] == 1


def test_debug_frame_from_the_file_and_from_a_build_id_debug_file(tmp_path: Path) -> None:
    # Built without unwind tables: its functions are described only in .debug_frame.
    exe = tmp_path / "df"
    subprocess.run(["gcc", "-O2", "-fomit-frame-pointer", "-fno-asynchronous-unwind-tables",
                    "-fno-unwind-tables", "-g", "-pthread", "-o", str(exe), str(NOFP_SRC)], check=True)
    assert ".debug_frame" in build_table(str(exe)).stats.sources
    with blocked([str(exe), "read"], ready_line=True) as (pid, tid):
        r = Unwinder().unwind_blocked(pid, tid)
        assert _names(pid, r.addresses)[1:5] == ["unwind_f3", "unwind_f2", "unwind_f1", "main"]
        assert r.complete
    # Stripped, its .debug_frame (compressed) moved to DEBUG_ROOT/.build-id/xx/yyyy.debug.
    debug = tmp_path / "df.debug"
    subprocess.run(["objcopy", "--only-keep-debug", "--compress-debug-sections=zlib", str(exe), str(debug)],
                   check=True)
    subprocess.run(["strip", "-g", str(exe)], check=True)
    bid = build_table(str(exe)).build_id
    assert bid is not None
    root = tmp_path / "debugroot"
    (root / ".build-id" / bid.hex()[:2]).mkdir(parents=True)
    shutil.move(debug, root / ".build-id" / bid.hex()[:2] / (bid.hex()[2:] + ".debug"))
    with blocked([str(exe), "read"], ready_line=True) as (pid, tid):
        without = Unwinder().unwind_blocked(pid, tid)
        with_debug = Unwinder(TableCache(debug_root=str(root))).unwind_blocked(pid, tid)
    assert without.stop_reason == StopReason.NO_CFI and len(without.addresses) == 2  # read, then f3: no rule
    assert with_debug.complete and with_debug.addresses[:2] == without.addresses


# --- against gdb -------------------------------------------------------------

def _gdb_frames(pid: int, tid: int) -> list[int | None]:
    """The frame pcs gdb's backtrace shows for thread `tid`, inline frames merged.

    gdb stops the process meanwhile: call it after offtop has read the stack.
    """
    out = subprocess.run(["gdb", "-p", str(pid), "-batch", "-nx",
                          "-ex", "set print frame-info location-and-address",
                          "-ex", "set backtrace past-main on",
                          "-ex", "thread apply all bt"], capture_output=True, text=True, timeout=120).stdout
    frames: dict[int, list[int | None]] = {}
    cur: int | None = None
    for line in out.splitlines():
        m = re.match(r"Thread \d+ \(.*LWP (\d+)\)", line)
        if m:
            cur = int(m.group(1))
            frames[cur] = []
            continue
        if re.match(r"#\d+\s+<signal handler called>", line) and cur is not None:
            frames[cur].append(None)  # gdb shows the signal trampoline without its pc
            continue
        m = re.match(r"#\d+\s+(0x[0-9a-f]+) in ", line)
        if m and cur is not None:
            pc = int(m.group(1), 16)
            # A function inlined into its caller is a frame of gdb's (from
            # .debug_info) at the caller's pc, not a frame on the stack.
            if not frames[cur] or frames[cur][-1] != pc:
                frames[cur].append(pc)
    return frames.get(tid, [])


GDB_CASES = {
    "sleep": (["/usr/bin/sleep", "1000"], None),
    "gzip": (["/usr/bin/gzip", "-c"], subprocess.PIPE),
    "dd": (["/usr/bin/dd", "of=/dev/null"], subprocess.PIPE),
    "tar": (["/usr/bin/tar", "-t", "-f", "-"], subprocess.PIPE),
    "python3": ([PYTHON, "-c", "import time; time.sleep(1000)"], None),
}


@pytest.mark.skipif(shutil.which("gdb") is None, reason="gdb is not installed (Debian's gdb)")
@pytest.mark.skipif(os.geteuid() != 0, reason="gdb must attach to a process that is not its child: root")
@pytest.mark.parametrize("name", [*GDB_CASES, "nofp-read", "nofp-deref", "nofp-thread", "nofp-signal"])
def test_same_frames_as_gdb(name: str, nofp_bin: Path) -> None:
    _same_frames_as_gdb(name, nofp_bin, Unwinder())


@pytest.mark.skipif(shutil.which("gdb") is None, reason="gdb is not installed (Debian's gdb)")
@pytest.mark.skipif(os.geteuid() != 0, reason="gdb must attach to a process that is not its child: root")
@pytest.mark.parametrize("name", ["python3", "gzip", "nofp-signal"])
def test_same_frames_as_gdb_with_tables_read_from_their_files(name: str, nofp_bin: Path) -> None:
    # Every table reads its FDEs from its file, as libLLVM's does (1 MB and more).
    tables = TableCache(builder=functools.partial(load_table, in_file_from=0))
    _same_frames_as_gdb(name, nofp_bin, Unwinder(tables))
    assert os.path.realpath(LIBC) in _open_fds()  # libc's table reads libc, held open


def _same_frames_as_gdb(name: str, nofp_bin: Path, unwinder: Unwinder) -> None:
    if name.startswith("nofp-"):
        ctx = blocked([str(nofp_bin), name.removeprefix("nofp-")], ready_line=True)
    else:
        cmd, stdin = GDB_CASES[name]
        if not os.path.exists(cmd[0]):
            pytest.skip(f"{cmd[0]} is not installed")
        ctx = blocked(cmd, stdin=stdin)
    with ctx as (pid, tid):
        r = unwinder.unwind_blocked(pid, tid)  # read first: gdb stops the target
        gdb = _gdb_frames(pid, tid)
    assert len(gdb) >= 4, "gdb showed no backtrace"
    ours = [a if g is not None else None for a, g in zip(r.addresses, gdb, strict=False)]
    assert ours == gdb and len(r.addresses) == len(gdb), \
        f"offtop {[hex(a) for a in r.addresses]} gdb {[g and hex(g) for g in gdb]}"
    assert r.complete


def test_debian_sleep_unwinds_to_main_and_libc_start_code() -> None:
    with blocked(["/usr/bin/sleep", "1000"]) as (pid, tid):
        r = Unwinder().unwind_blocked(pid, tid)
        names = _names(pid, r.addresses)
        maps = read_exec_maps(pid)
    modules = []
    for i, a in enumerate(r.addresses):
        m = next(m for m in maps if m.start <= (a - 1 if i else a) < m.end)
        modules.append(os.path.basename(m.path))
    assert r.complete, names
    # clock_nanosleep, nanosleep (libc); sleep's own frames down to main; libc's
    # start code, which calls main; _start (sleep) whose return address is undefined.
    assert modules[:2] == ["libc.so.6", "libc.so.6"]
    assert modules[-4:] == ["sleep", "libc.so.6", "libc.so.6", "sleep"]
    assert "sleep" in modules[2:-3]
    if _libc_has_symtab():
        assert names[-3:-1] == ["__libc_start_call_main", "__libc_start_main"], names


def test_a_copied_stack_serves_the_words_it_holds_and_none_outside() -> None:
    from offtop.unwind.memory import CopiedStack

    data = struct.pack("<4Q", 1, 2, 3, 4)
    mem = CopiedStack(0x7000, data)
    assert [mem.u64(0x7000 + 8 * i) for i in range(4)] == [1, 2, 3, 4]
    assert mem.u64(0x7004) == int.from_bytes(data[4:12], "little")
    assert mem.u64(0x6FF8) is None and mem.u64(0x7019) is None and mem.u64(0x7020) is None
    assert mem.failures == {}


def test_a_thread_found_running_is_not_walked_and_its_process_s_maps_are_not_read() -> None:
    """The maps of a process of thousands of threads are ~0.5 MB: they are asked for
    (once a pass, offtop.bpf.unwound) only when a thread is found blocked."""
    asked: list[int] = []

    def maps_of(pid: int) -> list[object]:
        asked.append(pid)
        return []

    spin = subprocess.Popen(["sh", "-c", "while :; do :; done"])  # no system call once looping
    try:
        deadline = time.monotonic() + 5
        while read_syscall_regs(spin.pid, spin.pid) is not None:  # still starting
            assert time.monotonic() < deadline
            time.sleep(0.01)
        r = Unwinder().unwind_blocked(spin.pid, spin.pid, maps_of=maps_of)
        assert r.stop_reason == StopReason.NOT_BLOCKED and asked == []
    finally:
        spin.kill()
        spin.wait()
    done = threading.Event()
    t = threading.Thread(target=done.wait)
    t.start()
    try:
        deadline = time.monotonic() + 5
        while read_syscall_regs(os.getpid(), t.native_id) is None:  # type: ignore[arg-type]
            assert time.monotonic() < deadline
            time.sleep(0.01)
        r = Unwinder().unwind_blocked(os.getpid(), t.native_id, maps_of=maps_of)  # type: ignore[arg-type]
        assert asked == [os.getpid()] and r.stop_reason != StopReason.NOT_BLOCKED
    finally:
        done.set()
        t.join()
