"""The saved user registers of a thread that is not running, read by a BPF task iterator.

A thread blocked since before offtop started was never seen switching
out, so the probe has no record of its rbp, and /proc gives only its sp
and pc (/proc/PID/syscall). Code built with frame pointers computes its
frame from rbp: without it, the unwind of such a thread stops after the
first frame. The kernel keeps every thread's user registers, saved at
kernel entry, at the top of its kernel stack; offcpu.c's `bpf_iter__task`
reads them for one thread at a time (an iterator link bound to its tid).

The iterator is loaded the first time it is asked for, so runs that never
need it pay nothing: its BTF id lookup (~40 ms) and verification. A kernel
without what it needs (task iterators bound to one tid: 6.1; BTF) makes it
unavailable for the rest of the run, with the reason kept; callers then
unwind as before, without rbp.
"""

from __future__ import annotations

import ctypes as ct
import os
import struct
import threading
from dataclasses import dataclass
from typing import Protocol

from offtop.bpf import btf, syscalls
from offtop.bpf.loader.kernel import BPF_TRACE_ITER, LoadFailed

ITERATOR = "bpf_iter__task"
#: The kernel function the iterator attaches to, as BTF names it.
TARGET = "bpf_iter_task"
#: One record: ip, sp, bp (offcpu.c).
_RECORD = struct.Struct("<3Q")


@dataclass(frozen=True, slots=True)
class UserRegs:
    """What the kernel saved of a thread's user registers at its last kernel entry."""

    pc: int
    sp: int
    bp: int


class Loader(Protocol):
    """What TaskRegisters needs of the loaded program (`LoadedObject`)."""

    def load_iterator(self, function: str, attach_btf_id: int) -> int:
        """The iterator program's fd, loaded on first use."""
        ...


class _LinkCreateAttr(ct.Structure):
    """`union bpf_attr` as BPF_LINK_CREATE reads it for an iterator."""

    _fields_ = [("prog_fd", ct.c_uint32), ("target_fd", ct.c_uint32),
                ("attach_type", ct.c_uint32), ("flags", ct.c_uint32),
                ("iter_info", ct.c_uint64), ("iter_info_len", ct.c_uint32)]


class _TaskLinkInfo(ct.Structure):
    """`union bpf_iter_link_info`'s task member (16 bytes with the union's padding)."""

    _fields_ = [("tid", ct.c_uint32), ("pid", ct.c_uint32), ("pid_fd", ct.c_uint32),
                ("_pad", ct.c_uint32)]


class _IterCreateAttr(ct.Structure):
    _fields_ = [("link_fd", ct.c_uint32), ("flags", ct.c_uint32)]


class TaskRegisters:
    """Reads one thread's saved user registers on demand (see the module docstring)."""

    def __init__(self, program: Loader, *, btf_path: str = btf.VMLINUX) -> None:
        self._program = program
        self._btf_path = btf_path
        self._fd = -1
        self._lock = threading.Lock()
        #: Why registers cannot be read on this kernel ('' while they can).
        self.unavailable = ""
        self.reads = 0
        self.failures = 0

    def of(self, tid: int) -> UserRegs | None:
        """Thread `tid`'s saved user registers; None if gone, a kernel thread, or unavailable."""
        with self._lock:
            fd = self._prog_fd()
            if fd < 0:
                return None
            self.reads += 1
            got = _run(fd, tid)
            if got is None:
                self.failures += 1
            return got

    def _prog_fd(self) -> int:
        if self._fd >= 0 or self.unavailable:
            return self._fd
        try:
            btf_id = btf.func_id(TARGET, self._btf_path)
        except (OSError, ValueError) as e:
            self.unavailable = f"kernel BTF: {e}"
            return -1
        if btf_id is None:
            self.unavailable = f"the kernel has no {TARGET} (task iterators)"
            return -1
        try:
            self._fd = self._program.load_iterator(ITERATOR, btf_id)
        except LoadFailed as e:
            self.unavailable = e.message
        return self._fd


def _run(prog_fd: int, tid: int) -> UserRegs | None:
    """Bind the iterator to `tid`, run it once, read its one record."""
    info = _TaskLinkInfo(tid=tid)
    attr = _LinkCreateAttr(prog_fd=prog_fd, attach_type=BPF_TRACE_ITER,
                           iter_info=ct.addressof(info), iter_info_len=ct.sizeof(info))
    link = syscalls.bpf(syscalls.BPF_LINK_CREATE, attr)
    if link < 0:
        return None  # no such thread (any more)
    try:
        it = syscalls.bpf(syscalls.BPF_ITER_CREATE, _IterCreateAttr(link_fd=link))
        if it < 0:
            return None
        try:
            data = os.read(it, 4096)
        except OSError:
            return None
        finally:
            os.close(it)
    finally:
        os.close(link)
    if len(data) != _RECORD.size:
        return None  # a kernel thread (nothing written), or not what offcpu.c writes
    return UserRegs(*_RECORD.unpack(data))
