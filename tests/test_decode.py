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


def test_event_decoding_and_states() -> None:
    ev = decode.OffcpuEvent(end_ns=5, delta_ns=7, cgroup_id=9, tgid=1, tid=2, ustack=-14,
                            kstack=3, state=0x2, cpu=1, comm=b"a[b]\0junk")
    raw = decode.decode_event(bytes(ev))
    assert (raw.delta_ns, raw.tid, raw.ustack, raw.comm) == (7, 2, -14, "a[b]")
    assert decode.state_name(0x2) == "D" and decode.state_name(0x100) == "R"
    assert decode.state_mask("SD") == 0x3
    with pytest.raises(ValueError, match="unknown state"):
        decode.state_mask("SQ")
