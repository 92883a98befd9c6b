"""Unwind tables shared by every process, keyed by file identity and build-id.

A file is known by (device, inode, size, mtime) from stat(), which is cheap
and changes when the file is replaced; two files with one GNU build-id (a
library in a container and on the host) share one table. Files that cannot
be read as ELF are remembered as such, so a bad file costs one attempt.
Memory is bounded by the bytes the tables hold (`TableStats.nbytes`); the
least recently used tables go first, the newest never (a walk needs it).
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Callable

from offtop.unwind.cfi import CfiLimits
from offtop.unwind.elffile import ElfFile, ElfFormatError
from offtop.unwind.lazy import load_table
from offtop.unwind.table import DEBUG_ROOT, FileTable

FileKey = tuple[int, int, int, int]


#: Bytes of tables held at most. A lazy table keeps its file's .eh_frame
#: whole: python3.11's is 0.5 MB, libc's 0.2, libLLVM's and libclang-cpp's
#: 5.5 MB each. With bcc compiles blocking beside it, the TUI held 21-24 MB of
#: tables, for all its life; the bound before (8,000,000 rows) let ~550 MB be held.
MAX_TABLE_BYTES = 16 << 20


class TableCache:
    """Unwind tables by file, LRU-bounded by the bytes they hold and their number."""

    def __init__(self, *, debug_root: str = DEBUG_ROOT, limits: CfiLimits | None = None,
                 max_bytes: int = MAX_TABLE_BYTES, max_files: int = 1024,
                 builder: Callable[..., FileTable] = load_table) -> None:
        self._debug_root = debug_root
        self._limits = limits or CfiLimits()
        self._max_bytes = max_bytes
        self._max_files = max_files
        self._build = builder
        self._by_file: OrderedDict[FileKey, FileTable | None] = OrderedDict()
        self._by_build_id: dict[bytes, FileTable] = {}
        self.nbytes = 0  #: held by the tables, as they count it
        self.builds = 0
        self.build_seconds = 0.0
        self.failures: dict[str, int] = {}  #: files that gave no table, by cause

    def __len__(self) -> int:
        return len(self._by_file)

    def get(self, path: str) -> FileTable | None:
        """The table of the ELF file at `path` (e.g. /proc/PID/map_files/…), None if unusable."""
        try:
            st = os.stat(path)
        except OSError:
            self._fail("stat")
            return None
        key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        if key in self._by_file:
            self._by_file.move_to_end(key)
            return self._by_file[key]
        table = self._load(path)
        self._by_file[key] = table
        if table is not None:
            self.nbytes += table.stats.nbytes
        self._evict()
        return table

    def _load(self, path: str) -> FileTable | None:
        try:
            with ElfFile(path) as elf:
                build_id = elf.build_id()
        except (OSError, ElfFormatError):
            self._fail("not_elf")
            return None
        if build_id is not None and build_id in self._by_build_id:
            return self._by_build_id[build_id]
        try:
            table = self._build(path, debug_root=self._debug_root, limits=self._limits)
        except (OSError, ElfFormatError):
            self._fail("unreadable")
            return None
        self.builds += 1
        self.build_seconds += table.stats.build_s
        if not len(table):
            self._fail("no_cfi")
        if build_id is not None:
            self._by_build_id[build_id] = table
        return table

    def _fail(self, cause: str) -> None:
        self.failures[cause] = self.failures.get(cause, 0) + 1

    def _evict(self) -> None:
        while len(self._by_file) > 1 and (self.nbytes > self._max_bytes
                                          or len(self._by_file) > self._max_files):
            _, old = self._by_file.popitem(last=False)
            if old is None:
                continue
            # Bytes are counted once per file holding the table (shared tables
            # count twice: the bound errs on the safe side).
            self.nbytes -= old.stats.nbytes
            if old.build_id is not None and not any(t is old for t in self._by_file.values()):
                self._by_build_id.pop(old.build_id, None)
