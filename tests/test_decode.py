"""The ctypes mirrors must match offcpu.c's structs byte for byte."""

from __future__ import annotations

import ctypes as ct
import re
from pathlib import Path

import pytest

from offtop.bpf import decode

SRC = (Path(__file__).resolve().parent.parent / "offtop" / "bpf" / "offcpu.c").read_text()
C_SIZES = {"u64": 8, "s64": 8, "u32": 4, "s32": 4, "u16": 2, "u8": 1, "char": 1}


def c_fields(struct: str) -> list[tuple[str, int]]:
    body = re.search(rf"struct {struct} \{{(.*?)\}};", SRC, re.S)
    assert body, struct
    out = []
    for line in body.group(1).splitlines():
        m = re.match(r"\s*(\w+)\s+(\w+)(?:\[(\d+)\])?;", line)
        if m:
            out.append((m.group(2), C_SIZES[m.group(1)] * int(m.group(3) or 1)))
    return out


@pytest.mark.parametrize("c_name,py", [
    ("start_rec", decode.StartRecord), ("agg_key", decode.AggKey),
    ("agg_val", decode.AggValue), ("offcpu_event", decode.OffcpuEvent),
    ("acc_rec", decode.AccRecord),
])
def test_mirrors_match_the_c_structs(c_name: str, py: type[ct.Structure]) -> None:
    fields = c_fields(c_name)
    assert [n for n, _ in fields] == [f[0] for f in py._fields_]
    for (name, size), f in zip(fields, py._fields_, strict=True):
        assert ct.sizeof(f[1]) == size, name
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
    ev = decode.OffcpuEvent(**values)
    got = decode.EVENT_STRUCT.unpack(bytes(ev))
    assert [f[0] for f in decode.OffcpuEvent._fields_] == list(decode.EVENT_FIELDS)
    assert dict(zip(decode.EVENT_FIELDS, got, strict=True)) == {
        **values, "comm": b"a[b]".ljust(16, b"\0")}
    assert decode.decode_comm(got[-1]) == "a[b]"


def test_states_and_flags() -> None:
    assert decode.state_name(0x2) == "D" and decode.state_name(0x100) == "R"
    assert decode.state_name(0x1 | decode.ST_BEFORE_START) == "S"
    assert decode.state_mask("SD") == 0x3
    with pytest.raises(ValueError, match="unknown state"):
        decode.state_mask("SQ")
