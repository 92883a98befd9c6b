"""Function symbols of ELF files, for user-space stack addresses.

offtop reads symbol tables itself rather than through bcc's symcache: bcc
0.26 closes a random file descriptor whenever a symcache is created
(ModulePath's fd_ left uninitialized, fixed upstream in 0.33), which under
process churn closed offtop's own ring, map and stdout descriptors. Reading
ELF here also lets one parsed file serve every process that maps it.

Only what symbolization needs is parsed: PT_LOAD segments (file offset ->
virtual address), .symtab/.dynsym function symbols, and the GNU build-id
that names a detached debug file under /usr/lib/debug/.build-id.

The files are other users' (any process's binary), so they are hostile
until checked: opened through `offtop.safe_files` (regular files only,
never blocking), read with pread (never mapped: a file its owner truncates
under a mapping kills the reader with SIGBUS), and every table is checked
against the file's size before it is read: header, program and section
header tables, each section's offset, size and entry size. Every read and
every count is capped. Loading is a generator that yields between bounded
steps, so `ElfCache` can spread one big file (libLLVM) over several
intervals instead of stalling one.
"""

from __future__ import annotations

import bisect
import heapq
import os
import struct
import time
from array import array
from collections import OrderedDict
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import dataclass

from offtop.demangle import demangle
from offtop.packed_strings import PackedStrings
from offtop.safe_files import FileRefused, SafeFile, open_regular

DEBUG_ROOT = "/usr/lib/debug"

_EHDR = struct.Struct("<16sHHIQQQIHHHHHH")
_PHDR = struct.Struct("<IIQQQQQQ")
_SHDR = struct.Struct("<IIQQQQIIQQ")
_SYM = struct.Struct("<IBBHQQ")
_NOTE = struct.Struct("<III")

PT_LOAD = 1
PT_NOTE = 4
SHT_SYMTAB = 2
SHT_STRTAB = 3
SHT_NOTE = 7
SHT_DYNSYM = 11
STT_FUNC = 2
STT_GNU_IFUNC = 10
STB_LOCAL = 0
NT_GNU_BUILD_ID = 3
_MAX_ADDRESS = (1 << 64) - 1
_FUNCTION_TYPES = bytes(int((b & 0xF) in (STT_FUNC, STT_GNU_IFUNC)) for b in range(256))

#: Caps on what one file may make offtop read and keep.
MAX_PHDRS = 4096
MAX_SECTIONS = 0xFF00  # SHN_LORESERVE: larger counts use extended numbering, not supported
MAX_SYMTAB_BYTES = 64 << 20  # ~2.8M symbol entries
MAX_STRTAB_BYTES = 64 << 20
MAX_NOTE_BYTES = 64 << 10
MAX_FUNCTIONS = 1 << 20  # function symbols kept per file
MAX_NAME_BYTES = 2048  # of a raw (mangled) name; longer ones are cut
MAX_NAME_CHARS = 1024  # of a shown (demangled) name
#: A string table this large or larger is kept compressed (`PackedStrings`):
#: libLLVM-14's .dynstr, 3.0 MB, in 0.73 MB. libc's (0.16 MB) is held as read.
PACK_FROM = 256 << 10
_STEP_SYMBOLS = 16384  # symbol entries per loading step (~0.4 MB, a few ms)
_STEP_BYTES = 1 << 20  # bytes read per loading step

#: Causes `ElfCache.get` reports instead of symbols (beside safe_files' causes).
BAD_ELF = "malformed ELF"
TIME_BUDGET = "time budget"
#: The file at a path is not (or no longer) the one that was mapped there.
FILE_REPLACED = "file replaced"


class ElfError(ValueError):
    """A file offtop cannot read symbols from: not ELF64 little-endian, or malformed.

    The message is one of a few fixed strings, never text from the file.
    """


@dataclass(frozen=True, slots=True)
class Segment:
    """One PT_LOAD segment: where a file range lives in the ELF's address space."""

    offset: int
    vaddr: int
    filesz: int


@dataclass(frozen=True, slots=True)
class _Section:
    type: int
    offset: int
    size: int
    link: int
    entsize: int


def _preference(name: bytes, bind: int) -> tuple[int, int, int]:
    # Of several names at one address (clock_nanosleep, __clock_nanosleep,
    # __GI___clock_nanosleep), show the one a programmer would call.
    return (len(name) - len(name.lstrip(b"_")), bind == STB_LOCAL, len(name))


