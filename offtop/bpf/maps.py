"""BPF maps by file descriptor, through the raw bpf() system call.

What bcc's table classes did for offtop, without bcc: create a map, look
up, update (with BPF_ANY / BPF_NOEXIST / BPF_EXIST), delete, walk the keys
(BPF_MAP_GET_NEXT_KEY), and read (and clear) a whole map in a few calls
with BPF_MAP_LOOKUP_BATCH / BPF_MAP_LOOKUP_AND_DELETE_BATCH where the
kernel has them (5.6+; a map type or kernel without them falls back to the
walk). Keys and values are bytes in and bytes out: their layouts are the
callers' business (`offtop.bpf.decode` mirrors offcpu.c's structs).

Per-CPU maps hold one value per *possible* CPU, each padded to 8 bytes:
`lookup_percpu` splits them. A cgroup array's value is an open cgroup
directory, given by path (`set_cgroup`).
"""

from __future__ import annotations

import ctypes as ct
import errno
import os
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from offtop.bpf import syscalls

# enum bpf_map_type (linux/bpf.h): the ones offtop's program uses, and their names.
MAP_TYPES: dict[int, str] = {
    1: "hash",
    2: "array",
    3: "prog_array",
    4: "perf_event_array",
    5: "percpu_hash",
    6: "percpu_array",
    7: "stack_trace",
    8: "cgroup_array",
    9: "lru_hash",
    10: "lru_percpu_hash",
}
HASH, ARRAY, PERF_EVENT_ARRAY, PERCPU_HASH, PERCPU_ARRAY = 1, 2, 4, 5, 6
STACK_TRACE, CGROUP_ARRAY, LRU_HASH, LRU_PERCPU_HASH = 7, 8, 9, 10
PERCPU_TYPES = frozenset({PERCPU_HASH, PERCPU_ARRAY, LRU_PERCPU_HASH})

# Map update flags (linux/bpf.h).
BPF_ANY, BPF_NOEXIST, BPF_EXIST = 0, 1, 2
#: A map that user space may mmap() (arrays only).
BPF_F_MMAPABLE = 1 << 10
#: The map flags offtop knows the meaning of: BPF_F_NO_PREALLOC, BPF_F_NO_COMMON_LRU,
#: BPF_F_NUMA_NODE, BPF_F_RDONLY, BPF_F_WRONLY, BPF_F_STACK_BUILD_ID, BPF_F_ZERO_SEED,
#: BPF_F_RDONLY_PROG, BPF_F_WRONLY_PROG, BPF_F_CLONE, BPF_F_MMAPABLE.
KNOWN_MAP_FLAGS = (1 << 11) - 1

BPF_OBJ_NAME_LEN = 16
#: ENOTSUPP, the kernel-internal errno a map type without batch operations returns.
ENOTSUPP = 524


class MapError(OSError):
    """A bpf() map command failed; `errno` says why."""


class _MapCreateAttr(ct.Structure):
    """`union bpf_attr` as BPF_MAP_CREATE reads it, up to btf_value_type_id."""

    _fields_ = [
        ("map_type", ct.c_uint32),
        ("key_size", ct.c_uint32),
        ("value_size", ct.c_uint32),
        ("max_entries", ct.c_uint32),
        ("map_flags", ct.c_uint32),
        ("inner_map_fd", ct.c_uint32),
        ("numa_node", ct.c_uint32),
        ("map_name", ct.c_char * BPF_OBJ_NAME_LEN),
        ("map_ifindex", ct.c_uint32),
        ("btf_fd", ct.c_uint32),
        ("btf_key_type_id", ct.c_uint32),
        ("btf_value_type_id", ct.c_uint32),
    ]


class _ElemAttr(ct.Structure):
    """`union bpf_attr` as the BPF_MAP_*_ELEM commands read it."""

    _fields_ = [
        ("map_fd", ct.c_uint32),
        ("pad", ct.c_uint32),
        ("key", ct.c_uint64),
        ("value", ct.c_uint64),  # or next_key
        ("flags", ct.c_uint64),
    ]


class _BatchAttr(ct.Structure):
    """`union bpf_attr` as the BPF_MAP_*_BATCH commands read it."""

    _fields_ = [
        ("in_batch", ct.c_uint64),
        ("out_batch", ct.c_uint64),
        ("keys", ct.c_uint64),
        ("values", ct.c_uint64),
        ("count", ct.c_uint32),
        ("map_fd", ct.c_uint32),
        ("elem_flags", ct.c_uint64),
        ("flags", ct.c_uint64),
    ]


