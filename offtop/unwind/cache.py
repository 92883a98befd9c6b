"""Unwind tables shared by every process, keyed by file identity and build-id.

A file is known by (device, inode, size, mtime) from stat(), which is cheap
and changes when the file is replaced; two files with one GNU build-id (a
library in a container and on the host) share one table. Files that cannot
be read as ELF are remembered as such, so a bad file costs one attempt.
Memory is bounded by the bytes the tables hold (`TableStats.nbytes`); the
least recently used tables go first, the newest never (a walk needs it).

A table that reads a large .eh_frame from its file keeps the file open (at
most 64 such in the cache, by the bytes each counts for,
`lazy.OPEN_FILE_NBYTES`), until nothing holds the table. Once no rule has
been asked of it for `MAX_IDLE_S` (through the cache or through a walk that
kept it), the cache lets it go (`forget_idle`), so that a program's file is
not held long after the program: an open file keeps its filesystem busy (no
unmount) and, once deleted, its blocks allocated.
"""

from __future__ import annotations

import os
import time
from collections import OrderedDict
from collections.abc import Callable

from offtop.safe_files import FileRefused, open_regular
from offtop.unwind.cfi import CfiLimits
from offtop.unwind.elffile import ElfFile, ElfFormatError
from offtop.unwind.lazy import load_table
from offtop.unwind.table import DEBUG_ROOT, FileTable

FileKey = tuple[int, int, int, int]


#: Bytes of tables held at most. A lazy table keeps a small .eh_frame whole
#: (python3.11's is 0.4 MB, libc's 0.2) and its index (8 bytes an FDE: libLLVM's
#: is 0.8 MB). With bcc compiles blocking beside it, the TUI once held 21-24 MB of
#: tables, for all its life; the bound before (8,000,000 rows) let ~550 MB be held.
MAX_TABLE_BYTES = 16 << 20
#: Seconds a table holding its file open is kept unused (see the module docstring).
MAX_IDLE_S = 30.0


class TableCache:
    """Unwind tables by file, LRU-bounded by the bytes they hold and their number."""

    def __init__(self, *, debug_root: str = DEBUG_ROOT, limits: CfiLimits | None = None,
                 max_bytes: int = MAX_TABLE_BYTES, max_files: int = 1024,
                 builder: Callable[..., FileTable] = load_table,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._debug_root = debug_root
        self._limits = limits or CfiLimits()
        self._max_bytes = max_bytes
        self._max_files = max_files
        self._build = builder
        self._by_file: OrderedDict[FileKey, FileTable | None] = OrderedDict()
        self._by_build_id: dict[bytes, FileTable] = {}
        self._clock = clock
        #: When each file's table was last seen in use, and its lookups then.
        self._used: dict[FileKey, tuple[float, int]] = {}
        self.nbytes = 0  #: held by the tables, as they count it
        self.builds = 0
        self.build_seconds = 0.0
        self.failures: dict[str, int] = {}  #: files that gave no table, by cause

    def __len__(self) -> int:
        return len(self._by_file)

    def get(self, path: str, expect: tuple[int, int] | None = None) -> FileTable | None:
        """The table of the ELF file at `path` (e.g. /proc/PID/map_files/…), None if unusable.
        `expect`: the (device, inode) the file must be (a path the kernel gave for a
        mapping, offtop.bpf.sent_maps): it is opened once, checked, and read through
        that open file, so a file swapped in under the path is never read."""
        if expect is not None:
            try:
                f = open_regular(path)
            except FileRefused:
                self._fail("stat")
                return None
            with f:
                if f.identity[:2] != expect:
                    self._fail("file_replaced")
                    return None
                return self.get(f"/proc/self/fd/{f.fd}")
        try:
            st = os.stat(path)
        except OSError:
            self._fail("stat")
            return None
        key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        if key in self._by_file:
            self._by_file.move_to_end(key)
            table = self._by_file[key]
            if table is not None:
                self._used[key] = (self._clock(), table.lookups)
            return table
        table = self._load(path)
        self._by_file[key] = table
        if table is not None:
            self._used[key] = (self._clock(), table.lookups)
            self.nbytes += table.stats.nbytes
        self._evict()
        return table

    def forget_idle(self, max_idle_s: float = MAX_IDLE_S) -> int:
        """Let go of the tables that hold their file open and had no rule asked of
        them for `max_idle_s`; return how many. Call it more often than that: use
        is seen by the lookups a table counts between two calls."""
        now = self._clock()
        idle = []
        for key, table in self._by_file.items():
            if table is None or not table.holds_file:
                continue
            at, lookups = self._used.get(key, (now, -1))
            if table.lookups != lookups:
                self._used[key] = (now, table.lookups)
            elif at < now - max_idle_s:
                idle.append(key)
        for key in idle:
            self._drop(key)
        return len(idle)

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
            self._drop(next(iter(self._by_file)))

    def _drop(self, key: FileKey) -> None:
        """Forget one file's table (a file it reads is closed once nothing holds it)."""
        old = self._by_file.pop(key)
        self._used.pop(key, None)
        if old is None:
            return
        # Bytes are counted once per file holding the table (shared tables
        # count twice: the bound errs on the safe side).
        self.nbytes -= old.stats.nbytes
        if old.build_id is not None and not any(t is old for t in self._by_file.values()):
            self._by_build_id.pop(old.build_id, None)