class ElfSymbols:
    """The function symbols and load segments of one ELF file, in compact arrays.

    Names stay in the file's own string tables and are decoded (and
    demangled) only when looked up, since a frame hits a handful of the
    thousands a library holds. A large string table is kept compressed
    (`PackedStrings`, from `PACK_FROM`).
    """

    def __init__(self, segments: list[Segment], starts: array[int], ends: array[int],
                 refs: array[int], strtabs: Sequence[bytes | PackedStrings],
                 build_id: bytes | None = None) -> None:
        self.segments = sorted(segments, key=lambda s: s.offset)
        self._starts = starts
        self._ends = ends
        self._refs = refs  # (string table index << 32) | offset of the name
        self._strtabs = strtabs
        self._shown: dict[int, str] = {}
        self.build_id = build_id

    def __len__(self) -> int:
        return len(self._starts)

    @property
    def nbytes(self) -> int:
        """Roughly what this table holds in memory (for the cache's budget)."""
        # Fixed at construction (the cache subtracts what it added); the
        # shown-name cache beside it is capped at 4096 entries.
        return 24 * len(self._starts) + 4096 + sum(
            t.nbytes if isinstance(t, PackedStrings) else len(t) for t in self._strtabs)

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
        name = self._shown.get(i)
        if name is None:
            raw = _name(self._strtabs, self._refs[i])
            name = demangle(raw.decode("utf-8", "replace"))
            if len(name) > MAX_NAME_CHARS:
                name = name[: MAX_NAME_CHARS - 1] + "…"
            if len(self._shown) >= 4096:
                self._shown.clear()
            self._shown[i] = name
        return name


# --- reading a file, checked -----------------------------------------------------


@dataclass(slots=True)
class _Parsed:
    segments: list[Segment]
    sections: list[_Section]
    notes: list[tuple[int, int]]  # (offset, size) of PT_NOTE segments


def _read_headers(f: SafeFile) -> _Parsed:
    size = f.size
    if size < _EHDR.size:
        raise ElfError("not an ELF file")
    head = f.pread_exact(0, _EHDR.size)
    if head[:4] != b"\x7fELF":
        raise ElfError("not an ELF file")
    if head[4] != 2 or head[5] != 1:
        raise ElfError("not a 64-bit little-endian ELF file")
    (_, _, _, _, _, phoff, shoff, _, _, phentsize, phnum, shentsize, shnum,
     _shstrndx) = _EHDR.unpack(head)
    segments: list[Segment] = []
    notes: list[tuple[int, int]] = []
    if phnum:
        if phentsize != _PHDR.size or phnum > MAX_PHDRS or phoff + phnum * phentsize > size:
            raise ElfError("bad program header table")
        for p in _PHDR.iter_unpack(f.pread_exact(phoff, phnum * phentsize)):
            if p[0] == PT_LOAD:
                segments.append(Segment(offset=p[2], vaddr=p[3], filesz=p[5]))
            elif p[0] == PT_NOTE and p[2] + p[5] <= size and p[5] <= MAX_NOTE_BYTES:
                notes.append((p[2], p[5]))
    sections: list[_Section] = []
    if shnum:
        if shentsize != _SHDR.size or shnum > MAX_SECTIONS or shoff + shnum * shentsize > size:
            raise ElfError("bad section header table")
        for sh in _SHDR.iter_unpack(f.pread_exact(shoff, shnum * shentsize)):
            sections.append(_Section(type=sh[1], offset=sh[4], size=sh[5], link=sh[6], entsize=sh[9]))
    return _Parsed(segments, sections, notes)


def _build_id(f: SafeFile, parsed: _Parsed) -> bytes | None:
    ranges = [(s.offset, s.size) for s in parsed.sections if s.type == SHT_NOTE] + parsed.notes
    for off, size in ranges:
        if size > MAX_NOTE_BYTES or off + size > f.size:
            continue  # a section the file does not hold (a debug file's NOBITS twin) or absurd
        data = f.pread(off, size)
        pos = 0
        while pos + _NOTE.size <= len(data):
            namesz, descsz, typ = _NOTE.unpack_from(data, pos)
            name_at = pos + _NOTE.size
            desc_at = name_at + ((namesz + 3) & ~3)
            if typ == NT_GNU_BUILD_ID and data[name_at:name_at + 4] == b"GNU\0":
                desc = data[desc_at: desc_at + descsz]
                return desc if 0 < len(desc) == descsz <= 64 else None
            pos = desc_at + ((descsz + 3) & ~3)
    return None


