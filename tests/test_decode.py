"""The ctypes mirrors must match offcpu.c's structs byte for byte."""

from __future__ import annotations

import ctypes as ct
import re
import struct
from pathlib import Path

import pytest

from offtop.bpf import decode

SRC = (Path(__file__).resolve().parent.parent / "offtop" / "bpf" / "offcpu.c").read_text()
C_SIZES = {"u64": 8, "s64": 8, "u32": 4, "s32": 4, "u16": 2, "u8": 1, "char": 1}


def c_fields(struct: str) -> list[tuple[str, int]]:
    """(name, size) of each field of a C struct in offcpu.c; nested structs flattened."""
    body = re.search(rf"struct {struct} \{{(.*?)\}};", SRC, re.S)
    assert body, struct
    out = []
    for line in body.group(1).splitlines():
        nested = re.match(r"\s*struct (\w+)\s+(\w+);", line)
        if nested:
            out += [(f"{nested.group(2)}.{n}", size) for n, size in c_fields(nested.group(1))]
            continue
        m = re.match(r"\s*(\w+)\s+(\w+)(?:\[(\d+)\])?;", line)
        if m:
            out.append((m.group(2), C_SIZES[m.group(1)] * int(m.group(3) or 1)))
    return out


def py_fields(py: type[ct.Structure], prefix: str = "") -> list[tuple[str, int]]:
    """(name, size) of each field of a ctypes mirror, nested structures flattened."""
    out: list[tuple[str, int]] = []
    for name, ctype in py._fields_:
        if isinstance(ctype, type) and issubclass(ctype, ct.Structure):
            out += py_fields(ctype, f"{prefix}{name}.")
        else:
            out.append((prefix + name, ct.sizeof(ctype)))
    return out


@pytest.mark.parametrize("c_name,py", [
    ("start_rec", decode.StartRecord), ("agg_key", decode.AggKey),
    ("agg_val", decode.AggValue), ("offcpu_event", decode.OffcpuEvent),
    ("acc_rec", decode.AccRecord), ("waker", decode.Waker),
])
def test_mirrors_match_the_c_structs(c_name: str, py: type[ct.Structure]) -> None:
    assert c_fields(c_name) == py_fields(py)
    assert decode.EVENT_STRUCT.size == ct.sizeof(decode.OffcpuEvent)


def test_counter_slots_match_the_c_defines() -> None:
    defines = dict(re.findall(r"#define (C_\w+) (\d+)", SRC))
    names = [k for k, _ in sorted(defines.items(), key=lambda kv: int(kv[1])) if k != "C_MAX"]
    assert [n[2:].lower() for n in names] == list(decode.COUNTERS)
    assert int(defines["C_MAX"]) == len(decode.COUNTERS)


def test_bulk_event_decoding_gives_each_field_in_order() -> None:
    """EVENT_STRUCT reads a raw event field by field, in EVENT_FIELDS order.

    Every field has a distinct value, so two swapped fields (tgid and tid,
    say) fail here, not only a wrong size.
    """
    values = {"end_ns": 5, "delta_ns": 7, "cgroup_id": 9, "tgid": 11, "tid": 13,
              "ustack": -14, "kstack": 3, "state": 0x2, "cpu": 1, "comm": b"a[b]"}
    waker = {"tgid": 17, "tid": 19, "ustack": -21, "kstack": 23, "what": 1 << 24, "pad": 0,
             "comm": b"w"}
    ev = decode.OffcpuEvent(**values, w=decode.Waker(**waker))
    got = decode.EVENT_STRUCT.unpack(bytes(ev))
    assert [n for n, _ in py_fields(decode.OffcpuEvent)] == list(decode.EVENT_FIELDS)
    want = {**values, "comm": b"a[b]".ljust(16, b"\0"),
            **{f"w.{k}": v for k, v in waker.items()}, "w.comm": b"w".ljust(16, b"\0")}
    assert dict(zip(decode.EVENT_FIELDS, got, strict=True)) == want
    assert decode.decode_comm(got[9]) == "a[b]"


def test_generation_sums_read_each_field_of_this_generations_slots() -> None:
    """Two slots, two generations each: only entries marked touched and tagged gen + 1
    are read, each field where the C struct has it (distinct values: swapped fields
    fail); the marks read are given back."""
    size = ct.sizeof(decode.AccRecord)
    buf = bytearray(2 * 2 * size)
    touched = bytearray(2 * 2)  # a byte per slot and parity: parity * slots + slot

    def put(slot: int, gen: int, tag: int, tid: int, *, mark: bool = True) -> None:
        rec = decode.AccRecord(tag=tag, tid=tid, tgid=tid + 1, state=2, ustack=-14, kstack=5,
                               total_ns=700, max_ns=300, count=3, comm=b"abc",
                               w=decode.Waker(tgid=17, tid=19, ustack=21, kstack=-23,
                                              what=1 << 24, pad=0, comm=b"w"))
        off = (2 * slot + gen % 2) * size
        buf[off:off + size] = bytes(rec)
        touched[(gen % 2) * 2 + slot] = int(mark)

    put(0, 4, 5, 100)   # generation 4's: read
    put(1, 4, 3, 200)   # an older tag in the same entry, marked by a late store: not read
    put(1, 5, 6, 300)   # the other generation's
    got = decode.generation_sums(buf, touched, 2, 4)
    assert got == [(5, 100, 101, 2, -14, 5, 700, 300, 3, b"abc".ljust(16, b"\0"),
                    17, 19, 21, -23, 1 << 24, 0, b"w".ljust(16, b"\0"))]
    assert touched == bytearray([0, 0, 0, 1])  # generation 4's marks given back, not 5's
    assert [r[1] for r in decode.generation_sums(buf, touched, 2, 5)] == [300]
    assert touched == bytearray(4)
    # A generation's sums not marked are not read: the marks alone say where to look.
    put(0, 6, 7, 400, mark=False)
    assert decode.generation_sums(buf, touched, 2, 6) == []