class _InfoAttr(ct.Structure):
    """`union bpf_attr` as BPF_OBJ_GET_INFO_BY_FD reads it."""

    _fields_ = [("bpf_fd", ct.c_uint32), ("info_len", ct.c_uint32), ("info", ct.c_uint64)]


class MapInfo(ct.Structure):
    """`struct bpf_map_info` (linux/bpf.h), the fields up to name: what the kernel made."""

    _fields_ = [
        ("type", ct.c_uint32),
        ("id", ct.c_uint32),
        ("key_size", ct.c_uint32),
        ("value_size", ct.c_uint32),
        ("max_entries", ct.c_uint32),
        ("map_flags", ct.c_uint32),
        ("name", ct.c_char * BPF_OBJ_NAME_LEN),
    ]


@dataclass(frozen=True, slots=True)
class MapSpec:
    """A map's definition: what BPF_MAP_CREATE needs."""

    name: str
    type: int
    key_size: int
    value_size: int
    max_entries: int
    flags: int = 0


_possible: int | None = None


def possible_cpus() -> int:
    """How many CPUs may ever exist (/sys/devices/system/cpu/possible): per-CPU values."""
    global _possible
    if _possible is None:
        try:
            with open("/sys/devices/system/cpu/possible") as f:
                text = f.read().strip()
            n = 0
            for part in text.split(","):
                lo, _, hi = part.partition("-")
                n = max(n, int(hi or lo) + 1)
            _possible = n
        except (OSError, ValueError):
            _possible = os.cpu_count() or 1
    return _possible


def _addr(buf: ct.Array[ct.c_char]) -> int:
    return ct.addressof(buf)


def _buffer(data: bytes | bytearray | memoryview, size: int, what: str) -> ct.Array[ct.c_char]:
    if len(data) != size:
        raise ValueError(f"{what} is {len(data)} bytes, the map's is {size}")
    return (ct.c_char * size).from_buffer_copy(data)


def _fail(err: int, doing: str) -> MapError:
    return MapError(err, f"{doing}: {os.strerror(err)}")


def create_map(spec: MapSpec) -> int:
    """BPF_MAP_CREATE: a new map's fd (close-on-exec, as every bpf() fd)."""
    attr = _MapCreateAttr(map_type=spec.type, key_size=spec.key_size,
                          value_size=spec.value_size, max_entries=spec.max_entries,
                          map_flags=spec.flags,
                          map_name=spec.name.encode()[: BPF_OBJ_NAME_LEN - 1])
    fd = syscalls.bpf(syscalls.BPF_MAP_CREATE, attr)
    if fd == -errno.EINVAL and attr.map_name:
        # Kernels before 4.15 have no map names.
        attr.map_name = b""
        fd = syscalls.bpf(syscalls.BPF_MAP_CREATE, attr)
    if fd < 0:
        raise _fail(-fd, f"cannot create map {spec.name} ({MAP_TYPES.get(spec.type, spec.type)})")
    return fd


def map_info(fd: int) -> MapInfo:
    """What the kernel says of the map behind `fd`."""
    info = MapInfo()
    attr = _InfoAttr(bpf_fd=fd, info_len=ct.sizeof(info), info=ct.addressof(info))
    res = syscalls.bpf(syscalls.BPF_OBJ_GET_INFO_BY_FD, attr)
    if res < 0:
        raise _fail(-res, "BPF_OBJ_GET_INFO_BY_FD")
    return info


