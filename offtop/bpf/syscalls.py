"""Raw system calls offtop makes that libc has no wrapper for, per architecture.

Python's `os` module has neither bpf() nor perf_event_open(), and glibc
exports no wrapper for them, so they go through `syscall(2)` with the
number of the running architecture. An architecture missing from a table
gets `UnsupportedSyscall`, never another architecture's number (321 is
bpf() on x86-64 but something else entirely elsewhere).
"""

from __future__ import annotations

import contextlib
import ctypes as ct
import ctypes.util
import os
import platform
from typing import Any

#: Syscall numbers by `platform.machine()` (from each architecture's unistd tables).
BPF: dict[str, int] = {"x86_64": 321, "aarch64": 280, "riscv64": 280, "s390x": 351,
                       "ppc64le": 361, "armv7l": 386, "i686": 357}
PERF_EVENT_OPEN: dict[str, int] = {"x86_64": 298, "aarch64": 241, "riscv64": 241,
                                   "s390x": 331, "ppc64le": 319, "armv7l": 364, "i686": 336}

# bpf() commands (linux/bpf.h, enum bpf_cmd).
BPF_MAP_CREATE = 0
BPF_MAP_LOOKUP_ELEM = 1
BPF_MAP_UPDATE_ELEM = 2
BPF_MAP_DELETE_ELEM = 3
BPF_MAP_GET_NEXT_KEY = 4
BPF_PROG_LOAD = 5
BPF_OBJ_GET_INFO_BY_FD = 15
BPF_MAP_LOOKUP_BATCH = 24
BPF_MAP_LOOKUP_AND_DELETE_BATCH = 25
BPF_MAP_UPDATE_BATCH = 26
BPF_MAP_DELETE_BATCH = 27
BPF_LINK_CREATE = 28
BPF_ITER_CREATE = 33


class UnsupportedSyscall(OSError):
    """This architecture's number for a system call is not known to offtop."""


_libc: Any = None


def libc() -> Any:
    """The C library, loaded once, with errno kept for `ctypes.get_errno()`."""
    global _libc
    if _libc is None:
        _libc = ct.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    return _libc


_machine = ""


def number(table: dict[str, int], name: str, machine: str | None = None) -> int:
    """The number of syscall `name` on `machine` (default: this one)."""
    global _machine
    if not machine:
        # platform.machine() costs a call chain per use; bpf() is called per map element.
        machine = _machine = _machine or platform.machine()
    nr = table.get(machine)
    if nr is None:
        raise UnsupportedSyscall(f"{name}() syscall number unknown on {machine}")
    return nr


def bpf(cmd: int, attr: ct.Array[Any] | ct.Structure) -> int:
    """bpf(cmd, &attr, sizeof attr): the result, or -errno."""
    res = int(libc().syscall(number(BPF, "bpf"), cmd, ct.byref(attr), ct.sizeof(attr)))
    return res if res >= 0 else -ct.get_errno()


def perf_event_open(attr: ct.Structure, pid: int, cpu: int, group_fd: int, flags: int) -> int:
    """perf_event_open(2): an fd, or -errno."""
    nr = number(PERF_EVENT_OPEN, "perf_event_open")
    res = int(libc().syscall(nr, ct.byref(attr), pid, cpu, group_fd, flags))
    return res if res >= 0 else -ct.get_errno()


def ioctl(fd: int, request: int, arg: int) -> int:
    """ioctl(fd, request, arg) with an integer argument: the result, or -errno."""
    res = int(libc().ioctl(ct.c_int(fd), ct.c_ulong(request), ct.c_ulong(arg)))
    return res if res >= 0 else -ct.get_errno()


def close_quietly(fd: int) -> None:
    """Close an fd offtop owns, ignoring EBADF."""
    if fd >= 0:
        with contextlib.suppress(OSError):
            os.close(fd)
