"""The kernel's BTF, read for one thing: the type id of a named function.

Loading a program that attaches by BTF (a task iterator) needs the id of
the kernel function it attaches to (`bpf_iter_task`), from
/sys/kernel/btf/vmlinux: a header, then type records, then a string table
(linux/btf.h; Documentation/bpf/btf.rst). Type ids are positions: the only
way to a record's id is to step over every record before it, each sized by
its kind. The file is the kernel's own, but is read with the care of any
file: size capped, every offset checked.
"""

from __future__ import annotations

import struct

VMLINUX = "/sys/kernel/btf/vmlinux"
#: vmlinux BTF is ~5 MB (6.x, Debian's config); far more than any kernel's.
MAX_BYTES = 64 << 20
BTF_MAGIC = 0xEB9F
KIND_FUNC = 12

#: Bytes after each 12-byte type record, by kind: fixed, and per vlen item.
#: (INT 4; ARRAY 12; STRUCT/UNION 12 per member; ENUM 8 per value;
#: FUNC_PROTO 8 per parameter; VAR 4; DATASEC 12 per variable; DECL_TAG 4;
#: ENUM64 12 per value; the rest nothing.)
_FIXED = {1: 4, 3: 12, 14: 4, 17: 4}
_PER_ITEM = {4: 12, 5: 12, 6: 8, 13: 8, 15: 12, 19: 12}
_KNOWN_KINDS = frozenset(range(1, 20))


class BtfError(ValueError):
    """The file is not BTF this reader understands."""


def func_id(name: str, path: str = VMLINUX) -> int | None:
    """The type id of function `name` in the BTF at `path`; None if it has none.

    Raises OSError if the file cannot be read, BtfError if it is not BTF.
    """
    with open(path, "rb") as f:
        data = f.read(MAX_BYTES + 1)
    if len(data) > MAX_BYTES:
        raise BtfError(f"{path} is over {MAX_BYTES >> 20} MB")
    return func_id_in(data, name)


def func_id_in(data: bytes, name: str) -> int | None:
    """`func_id` over the bytes of a BTF blob."""
    if len(data) < 24:
        raise BtfError("too short for a BTF header")
    magic, _version, _flags, hdr_len = struct.unpack_from("<HBBI", data, 0)
    if magic != BTF_MAGIC:
        raise BtfError("not BTF (or not little-endian)")
    type_off, type_len, str_off, str_len = struct.unpack_from("<4I", data, 8)
    types_at, strs_at = hdr_len + type_off, hdr_len + str_off
    if hdr_len < 24 or types_at + type_len > len(data) or strs_at + str_len > len(data):
        raise BtfError("sections run past the end")
    strings = data[strs_at: strs_at + str_len]
    # Every string offset naming `name`: there is usually one, but nothing says so.
    want, names = name.encode() + b"\0", set()
    at = strings.find(b"\0" + want)
    while at >= 0:
        names.add(at + 1)
        at = strings.find(b"\0" + want, at + 1)
    if strings.startswith(want):
        names.add(0)
    if not names:
        return None
    unpack = struct.Struct("<II").unpack_from
    pos, end, tid = types_at, types_at + type_len, 1
    while pos + 12 <= end:
        name_off, info = unpack(data, pos)
        kind, vlen = (info >> 24) & 0x1F, info & 0xFFFF
        if kind == KIND_FUNC and name_off in names:
            return tid
        if kind not in _KNOWN_KINDS:
            raise BtfError(f"type {tid} has kind {kind}, unknown to this reader")
        pos += 12 + _FIXED.get(kind, 0) + _PER_ITEM.get(kind, 0) * vlen
        tid += 1
    return None
