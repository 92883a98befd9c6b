"""The parts of an ELF file that unwinding needs, read with bounded preads.

The unwinder reads files that other processes map: they are untrusted. So a
file is opened only if it is a regular one, without blocking
(`safe_files.open_regular`), nothing here maps a file (a file truncated under
a mapping raises SIGBUS in offtop), every offset and size is checked against
the file's size before it is read, and every section read is capped. Only
what call-frame information needs is read: PT_LOAD segments (file offset ->
virtual address), the PT_GNU_EH_FRAME segment (finds .eh_frame_hdr when
section headers are stripped), named section headers, and the GNU build-id.
"""

from __future__ import annotations

import errno
import os
import struct
import zlib
from dataclasses import dataclass

from offtop.safe_files import FileRefused, open_regular

_EHDR = struct.Struct("<16sHHIQQQIHHHHHH")
_PHDR = struct.Struct("<IIQQQQQQ")
_SHDR = struct.Struct("<IIQQQQIIQQ")
_NOTE = struct.Struct("<III")
_CHDR = struct.Struct("<IIQQ")

EM_X86_64 = 62
PT_LOAD = 1
PT_NOTE = 4
PT_GNU_EH_FRAME = 0x6474E550
SHT_NOBITS = 8
SHF_COMPRESSED = 0x800
ELFCOMPRESS_ZLIB = 1
NT_GNU_BUILD_ID = 3

#: Section headers beyond this many are not read (real files have < 100).
MAX_SECTIONS = 4096
#: Program headers beyond this many are not read.
MAX_SEGMENTS = 512
#: The largest section (compressed or not) read into memory. libLLVM's
#: .eh_frame is ~5 MiB; a file claiming more than this is refused.
MAX_SECTION_BYTES = 128 << 20


class ElfFormatError(ValueError):
    """A file that is not a readable x86-64 ELF64 file, or is inconsistent."""


@dataclass(frozen=True, slots=True)
class LoadSegment:
    """One PT_LOAD segment: file range [offset, offset+filesz) at vaddr."""

    offset: int
    vaddr: int
    filesz: int
    memsz: int
    executable: bool


@dataclass(frozen=True, slots=True)
class Section:
    """One section header, by the fields unwinding needs."""

    name: str
    type: int
    flags: int
    addr: int
    offset: int
    size: int