def test_owned_slot_fields_are_found_by_their_taken_bytes_and_freed_byte_first() -> None:
    """Only slots whose byte says claimed are read (the rest of the array is never
    walked); one being released as it is read (tid 0 already) is left out. Freeing
    a slot clears its byte, then its tid, and only if it still holds that tid."""
    size = ct.sizeof(decode.StartRecord)
    slots = 64
    buf = bytearray(slots * size)
    taken = bytearray(slots)

    def put(slot: int, tid: int, *, byte: int) -> None:
        rec = decode.StartRecord(ts=tid * 10, tid=tid, tgid=tid + 1, ustack=3, kstack=-1)
        buf[slot * size:(slot + 1) * size] = bytes(rec)
        taken[slot] = byte

    put(3, 300, byte=1)
    put(40, 4000, byte=1)
    put(41, 4100, byte=0)  # claimed a moment ago, its byte not set yet: next time
    put(63, 0, byte=1)     # released as it is read: its tid is 0 already
    got = decode.owned_slot_fields(buf, taken, slots)
    assert [(f[-1], f[1], f[2], f[0]) for f in got] == [(3, 300, 301, 3000),
                                                         (40, 4000, 4001, 40000)]
    decode.free_slot(buf, taken, 40, 4001)  # another thread's now: left alone
    assert taken[40] == 1 and decode.owned_slot_fields(buf, taken, slots)[1][1] == 4000
    decode.free_slot(buf, taken, 40, 4000)
    assert taken[40] == 0 and decode.StartRecord.from_buffer_copy(buf, 40 * size).tid == 0
    assert [f[-1] for f in decode.owned_slot_fields(buf, taken, slots)] == [3]


def test_states_and_flags() -> None:
    assert decode.state_name(0x2) == "D" and decode.state_name(0x100) == "R"
    assert decode.state_name(0x1 | decode.ST_BEFORE_START) == "S"
    assert decode.state_mask("SD") == 0x3
    with pytest.raises(ValueError, match="unknown state"):
        decode.state_mask("SQ")


def test_new_user_stack_records_give_the_id_its_process_and_the_whole_frames_only() -> None:
    # As the kernel hands them over: the id and the tgid in a u64, the frames, and
    # the 4 bytes that pad a raw sample (its u32 size in front) to 8.
    frames = struct.pack("<3Q", 0x401000, 0x401100 | (1 << 63), 0x7F0000001234)
    records = [struct.pack("<II", 0x7ABCDEF1, 4_194_303) + frames + b"\0" * 4,
               struct.pack("<Q", 5) + b"\0" * 4]  # no frames: skipped
    [(sid, tgid, packed)] = decode.new_user_stacks(records)
    assert sid == 0x7ABCDEF1 and tgid == 4_194_303 and packed == frames
    assert decode.record_addresses(packed) == (0x401000, 0x401100 | (1 << 63), 0x7F0000001234)
    # A map's value: read up to its first 0.
    assert decode.stack_addresses(frames + bytes(16)) == decode.record_addresses(packed)


def test_a_new_user_stack_with_a_copy_of_its_top() -> None:
    # offcpu.c copy_stack: the id with USTACK_COPIED, depth + 1 frame slots (up to
    # the first 0; the slots after it hold an older walk's frames), then sp, bp,
    # the copy's length and the bytes.
    depth = 7
    frames = struct.pack("<3Q", 0x401000, 0x401100 | (1 << 63), 0x7F0000001234)
    slots = frames + bytes(8) + struct.pack("<4Q", 0xDEAD, 0xBEEF, 1, 2)
    data = bytes(range(256)) * 3
    head = struct.pack("<IIQQQ", 0x1234 | decode.USTACK_COPIED, 777, 0x7FFC0000, 0x7FFC0100, len(data))
    rec = head[:8] + slots + head[8:] + data + bytes(4)  # padded by the kernel
    plain = struct.pack("<II", 0x55, 778) + frames
    copies: list[decode.StackCopy] = []
    got = decode.new_user_stacks([rec, plain], depth=depth, copies=copies)
    assert got == [(0x1234, 777, frames), (0x55, 778, frames)]
    assert copies == [decode.StackCopy(0x1234, 777, 0x401000, 0x7FFC0000, 0x7FFC0100, data)]
    # Cut short (or no depth given): the frames are kept, the copy is not.
    copies.clear()
    assert decode.new_user_stacks([rec[:-200]], depth=depth, copies=copies) == [(0x1234, 777, frames)]
    assert decode.new_user_stacks([rec], copies=copies) == []  # no depth: no slots to read
    assert copies == []
