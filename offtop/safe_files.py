"""Opening and reading files on behalf of other processes, without trusting them.

offtop runs as root and reads files that other users control: binaries
through /proc/PID/map_files, perf maps in /tmp, a process's /proc/PID/maps.
Any of them may be a FIFO (an open() for reading would wait for a writer
forever), a device (opening some devices acts: a watchdog starts counting),
a symlink planted for someone else's pid, or a huge sparse file. So a file
is first opened with O_PATH, which reaches the inode without calling any
driver or blocking, and only when fstat() says it is a regular file (and,
when asked, owned by the right user) is that same inode reopened for
reading through /proc/self/fd: O_RDONLY | O_NONBLOCK | O_CLOEXEC |
O_NOCTTY, so nothing can be swapped in between the check and the open.
Reads are positioned (pread) and capped by the caller: nothing here maps a
file into memory, since a mapped file truncated by its owner would kill
offtop with SIGBUS.

Refusals raise `FileRefused`, whose `cause` is one of a few fixed strings,
so callers can count them by cause.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Collection, Iterator
from types import TracebackType

#: Causes of a refusal (`FileRefused.cause`), a fixed vocabulary for counting.
NOT_REGULAR = "not a regular file"
TOO_LARGE = "file too large"
WRONG_OWNER = "not owned by the process's user"
UNREADABLE = "unreadable"

_OPEN_PATH = os.O_PATH | os.O_CLOEXEC
_OPEN_READ = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY


class FileRefused(Exception):
    """A file offtop will not read; `cause` says why (one of this module's constants)."""

    def __init__(self, cause: str, detail: str = "", *, os_errno: int = 0) -> None:
        super().__init__(f"{cause}: {detail}" if detail else cause)
        self.cause = cause
        self.os_errno = os_errno

    @classmethod
    def from_os_error(cls, e: OSError) -> FileRefused:
        """An OSError as a refusal (cause UNREADABLE), its errno kept."""
        return cls(UNREADABLE, os.strerror(e.errno or 0), os_errno=e.errno or 0)

    @property
    def gone(self) -> bool:
        """True when the refusal only means the file (or its process) no longer exists."""
        return self.os_errno in (errno.ENOENT, errno.ESRCH)


class SafeFile:
    """A regular file open for reading, with its fstat() taken after the open."""

    def __init__(self, fd: int, st: os.stat_result) -> None:
        self.fd = fd
        self.stat = st

    @property
    def size(self) -> int:
        """The size fstat() reported when the file was opened (0 for /proc files)."""
        return self.stat.st_size

    @property
    def identity(self) -> tuple[int, int, int, int]:
        """(device, inode, size, mtime): names this version of this file."""
        st = self.stat
        return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)

    def pread(self, offset: int, length: int) -> bytes:
        """Up to `length` bytes at `offset`: fewer only at the end of the file."""
        if length <= 0:
            return b""
        parts: list[bytes] = []
        got = 0
        while got < length:
            try:
                chunk = os.pread(self.fd, length - got, offset + got)
            except InterruptedError:
                continue
            except OSError as e:
                raise FileRefused.from_os_error(e) from None
            if not chunk:
                break
            parts.append(chunk)
            got += len(chunk)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def pread_exact(self, offset: int, length: int) -> bytes:
        """Exactly `length` bytes at `offset`, or FileRefused (the file shrank)."""
        data = self.pread(offset, length)
        if len(data) != length:
            raise FileRefused(UNREADABLE, "file shorter than it said")
        return data

    def chunks(self, *, start: int = 0, chunk: int = 1 << 20, limit: int) -> Iterator[bytes]:
        """The file from `start` in chunks, at most `limit` bytes in all."""
        pos = start
        end = start + limit
        while pos < end:
            data = self.pread(pos, min(chunk, end - pos))
            if not data:
                return
            pos += len(data)
            yield data

    def read_capped(self, limit: int) -> tuple[bytes, bool]:
        """The file's first `limit` bytes, and whether there was more."""
        data = b"".join(self.chunks(limit=limit + 1, chunk=min(limit + 1, 1 << 20)))
        return data[:limit], len(data) > limit

    def close(self) -> None:
        """Close the descriptor (idempotent)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> SafeFile:
        return self

    def __exit__(self, t: type[BaseException] | None, v: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


def open_regular(
    path: str,
    *,
    follow_symlinks: bool = True,
    max_size: int | None = None,
    owners: Collection[int] | None = None,
) -> SafeFile:
    """Open `path` for reading if it is a regular file (see the module docstring).

    `follow_symlinks=False` refuses a symlink as the last component (for
    files in world-writable directories such as /tmp; /proc's magic links
    such as map_files need following). `max_size` refuses larger files,
    `owners` files owned by any other uid.
    """
    try:
        pfd = os.open(path, _OPEN_PATH | (0 if follow_symlinks else os.O_NOFOLLOW))
    except OSError as e:
        raise FileRefused.from_os_error(e) from None
    try:
        st = os.fstat(pfd)
        _check(st, max_size, owners)
        try:
            fd = os.open(f"/proc/self/fd/{pfd}", _OPEN_READ)
        except OSError as e:
            raise FileRefused.from_os_error(e) from None
    finally:
        os.close(pfd)
    try:
        st2 = os.fstat(fd)
        if (st2.st_dev, st2.st_ino) != (st.st_dev, st.st_ino):  # cannot happen; cheap to be sure
            raise FileRefused(UNREADABLE, "file changed while opening")
        _check(st2, max_size, owners)
    except BaseException:
        os.close(fd)
        raise
    return SafeFile(fd, st2)


def _check(st: os.stat_result, max_size: int | None, owners: Collection[int] | None) -> None:
    if not stat.S_ISREG(st.st_mode):
        raise FileRefused(NOT_REGULAR, stat.filemode(st.st_mode))
    if owners is not None and st.st_uid not in owners:
        raise FileRefused(WRONG_OWNER, f"uid {st.st_uid}")
    if max_size is not None and st.st_size > max_size:
        raise FileRefused(TOO_LARGE, f"{st.st_size} bytes")


def read_proc_small(path: str, limit: int = 4096) -> bytes:
    """The first `limit` bytes of a small file /proc makes itself (a task's stat or
    comm; never a path a process can point elsewhere, such as map_files): one
    open, one read, one close. Python's open() adds fstat, ioctl and lseek to each,
    and offtop reads a few hundred such files a second on a busy server. OSError
    if it cannot be read (the task is gone)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return os.read(fd, limit)
    finally:
        os.close(fd)


def read_proc_file(path: str, limit: int) -> tuple[bytes, bool]:
    """A /proc file's first `limit` bytes and whether it was longer (FileRefused if unreadable)."""
    with open_regular(path) as f:
        return f.read_capped(limit)

