"""Reading another process's memory with process_vm_readv(2), bounded.

One unwind reads a few words per frame, all on the thread's stack; reading
whole pages and serving words from them costs one system call per page
instead of one per word, and gives the walk one consistent view of each page.
A page that cannot be read (unmapped, a guard page, the process gone) is
remembered as such and counted; nothing here raises for the target's sake.
"""

from __future__ import annotations

import ctypes
import errno
import os
import struct

PAGE = 4096
_U64 = struct.Struct("<Q").unpack_from


class _IoVec(ctypes.Structure):
    # struct iovec (<sys/uio.h>): must match the C struct.
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


_libc = ctypes.CDLL(None, use_errno=True)
_process_vm_readv = _libc.process_vm_readv
_process_vm_readv.restype = ctypes.c_ssize_t
_process_vm_readv.argtypes = [ctypes.c_int, ctypes.POINTER(_IoVec), ctypes.c_ulong,
                              ctypes.POINTER(_IoVec), ctypes.c_ulong, ctypes.c_ulong]


def read_remote(pid: int, addr: int, size: int) -> bytes:
    """Up to `size` bytes of process `pid` at `addr` (fewer at an unmapped boundary).

    Raises OSError when nothing could be read (EFAULT: not mapped; ESRCH:
    gone; EPERM: not allowed).
    """
    if size <= 0 or addr < 0 or addr + size > 1 << 64:
        raise OSError(errno.EFAULT, "address out of range")
    buf = ctypes.create_string_buffer(size)
    local = _IoVec(ctypes.cast(buf, ctypes.c_void_p), size)
    remote = _IoVec(addr, size)
    n = _process_vm_readv(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
    if n < 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))
    return buf.raw[:n]


class StackReader:
    """Words of one process's memory, read a page at a time, at most `max_pages` pages.

    Meant for one unwind: pages are not re-read, so make a new reader per
    unwind (a blocked thread's stack does not change, another thread's may).
    """

    def __init__(self, pid: int, *, max_pages: int = 64) -> None:
        self.pid = pid
        self.max_pages = max_pages
        self._pages: dict[int, bytes | None] = {}
        self.pages_read = 0
        self.failures: dict[str, int] = {}  #: failed page reads by errno name

    def _page(self, base: int) -> bytes | None:
        if base in self._pages:
            return self._pages[base]
        if len(self._pages) >= self.max_pages:
            self.failures["page_budget"] = self.failures.get("page_budget", 0) + 1
            return None
        try:
            data: bytes | None = read_remote(self.pid, base, PAGE)
            self.pages_read += 1
        except OSError as e:
            name = errno.errorcode.get(e.errno or 0, "error")
            self.failures[name] = self.failures.get(name, 0) + 1
            data = None
        if data is not None and len(data) != PAGE:
            data = None
        self._pages[base] = data
        return data

    def u64(self, addr: int) -> int | None:
        """The 8-byte little-endian word at `addr`, or None when it cannot be read."""
        if addr < 0 or addr > (1 << 64) - 8:
            return None
        base = addr & ~(PAGE - 1)
        off = addr - base
        page = self._page(base)
        if page is None:
            return None
        if off <= PAGE - 8:
            return int(_U64(page, off)[0])
        nxt = self._page(base + PAGE)  # a word straddling two pages
        if nxt is None:
            return None
        return int(_U64(page[off:] + nxt[:8 - (PAGE - off)], 0)[0])


class CopiedStack:
    """Words of a stack copied by the probe (`base` is the address of `data[0]`):
    the memory of a moment gone by, so nothing outside the copy is read."""

    def __init__(self, base: int, data: bytes) -> None:
        self._base = base
        self._data = data
        self.failures: dict[str, int] = {}

    def u64(self, addr: int) -> int | None:
        """The 8-byte little-endian word at `addr`, or None outside the copy."""
        off = addr - self._base
        if off < 0 or off > len(self._data) - 8:
            return None
        return int(_U64(self._data, off)[0])
