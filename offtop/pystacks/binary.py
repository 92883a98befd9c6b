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

import os
import re
import struct
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from offtop.safe_files import FileRefused, open_regular
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
#: A symbol or string table larger than this is not read (libpython's .symtab is ~1 MB).
_MAX_TABLE = 16 << 20

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


def parse_elf_symbols(pread: Callable[[int, int], bytes], size: int,
                      wanted: frozenset[str] = WANTED) -> ElfInfo:
    """Load segments and the values of the `wanted` symbols of a 64-bit little-endian ELF file.

    `pread(offset, length)` reads the file (`size` bytes); only the headers
    and the symbol tables are read, each capped. Raises ValueError for a
    file that is not such an ELF file.
    """
    ehdr = pread(0, _EHDR.size)
    if len(ehdr) < _EHDR.size or ehdr[:4] != b"\x7fELF" or ehdr[4] != 2 or ehdr[5] != 1:
        raise ValueError("not a 64-bit little-endian ELF file")
    (_, _, _, _, _, phoff, shoff, _, _, phentsize, phnum, shentsize, shnum, _) = _EHDR.unpack(ehdr)
    segments = []
    if phentsize == _PHDR.size and phoff + phnum * _PHDR.size <= size:
        raw = pread(phoff, phnum * _PHDR.size)
        for p in _PHDR.iter_unpack(raw[:len(raw) - len(raw) % _PHDR.size]):
            if p[0] == _PT_LOAD:
                segments.append(LoadSegment(offset=p[2], vaddr=p[3], filesz=p[5]))
    shdrs: list[tuple[int, ...]] = []
    if shentsize == _SHDR.size and shoff and shoff + shnum * _SHDR.size <= size:
        raw = pread(shoff, shnum * _SHDR.size)
        shdrs = list(_SHDR.iter_unpack(raw[:len(raw) - len(raw) % _SHDR.size]))
    found: dict[str, int] = {}
    # .dynsym first: it is what a stripped file keeps; .symtab only for what it lacks.
    for kind in (_SHT_DYNSYM, _SHT_SYMTAB):
        if len(found) == len(wanted):
            break
        for sh in shdrs:
            if sh[1] != kind or sh[9] != _SYM.size or sh[6] >= len(shdrs):
                continue
            strtab = shdrs[sh[6]]
            if sh[5] > _MAX_TABLE or strtab[5] > _MAX_TABLE or sh[4] + sh[5] > size \
                    or strtab[4] + strtab[5] > size:
                continue
            table = pread(sh[4], sh[5])
            strings = pread(strtab[4], strtab[5])
            for name in wanted - found.keys():
                value = _find_symbol(table, strings, name)
                if value is not None:
                    found[name] = value
    return ElfInfo(segments=tuple(segments), symbols=found)


def _find_symbol(table: bytes, strings: bytes, name: str) -> int | None:
    """The value of the defined symbol `name` in a symbol table, found at C speed.

    Rather than unpacking every entry in Python (a hostile file can hold
    hundreds of thousands), the name is looked up in the string table, and
    the entries whose st_name is its offset by bytes.find.
    """
    # Linkers share string tails ("Version" inside "Py_Version"): any place the
    # name ends in a NUL may be the one a symbol points at.
    needle = name.encode() + b"\0"
    pos = strings.find(needle)
    while pos >= 0:
        ref = pos.to_bytes(4, "little")
        hit = table.find(ref)
        while hit >= 0:
            if hit % _SYM.size == 0 and hit + _SYM.size <= len(table):
                _name, _info, _other, shndx, value, _size = _SYM.unpack_from(table, hit)
                if shndx != 0 and value != 0:
                    return int(value)
            hit = table.find(ref, hit + 1)
        pos = strings.find(needle, pos + 1)
    return None


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
        # The file is another user's: opened only if regular (never a FIFO or a
        # device), read with pread, never mapped (a truncated mapping is SIGBUS).
        try:
            with open_regular(handle) as f:
                key = f.identity
                if key in self._files:
                    self._files.move_to_end(key)
                    return self._files[key]
                info: ElfInfo | None
                try:
                    info = parse_elf_symbols(f.pread, f.size)
                except ValueError:
                    info = None
        except FileRefused:
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
            info = self._info(m.handle)
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
