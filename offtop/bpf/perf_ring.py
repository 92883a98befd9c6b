"""A bounded reader of per-CPU perf ring buffers (BPF_PERF_OUTPUT).

bcc's own reader loops until the ring is empty, re-reading the head as it
goes: under a flood the producer keeps it non-empty and the call never
returns (measured: over 10 s, deaf to SIGTERM). This reader opens the
perf events itself, and each `drain()` consumes at most what was in the
ring when it started, then returns, so a caller always gets control back
within one bounded batch.

Records are copied out as raw bytes, or (`drain_unpacked`) decoded in bulk
with one `struct.iter_unpack` over each run of same-size samples, which is
what lets Python take in several hundred thousand events per second.
"""

from __future__ import annotations

import contextlib
import ctypes as ct
import mmap
import os
import resource
import select
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from offtop.bpf import syscalls

PERF_TYPE_SOFTWARE = 1
PERF_COUNT_SW_BPF_OUTPUT = 10
PERF_SAMPLE_RAW = 1 << 10
PERF_FLAG_FD_CLOEXEC = 1 << 3
PERF_EVENT_IOC_ENABLE = 0x2400
PERF_EVENT_IOC_DISABLE = 0x2401
PERF_RECORD_LOST = 2
PERF_RECORD_SAMPLE = 9
# perf_event_attr flag bits (the bitfield after read_format).
ATTR_DISABLED = 1 << 0
_ATTR_WATERMARK = 1 << 14

_HEADER = struct.Struct("<IHH")  # perf_event_header: type, misc, size
_U64 = struct.Struct("<Q")
_U32 = struct.Struct("<I")
# perf_event_mmap_page: data_head at 1024, data_tail at 1032.
_DATA_HEAD = 1024
_DATA_TAIL = 1032


class PerfEventAttr(ct.Structure):
    """`struct perf_event_attr`, up to PERF_ATTR_SIZE_VER5 (112 bytes)."""

    _fields_ = [
        ("type", ct.c_uint32),
        ("size", ct.c_uint32),
        ("config", ct.c_uint64),
        ("sample_period", ct.c_uint64),
        ("sample_type", ct.c_uint64),
        ("read_format", ct.c_uint64),
        ("flags", ct.c_uint64),
        ("wakeup_events", ct.c_uint32),
        ("bp_type", ct.c_uint32),
        ("config1", ct.c_uint64),
        ("config2", ct.c_uint64),
        ("branch_sample_type", ct.c_uint64),
        ("sample_regs_user", ct.c_uint64),
        ("sample_stack_user", ct.c_uint32),
        ("clockid", ct.c_int32),
        ("sample_regs_intr", ct.c_uint64),
        ("aux_watermark", ct.c_uint32),
        ("sample_max_stack", ct.c_uint16),
        ("reserved_2", ct.c_uint16),
    ]


def _sample_size(payload: int) -> int:
    """Bytes of one PERF_RECORD_SAMPLE carrying a `payload`-byte raw record.

    The kernel pads the u32 size plus the raw bytes to a multiple of 8
    (perf_prepare_sample), then adds the 8-byte header.
    """
    return 8 + ((4 + payload + 7) & ~7)


def online_cpus() -> list[int]:
    """CPU numbers from /sys/devices/system/cpu/online ("0-3,6")."""
    try:
        with open("/sys/devices/system/cpu/online") as f:
            text = f.read().strip()
    except OSError:
        return list(range(os.cpu_count() or 1))
    cpus: list[int] = []
    for part in text.split(","):
        if "-" in part:
            a, b = part.split("-")
            cpus.extend(range(int(a), int(b) + 1))
        elif part:
            cpus.append(int(part))
    return cpus


