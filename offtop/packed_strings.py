"""A string table kept compressed, in blocks, and read back a block at a time.

A symbol table keeps its file's string table to name the few functions a
stack ever meets, and C++ libraries' tables are large: libLLVM-14's .dynstr
is 3.0 MB, libclang-cpp's 2.5 MB; the kernel's names (kallsyms) are 2.8 MB,
in every offtop (0.56 MB packed). Mangled names compress well: in 4 KiB
blocks, zlib takes them to a fifth or a quarter (libLLVM's to 0.73 MB), and a
block decompresses in ~10 µs, which a name pays once (its shown form is
cached by `ElfSymbols`). The bytes are offtop's own compression of what it
read (bounded by `elf.MAX_STRTAB_BYTES`), so reading them back cannot be
made to expand.
"""

from __future__ import annotations

import zlib
from collections.abc import Generator

#: Bytes of the table per compressed block.
BLOCK = 4096
#: Blocks compressed per loading step (~1 ms).
_STEP_BLOCKS = 64


class PackedStrings:
    """NUL-terminated strings at offsets into a table held compressed (see module)."""

    def __init__(self, blocks: list[bytes], size: int) -> None:
        self._blocks = blocks
        self._size = size
        self._last: tuple[int, bytes] = (-1, b"")  # the block read last, for neighbours
        #: Memory held: the blocks and the list's slots (a bytes object's header ~33).
        self.nbytes = sum(len(b) for b in blocks) + 41 * len(blocks)

    @classmethod
    def packing(cls, data: bytes) -> Generator[None, None, PackedStrings]:
        """`data` packed, a few blocks per step (yields between steps)."""
        blocks = []
        for lo in range(0, len(data), BLOCK):
            blocks.append(zlib.compress(data[lo:lo + BLOCK], 6))
            if len(blocks) % _STEP_BLOCKS == 0:
                yield
        return cls(blocks, len(data))

    @classmethod
    def packed(cls, data: bytes) -> PackedStrings:
        """`data` packed at once."""
        steps = cls.packing(data)
        while True:
            try:
                next(steps)
            except StopIteration as done:
                result: PackedStrings = done.value
                return result

    def __len__(self) -> int:
        return self._size

    def read(self, offset: int, n: int) -> bytes:
        """`n` bytes at `offset` (fewer past the end of the table)."""
        k = offset // BLOCK
        start = offset - k * BLOCK
        text = self._block(k)
        while len(text) < start + n and (k + 1) * BLOCK < self._size:
            k += 1
            text += self._block(k)
        return text[start:start + n]

    def string_at(self, offset: int, limit: int) -> bytes:
        """The string at `offset`, up to its NUL (at most `limit` bytes; to the end of
        the table if it has none)."""
        k = offset // BLOCK
        start = offset - k * BLOCK
        text = self._block(k)
        end = text.find(b"\0", start, start + limit)
        while end < 0 and len(text) < start + limit and (k + 1) * BLOCK < self._size:
            k += 1  # runs on into the next block
            text += self._block(k)
            end = text.find(b"\0", start, start + limit)
        return text[start:end] if end >= 0 else text[start:start + limit]

    def _block(self, k: int) -> bytes:
        last = self._last  # one read: another thread may replace it meanwhile
        if last[0] != k:
            last = (k, zlib.decompress(self._blocks[k]) if 0 <= k < len(self._blocks) else b"")
            self._last = last
        return last[1]