class ElfFile:
    """An open ELF64 little-endian file: headers parsed, sections read on demand.

    Use as a context manager; the file descriptor is closed on exit.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        # Opened only if regular, without blocking (safe_files): a process can map
        # files offtop would otherwise open as root.
        try:
            self._file = open_regular(path)
        except FileRefused as e:
            raise OSError(e.os_errno or errno.EINVAL, f"{path}: {e}") from None
        try:
            self.size = self._file.size
            self._parse_headers()
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> ElfFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the file descriptor (idempotent)."""
        self._file.close()

    def read(self, offset: int, size: int) -> bytes:
        """Exactly `size` bytes at `offset`, or ElfFormatError when out of the file."""
        if offset < 0 or size < 0 or offset + size > self.size or size > MAX_SECTION_BYTES:
            raise ElfFormatError(f"read of {size} bytes at {offset:#x} is outside the file")
        data = os.pread(self._file.fd, size, offset)
        if len(data) != size:  # the file shrank since fstat
            raise ElfFormatError("short read")
        return data

    def _parse_headers(self) -> None:
        if self.size < _EHDR.size:
            raise ElfFormatError("too small for an ELF header")
        ehdr = _EHDR.unpack(self.read(0, _EHDR.size))
        ident = ehdr[0]
        if ident[:4] != b"\x7fELF" or ident[4] != 2 or ident[5] != 1:
            raise ElfFormatError("not an ELF64 little-endian file")
        if ehdr[2] != EM_X86_64:
            raise ElfFormatError(f"machine {ehdr[2]} is not x86-64")
        phoff, shoff, phentsize, phnum = ehdr[5], ehdr[6], ehdr[9], ehdr[10]
        shentsize, shnum, shstrndx = ehdr[11], ehdr[12], ehdr[13]
        self.segments: list[LoadSegment] = []
        self.eh_frame_hdr_vaddr: int | None = None
        self._notes: list[tuple[int, int]] = []
        if phentsize == _PHDR.size and 0 < phnum <= MAX_SEGMENTS:
            raw = self.read(phoff, phnum * _PHDR.size)
            for p in _PHDR.iter_unpack(raw):
                if p[0] == PT_LOAD:
                    self.segments.append(LoadSegment(p[2], p[3], p[5], p[6], bool(p[1] & 1)))
                elif p[0] == PT_GNU_EH_FRAME:
                    self.eh_frame_hdr_vaddr = p[3]
                elif p[0] == PT_NOTE:
                    self._notes.append((p[2], p[5]))
        self.sections: dict[str, Section] = {}
        if shentsize == _SHDR.size and 0 < shnum <= MAX_SECTIONS and shoff:
            raw = self.read(shoff, shnum * _SHDR.size)
            headers = list(_SHDR.iter_unpack(raw))
            names = b""
            if shstrndx < len(headers):
                strtab = headers[shstrndx]
                if strtab[1] != SHT_NOBITS and strtab[5] <= 1 << 20:
                    names = self.read(strtab[4], strtab[5])
            for h in headers:
                end = names.find(b"\0", h[0])
                name = names[h[0]:end].decode("ascii", "replace") if end >= 0 else ""
                # The first of several same-named sections wins, as for the linkers.
                self.sections.setdefault(name, Section(name, h[1], h[2], h[3], h[4], h[5]))

    def section_data(self, name: str) -> bytes | None:
        """A section's bytes (decompressed if SHF_COMPRESSED or .z-named), or None if absent."""
        sec = self.sections.get(name)
        if sec is not None and sec.type != SHT_NOBITS and sec.size > 0:
            data = self.read(sec.offset, sec.size)
            if sec.flags & SHF_COMPRESSED:
                return _decompress_chdr(data)
            return data
        zsec = self.sections.get(".z" + name.lstrip("."))
        if zsec is not None and zsec.type != SHT_NOBITS and zsec.size > 12:
            data = self.read(zsec.offset, zsec.size)
            if data[:4] == b"ZLIB":  # GNU .zdebug_*: "ZLIB", big-endian size, stream
                return _inflate(data[12:], int.from_bytes(data[4:12], "big"))
        return None

    def vaddr_to_offset(self, vaddr: int, size: int) -> int | None:
        """The file offset of `size` bytes loaded at `vaddr`, if a segment holds them all."""
        for s in self.segments:
            if s.vaddr <= vaddr and vaddr + size <= s.vaddr + s.filesz:
                return vaddr - s.vaddr + s.offset
        return None

    def segment_end_at(self, vaddr: int) -> int | None:
        """The end vaddr of the file-backed part of the segment holding `vaddr`."""
        for s in self.segments:
            if s.vaddr <= vaddr < s.vaddr + s.filesz:
                return s.vaddr + s.filesz
        return None

    def build_id(self) -> bytes | None:
        """The GNU build-id note's bytes, from section headers or PT_NOTE segments."""
        places = [(s.offset, s.size) for s in self.sections.values() if s.type == 7]
        for off, size in places + self._notes:
            if size > 1 << 16 or off + size > self.size:
                continue
            found = _find_build_id(self.read(off, size))
            if found is not None:
                return found
        return None


def _find_build_id(notes: bytes) -> bytes | None:
    pos = 0
    while pos + _NOTE.size <= len(notes):
        namesz, descsz, typ = _NOTE.unpack_from(notes, pos)
        name_at = pos + _NOTE.size
        desc_at = name_at + ((namesz + 3) & ~3)
        if typ == NT_GNU_BUILD_ID and notes[name_at:name_at + 4] == b"GNU\0" and 0 < descsz <= 64:
            desc = notes[desc_at:desc_at + descsz]
            return desc if len(desc) == descsz else None
        pos = desc_at + ((descsz + 3) & ~3)
    return None


def _decompress_chdr(data: bytes) -> bytes:
    if len(data) < _CHDR.size:
        raise ElfFormatError("compressed section without a header")
    typ, _reserved, size, _align = _CHDR.unpack_from(data, 0)
    if typ != ELFCOMPRESS_ZLIB:
        raise ElfFormatError(f"compression type {typ} is not zlib")
    return _inflate(data[_CHDR.size:], size)


def _inflate(stream: bytes, size: int) -> bytes:
    # The header's size is a claim of the file: inflate no more than the cap,
    # so a small hostile stream cannot expand into gigabytes.
    if size > MAX_SECTION_BYTES:
        raise ElfFormatError(f"compressed section claims {size} bytes")
    try:
        d = zlib.decompressobj()
        out = d.decompress(stream, size + 1)
    except zlib.error as e:
        raise ElfFormatError(f"bad zlib stream: {e}") from None
    if len(out) != size:
        raise ElfFormatError("compressed section is not the size it claims")
    return out