def _symbol_table(parsed: _Parsed, wanted: int, file_size: int) -> tuple[_Section, _Section] | None:
    """The first section of type `wanted` and its string table, both checked."""
    for s in parsed.sections:
        if s.type != wanted:
            continue
        if s.entsize != _SYM.size or s.size % _SYM.size:
            raise ElfError("bad symbol table entry size")
        if s.offset + s.size > file_size:
            raise ElfError("symbol table past the end of the file")
        if s.size > MAX_SYMTAB_BYTES:
            raise ElfError("symbol table too large")
        if not 0 < s.link < len(parsed.sections):
            raise ElfError("symbol table without a string table")
        strtab = parsed.sections[s.link]
        if strtab.type != SHT_STRTAB or strtab.offset + strtab.size > file_size:
            raise ElfError("bad string table")
        if strtab.size > MAX_STRTAB_BYTES:
            raise ElfError("string table too large")
        return s, strtab
    return None


@dataclass(slots=True)
class _Candidates:
    """Function symbols as they are found, before sorting."""

    values: array[int]
    sizes: array[int]
    refs: array[int]  # (string table index << 32) | offset of the name
    binds: array[int]
    strtabs: list[bytes]
    truncated: bool = False

    @classmethod
    def empty(cls) -> _Candidates:
        return cls(array("Q"), array("Q"), array("Q"), array("B"), [])


def _scan(f: SafeFile, symtab: _Section, strtab: _Section,
          found: _Candidates) -> Generator[None, None, None]:
    """Collect the function symbols of one table into `found`, a step at a time."""
    table_id = len(found.strtabs)
    str_size = strtab.size
    step = _STEP_SYMBOLS * _SYM.size
    for pos in range(symtab.offset, symtab.offset + symtab.size, step):
        if found.truncated:
            break
        data = f.pread_exact(pos, min(step, symtab.offset + symtab.size - pos))
        # The st_info byte of every entry, mapped to 1 for functions: find()
        # then skips everything else at C speed (a table of zeros costs nothing).
        is_func = data[4::_SYM.size].translate(_FUNCTION_TYPES)
        i = is_func.find(1)
        while i >= 0:
            name_off, info, _other, shndx, value, size = _SYM.unpack_from(data, i * _SYM.size)
            i = is_func.find(1, i + 1)
            if shndx == 0 or value == 0 or name_off >= str_size:
                continue
            if len(found.values) >= MAX_FUNCTIONS:
                found.truncated = True
                break
            found.values.append(value)
            found.sizes.append(size)
            found.refs.append(table_id << 32 | name_off)
            found.binds.append(info >> 4)
        yield
    parts = []
    for chunk in f.chunks(start=strtab.offset, chunk=_STEP_BYTES, limit=str_size):
        parts.append(chunk)
        yield
    data = b"".join(parts)
    if len(data) != str_size:
        raise FileRefused("unreadable", "file shorter than it said")
    found.strtabs.append(data)


def _name(strtabs: Sequence[bytes | PackedStrings], ref: int) -> bytes:
    """A name from a string table: up to its NUL, at most MAX_NAME_BYTES."""
    table = strtabs[ref >> 32]
    off = ref & 0xFFFFFFFF
    if isinstance(table, PackedStrings):
        return table.string_at(off, MAX_NAME_BYTES)
    end = table.find(b"\0", off, off + MAX_NAME_BYTES)
    return table[off: end if end >= 0 else min(len(table), off + MAX_NAME_BYTES)]


def _sorted_indexes(values: array[int]) -> Generator[None, None, Iterator[int]]:
    """The indexes of `values` in value order: chunks sorted a step at a time, then merged."""
    n = len(values)
    scale = n + 1
    runs: list[list[int]] = []
    for lo in range(0, n, 65536):
        runs.append(sorted(values[i] * scale + i for i in range(lo, min(n, lo + 65536))))
        yield
    return (k % scale for k in heapq.merge(*runs))