def make_room_for_files(more: int, *, margin: int = 1024) -> None:
    """Raise the soft limit on open files (toward the hard one) so that `more`
    descriptors fit beside `margin` others: rings take one a CPU each, and the
    usual soft limit (1,024) is what a 512-CPU machine needs for two rings."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = more + margin
    if soft == resource.RLIM_INFINITY or soft >= want:
        return
    with contextlib.suppress(OSError, ValueError):
        resource.setrlimit(resource.RLIMIT_NOFILE,
                           (want if hard == resource.RLIM_INFINITY else min(want, hard), hard))


def ring_pages(most: int, total: int, cpus: int, *, least: int) -> int:
    """Pages of ring for each of `cpus` CPUs: `most`, or fewer, so that all the rings
    together stay within `total` pages, but never fewer than `least` (nor more than
    `most`); a power of two, as the kernel wants."""
    pages = min(most, max(least, total // max(1, cpus)))
    return 1 << (max(1, pages).bit_length() - 1)


@dataclass(slots=True)
class _Ring:
    cpu: int
    fd: int
    mm: mmap.mmap
    data_size: int
    page_size: int


class PerfRing:
    """One BPF-output perf event and ring per online CPU.

    `set_fd(cpu, fd)` is called for each ring to store its fd in the BPF
    program's perf event array. `wakeup_events` batches wakeups: the kernel
    signals the poller once per that many records instead of every one.
    `attr`: another event than BPF output, opened on each CPU as given (its
    records are read with `drain_records`); `set_fd` may then be None.
    """

    def __init__(
        self,
        set_fd: Callable[[int, int], None] | None,
        *,
        pages: int = 64,
        wakeup_events: int = 64,
        attr: PerfEventAttr | None = None,
    ) -> None:
        if pages <= 0 or pages & (pages - 1):
            raise ValueError("pages must be a power of two")
        self._libc = syscalls.libc()
        self._rings: list[_Ring] = []
        self._epoll = select.epoll()
        #: Written by `wake`: ends a `wait` at once (-1 once closed).
        self._wake_fd = -1
        self.lost = 0
        page = mmap.PAGESIZE
        try:
            self._wake_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
            self._epoll.register(self._wake_fd, select.EPOLLIN)
            if attr is None:
                attr = PerfEventAttr()
                attr.type = PERF_TYPE_SOFTWARE
                attr.size = ct.sizeof(PerfEventAttr)
                attr.config = PERF_COUNT_SW_BPF_OUTPUT
                attr.sample_period = 1
                attr.sample_type = PERF_SAMPLE_RAW
                attr.flags = ATTR_DISABLED
                attr.wakeup_events = max(1, wakeup_events)
            for cpu in online_cpus():
                fd = syscalls.perf_event_open(attr, -1, cpu, -1, PERF_FLAG_FD_CLOEXEC)
                if fd < 0:
                    raise OSError(-fd, f"perf_event_open(cpu {cpu}): {os.strerror(-fd)}")
                try:
                    mm = mmap.mmap(fd, page * (pages + 1), mmap.MAP_SHARED,
                                   mmap.PROT_READ | mmap.PROT_WRITE)
                except OSError:
                    os.close(fd)
                    raise
                self._rings.append(_Ring(cpu, fd, mm, page * pages, page))
                if set_fd is not None:
                    set_fd(cpu, fd)
                self._libc.ioctl(fd, PERF_EVENT_IOC_ENABLE, 0)
                self._epoll.register(fd, select.EPOLLIN)
        except BaseException:
            self.close()
            raise

    @property
    def data_bytes(self) -> int:
        """The rings' data areas, in all: the most they can hold at once."""
        return sum(r.data_size for r in self._rings)

    def wait(self, timeout_s: float) -> bool:
        """Sleep until some ring has a batch ready, `wake` is called, or `timeout_s`
        passes; False if the time ran out."""
        try:
            ready = self._epoll.poll(max(0.0, timeout_s))
        except InterruptedError:
            return False
        for fd, _ in ready:
            if fd == self._wake_fd:
                with contextlib.suppress(OSError):
                    os.eventfd_read(fd)  # taken: the next wait sleeps again
        return bool(ready)

    def wake_on(self, other: PerfRing) -> None:
        """Let `other`'s batches end this ring's `wait` too (one loop waits on both)."""
        for r in other._rings:
            self._epoll.register(r.fd, select.EPOLLIN)

    def wake(self) -> None:
        """End the `wait` under way, or else the next one, at once. Callable from any
        thread or a signal handler (one write to an eventfd)."""
        fd = self._wake_fd
        if fd >= 0:
            with contextlib.suppress(OSError):
                os.eventfd_write(fd, 1)

    def drain(self, out: list[bytes], *, max_records: int = 1 << 20) -> int:
        """Append each ring's raw samples to `out`; return how many were read.

        Reads at most what each ring held when this call began (and at most
        `max_records` in all), so it returns even while producers flood.
        Lost-record notices are added to `self.lost`.
        """
        return self._drain_all(out, max_records)

    def drain_unpacked(self, out: list[tuple[Any, ...]], record: struct.Struct, *,
                       max_records: int = 1 << 20) -> int:
        """Like `drain`, but append each sample decoded with `record` (a tuple).

        Every sample must be one `record` (what a BPF program that submits
        one struct produces); a shorter one is skipped. Runs of such samples
        are checked header by header with strided byte comparisons and
        decoded with a single `iter_unpack`, not one Python step per record.
        """
        return self._drain_all(out, max_records, record)

    def drain_records(self, out: list[tuple[int, int, bytes]], *,
                      max_records: int = 1 << 20) -> int:
        """Like `drain`, but append every record but LOST ones whole, as (type,
        misc, the record's bytes, its header included): for events whose
        records are not samples (`attr`)."""
        return self._drain_all(out, max_records, whole=True)

    def _drain_all(self, out: list[Any], max_records: int, record: struct.Struct | None = None,
                   *, whole: bool = False) -> int:
        """Each ring in turn (`_drain_one`), `max_records` at most in all."""
        n = 0
        for r in self._rings:
            n += self._drain_one(r, out, max_records - n, record, whole=whole)
            if n >= max_records:
                break
        return n

    def _drain_one(self, r: _Ring, out: list[Any], budget: int,
                   record: struct.Struct | None = None, *, whole: bool = False) -> int:
        mm = r.mm
        head = _U64.unpack_from(mm, _DATA_HEAD)[0]
        tail = _U64.unpack_from(mm, _DATA_TAIL)[0]
        if head == tail or budget <= 0:
            return 0
        size = r.data_size
        base = r.page_size
        # Copy the ready region once; it may wrap around the ring's end.
        start = tail % size
        avail = head - tail
        if start + avail <= size:
            chunk = mm[base + start: base + start + avail]
        else:
            chunk = mm[base + start: base + size] + mm[base: base + (start + avail - size)]
        pos = 0
        n = 0
        if record is not None:
            pos = n = self._bulk(chunk, avail, budget, record, out)
            pos *= _sample_size(record.size)
        while pos + 8 <= avail and n < budget:
            typ, _misc, rsize = _HEADER.unpack_from(chunk, pos)
            if rsize == 0 or pos + rsize > avail:
                break
            if whole and typ != PERF_RECORD_LOST:
                out.append((typ, _misc, chunk[pos: pos + rsize]))
                n += 1
            elif typ == PERF_RECORD_SAMPLE:
                raw_size = _U32.unpack_from(chunk, pos + 8)[0]
                if record is None:
                    out.append(chunk[pos + 12: pos + 12 + raw_size])
                    n += 1
                elif raw_size >= record.size:
                    out.append(record.unpack_from(chunk, pos + 12))
                    n += 1
            elif typ == PERF_RECORD_LOST:
                # struct { header; u64 id; u64 lost; }
                self.lost += _U64.unpack_from(chunk, pos + 16)[0]
            pos += rsize
        # Release what was consumed; x86 orders this store after the loads above.
        _U64.pack_into(mm, _DATA_TAIL, tail + pos)
        return n

    @staticmethod
    def _bulk(chunk: bytes, avail: int, budget: int, record: struct.Struct, out: list[Any]) -> int:
        """Decode the longest prefix of `chunk` made of whole `record` samples.

        A sample of a `record.size` payload is a perf header (type, misc,
        size), a u32 raw size, the payload, and padding to 8 bytes: always the
        same `step` bytes. Reading `step` from each header to the next is the
        walk a reader must do; here every header on that walk is compared at
        once, by byte strides: type SAMPLE, size `step`, raw size as expected.
        If any differs (a LOST record, another size), fall back to the walk.
        """
        step = _sample_size(record.size)
        k = min(avail // step, budget)
        if k == 0:
            return 0
        end = k * step
        raw = step - 12
        if (chunk[0:end:step] != bytes((PERF_RECORD_SAMPLE,)) * k
                or chunk[6:end:step] != bytes((step & 0xFF,)) * k
                or chunk[7:end:step] != bytes((step >> 8,)) * k
                or chunk[8:end:step] != bytes((raw & 0xFF,)) * k
                or chunk[9:end:step] != bytes((raw >> 8,)) * k):
            return 0
        order, body = (record.format[0], record.format[1:]) if record.format[0] in "@=<>!" \
            else ("", record.format)
        fmt = struct.Struct(f"{order}12x{body}{step - 12 - record.size}x")
        if fmt.size != step:  # native alignment would move fields: walk instead
            return 0
        out.extend(fmt.iter_unpack(memoryview(chunk)[:end]))
        return k

    def close(self) -> None:
        """Disable and unmap every ring; safe to call twice."""
        for r in self._rings:
            try:
                self._libc.ioctl(r.fd, PERF_EVENT_IOC_DISABLE, 0)
                r.mm.close()
            finally:
                os.close(r.fd)
        self._rings = []
        fd, self._wake_fd = self._wake_fd, -1
        if fd >= 0:
            os.close(fd)
        self._epoll.close()
