"""Records of offcpu.c, decoded: ctypes mirrors of its C structs.

Each structure names the C struct it must match field for field; a size
check in the tests keeps them honest. Nothing here talks to the kernel.
"""

from __future__ import annotations

import ctypes as ct
import struct
from dataclasses import dataclass
from typing import Any

from offtop import safe_text

# Normalized prev_state bits (offcpu.c ST_*; the kernel's TASK_REPORT order).
STATE_BITS: dict[int, str] = {
    0x01: "S",
    0x02: "D",
    0x04: "T",
    0x08: "t",
    0x10: "X",
    0x20: "Z",
    0x40: "P",
    0x80: "I",
    0x100: "R",
}
STATE_MASKS: dict[str, int] = {v: k for k, v in STATE_BITS.items()}
DEFAULT_STATES = "SDI"

# offcpu.c C_* counter slots, in order.
COUNTERS = (
    "ustack_efault",
    "ustack_enomem",
    "ustack_eexist",
    "ustack_other",
    "kstack_efault",
    "kstack_enomem",
    "kstack_eexist",
    "kstack_other",
    "start_full",
    "agg_full",
    "output_fail",
    "no_start",
    "runs",
    "timed_runs",
    "timed_ns",
    "end_unseen",
)


def state_name(bits: int) -> str:
    """The letter of a normalized state value ('?' if unknown), flags ignored."""
    return STATE_BITS.get(bits & 0x1FF, "?")


def state_mask(letters: str) -> int:
    """A mask for offcpu.c from state letters such as 'SD' or 'SDR'."""
    mask = 0
    for ch in letters:
        if ch not in STATE_MASKS:
            raise ValueError(
                f"unknown state {ch!r} in {letters!r}: use letters from "
                f"{''.join(STATE_MASKS)} (S sleeping, D uninterruptible, I idle, R preempted)"
            )
        mask |= STATE_MASKS[ch]
    return mask


class Waker(ct.Structure):
    """Mirrors `struct waker` in offcpu.c: who ended a block (what == 0: not seen)."""

    _fields_ = [
        ("tgid", ct.c_uint32),
        ("tid", ct.c_uint32),
        ("ustack", ct.c_int32),
        ("kstack", ct.c_int32),
        ("what", ct.c_uint32),
        ("pad", ct.c_uint32),
        ("comm", ct.c_char * 16),
    ]


#: offcpu.c WAKER_*: the kind of waker, in `what >> 24` (the low 24 bits: a number).
WAKER_KINDS: dict[int, str] = {0: "", 1: "task", 2: "interrupt"}
#: A kernel stack id at or above this names an interrupt's path in offcpu.c's
#: irq_paths (its stack cut at the kernel's entry code), not a kernel_stacks entry.
IRQ_PATH_BASE = 1 << 30


class StartRecord(ct.Structure):
    """Mirrors `struct start_rec` in offcpu.c (ts == 0: not blocked now; tid == 0: free)."""

    _fields_ = [
        ("ts", ct.c_uint64),
        ("cgroup_id", ct.c_uint64),
        ("tid", ct.c_uint64),
        ("tgid", ct.c_uint32),
        ("state", ct.c_uint32),
        ("ustack", ct.c_int32),
        ("kstack", ct.c_int32),
        ("skip", ct.c_uint32),
        ("cg_gen", ct.c_uint32),
        ("upc", ct.c_uint64),
        ("usp", ct.c_uint64),
        ("ubp", ct.c_uint64),
        ("w", Waker),
    ]


#: start_rec.skip: the record was seeded by offtop for a thread blocked before it started.
REC_SKIP, REC_NO_USER, REC_SEEDED = 1, 2, 4
#: A state bit of blocks that began before offtop started (offcpu.c ST_BEFORE_START).
ST_BEFORE_START = 0x80000000
#: Bit 63 of a user-stack address: the probe reached the frame along the rbp
#: chain, not by a call-frame rule (offcpu.c FP_FRAME_TAG).
FP_FRAME_TAG = 1 << 63


def stack_addresses(raw: bytes) -> tuple[int, ...]:
    """The addresses of a stack packed as u64s (a stack map's value), up to its first 0."""
    ips = struct.unpack(f"<{len(raw) // 8}Q", raw)
    try:
        return ips[:ips.index(0)]
    except ValueError:
        return ips


def record_addresses(raw: bytes) -> tuple[int, ...]:
    """The addresses of a stack as `new_user_stacks` gives it: its frames only, no
    terminating 0 to look for (`stack_addresses` would scan the whole stack for one
    and raise at its end, ~0.6 µs more a stack)."""
    return struct.unpack(f"<{len(raw) // 8}Q", raw)


#: In a new user stack record's id: the stack's top bytes follow (offcpu.c USTACK_COPIED).
USTACK_COPIED = 1 << 31
#: How many bytes of a user stack the probe copies at most (offcpu.c STACK_COPY).
STACK_COPY = 4096
_COPY_HEAD = struct.Struct("<QQQ")  # sp, bp, length