class ElementReader:
    """Lookups in one map by one thread, cheap: the key and value buffers and the
    system call's arguments are made once (a lookup in `BpfMap` makes them per
    call, so that any thread may call it). The stack store reads a few thousand
    stacks a second on a busy server this way."""

    def __init__(self, m: BpfMap) -> None:
        self.map = m
        self._key = ct.create_string_buffer(m.key_size)
        self._value = ct.create_string_buffer(m.value_bytes)
        self._attr = _ElemAttr(map_fd=m.fd, key=ct.addressof(self._key),
                               value=ct.addressof(self._value), flags=0)
        self._key_size = m.key_size
        self._args = (syscalls.number(syscalls.BPF, "bpf"), syscalls.BPF_MAP_LOOKUP_ELEM,
                      ct.byref(self._attr), ct.sizeof(self._attr))
        self._syscall = syscalls.libc().syscall

    def lookup(self, key: bytes) -> bytes | None:
        """The value at `key`, None if absent (`BpfMap.lookup`'s contract)."""
        if len(key) != self._key_size:
            raise ValueError(f"key is {len(key)} bytes, the map's is {self._key_size}")
        ct.memmove(self._key, key, self._key_size)
        if self._syscall(*self._args) < 0:
            err = ct.get_errno()
            if err == errno.ENOENT:
                return None
            raise _fail(err, f"lookup in {self.map.name}")
        return self._value.raw


