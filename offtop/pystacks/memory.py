"""Reading another process's memory with process_vm_readv, bounded and validated.

process_vm_readv copies from the target's address space without stopping,
signalling or tracing it, and fails cleanly (EFAULT) on an unmapped address,
so a garbage pointer costs one failed syscall and nothing else. Several
ranges can be read in one call (one iovec each), which is how a read of many
code objects stays cheap.

Everything read here is untrusted: sizes are capped by the caller's limits
and by `MAX_READ`, and pointers are checked with `plausible_pointer` before
they are followed.
"""

from __future__ import annotations

import ctypes
import errno
import os
import struct
from collections.abc import Sequence

#: The most bytes one read may ask for: a string, a line table, a struct.
MAX_READ = 1 << 18
#: How many ranges one batched read may carry (the kernel's UIO_MAXIOV).
MAX_IOV = 1024
#: User-space addresses on x86-64 and arm64 (47/48-bit) lie below this; a pointer
#: above it, or in the first page, is not a pointer to the target's data.
USER_ADDRESS_END = 1 << 47

_U64 = struct.Struct("<Q")
#: Reads up to this size go through one preallocated buffer.
_SCRATCH = 4096


class ReadError(OSError):
    """The target's memory could not be read (gone, not permitted, unmapped)."""


class _Iovec(ctypes.Structure):
    # struct iovec from <sys/uio.h>.
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


def _load_process_vm_readv() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.process_vm_readv
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_ssize_t
    fn.argtypes = [ctypes.c_int, ctypes.POINTER(_Iovec), ctypes.c_ulong,
                   ctypes.POINTER(_Iovec), ctypes.c_ulong, ctypes.c_ulong]
    return fn


_process_vm_readv = _load_process_vm_readv()


def plausible_pointer(addr: int, align: int = 8) -> bool:
    """True when `addr` could point to the target's data: user space, not page 0, aligned."""
    return 0x1000 <= addr < USER_ADDRESS_END and addr % align == 0


class ProcessMemory:
    """The memory of one process, read by process_vm_readv; counts its syscalls."""

    def __init__(self, pid: int) -> None:
        if _process_vm_readv is None:
            raise ReadError(errno.ENOSYS, "process_vm_readv is not available")
        self.pid = pid
        self.syscalls = 0
        # Most reads are a struct or a short string: one buffer and one pair of
        # iovecs serve them all, so a read is a syscall and a copy, not a
        # dozen ctypes allocations.
        self._scratch = ctypes.create_string_buffer(_SCRATCH)
        self._local = _Iovec(ctypes.addressof(self._scratch), 0)
        self._remote = _Iovec(0, 0)

    def read(self, addr: int, size: int, min_size: int | None = None) -> bytes:
        """`size` bytes at `addr`; fewer (at least `min_size`) if the range runs into a hole."""
        need = size if min_size is None else min_size
        if size <= 0 or size > MAX_READ or not 0 < addr < USER_ADDRESS_END - size:
            raise ReadError(errno.EINVAL, f"bad read of {size} bytes at {addr:#x}")
        if size <= _SCRATCH:
            buf = self._scratch
            self._local.iov_len = size
            local = self._local
        else:
            buf = ctypes.create_string_buffer(size)
            local = _Iovec(ctypes.addressof(buf), size)
        self._remote.iov_base = addr
        self._remote.iov_len = size
        got = self._call(ctypes.byref(local), ctypes.byref(self._remote), 1)
        if got < need:
            raise ReadError(errno.EFAULT, f"short read at {addr:#x}: {got} of {need} bytes")
        return ctypes.string_at(buf, got)

    def read_many(self, ranges: Sequence[tuple[int, int]]) -> list[bytes | None]:
        """Several (addr, size) ranges in as few syscalls as possible; None for a range not read whole.

        The kernel stops at the first range that faults, so the ranges after
        it are retried in a further call: a single bad pointer costs one more
        syscall, not the whole batch.
        """
        out: list[bytes | None] = [None] * len(ranges)
        i = 0
        while i < len(ranges):
            batch = [(j, a, s) for j, (a, s) in enumerate(ranges[i:i + MAX_IOV], start=i)
                     if 0 < s <= MAX_READ and 0 < a < USER_ADDRESS_END - s]
            if not batch:
                i += MAX_IOV
                continue
            n = len(batch)
            locals_ = (_Iovec * n)()
            remotes = (_Iovec * n)()
            bufs = []
            for k, (_, a, s) in enumerate(batch):
                b = ctypes.create_string_buffer(s)
                bufs.append(b)
                locals_[k] = _Iovec(ctypes.addressof(b), s)
                remotes[k] = _Iovec(a, s)
            try:
                got = self._call(locals_, remotes, n)
            except ReadError as e:
                if e.errno != errno.EFAULT:
                    raise
                got = 0
            # Ranges copied whole before the first fault.
            done = 0
            for k, (j, _, s) in enumerate(batch):
                if got >= s:
                    out[j] = bufs[k].raw
                    got -= s
                    done = k + 1
                else:
                    break
            # Skip the range that faulted and go on with the ones after it.
            i = batch[done][0] + 1 if done < n else batch[-1][0] + 1
        return out

    def read_u64(self, addr: int) -> int:
        """One little-endian 64-bit word."""
        return int(_U64.unpack(self.read(addr, 8))[0])

    def _call(self, local: object, remote: object, count: int) -> int:
        assert _process_vm_readv is not None
        self.syscalls += 1
        got = int(_process_vm_readv(self.pid, local, count, remote, count, 0))
        if got < 0:
            err = ctypes.get_errno()
            raise ReadError(err, f"process_vm_readv({self.pid}): {os.strerror(err)}")
        return got
