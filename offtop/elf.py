"""Function symbols of ELF files, for user-space stack addresses.

offtop reads symbol tables itself rather than through bcc's symcache: bcc
0.26 closes a random file descriptor whenever a symcache is created
(ModulePath's fd_ left uninitialized, fixed upstream in 0.33), which under
process churn closed offtop's own ring, map and stdout descriptors. Reading
ELF here also lets one parsed file serve every process that maps it.

Only what symbolization needs is parsed: PT_LOAD segments (file offset ->
virtual address), .symtab/.dynsym function symbols, and the GNU build-id
that names a detached debug file under /usr/lib/debug/.build-id.
"""

from __future__ import annotations

import bisect
import ctypes
import ctypes.util
import mmap
import os
import struct
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

DEBUG_ROOT = "/usr/lib/debug"

_EHDR = struct.Struct("<16sHHIQQQIHHHHHH")
_PHDR = struct.Struct("<IIQQQQQQ")
_SHDR = struct.Struct("<IIQQQQIIQQ")
_SYM = struct.Struct("<IBBHQQ")
_NOTE = struct.Struct("<III")

PT_LOAD = 1
SHT_SYMTAB = 2
SHT_NOTE = 7
SHT_DYNSYM = 11
STT_FUNC = 2
STT_GNU_IFUNC = 10
STB_LOCAL = 0
NT_GNU_BUILD_ID = 3


class ElfError(ValueError):
    """A file offtop cannot read symbols from (not ELF64 little-endian, truncated)."""


@dataclass(frozen=True, slots=True)
class Segment:
    """One PT_LOAD segment: where a file range lives in the ELF's address space."""

    offset: int
    vaddr: int
    filesz: int


def _preference(name: str, bind: int) -> tuple[int, int, int]:
    # Of several names at one address (clock_nanosleep, __clock_nanosleep,
    # __GI___clock_nanosleep), show the one a programmer would call.
    return (len(name) - len(name.lstrip("_")), bind == STB_LOCAL, len(name))


class ElfSymbols:
    """The function symbols and load segments of one ELF file."""

    def __init__(self, segments: list[Segment], symbols: list[tuple[int, int, str]],
                 build_id: bytes | None = None) -> None:
        self.segments = sorted(segments, key=lambda s: s.offset)
        symbols.sort()
        self._starts = [s[0] for s in symbols]
        self._ends = [s[0] + s[1] for s in symbols]
        self._names = [s[2] for s in symbols]
        self.build_id = build_id

    def __len__(self) -> int:
        return len(self._names)

    def vaddr_of(self, file_offset: int) -> int | None:
        """The virtual address a file offset is loaded at, if it is in a segment."""
        for s in self.segments:
            if s.offset <= file_offset < s.offset + s.filesz:
                return file_offset - s.offset + s.vaddr
        return None

    def lookup(self, vaddr: int) -> str | None:
        """The function containing `vaddr` (a sizeless symbol reaches the next one)."""
        i = bisect.bisect_right(self._starts, vaddr) - 1
        if i < 0:
            return None
        end = self._ends[i]
        if end > self._starts[i] and vaddr >= end:
            return None
        return self._names[i]


def _read_symbols(data: Any, shdrs: list[tuple[int, ...]], wanted: int) -> list[tuple[int, int, str, int]]:
    out = []
    for sh in shdrs:
        if sh[1] != wanted or sh[9] != _SYM.size or sh[6] >= len(shdrs):
            continue
        strtab = shdrs[sh[6]]
        str_off, str_end = strtab[4], strtab[4] + strtab[5]
        if sh[4] + sh[5] > len(data) or str_end > len(data):
            continue
        for name_off, info, _other, shndx, value, size in _SYM.iter_unpack(data[sh[4]: sh[4] + sh[5]]):
            typ = info & 0xF
            if (typ != STT_FUNC and typ != STT_GNU_IFUNC) or shndx == 0 or value == 0:
                continue
            start = str_off + name_off
            end = data.find(b"\0", start, str_end)
            if end < 0:
                continue
            out.append((value, size, data[start:end].decode("utf-8", "replace"), info >> 4))
    return out