class BpfMap:
    """One map, by fd, with its definition; keys and values are bytes.

    Each call uses buffers of its own, so single-element operations may come
    from any thread (the kernel orders them); a whole-map read belongs to one.
    """

    def __init__(self, fd: int, spec: MapSpec) -> None:
        self.fd = fd
        self.spec = spec
        self.key_size = spec.key_size
        percpu = spec.type in PERCPU_TYPES
        self.ncpus = possible_cpus() if percpu else 1
        #: Bytes of one lookup's value: per-CPU values are padded to 8 bytes each.
        self.value_bytes = ((spec.value_size + 7) & ~7) * self.ncpus if percpu else spec.value_size
        #: Whether the kernel did the batch commands on this map (None: not tried yet).
        self.batch_ok: bool | None = None
        # items_raw's key and value buffers, kept: zeroing megabytes at every
        # read cost more than the read of a map with few entries.
        self._batch_lock = threading.Lock()
        self._batch_bufs: tuple[int, ct.Array[ct.c_char], ct.Array[ct.c_char]] | None = None

    def __repr__(self) -> str:
        return f"BpfMap({self.spec.name!r}, fd={self.fd})"

    @property
    def name(self) -> str:
        """The map's name in the program."""
        return self.spec.name

    # --- one element ---------------------------------------------------------

    def _elem(self, cmd: int, key: ct.Array[ct.c_char] | None, value: int, flags: int) -> int:
        attr = _ElemAttr(map_fd=self.fd, key=_addr(key) if key is not None else 0,
                         value=value, flags=flags)
        return syscalls.bpf(cmd, attr)

    def lookup(self, key: bytes | bytearray | memoryview) -> bytes | None:
        """The value at `key` (per-CPU: all CPUs' values back to back), None if absent."""
        k = _buffer(key, self.key_size, "key")
        value = ct.create_string_buffer(self.value_bytes)  # per call: any thread may look up
        res = self._elem(syscalls.BPF_MAP_LOOKUP_ELEM, k, _addr(value), 0)
        if res == -errno.ENOENT:
            return None
        if res < 0:
            raise _fail(-res, f"lookup in {self.name}")
        return value.raw

    def lookup_percpu(self, key: bytes | bytearray | memoryview) -> list[bytes] | None:
        """A per-CPU map's values at `key`, one per possible CPU; None if absent."""
        raw = self.lookup(key)
        if raw is None:
            return None
        step = len(raw) // self.ncpus
        size = self.spec.value_size
        return [raw[i * step: i * step + size] for i in range(self.ncpus)]

    def update(self, key: bytes | bytearray | memoryview, value: bytes | bytearray | memoryview,
               flags: int = BPF_ANY) -> None:
        """Write `value` at `key` (flags: BPF_ANY, BPF_NOEXIST, BPF_EXIST); MapError if refused.

        A per-CPU map takes one value per possible CPU, back to back, each
        padded to 8 bytes (`value_bytes` in all).
        """
        k = _buffer(key, self.key_size, "key")
        v = _buffer(value, self.value_bytes, "value")
        res = self._elem(syscalls.BPF_MAP_UPDATE_ELEM, k, _addr(v), flags)
        if res < 0:
            raise _fail(-res, f"update of {self.name}")

    def try_update(self, key: bytes | bytearray | memoryview,
                   value: bytes | bytearray | memoryview, flags: int = BPF_ANY) -> int:
        """`update` that returns 0 or -errno instead of raising (e.g. BPF_NOEXIST taken)."""
        k = _buffer(key, self.key_size, "key")
        v = _buffer(value, self.value_bytes, "value")
        return self._elem(syscalls.BPF_MAP_UPDATE_ELEM, k, _addr(v), flags)

    def delete(self, key: bytes | bytearray | memoryview) -> bool:
        """Remove `key`; False if it was not there."""
        k = _buffer(key, self.key_size, "key")
        res = self._elem(syscalls.BPF_MAP_DELETE_ELEM, k, 0, 0)
        if res == -errno.ENOENT:
            return False
        if res < 0:
            raise _fail(-res, f"delete in {self.name}")
        return True

    def set_cgroup(self, index: int, path: str) -> None:
        """Put the cgroup (v2 directory) at `path` in slot `index` of a cgroup array."""
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            self.update(index.to_bytes(4, "little"), fd.to_bytes(4, "little"))
        finally:
            os.close(fd)

    # --- every element ---------------------------------------------------------

    def keys_by_walk(self) -> Iterator[bytes]:
        """Every key, one BPF_MAP_GET_NEXT_KEY at a time (any map type, any kernel).

        A key deleted while the walk is at it makes the kernel start over
        from the first key (hash maps): the walk stops after as many steps
        as the map can hold entries, so it always ends.
        """
        cur = ct.create_string_buffer(self.key_size)
        nxt = ct.create_string_buffer(self.key_size)
        first = True
        for _ in range(self.spec.max_entries + 1):
            res = self._elem(syscalls.BPF_MAP_GET_NEXT_KEY, None if first else cur,
                             _addr(nxt), 0)
            if res == -errno.ENOENT:
                return
            if res < 0:
                raise _fail(-res, f"walk of {self.name}")
            first = False
            key = nxt.raw
            yield key
            ct.memmove(cur, nxt, self.key_size)

    def all_keys(self, *, chunk_bytes: int = 1 << 20) -> list[bytes]:
        """Every key: in batches where the kernel can, else by walking."""
        # Values are read (the batch command copies them) but not kept: a
        # stack map's are ~1 kB each, and keeping them made a 50 MB peak.
        raw = self.items_raw(chunk_bytes=chunk_bytes, values=False)
        if raw is None:
            return list(self.keys_by_walk())
        keys, _, n = raw
        ks = self.key_size
        return [keys[i * ks:(i + 1) * ks] for i in range(n)]

    def items(self, *, delete: bool = False) -> list[tuple[bytes, bytes]]:
        """Every (key, value), and with `delete` each one removed as it is read.

        BPF_MAP_LOOKUP(_AND_DELETE)_BATCH where the kernel has it for this
        map; else a walk, a lookup and (with `delete`) a delete per key.
        A key deleted meanwhile by the program is left out.
        """
        raw = self.items_raw(delete=delete)
        if raw is not None:
            keys, values, n = raw
            ks, vs = self.key_size, self.value_bytes
            return [(keys[i * ks:(i + 1) * ks], values[i * vs:(i + 1) * vs]) for i in range(n)]
        out = []
        for k in list(self.keys_by_walk()):
            v = self.lookup(k)
            if v is None:
                continue
            if delete:
                self.delete(k)
            out.append((k, v))
        return out

    def items_raw(self, *, delete: bool = False, chunk_bytes: int = 4 << 20,
                  values: bool = True) -> tuple[bytes, bytes, int] | None:
        """The whole map as two byte strings (keys, values back to back) and their count.

        For decoding in bulk (`struct.iter_unpack`). One batch command per
        `chunk_bytes` of entries; None where the kernel has no batch commands
        for this map (then `items` walks it). `values=False`: the values
        come back empty (b""), never held beyond one batch.
        """
        if self.batch_ok is False:
            return None
        cmd = syscalls.BPF_MAP_LOOKUP_AND_DELETE_BATCH if delete else syscalls.BPF_MAP_LOOKUP_BATCH
        ks, vs = self.key_size, self.value_bytes
        count = max(1, min(self.spec.max_entries, chunk_bytes // (ks + vs)))
        with self._batch_lock:
            bufs, self._batch_bufs = self._batch_bufs, None  # this call's, until it returns
        if bufs is None or bufs[0] < count:
            bufs = (count, ct.create_string_buffer(count * ks), ct.create_string_buffer(count * vs))
        try:
            return self._read_batches(cmd, bufs, keep_values=values)
        finally:
            with self._batch_lock:
                self._batch_bufs = bufs

    def _read_batches(self, cmd: int,
                      bufs: tuple[int, ct.Array[ct.c_char], ct.Array[ct.c_char]], *,
                      keep_values: bool = True) -> tuple[bytes, bytes, int] | None:
        """`items_raw`'s batch commands, into `bufs` (capacity, keys, values)."""
        ks, vs = self.key_size, self.value_bytes
        count, keys, values = bufs
        # A hash map's batch token is a bucket number (u32), an array's a key.
        token_size = max(ks, 8)
        tok_in = ct.create_string_buffer(token_size)
        tok_out = ct.create_string_buffer(token_size)
        kparts: list[bytes] = []
        vparts: list[bytes] = []
        total = 0
        first = True
        while True:
            attr = _BatchAttr(in_batch=0 if first else _addr(tok_in), out_batch=_addr(tok_out),
                              keys=_addr(keys), values=_addr(values), count=count,
                              map_fd=self.fd)
            res = syscalls.bpf(cmd, attr)
            if res < 0 and first and _unsupported(res):
                self.batch_ok = False
                return None
            if res == -errno.ENOSPC and attr.count == 0:
                # One hash bucket holds more than `count` entries: make room for it.
                count *= 2
                keys = ct.create_string_buffer(count * ks)
                values = ct.create_string_buffer(count * vs)
                continue
            if res < 0 and res != -errno.ENOENT:
                raise _fail(-res, f"batch read of {self.name}")
            self.batch_ok = True
            n = int(attr.count)
            if n:
                kparts.append(ct.string_at(keys, n * ks))
                if keep_values:
                    vparts.append(ct.string_at(values, n * vs))
                total += n
            if res == -errno.ENOENT:  # that was the last of it
                return b"".join(kparts), b"".join(vparts), total
            ct.memmove(tok_in, tok_out, token_size)
            first = False

    def delete_many(self, keys: Sequence[bytes]) -> int:
        """Delete these keys (BPF_MAP_DELETE_BATCH where the kernel has it); how many went.

        The keys go into one buffer, once: the kernel stops at a key that is
        gone already and says how many it deleted before it, and the next
        command starts past that key in the same buffer (re-packing the rest
        per miss made a sweep of many gone keys quadratic).
        """
        return self.delete_some(keys)[0]

    def delete_some(self, keys: Sequence[bytes], max_gone: int | None = None) -> tuple[int, int]:
        """`delete_many`, in order, stopping once more than `max_gone` keys were found
        gone already (each costs a command of its own): (how many went, how many
        of `keys` were tried: those past it were not)."""
        n = len(keys)
        if not n:
            return 0, 0
        limit = n if max_gone is None else max_gone
        ks = self.key_size
        buf = ct.create_string_buffer(b"".join(keys), n * ks)
        base = _addr(buf)
        deleted = missed = 0
        at = 0  # the first key not yet tried
        while at < n and self.batch_ok is not False:
            left = n - at
            attr = _BatchAttr(keys=base + at * ks, count=left, map_fd=self.fd)
            res = syscalls.bpf(syscalls.BPF_MAP_DELETE_BATCH, attr)
            if res == 0:
                self.batch_ok = True
                return deleted + left, n
            # A map type without the command (a stack map) fails before the
            # kernel writes the count back: it still reads `left`.
            if _unsupported(res) and attr.count in (0, left):
                self.batch_ok = False
                break
            if res != -errno.ENOENT:
                raise _fail(-res, f"batch delete in {self.name}")
            self.batch_ok = True
            # It stopped at a key that was gone already: skip that one.
            done = int(attr.count)
            deleted += done
            at += done + 1
            missed += 1
            if missed > limit:
                return deleted, at
        while at < n and missed <= limit:
            if self.delete(keys[at]):
                deleted += 1
            else:
                missed += 1
            at += 1
        return deleted, at

    def close(self) -> None:
        """Close the fd (the kernel frees the map with its last reference)."""
        syscalls.close_quietly(self.fd)
        self.fd = -1


def _unsupported(res: int) -> bool:
    """bpf() saying it has no such command, or none for this map type."""
    return -res in (errno.EINVAL, ENOTSUPP, errno.EOPNOTSUPP, errno.ENOSYS)