def _finish(segments: list[Segment], found: _Candidates, build_id: bytes | None,
            pack_from: int) -> Generator[None, None, ElfSymbols]:
    """Sorted, one symbol per address: of several, the name a programmer would call.
    String tables of `pack_from` bytes or more are kept compressed (`PackedStrings`)."""
    order = yield from _sorted_indexes(found.values)
    values, sizes, refs = found.values, found.sizes, found.refs
    starts: array[int] = array("Q")
    ends: array[int] = array("Q")
    kept: array[int] = array("Q")
    last = -1
    for count, i in enumerate(order):
        value = values[i]
        end = min(value + sizes[i], _MAX_ADDRESS)  # a hostile size must not overflow the array
        if value != last:
            starts.append(value)
            ends.append(end)
            kept.append(i)
            last = value
        else:  # an alias: keep the longest size, the preferred name
            ends[-1] = max(ends[-1], end)
            j = kept[-1]
            if (_preference(_name(found.strtabs, refs[i]), found.binds[i])
                    < _preference(_name(found.strtabs, refs[j]), found.binds[j])):
                kept[-1] = i
        if count % 8192 == 8191:
            yield
    strtabs: list[bytes | PackedStrings] = []
    for table in found.strtabs:
        strtabs.append((yield from PackedStrings.packing(table)) if len(table) >= pack_from
                       else table)
    return ElfSymbols(segments, starts, ends, array("Q", (refs[i] for i in kept)), strtabs,
                      build_id)


def load_steps(f: SafeFile, *, debug_root: str = DEBUG_ROOT,
               pack_from: int = PACK_FROM) -> Generator[None, None, ElfSymbols]:
    """Load an open ELF file's symbols, yielding between bounded steps.

    Takes .symtab from the detached debug file named by the build-id when
    the file itself has none. Raises ElfError or FileRefused.
    """
    parsed = _read_headers(f)
    build_id = _build_id(f, parsed)
    found = _Candidates.empty()
    own = _symbol_table(parsed, SHT_SYMTAB, f.size)
    if own is None and build_id:
        yield from _scan_debug_file(build_id, debug_root, found)
    if own is None:
        own = _symbol_table(parsed, SHT_DYNSYM, f.size)
    if own is not None:
        yield from _scan(f, own[0], own[1], found)
    return (yield from _finish(parsed.segments, found, build_id, pack_from))


def _scan_debug_file(build_id: bytes, debug_root: str, found: _Candidates) -> Generator[None, None, None]:
    hexid = build_id.hex()
    path = os.path.join(debug_root, ".build-id", hexid[:2], hexid[2:] + ".debug")
    try:
        with open_regular(path) as dbg:
            parsed = _read_headers(dbg)
            if _build_id(dbg, parsed) not in (None, build_id):
                return
            table = _symbol_table(parsed, SHT_SYMTAB, dbg.size)
            if table is not None:
                yield from _scan(dbg, table[0], table[1], found)
    except (FileRefused, ElfError):
        return  # no usable debug file: the file's own .dynsym still serves


def load_elf(path: str, *, debug_root: str = DEBUG_ROOT, pack_from: int = PACK_FROM) -> ElfSymbols:
    """Read an ELF file's symbols at once (raises ElfError or FileRefused)."""
    with open_regular(path) as f:
        steps = load_steps(f, debug_root=debug_root, pack_from=pack_from)
        while True:
            try:
                next(steps)
            except StopIteration as done:
                result: ElfSymbols = done.value
                return result


# --- the cache ---------------------------------------------------------------------


@dataclass(slots=True)
class _Loading:
    """A file being loaded over several calls."""

    file: SafeFile
    steps: Generator[None, None, ElfSymbols]
    seconds: float = 0.0

    def abandon(self) -> None:
        self.steps.close()
        self.file.close()


#: Bytes of symbol tables cached at most, all files together (the newest is
#: always kept). Kept as offtop keeps them, libLLVM's are 1.5 MB (3.7 with its
#: string table held as read), libclang-cpp's 1.06, libc's 0.25:
#: a host's working set fits many times over, and offtop's memory stays
#: within a bound its users can plan for (it was 256 MB).
MAX_CACHED_BYTES = 64 << 20