@dataclass(frozen=True, slots=True)
class StackCopy:
    """The top of a user stack as the probe copied it with a new stack (offcpu.c
    copy_stack): the registers its walk began from and the bytes from sp up."""

    sid: int
    tgid: int
    pc: int
    sp: int
    bp: int
    data: bytes


def new_user_stacks(records: list[bytes], *, depth: int = 0,
                    copies: list[StackCopy] | None = None) -> list[tuple[int, int, bytes]]:
    """(id, tgid, packed frames) of each record the probe sent through
    `new_user_stacks` (offcpu.c): the id in a u64's lower half and the tgid of
    the process whose stack it is (the first to have it) in its upper half,
    then the frames, a u64 each; the kernel pads a record to 8 bytes with its
    4-byte size, so the frames are the whole u64s after the id. The frames
    stay packed until read (`record_addresses`).

    A record whose id has USTACK_COPIED holds `depth` + 1 frame slots (up to
    the first 0), then the stack's top bytes: appended to `copies` (dropped
    when the record is not whole, or no list is given). Without `depth` such
    a record cannot be read: it is left out."""
    out = []
    slots = 8 * (depth + 1)
    for rec in records:
        low = int.from_bytes(rec[:4], "little")
        if low & USTACK_COPIED:
            addrs = stack_addresses(rec[8: 8 + slots]) if depth else ()
            if not addrs:
                continue
            sid, tgid = low & ~USTACK_COPIED, int.from_bytes(rec[4:8], "little")
            out.append((sid, tgid, rec[8: 8 + 8 * len(addrs)]))
            head = 8 + slots
            if copies is not None and len(rec) >= head + _COPY_HEAD.size:
                sp, bp, length = _COPY_HEAD.unpack_from(rec, head)
                data = rec[head + _COPY_HEAD.size: head + _COPY_HEAD.size + min(length, STACK_COPY)]
                if len(data) == length:
                    copies.append(StackCopy(sid, tgid, addrs[0], sp, bp, data))
            continue
        n = (len(rec) - 8) // 8
        if n > 0:
            out.append((low, int.from_bytes(rec[4:8], "little"), rec[8: 8 + 8 * n]))
    return out


class AccRecord(ct.Structure):
    """Mirrors `struct acc_rec` in offcpu.c (a thread's short blocks of one generation)."""

    _fields_ = [
        ("tag", ct.c_uint32),
        ("tid", ct.c_uint32),
        ("tgid", ct.c_uint32),
        ("state", ct.c_uint32),
        ("ustack", ct.c_int32),
        ("kstack", ct.c_int32),
        ("total_ns", ct.c_uint64),
        ("max_ns", ct.c_uint64),
        ("count", ct.c_uint64),
        ("comm", ct.c_char * 16),
        ("w", Waker),
    ]


#: `AccRecord` as a struct: (tag, tid, tgid, state, ustack, kstack, total_ns, max_ns,
#: count, comm, waker tgid, tid, ustack, kstack, what, pad, comm). Unpacked as a
#: tuple: reading ctypes fields one by one cost more than the summing.
ACC_STRUCT = struct.Struct("<IIIIiiQQQ16sIIiiII16s")
assert ACC_STRUCT.size == ct.sizeof(AccRecord)


def generation_sums(buf: Any, touched: Any, slots: int, gen: int) -> list[tuple[Any, ...]]:
    """The per-slot sums offcpu.c filled in generation `gen` (offcpu_acc's raw bytes),
    as `ACC_STRUCT` tuples.

    Entry slot * 2 + gen % 2 of each slot. `touched` (offcpu_touched's raw
    bytes, writable: an mmap or bytearray) has a byte per slot and parity,
    set to 1 where the program started a slot's sums: the generation's bytes
    are searched with `find` (memchr speed) and zeroed as they are read, so
    the cost grows with the slots used, not with the array. A marked entry
    is read only if tagged gen + 1 (its generation).
    """
    size = ACC_STRUCT.size
    half = gen % 2
    lo, hi = half * slots, (half + 1) * slots
    want = (gen + 1) & 0xFFFFFFFF
    unpack = ACC_STRUCT.unpack_from
    find = touched.find
    out = []
    at = find(b"\x01", lo, hi)
    while at >= 0:
        touched[at] = 0
        rec = unpack(buf, (2 * (at - lo) + half) * size)
        if rec[0] == want:
            out.append(rec)
        at = find(b"\x01", at + 1, hi)
    return out


# Where start_rec.tid sits, for freeing slots of offcpu_slots.
START_TID_OFFSET = StartRecord.tid.offset
_U64 = struct.Struct("<Q")


