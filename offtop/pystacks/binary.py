"""Finding the interpreter in a process: which mapped ELF file defines `_PyRuntime`, and where.

CPython keeps all its global state in one exported object, `_PyRuntime`
(3.7 on), in the python executable when the interpreter is linked into it
(Debian's /usr/bin/python3.11) or in libpython when it is shared (pyenv,
most builds with --enable-shared). Both export it in .dynsym, so stripped
binaries still have it. Beside it a few more exported symbols are looked
up: `Py_Version` (3.11 on, the exact version) and the type objects whose
addresses tell a code object or a str from garbage.

Only the symbols named in `WANTED` are read, from a file opened through
/proc/PID/map_files (the very file the process mapped, even if replaced on
disk since), and each parsed file is shared by all processes that map it.
"""

from __future__ import annotations

import mmap
import os
import re
import struct
from collections import OrderedDict
from dataclasses import dataclass

from offtop.symbols import Mapping, read_maps

#: Exported symbols a reader needs.
WANTED = frozenset({
    "_PyRuntime", "Py_Version", "PyCode_Type", "PyUnicode_Type", "PyBytes_Type", "PyFrame_Type",
})

_EHDR = struct.Struct("<16sHHIQQQIHHHHHH")
_PHDR = struct.Struct("<IIQQQQQQ")
_SHDR = struct.Struct("<IIQQQQIIQQ")
_SYM = struct.Struct("<IBBHQQ")
_PT_LOAD = 1
_SHT_SYMTAB = 2
_SHT_DYNSYM = 11
#: A symbol table larger than this is not read (libpython's .symtab is ~1 MB).
_MAX_TABLE = 64 << 20

_VERSION_IN_NAME = re.compile(r"python(\d)\.(\d{1,2})")


@dataclass(frozen=True, slots=True)
class LoadSegment:
    """A PT_LOAD program header: file range and the address it is linked at."""

    offset: int
    vaddr: int
    filesz: int


@dataclass(frozen=True, slots=True)
class ElfInfo:
    """What a reader needs from one ELF file: its load segments and wanted symbols."""

    segments: tuple[LoadSegment, ...]
    symbols: dict[str, int]


@dataclass(frozen=True, slots=True)
class Interpreter:
    """Where the interpreter lives in one process: run-time addresses of its symbols."""

    path: str
    symbols: dict[str, int]
    name_version: tuple[int, int] | None
    """(major, minor) from the file's name (libpython3.9.so, python3.9), if it says."""


def parse_elf_symbols(data: bytes | mmap.mmap, wanted: frozenset[str] = WANTED) -> ElfInfo:
    """Load segments and the values of the `wanted` symbols of 64-bit little-endian ELF bytes.

    Raises ValueError for a file that is not such an ELF file or whose
    headers point outside it.
    """
    if len(data) < _EHDR.size or data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise ValueError("not a 64-bit little-endian ELF file")
    (_, _, _, _, _, phoff, shoff, _, _, phentsize, phnum, shentsize, shnum, _) = _EHDR.unpack_from(data, 0)
    segments = []
    if phentsize == _PHDR.size and phoff + phnum * _PHDR.size <= len(data):
        for i in range(phnum):
            p = _PHDR.unpack_from(data, phoff + i * _PHDR.size)
            if p[0] == _PT_LOAD:
                segments.append(LoadSegment(offset=p[2], vaddr=p[3], filesz=p[5]))
    shdrs: list[tuple[int, ...]] = []
    if shentsize == _SHDR.size and shoff and shoff + shnum * _SHDR.size <= len(data):
        shdrs = [_SHDR.unpack_from(data, shoff + i * _SHDR.size) for i in range(shnum)]
    found: dict[str, int] = {}
    # .dynsym first: it is what a stripped file keeps; .symtab fills in the rest.
    for kind in (_SHT_DYNSYM, _SHT_SYMTAB):
        if len(found) == len(wanted):
            break  # libpython's .symtab has tens of thousands of symbols: skip it when it can
        for sh in shdrs:
            if sh[1] != kind or sh[9] != _SYM.size or sh[6] >= len(shdrs) or sh[5] > _MAX_TABLE:
                continue
            strtab = shdrs[sh[6]]
            str_lo, str_hi = strtab[4], strtab[4] + strtab[5]
            if sh[4] + sh[5] > len(data) or str_hi > len(data):
                continue
            for name_off, _info, _other, shndx, value, _size in _SYM.iter_unpack(data[sh[4]:sh[4] + sh[5]]):
                if shndx == 0 or value == 0 or str_lo + name_off >= str_hi:
                    continue
                start = str_lo + name_off
                end = data.find(b"\0", start, min(str_hi, start + 64))
                if end < 0:
                    continue
                name = bytes(data[start:end]).decode("ascii", "replace")
                if name in wanted and name not in found:
                    found[name] = value
    return ElfInfo(segments=tuple(segments), symbols=found)


def load_bias(info: ElfInfo, mapping: Mapping) -> int | None:
    """How far the file is loaded from its link addresses, from one of its mappings."""
    size = mapping.end - mapping.start
    for seg in info.segments:
        # A mapping starts at the page (4 to 64 KiB) that holds its segment's
        # first byte, and file offset and address are congruent modulo it.
        if mapping.offset <= seg.offset < mapping.offset + min(size, 1 << 16):
            return mapping.start - mapping.offset - (seg.vaddr - seg.offset)
    return None


class InterpreterFinder:
    """Finds the interpreter of a process, sharing parsed files by identity."""

    def __init__(self, *, max_files: int = 256, proc: str = "/proc") -> None:
        self._files: OrderedDict[tuple[int, int, int, int], ElfInfo | None] = OrderedDict()
        self._max = max_files
        self._proc = proc

    def _info(self, handle: str) -> ElfInfo | None:
        try:
            with open(handle, "rb") as f:
                st = os.fstat(f.fileno())
                key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
                if key in self._files:
                    self._files.move_to_end(key)
                    return self._files[key]
                info: ElfInfo | None
                try:
                    with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
                        info = parse_elf_symbols(data)
                except ValueError:
                    info = None
        except OSError:
            return None
        self._files[key] = info
        if len(self._files) > self._max:
            self._files.popitem(last=False)
        return info

    def find(self, pid: int) -> Interpreter | None:
        """The interpreter mapped into `pid`, or None if no mapped file defines `_PyRuntime`."""
        maps = read_maps(pid, self._proc)
        try:
            exe = os.readlink(f"{self._proc}/{pid}/exe").removesuffix(" (deleted)")
        except OSError:
            exe = ""
        # The executable first (python3.11, or an embedder linked with the
        # interpreter), then any libpython; never every library a process maps.
        seen: set[str] = set()
        candidates = [m for m in maps if m.path.removesuffix(" (deleted)") == exe]
        candidates += [m for m in maps if m.module.startswith("libpython")]
        for m in candidates:
            if m.path in seen:
                continue
            seen.add(m.path)
            # map_files names carry no leading zeros (41f000-6d2000), unlike maps.
            info = self._info(f"{self._proc}/{pid}/map_files/{m.start:x}-{m.end:x}")
            if info is None or "_PyRuntime" not in info.symbols:
                continue
            bias = load_bias(info, m)
            if bias is None:
                continue
            match = _VERSION_IN_NAME.search(m.module)
            return Interpreter(
                path=m.path,
                symbols={k: v + bias for k, v in info.symbols.items()},
                name_version=(int(match[1]), int(match[2])) if match else None,
            )
        return None