class ElfCache:
    """Parsed files, shared by all processes, keyed by (device, inode, size, mtime).

    Failures are cached too (by cause), so a hostile file is parsed once. The
    cache holds at most `max_files` files and about `max_bytes` of tables;
    at most `max_loading` files are part-loaded at a time.
    """

    def __init__(self, max_files: int = 512, *, max_bytes: int = MAX_CACHED_BYTES, max_loading: int = 2,
                 debug_root: str = DEBUG_ROOT, clock: Callable[[], float] = time.monotonic) -> None:
        self._files: OrderedDict[tuple[int, int, int, int], ElfSymbols | str] = OrderedDict()
        self._loading: OrderedDict[tuple[int, int, int, int], _Loading] = OrderedDict()
        self._max = max_files
        self._max_bytes = max_bytes
        self._max_loading = max_loading
        self._bytes = 0
        self._debug_root = debug_root
        self._clock = clock
        #: Seconds spent loading files, and how many loads ended (for stats).
        self.load_seconds = 0.0
        self.loads = 0
        #: The slowest load so far: (seconds, symbols).
        self.slowest: tuple[float, int] = (0.0, 0)

    def __len__(self) -> int:
        return len(self._files)

    @property
    def nbytes(self) -> int:
        """Memory the cached tables hold, roughly."""
        return self._bytes

    def get(self, path: str, *, deadline: float | None = None,
            expect: tuple[int, int] | None = None) -> ElfSymbols | str:
        """The symbols of the file at `path`, or the cause they cannot be had.

        Past `deadline` (a `clock` time), no loading is started or continued:
        the answer is TIME_BUDGET, and a part-loaded file goes on at the next call.
        `expect`: the (device, inode) the file must be (else FILE_REPLACED).
        """
        try:
            st = os.stat(path)
        except OSError as e:
            return FileRefused.from_os_error(e).cause
        if expect is not None and (st.st_dev, st.st_ino) != expect:
            return FILE_REPLACED
        key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        done = self._files.get(key)
        if done is not None:
            self._files.move_to_end(key)
            return done
        if deadline is not None and self._clock() >= deadline:
            return TIME_BUDGET
        loading = self._loading.get(key)
        if loading is None:
            try:
                f = open_regular(path)
            except FileRefused as e:
                if not e.gone:
                    self._store(key, e.cause)
                return e.cause
            if f.identity != key:
                # Replaced between the stat and the open: its contents must not
                # be kept under the other file's key.
                f.close()
                return FILE_REPLACED
            loading = self._loading[key] = _Loading(f, load_steps(f, debug_root=self._debug_root))
            while len(self._loading) > self._max_loading:
                self._loading.popitem(last=False)[1].abandon()
        result = self._advance(loading, deadline)
        if result is None:
            return TIME_BUDGET
        del self._loading[key]
        loading.file.close()
        self._store(key, result)
        return result

    def _advance(self, loading: _Loading, deadline: float | None) -> ElfSymbols | str | None:
        t0 = self._clock()
        try:
            # At least one step per call, however little time is left (else a
            # small budget would never load anything): a step is a few ms.
            next(loading.steps)
            while deadline is None or self._clock() < deadline:
                next(loading.steps)
            return None
        except StopIteration as done:
            result: ElfSymbols | str = done.value
        except (ValueError, OverflowError, IndexError, struct.error):
            # ElfError, or anything else a malformed file could still provoke:
            # a file's content must never end offtop.
            result = BAD_ELF
        except FileRefused as e:
            result = e.cause
        finally:
            spent = self._clock() - t0
            loading.seconds += spent
            self.load_seconds += spent
        self.loads += 1
        if isinstance(result, ElfSymbols) and loading.seconds > self.slowest[0]:
            self.slowest = (loading.seconds, len(result))
        return result

    def _store(self, key: tuple[int, int, int, int], value: ElfSymbols | str) -> None:
        self._files[key] = value
        self._bytes += value.nbytes if isinstance(value, ElfSymbols) else 0
        while len(self._files) > self._max or (self._bytes > self._max_bytes and len(self._files) > 1):
            _, old = self._files.popitem(last=False)
            self._bytes -= old.nbytes if isinstance(old, ElfSymbols) else 0

    def close(self) -> None:
        """Drop everything, part-loaded files included."""
        for loading in self._loading.values():
            loading.abandon()
        self._loading.clear()
        self._files.clear()
        self._bytes = 0