#: The fields of a start_rec read to list who is blocked now, unpacked in bulk
#: (ts, cgroup_id, tid, tgid, state, ustack, kstack, skip, cg_gen, upc, usp,
#: ubp; the waker is left): ctypes objects cost a field access per use, and
#: a server of 20,000 idle threads has 20,000 records to look at per snapshot.
_REC_FIELDS = struct.Struct("<QQQIIiiIIQQQ")
_REC_WHOLE = struct.Struct(f"<QQQIIiiIIQQQ{ct.sizeof(StartRecord) - _REC_FIELDS.size}x")
#: (ts, tid, tgid, state, ustack, kstack, ubp, slot): slot -1 for the overflow hash.
RecordFields = tuple[int, int, int, int, int, int, int, int]


def owned_slot_fields(buf: Any, taken: Any, slots: int) -> list[RecordFields]:
    """The record of every claimed slot in offcpu_slots' raw bytes, as `RecordFields`.

    `buf` is the mmap of the array (`slots` records back to back), `taken`
    offcpu_slot_taken's bytes (a byte per slot, 1 while claimed): they are
    searched with `find` (memchr speed), so only claimed slots cost Python.
    A slot being released as it is read (its tid 0 already) is left out.
    """
    size = ct.sizeof(StartRecord)
    unpack = _REC_FIELDS.unpack_from
    find = taken.find
    out = []
    at = find(b"\x01", 0, slots)
    while at >= 0:
        ts, _cg, tid, tgid, state, us, ks, _skip, _gen, _pc, _sp, bp = unpack(buf, at * size)
        if tid:
            out.append((ts, tid, tgid, state, us, ks, bp, at))
        at = find(b"\x01", at + 1, slots)
    return out


def record_fields(values: bytes, n: int) -> list[RecordFields]:
    """`n` start_recs back to back (the overflow hash's values), as `RecordFields`."""
    whole = values[: n * _REC_WHOLE.size]
    return [(ts, tid, tgid, state, us, ks, bp, -1)
            for ts, _cg, tid, tgid, state, us, ks, _skip, _gen, _pc, _sp, bp
            in _REC_WHOLE.iter_unpack(whole)]


def free_slot(buf: Any, taken: Any, index: int, tid: int) -> None:
    """Give back slot `index` if it still holds `tid` (a thread gone for good).

    Its byte in `taken` is cleared first, then the tid with one aligned 8-byte
    store, as the probe releases a slot (offcpu.c drop_rec): the probe claims
    slots with a compare-and-swap on the tid, then sets the byte, so a slot
    claimed again at once ends with its byte set.
    """
    at = index * ct.sizeof(StartRecord) + START_TID_OFFSET
    if _U64.unpack_from(buf, at)[0] == tid:
        taken[index] = 0
        _U64.pack_into(buf, at, 0)


class AggKey(ct.Structure):
    """Mirrors `struct agg_key` in offcpu.c."""

    _fields_ = [
        ("tgid", ct.c_uint32),
        ("tid", ct.c_uint32),
        ("ustack", ct.c_int32),
        ("kstack", ct.c_int32),
        ("state", ct.c_uint32),
        ("waker_tgid", ct.c_uint32),
        ("waker_tid", ct.c_uint32),
        ("waker_what", ct.c_uint32),
    ]


class AggValue(ct.Structure):
    """Mirrors `struct agg_val` in offcpu.c."""

    _fields_ = [
        ("total_ns", ct.c_uint64),
        ("max_ns", ct.c_uint64),
        ("count", ct.c_uint64),
        ("comm", ct.c_char * 16),
        ("waker_comm", ct.c_char * 16),
        ("waker_ustack", ct.c_int32),
        ("waker_kstack", ct.c_int32),
    ]


class OffcpuEvent(ct.Structure):
    """Mirrors `struct offcpu_event` in offcpu.c (one long block)."""

    _fields_ = [
        ("end_ns", ct.c_uint64),
        ("delta_ns", ct.c_uint64),
        ("cgroup_id", ct.c_uint64),
        ("tgid", ct.c_uint32),
        ("tid", ct.c_uint32),
        ("ustack", ct.c_int32),
        ("kstack", ct.c_int32),
        ("state", ct.c_uint32),
        ("cpu", ct.c_uint32),
        ("comm", ct.c_char * 16),
        ("w", Waker),
    ]


# The same layout for bulk decoding of raw perf-buffer bytes: tuples of these
# fields, in this order (the engine unpacks them so).
EVENT_STRUCT = struct.Struct("<QQQIIiiII16sIIiiII16s")
EVENT_FIELDS = ("end_ns", "delta_ns", "cgroup_id", "tgid", "tid", "ustack", "kstack", "state",
                "cpu", "comm", "w.tgid", "w.tid", "w.ustack", "w.kstack", "w.what", "w.pad",
                "w.comm")
assert EVENT_STRUCT.size == ct.sizeof(OffcpuEvent)


def decode_comm(raw: bytes) -> str:
    """A task comm from its NUL-padded bytes (never fails).

    Any task names itself with any bytes (prctl PR_SET_NAME): decoded with
    replacement, control characters kept (JSON is exact; whatever shows it
    on a terminal escapes them, see `offtop.safe_text`).
    """
    return safe_text.decode(raw.split(b"\0", 1)[0])