def parse_elf(data: Any) -> tuple[list[Segment], list[tuple[int, int, str, int]], bytes | None]:
    """Segments, function symbols (value, size, name, bind) and build-id of ELF bytes."""
    if len(data) < _EHDR.size or data[:4] != b"\x7fELF":
        raise ElfError("not an ELF file")
    ident = data[:16]
    if ident[4] != 2 or ident[5] != 1:
        raise ElfError("not a 64-bit little-endian ELF file")
    (_, _, _, _, _, phoff, shoff, _, _, phentsize, phnum, shentsize, shnum,
     _shstrndx) = _EHDR.unpack_from(data, 0)
    segments = []
    if phentsize == _PHDR.size:
        for i in range(phnum):
            off = phoff + i * phentsize
            if off + _PHDR.size > len(data):
                break
            p = _PHDR.unpack_from(data, off)
            if p[0] == PT_LOAD:
                segments.append(Segment(offset=p[2], vaddr=p[3], filesz=p[5]))
    shdrs: list[tuple[int, ...]] = []
    if shentsize == _SHDR.size and shoff and shoff + shnum * shentsize <= len(data):
        shdrs = [_SHDR.unpack_from(data, shoff + i * shentsize) for i in range(shnum)]
    symbols = _read_symbols(data, shdrs, SHT_SYMTAB) or _read_symbols(data, shdrs, SHT_DYNSYM)
    build_id = None
    for sh in shdrs:
        if sh[1] != SHT_NOTE or sh[4] + sh[5] > len(data):
            continue
        pos, end = sh[4], sh[4] + sh[5]
        while pos + _NOTE.size <= end:
            namesz, descsz, typ = _NOTE.unpack_from(data, pos)
            name_at = pos + _NOTE.size
            desc_at = name_at + ((namesz + 3) & ~3)
            if typ == NT_GNU_BUILD_ID and data[name_at:name_at + 3] == b"GNU":
                build_id = bytes(data[desc_at: desc_at + descsz])
                break
            pos = desc_at + ((descsz + 3) & ~3)
        if build_id:
            break
    return segments, symbols, build_id


def _best_names(symbols: list[tuple[int, int, str, int]]) -> list[tuple[int, int, str]]:
    best: dict[int, tuple[int, str, tuple[int, int, int]]] = {}
    for value, size, name, bind in symbols:
        pref = _preference(name, bind)
        cur = best.get(value)
        if cur is None or pref < cur[2]:
            best[value] = (max(size, cur[0] if cur else 0), name, pref)
    return [(v, s, demangle(n)) for v, (s, n, _) in best.items()]


def load_elf(path: str, *, debug_root: str = DEBUG_ROOT) -> ElfSymbols:
    """Read an ELF file, taking .symtab from its detached debug file when it has one."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            raise ElfError("empty file")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            segments, symbols, build_id = parse_elf(data)
    has_symtab = any(bind == STB_LOCAL for *_, bind in symbols)
    if build_id and not has_symtab:
        hexid = build_id.hex()
        debug = os.path.join(debug_root, ".build-id", hexid[:2], hexid[2:] + ".debug")
        try:
            with open(debug, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
                _, dbg_symbols, dbg_id = parse_elf(data)
            if dbg_symbols and dbg_id in (None, build_id):
                symbols = dbg_symbols + symbols
        except (OSError, ValueError):
            pass
    return ElfSymbols(segments, _best_names(symbols), build_id)


class ElfCache:
    """Parsed files, shared by all processes, keyed by (device, inode, size, mtime)."""

    def __init__(self, max_files: int = 512) -> None:
        self._files: OrderedDict[tuple[int, int, int, int], ElfSymbols | None] = OrderedDict()
        self._max = max_files

    def __len__(self) -> int:
        return len(self._files)

    def get(self, path: str) -> ElfSymbols | None:
        """The symbols of the file at `path` (None if it is not readable ELF)."""
        try:
            st = os.stat(path)
        except OSError:
            return None
        key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        if key in self._files:
            self._files.move_to_end(key)
            return self._files[key]
        try:
            syms: ElfSymbols | None = load_elf(path)
        except (OSError, ValueError):
            syms = None
        self._files[key] = syms
        if len(self._files) > self._max:
            self._files.popitem(last=False)
        return syms


# --- C++ names ---------------------------------------------------------------

_demangler: Any = None
_libc: Any = None


def demangle(name: str) -> str:
    """A C++ symbol demangled by libstdc++ (the name itself when it is not C++)."""
    global _demangler, _libc
    if not name.startswith("_Z"):
        return name
    if _demangler is None:
        try:
            lib = ctypes.CDLL(ctypes.util.find_library("stdc++") or "libstdc++.so.6")
            fn = lib.__cxa_demangle
            fn.restype = ctypes.c_void_p
            fn.argtypes = [ctypes.c_char_p, ctypes.c_void_p, ctypes.c_void_p,
                           ctypes.POINTER(ctypes.c_int)]
            _libc = ctypes.CDLL(ctypes.util.find_library("c"))
            _libc.free.argtypes = [ctypes.c_void_p]
            _demangler = fn
        except (OSError, AttributeError):
            _demangler = False
    if not _demangler:
        return name
    status = ctypes.c_int(0)
    ptr = _demangler(name.encode(), None, None, ctypes.byref(status))
    if not ptr:
        return name
    try:
        if status.value != 0:
            return name
        return ctypes.string_at(ptr).decode("utf-8", "replace")
    finally:
        _libc.free(ptr)
